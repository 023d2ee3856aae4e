package cluster

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/tools/remotecommand"
	"k8s.io/utils/ptr"

	"pvbridge.io/e2e/images"
)

// TestContainerdNodeRunsPods runs an ordinary pod (service account token, pod network) in a
// real container on a containerd node, reaches its apiserver and another control plane's, reads
// its logs, execs into it, and checks that stopping the lab leaves no container, bridge or DNAT
// rule behind.
func TestContainerdNodeRunsPods(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	lab := newTestLab(t)
	cp, err := lab.StartControlPlane(ctx, "ctr")
	g.Expect(err).NotTo(HaveOccurred())

	archives, err := labImageArchives(lab)
	g.Expect(err).NotTo(HaveOccurred())
	node, err := cp.AddNode(ctx, "node-1", NodeOptions{Runtime: Containerd, Images: archives})
	g.Expect(err).NotTo(HaveOccurred())

	// A control plane started after the node: its apiserver is reachable from the node's pods
	// too, at its own Service address, as a guest's pods reach the management cluster.
	other, err := lab.StartControlPlane(ctx, "other")
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(other.ServiceIP).NotTo(Equal(cp.ServiceIP))

	c := cp.Client()
	// The pod reaches the apiserver through the kubernetes Service, as in-cluster clients do.
	g.Expect(runBusybox(ctx, c, node.Name, "hello", `echo "hello from $(hostname)"; `+
		`echo | nc -w 5 "$KUBERNETES_SERVICE_HOST" "$KUBERNETES_SERVICE_PORT" && echo "apiserver reachable"; `+
		`echo | nc -w 5 `+other.ServiceIP+` 443 && echo "other apiserver reachable"; `+
		`exec sleep 3600`)).To(Succeed())
	g.Eventually(func(g Gomega) {
		logs, err := c.CoreV1().Pods("default").GetLogs("hello", &corev1.PodLogOptions{}).DoRaw(ctx)
		g.Expect(err).NotTo(HaveOccurred(), string(logs))
		g.Expect(string(logs)).To(And(ContainSubstring("hello from hello"), ContainSubstring("\napiserver reachable"), ContainSubstring("other apiserver reachable")))
	}).WithContext(ctx).WithTimeout(time.Minute).Should(Succeed())

	req := c.CoreV1().RESTClient().Post().Resource("pods").Namespace("default").Name("hello").SubResource("exec").
		VersionedParams(&corev1.PodExecOptions{
			Container: "app", Command: []string{"cat", "/var/run/secrets/kubernetes.io/serviceaccount/namespace"}, Stdout: true, Stderr: true,
		}, scheme.ParameterCodec)
	exe, err := remotecommand.NewSPDYExecutor(cp.RESTConfig(), "POST", req.URL())
	g.Expect(err).NotTo(HaveOccurred())
	var stdout, stderr bytes.Buffer
	g.Expect(exe.StreamWithContext(ctx, remotecommand.StreamOptions{Stdout: &stdout, Stderr: &stderr})).To(Succeed(), stderr.String())
	g.Expect(stdout.String()).To(Equal("default"))

	// The container is a real process of the node's namespace.
	ps, err := exec.Command("nsenter", "--target", fmt.Sprint(node.nsPid), "--mount", "--pid", "--", "ps", "-eo", "args").Output()
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(string(ps)).To(ContainSubstring("sleep 3600"))

	bridge := readFirst(t, filepath.Join(lab.Root, "bridges"))
	g.Expect(lab.Stop()).To(Succeed())
	g.Expect(exec.Command("ip", "link", "show", bridge).Run()).To(HaveOccurred(), "bridge %s is left", bridge)
	nat, err := exec.Command("iptables-save", "-t", "nat").Output()
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(string(nat)).NotTo(ContainSubstring(lab.Root))
	out, _ := exec.Command("pgrep", "-f", "sleep 3600").Output()
	g.Expect(string(out)).To(BeEmpty(), "the container's process is left")
}

// labImageArchives builds the lab's own images (pause, busybox) below the lab's root.
func labImageArchives(lab *Lab) ([]string, error) {
	labImages, err := images.LabImages()
	if err != nil {
		return nil, err
	}
	built, err := images.BuildAll(images.Options{Root: lab.Binaries().Repo, Out: filepath.Join(lab.Root, "images")}, labImages)
	if err != nil {
		return nil, err
	}
	var archives []string
	for _, b := range built {
		archives = append(archives, b.File)
	}
	return archives, nil
}

// runBusybox runs script in a busybox pod of namespace default on node and waits until it runs
// in its own network.
func runBusybox(ctx context.Context, c kubernetes.Interface, node, name, script string) error {
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: name},
		Spec: corev1.PodSpec{
			NodeName:                      node,
			TerminationGracePeriodSeconds: ptr.To[int64](1),
			Containers: []corev1.Container{{
				Name: "app", Image: "busybox", ImagePullPolicy: corev1.PullIfNotPresent, // imported, no registry
				Command: []string{"sh", "-c", script},
			}},
		},
	}
	if _, err := c.CoreV1().Pods("default").Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		return err
	}
	return wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		p, err := c.CoreV1().Pods("default").Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		return p.Status.Phase == corev1.PodRunning && p.Status.PodIP != "" && p.Status.PodIP != p.Status.HostIP, nil
	})
}

// readFirst returns the name of the one entry of dir.
func readFirst(t *testing.T, dir string) string {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil || len(entries) != 1 {
		t.Fatalf("%s: %v, %d entries", dir, err, len(entries))
	}
	return entries[0].Name()
}

// TestStoppedPodNetworkLeavesTheReaperNothing: a lab's reaper runs after Stop and deletes every
// bridge recorded under bridges/. Stop frees the subnet before that, and another lab may then
// make a bridge of the same name, so a stopped pod network leaves no record (CI once lost a
// containerd node's bridge that way, and its kubelet could not bind its node address).
func TestStoppedPodNetworkLeavesTheReaperNothing(t *testing.T) {
	g := NewWithT(t)
	lab := newTestLab(t)
	pn, err := lab.startPodNetwork()
	g.Expect(err).NotTo(HaveOccurred())
	record := filepath.Join(lab.Root, "bridges", pn.Bridge)
	g.Expect(record).To(BeAnExistingFile())
	g.Expect(pn.stop()).To(Succeed())
	g.Expect(record).NotTo(BeAnExistingFile(), "the reaper would delete the next bridge of that name")
	g.Expect(pn.lock).NotTo(BeAnExistingFile())
	g.Expect(exec.Command("ip", "link", "show", pn.Bridge).Run()).To(HaveOccurred())
}
