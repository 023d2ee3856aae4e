// Package containers_test installs pvbridge's shipped overlays, with the images `make images`
// builds, on lab clusters whose nodes run real containers (containerd), and takes volumes
// through them.
package containers_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"

	"pvbridge.io/e2e/cluster"
	"pvbridge.io/e2e/images"
)

// TestManagementOverlayInRealContainers applies the management overlay (file-mode PMEM) to a
// cluster with one containerd host, waits until every pvbridge workload is ready (their
// /healthz answers), and takes a volume of class pmem through mgmt-csi in real containers: one
// pod writes, a second reads it back after the first one's detach.
func TestManagementOverlayInRealContainers(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	lab, archives := newLab(t)
	cp, err := lab.StartControlPlane(ctx, "mgmt")
	g.Expect(err).NotTo(HaveOccurred())
	host, err := cp.AddNode(ctx, "host-a", cluster.NodeOptions{
		Runtime: cluster.Containerd, Images: archives, Labels: map[string]string{"vm.pvbridge.io/host": "true"},
	})
	g.Expect(err).NotTo(HaveOccurred())

	// The host's emulated PMEM: an XFS filesystem in a file, mounted in the host.
	pmem := filepath.Join(host.Dir, "pmem.img")
	g.Expect(os.WriteFile(pmem, nil, 0o600)).To(Succeed())
	g.Expect(os.Truncate(pmem, 2<<30)).To(Succeed())
	g.Expect(os.MkdirAll(host.HostPath("/var/lib/pvbridge/pmem"), 0o755)).To(Succeed())
	for _, cmd := range []*exec.Cmd{
		exec.CommandContext(ctx, "mkfs.xfs", "-q", "-m", "reflink=1", pmem),
		host.Command(ctx, "mount", "-o", "loop", pmem, "/var/lib/pvbridge/pmem"),
	} {
		out, err := cmd.CombinedOutput()
		g.Expect(err).NotTo(HaveOccurred(), string(out))
	}

	kubectl, err := lab.Binaries().Tool("kubectl")
	g.Expect(err).NotTo(HaveOccurred())
	out, err := exec.CommandContext(ctx, kubectl, "--kubeconfig", cp.Kubeconfig, "apply", "--server-side", "--force-conflicts",
		"-k", filepath.Join("testdata", "management")).CombinedOutput()
	g.Expect(err).NotTo(HaveOccurred(), string(out))
	c := cp.Client()
	waitWorkloadsReady(ctx, g, c, "pvbridge-system")

	claim := &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: "data"},
		Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes:      []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			StorageClassName: ptr.To("pmem"),
			Resources:        corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("64Mi")}},
		},
	}
	_, err = c.CoreV1().PersistentVolumeClaims("default").Create(ctx, claim, metav1.CreateOptions{})
	g.Expect(err).NotTo(HaveOccurred())

	runToCompletion(ctx, g, c, "writer", "echo written-in-a-container > /data/file && sync")
	g.Eventually(func(g Gomega) {
		vas, err := c.StorageV1().VolumeAttachments().List(ctx, metav1.ListOptions{})
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(vas.Items).To(BeEmpty(), "the writer's volume is detached")
	}).WithContext(ctx).WithTimeout(2 * time.Minute).Should(Succeed())
	g.Expect(runToCompletion(ctx, g, c, "reader", "cat /data/file")).To(Equal("written-in-a-container\n"))

	// Deleting the claim deletes the volume: its PV, and the loop device mgmt-csi made for it.
	pvc, err := c.CoreV1().PersistentVolumeClaims("default").Get(ctx, "data", metav1.GetOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(c.CoreV1().PersistentVolumeClaims("default").Delete(ctx, "data", metav1.DeleteOptions{})).To(Succeed())
	g.Eventually(func(g Gomega) {
		_, err := c.CoreV1().PersistentVolumes().Get(ctx, pvc.Spec.VolumeName, metav1.GetOptions{})
		g.Expect(apierrors.IsNotFound(err)).To(BeTrue(), "PV %s: %v", pvc.Spec.VolumeName, err)
		loops, err := cluster.LoopsBelow(lab.Root)
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(loops).To(HaveLen(1), "only the PMEM filesystem's loop device")
	}).WithContext(ctx).WithTimeout(2 * time.Minute).Should(Succeed())
}

