// Package manifests proves the kustomize overlays of manifests/ against a real kube-apiserver:
// every overlay builds and each of its objects passes a server-side dry run, and the tenancy
// admission policy, applied for real, refuses every cross-tenant write of a guest identity with
// its reason while the same writes within the guest's own rights pass. With the pinned tools it
// also checks the monitoring component (promtool) and the Helm charts' values (helm).
package manifests

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"k8s.io/client-go/rest"
	"k8s.io/klog/v2"
	ctrl "sigs.k8s.io/controller-runtime"

	"pvbridge.io/e2e/polling"
	"pvbridge.io/pkg/testenv"
)

// The package's test apiserver, started once by TestMain: a real kube-apiserver and etcd (the
// lab's pinned binaries) with pvbridge's and the snapshot CRDs, RBAC authorization and the
// default admission plugins.
var (
	// adminConfig is an admin (system:masters) of the apiserver; adminKubeconfig its file.
	adminConfig     *rest.Config
	adminKubeconfig string
	// kubectl is the pinned kubectl, with kustomize built in.
	kubectl string
)

// manifestsDir is the repository's manifests/ directory.
var manifestsDir = filepath.Join("..", "..", "manifests")

func TestMain(m *testing.M) {
	polling.Set()
	os.Exit(runSuite(m))
}

func runSuite(m *testing.M) int {
	ctrl.SetLogger(klog.Background())
	bin, err := testenv.BinDir()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	kubectl = filepath.Join(bin, "kubectl")
	if _, err := os.Stat(kubectl); err != nil {
		fmt.Fprintf(os.Stderr, "kubectl is not built (run `make tools`): %v\n", err)
		return 1
	}
	srv, err := testenv.Start("bases", "snapshot")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer srv.Stop()
	adminConfig, adminKubeconfig = srv.Admin.Config(), srv.AdminKubeconfig
	return m.Run()
}
