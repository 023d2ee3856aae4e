// Package containers_test installs pvbridge's shipped overlays, with the images `make images`
// builds, on lab clusters whose nodes run real containers (containerd), and takes volumes
// through them.
package containers_test

import (
	"context"
	"os"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"
	logf "sigs.k8s.io/controller-runtime/pkg/log"

	"pvbridge.io/e2e/cluster"
	"pvbridge.io/e2e/deploy"
)

func TestMain(m *testing.M) {
	logf.SetLogger(klog.Background()) // deploy's controller-runtime clients log through klog
	os.Exit(m.Run())
}

// TestOverlaysInRealContainers installs both overlays for real (deploy.Install: containerd
// nodes, the built images, kubectl apply -k) on a management cluster with one host and a guest
// cluster of two VMs on it, and takes a guest volume through both layers in real containers:
// a pod on vm-1 writes, and after its volume is detached from vm-1 (hot-unplugged), a pod on
// vm-2 reads it back. Deleting the claim deletes the management volume and its loop device.
func TestOverlaysInRealContainers(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	lab := newLab(t)
	in, err := deploy.Install(ctx, lab, deploy.InstalledOptions{
		Hosts: []string{"host-a"}, PmemSize: 2 << 30,
		Guest: deploy.GuestOptions{Name: "alpha", Namespace: "tenant-a", VMs: map[string]string{"vm-1": "host-a", "vm-2": "host-a"}},
	})
	g.Expect(err).NotTo(HaveOccurred())
	gc, mc := in.Guest.Client(), in.Mgmt.Client()

	_, err = gc.CoreV1().PersistentVolumeClaims("default").Create(ctx, deploy.PVC("default", "data", "", "64Mi", false), metav1.CreateOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	runToCompletion(ctx, g, gc, "writer", "vm-1", "echo written-in-a-container > /data/file && sync")
	g.Eventually(func(g Gomega) {
		vas, err := gc.StorageV1().VolumeAttachments().List(ctx, metav1.ListOptions{})
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(vas.Items).To(BeEmpty(), "the writer's volume is detached from vm-1")
	}).WithContext(ctx).WithTimeout(2 * time.Minute).Should(Succeed())
	g.Expect(runToCompletion(ctx, g, gc, "reader", "vm-2", "cat /data/file")).To(Equal("written-in-a-container\n"))

	// Deleting the claim deletes the guest PV, the management PVC and PV, and the loop device
	// mgmt-csi made for the volume.
	pvc, err := gc.CoreV1().PersistentVolumeClaims("default").Get(ctx, "data", metav1.GetOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(gc.CoreV1().PersistentVolumeClaims("default").Delete(ctx, "data", metav1.DeleteOptions{})).To(Succeed())
	g.Eventually(func(g Gomega) {
		_, err := gc.CoreV1().PersistentVolumes().Get(ctx, pvc.Spec.VolumeName, metav1.GetOptions{})
		g.Expect(apierrors.IsNotFound(err)).To(BeTrue(), "guest PV %s: %v", pvc.Spec.VolumeName, err)
		pvs, err := mc.CoreV1().PersistentVolumes().List(ctx, metav1.ListOptions{})
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(pvs.Items).To(BeEmpty(), "management PVs")
		loops, err := cluster.LoopsBelow(lab.Root)
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(loops).To(HaveLen(1), "only the PMEM filesystem's loop device")
	}).WithContext(ctx).WithTimeout(2 * time.Minute).Should(Succeed())
}

// newLab starts a lab that stops when the test ends.
func newLab(t *testing.T) *cluster.Lab {
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
	return lab
}

// runToCompletion runs script on node in a busybox pod that mounts claim "data" at /data, waits
// until it succeeded, deletes it and returns its output.
func runToCompletion(ctx context.Context, g Gomega, c kubernetes.Interface, name, node, script string) string {
	pod := deploy.Pod("default", name, "data", node, false)
	pod.Spec.RestartPolicy = corev1.RestartPolicyNever
	pod.Spec.Containers[0].Command = []string{"sh", "-c", script}
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