// newLab starts a lab that stops when the test ends, with every image built into it.
func newLab(t *testing.T) (*cluster.Lab, []string) {
	g := NewWithT(t)
	bin, err := cluster.DefaultBinaries()
	g.Expect(err).NotTo(HaveOccurred())
	root, err := os.MkdirTemp("", "pvb-")
	g.Expect(err).NotTo(HaveOccurred())
	lab, err := cluster.NewLab(root, bin)
	g.Expect(err).NotTo(HaveOccurred())
	t.Cleanup(func() {
		if err := lab.Stop(); err != nil {
			t.Errorf("stop lab: %v", err)
		}
		if !t.Failed() {
			_ = os.RemoveAll(root)
		}
	})
	archives, err := images.BuildForLab(bin.Repo, bin.Dir, filepath.Join(root, "images"))
	g.Expect(err).NotTo(HaveOccurred())
	return lab, archives
}

// waitWorkloadsReady waits until every Deployment and DaemonSet of ns has all its pods ready.
func waitWorkloadsReady(ctx context.Context, g Gomega, c kubernetes.Interface, ns string) {
	g.Eventually(func(g Gomega) {
		deps, err := c.AppsV1().Deployments(ns).List(ctx, metav1.ListOptions{})
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(deps.Items).NotTo(BeEmpty())
		for _, d := range deps.Items {
			g.Expect(d.Status.ReadyReplicas).To(Equal(ptr.Deref(d.Spec.Replicas, 1)), "Deployment %s: %s", d.Name, podProblems(ctx, c, ns))
		}
		dss, err := c.AppsV1().DaemonSets(ns).List(ctx, metav1.ListOptions{})
		g.Expect(err).NotTo(HaveOccurred())
		for _, ds := range dss.Items {
			g.Expect(ds.Status.DesiredNumberScheduled).To(BeNumerically(">", 0), "DaemonSet %s", ds.Name)
			g.Expect(ds.Status.NumberReady).To(Equal(ds.Status.DesiredNumberScheduled), "DaemonSet %s: %s", ds.Name, podProblems(ctx, c, ns))
		}
	}).WithContext(ctx).WithTimeout(3 * time.Minute).Should(Succeed())
}

// podProblems describes the pods of ns that are not ready, for a failure message.
func podProblems(ctx context.Context, c kubernetes.Interface, ns string) string {
	pods, err := c.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		return err.Error()
	}
	var s string
	for _, p := range pods.Items {
		for _, cs := range p.Status.ContainerStatuses {
			switch {
			case cs.State.Waiting != nil:
				s += fmt.Sprintf("\n%s/%s waiting: %s %s", p.Name, cs.Name, cs.State.Waiting.Reason, cs.State.Waiting.Message)
			case cs.State.Terminated != nil:
				s += fmt.Sprintf("\n%s/%s terminated: %s %s", p.Name, cs.Name, cs.State.Terminated.Reason, cs.State.Terminated.Message)
			case !cs.Ready:
				s += fmt.Sprintf("\n%s/%s not ready (restarts %d)", p.Name, cs.Name, cs.RestartCount)
			}
		}
	}
	return s
}

// runToCompletion runs script in a busybox pod that mounts claim "data" at /data, waits until
// it succeeded, deletes it and returns its output.
func runToCompletion(ctx context.Context, g Gomega, c kubernetes.Interface, name, script string) string {
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: name},
		Spec: corev1.PodSpec{
			RestartPolicy:                 corev1.RestartPolicyNever,
			TerminationGracePeriodSeconds: ptr.To[int64](1),
			Containers: []corev1.Container{{
				Name: "app", Image: "busybox", ImagePullPolicy: corev1.PullIfNotPresent,
				Command:      []string{"sh", "-c", script},
				VolumeMounts: []corev1.VolumeMount{{Name: "data", MountPath: "/data"}},
			}},
			Volumes: []corev1.Volume{{Name: "data", VolumeSource: corev1.VolumeSource{
				PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: "data"},
			}}},
		},
	}
	_, err := c.CoreV1().Pods("default").Create(ctx, pod, metav1.CreateOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	g.Eventually(func(g Gomega) {
		p, err := c.CoreV1().Pods("default").Get(ctx, name, metav1.GetOptions{})
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(p.Status.Phase).NotTo(Equal(corev1.PodFailed))
		g.Expect(p.Status.Phase).To(Equal(corev1.PodSucceeded))
	}).WithContext(ctx).WithTimeout(3 * time.Minute).Should(Succeed())
	logs, err := c.CoreV1().Pods("default").GetLogs(name, &corev1.PodLogOptions{}).DoRaw(ctx)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(c.CoreV1().Pods("default").Delete(ctx, name, metav1.DeleteOptions{})).To(Succeed())
	return string(logs)
}
