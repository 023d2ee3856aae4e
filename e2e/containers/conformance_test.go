package containers_test

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/onsi/ginkgo/v2/types"
	. "github.com/onsi/gomega"
	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/util/retry"

	"pvbridge.io/e2e/cluster"
	"pvbridge.io/pkg/names"
	"pvbridge.io/pkg/testenv"
)

var (
	full  = flag.Bool("conformance.full", false, "run every External Storage test but the skipped ones (make conformance), not the CI subset")
	only  = flag.String("conformance.focus", "", "a regular expression of the tests to run instead (after the driver's name)")
	procs = flag.Int("conformance.procs", 1, "parallel processes of e2e.test, run by the ginkgo CLI when more than 1")
	keep  = flag.String("conformance.reports", "", "a directory to copy each driver's JUnit reports into (<dir>/<driver>/), to keep them after the lab is removed")
)

// subset is what CI runs of each driver: provisioning (empty, from a snapshot, from a clone,
// with mount options), the data tests of one filesystem volume, ReadWriteOncePod's
// enforcement, a class given to a volume in use (VolumeAttributesClass) and, of guest-csi, which
// alone declares them, the nodes' volume limits; not the [Slow] ones. Each pattern must match a
// test that passed: a focus that matches nothing of the pinned e2e.test (a test renamed) fails
// the run instead of shrinking it.
var subset = []string{
	`\[Testpattern: Dynamic PV \(default fs\)\] provisioning`,
	`\[Testpattern: Dynamic PV \(default fs\)\] volumes`,
	`\[Testpattern: Dynamic PV \(default fs\)\] read-write-once-pod`,
	`\[Testpattern: Dynamic PV \(default fs\)\] volume-modify .*should modify volume with no VAC`,
}

const volumeLimits = `\[Testpattern: Dynamic PV \(filesystem volmode\)\] volumeLimits should verify that all csinodes have volume limits`

const subsetSkip = `\[Slow\]`

// skip are the tests no run includes, each for the reason docs/conformance.md gives.
var skip = []string{
	`\[Disruptive\]`,
	`should provision storage with any volume data source`,
}

// onlineExt4Growth are the tests that grow a mounted ext4, which the kernel allows only with
// CAP_SYS_RESOURCE (EXT4_IOC_RESIZE_FS). Where the machine has dropped it from every bounding
// set (this sandbox), no container can have it, and they are skipped, saying so; everywhere
// else they run.
var onlineExt4Growth = []string{
	`\(default fs\)\(allowExpansion\)\] volume-expand .*should resize volume when PVC is edited while pod is using it`,
	`Generic Ephemeral-volume \(default fs\).*should support expansion of pvcs created for ephemeral pvcs`,
}

// confinement is the taint that keeps e2e.test's pods off the nodes of every host but host-a:
// a snapshot or a clone is made on its source's host, and some tests run the restoring pod
// with no node selection at all (docs/conformance.md).
const confinement = "pvbridge.io/conformance"

