package suite_test

import (
	"bytes"
	"os/exec"
	"path/filepath"
	"strings"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"

	"pvbridge.io/e2e/cluster"
)

var _ = Describe("Manifests", Label("manifests"), func() {
	// The overlays a platform admin applies, against the clusters they are for: every object is
	// accepted by the lab's apiservers, which run pvbridge (server-side dry run, so nothing
	// changes; conflicts with the lab's own field managers are forced, as a takeover would).
	DescribeTable("every object of an overlay passes a server-side dry run against the lab",
		func(ctx SpecContext, overlay string, cp func() *cluster.ControlPlane) {
			kubectl, err := lab.Binaries().Tool("kubectl")
			Expect(err).NotTo(HaveOccurred())
			rendered, err := exec.CommandContext(ctx, kubectl, "kustomize", filepath.Join(lab.Binaries().Repo, "manifests", "overlays", overlay)).Output()
			Expect(err).NotTo(HaveOccurred())
			apply := exec.CommandContext(ctx, kubectl, "--kubeconfig="+cp().Kubeconfig, "apply", "--server-side", "--dry-run=server",
				"--force-conflicts", "--field-manager=pvbridge-e2e", "-f", "-")
			apply.Stdin = bytes.NewReader(rendered)
			out, err := apply.CombinedOutput()
			Expect(err).NotTo(HaveOccurred(), "%s", out)
			lines := strings.Split(strings.TrimSpace(string(out)), "\n")
			Expect(lines).To(HaveLen(strings.Count("\n"+string(rendered), "\n---\n")+1), "%s", out)
			Expect(lines).To(HaveEach(HaveSuffix("serverside-applied (server dry run)")))
		},
		Entry("management, on the management cluster", "management", func() *cluster.ControlPlane { return mgmt.CP }),
		Entry("guest, on guest cluster alpha", "guest", func() *cluster.ControlPlane { return alpha.CP }),
	)
})
