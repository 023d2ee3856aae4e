package containers_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"pvbridge.io/e2e/cluster"
	"pvbridge.io/e2e/deploy"
)

// TestOverlaysInRealContainers takes a guest volume through both layers in real containers: a
// pod on vm-1 writes, and after its volume is detached from vm-1 (hot-unplugged), a pod on vm-3
// (the same host) reads it back. Deleting the claim deletes the management volume and the loop
// device mgmt-csi made for it. guest-csi's metrics endpoint counts the calls it served. Between
// the writer and the reader, the pod of vm-operator's controller that holds its Lease is
// deleted: the other replica the manifests run takes over and hot-plugs the reader's disk.
func TestOverlaysInRealContainers(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	gc, mc := in.Guest.Client(), in.Mgmt.Client()
	loopsBefore, err := cluster.LoopsBelow(lab.Root)
	g.Expect(err).NotTo(HaveOccurred())

	_, err = gc.CoreV1().PersistentVolumeClaims("default").Create(ctx, deploy.PVC("default", "data", "", "64Mi", false), metav1.CreateOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	runToCompletion(ctx, g, gc, "default", "writer", "vm-1", "echo written-in-a-container > /data/file && sync")
	_, err = deploy.DeleteLeader(ctx, mc, deploy.InstallNamespace, "pvbridge-vm-operator-controller", "app.kubernetes.io/name=vm-operator,app.kubernetes.io/component=controller")
	g.Expect(err).NotTo(HaveOccurred())
	pvc, err := gc.CoreV1().PersistentVolumeClaims("default").Get(ctx, "data", metav1.GetOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	g.Eventually(func(g Gomega) {
		vas, err := gc.StorageV1().VolumeAttachments().List(ctx, metav1.ListOptions{})
		g.Expect(err).NotTo(HaveOccurred())
		for _, va := range vas.Items {
			g.Expect(va.Spec.Source.PersistentVolumeName).NotTo(HaveValue(Equal(pvc.Spec.VolumeName)), "the writer's volume is detached from vm-1")
		}
	}).WithContext(ctx).WithTimeout(2 * time.Minute).Should(Succeed())
	g.Expect(runToCompletion(ctx, g, gc, "default", "reader", "vm-3", "cat /data/file")).To(Equal("written-in-a-container\n"))

	// The drivers measure the calls they served: guest-csi's controller, scraped through the
	// apiserver's pod proxy on the port its manifest names, counts the volume's CreateVolume.
	g.Eventually(func(g Gomega) {
		pods, err := gc.CoreV1().Pods("pvbridge-system").List(ctx, metav1.ListOptions{
			LabelSelector: "app.kubernetes.io/name=guest-csi,app.kubernetes.io/component=controller"})
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(pods.Items).To(HaveLen(1))
		metrics, err := gc.CoreV1().Pods("pvbridge-system").ProxyGet("http", pods.Items[0].Name, "8090", "/metrics", nil).DoRaw(ctx)
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(string(metrics)).To(MatchRegexp(`(?m)^csi_plugin_operations_seconds_count\{driver_name="guest\.csi\.pvbridge\.io",grpc_status_code="OK",method_name="/csi\.v1\.Controller/CreateVolume"\} [1-9]`))
	}).WithContext(ctx).WithTimeout(time.Minute).Should(Succeed())

	// A guest volume's handle is the name of its management PVC.
	pv, err := gc.CoreV1().PersistentVolumes().Get(ctx, pvc.Spec.VolumeName, metav1.GetOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	mgmtPVC, err := mc.CoreV1().PersistentVolumeClaims(in.Options.Guest.Namespace).Get(ctx, pv.Spec.CSI.VolumeHandle, metav1.GetOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	mgmtPV := mgmtPVC.Spec.VolumeName
	g.Expect(gc.CoreV1().PersistentVolumeClaims("default").Delete(ctx, "data", metav1.DeleteOptions{})).To(Succeed())
	g.Eventually(func(g Gomega) {
		_, err := gc.CoreV1().PersistentVolumes().Get(ctx, pvc.Spec.VolumeName, metav1.GetOptions{})
		g.Expect(apierrors.IsNotFound(err)).To(BeTrue(), "guest PV %s: %v", pvc.Spec.VolumeName, err)
		_, err = mc.CoreV1().PersistentVolumes().Get(ctx, mgmtPV, metav1.GetOptions{})
		g.Expect(apierrors.IsNotFound(err)).To(BeTrue(), "management PV %s: %v", mgmtPV, err)
		loops, err := cluster.LoopsBelow(lab.Root)
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(loops).To(HaveLen(len(loopsBefore)), "the volume's loop device is detached")
	}).WithContext(ctx).WithTimeout(2 * time.Minute).Should(Succeed())
}

// runToCompletion runs script on node in a busybox pod that mounts claim "data" at /data, waits
// until it succeeded, deletes it and returns its output.
func runToCompletion(ctx context.Context, g Gomega, c kubernetes.Interface, ns, name, node, script string) string {
	pod := deploy.Pod(ns, name, "data", node, false)
	pod.Spec.RestartPolicy = corev1.RestartPolicyNever
	pod.Spec.Containers[0].Command = []string{"sh", "-c", script}
	_, err := c.CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	g.Eventually(func(g Gomega) {
		p, err := c.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(p.Status.Phase).NotTo(Equal(corev1.PodFailed))
		g.Expect(p.Status.Phase).To(Equal(corev1.PodSucceeded))
	}).WithContext(ctx).WithTimeout(3 * time.Minute).Should(Succeed())
	logs, err := c.CoreV1().Pods(ns).GetLogs(name, &corev1.PodLogOptions{}).DoRaw(ctx)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(c.CoreV1().Pods(ns).Delete(ctx, name, metav1.DeleteOptions{})).To(Succeed())
	return string(logs)
}

// expectRecords checks that log holds the records 1 to n in order, n at least synced: what a
// writer appending numbered, synced lines left.
func expectRecords(g Gomega, log string, synced int) {
	lines := strings.Fields(log)
	g.Expect(len(lines)).To(BeNumerically(">=", synced), "every record the writer had synced")
	for i, l := range lines {
		g.Expect(l).To(Equal(fmt.Sprint(i+1)), "record %d", i+1)
	}
}