// TestExternalStorage runs Kubernetes' own storage tests, the External Storage suite of e2e.test
// at the pinned Kubernetes version, against guest-csi in the guest cluster and mgmt-csi in the
// management cluster, each declared by testdata/<driver>.yaml; a failed test fails the driver's
// subtest, and the totals are logged. docs/conformance.md explains every skip.
func TestExternalStorage(t *testing.T) {
	var vmsOfHostA []string
	for vm, host := range in.Options.Guest.VMs {
		if host == "host-a" {
			vmsOfHostA = append(vmsOfHostA, vm)
		}
	}
	// guest-csi's test class names this management class, which its cluster may use.
	allowAttributesClasses(t, map[string]string{"pvbridge-conformance": "1Gi"})
	for _, d := range []struct {
		driver, definition string
		cp                 *cluster.ControlPlane
		nodes, subset      []string
	}{
		{names.GuestDriver, "guest-csi.yaml", in.Guest, vmsOfHostA, append(slices.Clone(subset), volumeLimits)},
		{names.PmemDriver, "mgmt-csi.yaml", in.Mgmt, []string{"host-a"}, subset},
	} {
		t.Run(d.driver, func(t *testing.T) {
			if *procs == 1 {
				// The two drivers are tested in their own clusters, and their tests mostly
				// wait (pods starting, e2e.test's polls): run at once, they take the time of
				// the longer one. Runs in parallel processes already load the machine.
				t.Parallel()
			}
			g := NewWithT(t)
			confine(t, d.cp.Client(), d.nodes)
			definition, err := filepath.Abs(filepath.Join("testdata", d.definition))
			g.Expect(err).NotTo(HaveOccurred())
			skips := slices.Clone(skip)
			if !testenv.HasCapability(t, "CapBnd", unix.CAP_SYS_RESOURCE) {
				t.Logf("this machine has no CAP_SYS_RESOURCE to give a container: the tests that grow a mounted ext4 are skipped")
				skips = append(skips, onlineExt4Growth...)
			}
			var required []string // patterns each of which a passed test must match
			switch {
			case *only != "":
				required = []string{*only}
			case !*full:
				required = d.subset
				skips = append(skips, subsetSkip)
			}
			focus := `External.Storage \[Driver: ` + strings.ReplaceAll(d.driver, ".", `\.`) + `\]`
			if required != nil {
				focus += ".*(" + strings.Join(required, "|") + ")" // an alternation stays after the driver's name
			}
			report := filepath.Join(lab.Root, d.driver+".json")
			ginkgoArgs := []string{"focus=" + focus, "skip=" + strings.Join(skips, "|"), "json-report=" + report, "no-color", "v"}
			args := []string{
				"--kubeconfig=" + d.cp.Kubeconfig, "--storage.testdriver=" + definition, "--repo-root=" + lab.Binaries().Repo,
				"--non-blocking-taints=node-role.kubernetes.io/control-plane," + confinement,
				"--report-dir=" + filepath.Join(lab.Root, "reports-"+d.driver),
			}
			cmd := exec.CommandContext(t.Context(), e2eTest, append(args, prefixed("--ginkgo.", ginkgoArgs)...)...)
			if *procs > 1 {
				// The ginkgo CLI runs the binary's specs in parallel processes ([Serial] ones
				// alone at the end) and merges their reports.
				cli, err := lab.Binaries().Tool("ginkgo")
				g.Expect(err).NotTo(HaveOccurred(), "make conformance builds it")
				cliArgs := append(prefixed("--", ginkgoArgs), fmt.Sprintf("--procs=%d", *procs), "--timeout=4h", e2eTest, "--")
				cmd = exec.CommandContext(t.Context(), cli, append(cliArgs, args...)...)
			}
			// The output goes to a file of the lab, to follow a long run and read after it.
			logFile := filepath.Join(lab.Root, d.driver+".log")
			out, err := os.Create(logFile)
			g.Expect(err).NotTo(HaveOccurred())
			defer out.Close()
			cmd.Stdout, cmd.Stderr = out, out
			t.Logf("e2e.test against %s, output in %s", d.driver, logFile)
			runErr := cmd.Run()
			if *keep != "" {
				keepReports(t, filepath.Join(*keep, d.driver), filepath.Join(lab.Root, "reports-"+d.driver))
			}
			passed, failed, skipped := summarize(t, report)
			t.Logf("%s: %d passed, %d failed, %d skipped:\n  %s", d.driver, len(passed), len(failed), len(skipped), strings.Join(skipped, "\n  "))
			if runErr != nil || len(failed) > 0 {
				t.Errorf("e2e.test against %s: %v; failed:\n  %s\n%s", d.driver, runErr, strings.Join(failed, "\n  "), cluster.Tail(logFile, 200))
			}
			g.Expect(passed).NotTo(BeEmpty(), "no test ran")
			g.Expect(unmatched(required, passed)).To(BeEmpty(), "focused tests that did not pass (a test renamed, or skipped by the suite)")
		})
	}
}

// unmatched returns the patterns that match none of names.
func unmatched(patterns, names []string) []string {
	var out []string
	for _, p := range patterns {
		re := regexp.MustCompile(p)
		if !slices.ContainsFunc(names, re.MatchString) {
			out = append(out, p)
		}
	}
	return out
}

// keepReports copies the JUnit files of a run into dir, replacing what an earlier run left there
// (the Ginkgo JSON report, 8 MiB a driver, stays in the lab).
func keepReports(t *testing.T, dir, junitDir string) {
	g := NewWithT(t)
	g.Expect(os.RemoveAll(dir)).To(Succeed())
	g.Expect(os.MkdirAll(dir, 0o755)).To(Succeed())
	junit, err := filepath.Glob(filepath.Join(junitDir, "junit_*.xml"))
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(junit).NotTo(BeEmpty(), "no JUnit report in %s", junitDir)
	for _, f := range junit {
		data, err := os.ReadFile(f)
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(os.WriteFile(filepath.Join(dir, filepath.Base(f)), data, 0o644)).To(Succeed())
	}
	t.Logf("reports of %s kept in %s", filepath.Base(dir), dir)
}

// prefixed returns each of args with prefix before it.
func prefixed(prefix string, args []string) []string {
	out := make([]string, len(args))
	for i, a := range args {
		out[i] = prefix + a
	}
	return out
}

// confine taints every node of a cluster but those named NoSchedule with confinement until the
// test ends; pods already running stay.
func confine(t *testing.T, cs kubernetes.Interface, keep []string) {
	g := NewWithT(t)
	nodes, err := cs.CoreV1().Nodes().List(t.Context(), metav1.ListOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	taint := corev1.Taint{Key: confinement, Effect: corev1.TaintEffectNoSchedule}
	for _, n := range nodes.Items {
		if slices.Contains(keep, n.Name) {
			continue
		}
		setTaint(g, cs, n.Name, &taint)
		t.Cleanup(func() { setTaint(NewWithT(t), cs, n.Name, nil) })
	}
}

// setTaint replaces node's confinement taint with taint (nil: removes it).
func setTaint(g Gomega, cs kubernetes.Interface, node string, taint *corev1.Taint) {
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		n, err := cs.CoreV1().Nodes().Get(context.Background(), node, metav1.GetOptions{})
		if err != nil {
			return err
		}
		n.Spec.Taints = slices.DeleteFunc(n.Spec.Taints, func(t corev1.Taint) bool { return t.Key == confinement })
		if taint != nil {
			n.Spec.Taints = append(n.Spec.Taints, *taint)
		}
		_, err = cs.CoreV1().Nodes().Update(context.Background(), n, metav1.UpdateOptions{})
		return err
	})
	g.Expect(err).NotTo(HaveOccurred(), "taint node %s", node)
}

// summarize reads a ginkgo JSON report: the names of the specs that passed, failed (or
// panicked, timed out, ...) and were skipped by the suite itself (a capability the driver does
// not declare); specs the focus filtered out are not counted.
func summarize(t *testing.T, file string) (passed, failed, skipped []string) {
	data, err := os.ReadFile(file)
	if err != nil {
		t.Errorf("report: %v", err)
		return nil, nil, nil
	}
	var reports []types.Report
	if err := json.Unmarshal(data, &reports); err != nil {
		t.Errorf("report %s: %v", file, err)
		return nil, nil, nil
	}
	for _, r := range reports {
		for _, s := range r.SpecReports {
			if s.LeafNodeType != types.NodeTypeIt {
				continue
			}
			name := s.FullText()
			switch {
			case s.State == types.SpecStatePassed:
				passed = append(passed, name)
			case s.State == types.SpecStateSkipped && s.Failure.Message != "":
				skipped = append(skipped, fmt.Sprintf("%s (%s)", name, s.Failure.Message))
			case s.State.Is(types.SpecStateFailureStates):
				failed = append(failed, name)
			}
		}
	}
	return passed, failed, skipped
}
