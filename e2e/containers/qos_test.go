package containers_test

import (
	"bytes"
	"context"
	"fmt"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/tools/remotecommand"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pvbridge.io/e2e/cluster"
	"pvbridge.io/e2e/deploy"
	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/pkg/names"
	"pvbridge.io/pkg/qos"
	"pvbridge.io/pkg/tenancy"
)

// TestVolumeAttributesClassLimitsIOLive gives a guest volume in use by a running pod a slower
// VolumeAttributesClass and measures, in that pod, the direct writes before and after: the
// limit is the hypervisor's (the local driver's QEMU throttle over the VM's disk), changed
// live through both layers (guest claim → guest-csi → management claim → mgmt-csi → PV → host
// agent). The management side reports the class applied in the VM's status and an Event, and
// a class the platform admin did not allow the cluster is refused: the guest claim's
// modification becomes Infeasible and the volume keeps its class. Only the limit is asserted,
// never a speed: a loaded machine writes slower than any class allows, never faster.
func TestVolumeAttributesClassLimitsIOLive(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	gc, mc := in.Guest.Client(), in.Mgmt.Client()
	mgmtNS := in.Options.Guest.Namespace
	const slow, fast = 4 << 20, 64 << 20

	cleanup := func(f func(ctx context.Context) error) { cleanupAfter(t, f) }
	loops, err := cluster.LoopsBelow(lab.Root)
	g.Expect(err).NotTo(HaveOccurred())
	cleanup(func(ctx context.Context) error {
		// The volume's loop devices, its own and the one over its throttled export, go with it.
		return wait.PollUntilContextCancel(ctx, 500*time.Millisecond, true, func(context.Context) (bool, error) {
			now, err := cluster.LoopsBelow(lab.Root)
			return len(now) == len(loops), err
		})
	})

	t.Log("the platform admin's classes, two of them allowed to the cluster; the guest's classes naming them")
	allowAttributesClasses(t, map[string]string{"pvbridge-slow": fmt.Sprint(slow), "pvbridge-fast": fmt.Sprint(fast)})
	_, err = mc.StorageV1().VolumeAttributesClasses().Create(ctx, &storagev1.VolumeAttributesClass{
		ObjectMeta: metav1.ObjectMeta{Name: "pvbridge-unlisted"}, DriverName: names.PmemDriver,
		Parameters: map[string]string{qos.MaxBytesPerSecondParam: "1Mi"},
	}, metav1.CreateOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	cleanup(func(ctx context.Context) error {
		return mc.StorageV1().VolumeAttributesClasses().Delete(ctx, "pvbridge-unlisted", metav1.DeleteOptions{})
	})
	for guest, mgmt := range map[string]string{"slow": "pvbridge-slow", "fast": "pvbridge-fast", "gold": "pvbridge-unlisted"} {
		_, err := gc.StorageV1().VolumeAttributesClasses().Create(ctx, &storagev1.VolumeAttributesClass{
			ObjectMeta: metav1.ObjectMeta{Name: guest}, DriverName: names.GuestDriver,
			Parameters: map[string]string{names.MgmtVolumeAttributesClassParam: mgmt},
		}, metav1.CreateOptions{})
		g.Expect(err).NotTo(HaveOccurred())
		cleanup(func(ctx context.Context) error {
			return gc.StorageV1().VolumeAttributesClasses().Delete(ctx, guest, metav1.DeleteOptions{})
		})
	}

	t.Log("a claim of class fast, in use by a running pod")
	ns, err := deploy.CreateNamespace(ctx, gc, "qos")
	g.Expect(err).NotTo(HaveOccurred())
	cleanup(func(ctx context.Context) error {
		return gc.CoreV1().Namespaces().Delete(ctx, ns, metav1.DeleteOptions{})
	})
	pvc := deploy.PVC(ns, "data", "", "128Mi", false)
	pvc.Spec.VolumeAttributesClassName = ptr.To("fast")
	_, err = gc.CoreV1().PersistentVolumeClaims(ns).Create(ctx, pvc, metav1.CreateOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	_, err = gc.CoreV1().Pods(ns).Create(ctx, deploy.Pod(ns, "app", "data", "vm-1", false), metav1.CreateOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	waitRunning(ctx, g, gc, ns, "app")
	pvc, err = gc.CoreV1().PersistentVolumeClaims(ns).Get(ctx, "data", metav1.GetOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(pvc.Status.CurrentVolumeAttributesClassName).To(HaveValue(Equal("fast")))
	pv, err := gc.CoreV1().PersistentVolumes().Get(ctx, pvc.Spec.VolumeName, metav1.GetOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	mgmtClaim := pv.Spec.CSI.VolumeHandle
	scheme, err := deploy.MgmtScheme()
	g.Expect(err).NotTo(HaveOccurred())
	vms, err := client.New(in.Mgmt.RESTConfig(), client.Options{Scheme: scheme})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(diskClass(ctx, g, vms, mgmtNS, "vm-1", mgmtClaim)).To(Equal("pvbridge-fast"))

	// 16 MiB of direct writes: 4 s at 4 MiB/s (less QEMU's burst of a tenth of a second), a
	// quarter of a second at 64 MiB/s.
	write := func() float64 {
		out := execIn(ctx, g, in.Guest, ns, "app", "dd", "if=/dev/zero", "of=/data/f", "bs=1M", "count=16", "oflag=direct")
		m := regexp.MustCompile(`(\d+) bytes .* copied, ([0-9.]+) s`).FindStringSubmatch(out)
		g.Expect(m).NotTo(BeNil(), out)
		n, _ := strconv.ParseFloat(m[1], 64)
		secs, _ := strconv.ParseFloat(m[2], 64)
		return n / secs
	}
	before := write()
	t.Logf("class fast (%d B/s): %.0f B/s written", fast, before)

	t.Log("the claim is given class slow while the pod has it mounted")
	start := time.Now()
	_, err = gc.CoreV1().PersistentVolumeClaims(ns).Patch(ctx, "data", types.MergePatchType, []byte(`{"spec":{"volumeAttributesClassName":"slow"}}`), metav1.PatchOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	g.Eventually(func(g Gomega) {
		pvc, err := gc.CoreV1().PersistentVolumeClaims(ns).Get(ctx, "data", metav1.GetOptions{})
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(pvc.Status.CurrentVolumeAttributesClassName).To(HaveValue(Equal("slow")))
	}).WithContext(ctx).WithTimeout(2 * time.Minute).Should(Succeed())
	t.Logf("modified in %v", time.Since(start).Round(time.Millisecond))
	after := write()
	t.Logf("class slow (%d B/s): %.0f B/s written, %.1f times as slow", slow, after, before/after)
	g.Expect(after).To(BeNumerically("<", 1.5*slow), "the new limit holds at once, in the same pod")

	t.Log("the management side reports it: the VM's disk has the class, and its Event says so")
	g.Expect(diskClass(ctx, g, vms, mgmtNS, "vm-1", mgmtClaim)).To(Equal("pvbridge-slow"))
	g.Eventually(func(g Gomega) {
		events, err := mc.CoreV1().Events(mgmtNS).List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=vm-1,reason=IOLimitsChanged"})
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(events.Items).To(ContainElement(HaveField("Message", ContainSubstring("VolumeAttributesClass pvbridge-slow (4194304 bytes/s), applied live"))))
	}).WithContext(ctx).WithTimeout(time.Minute).Should(Succeed())

	t.Log("a class the platform admin did not allow the cluster is refused, and the volume keeps its class")
	_, err = gc.CoreV1().PersistentVolumeClaims(ns).Patch(ctx, "data", types.MergePatchType, []byte(`{"spec":{"volumeAttributesClassName":"gold"}}`), metav1.PatchOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	g.Eventually(func(g Gomega) {
		pvc, err := gc.CoreV1().PersistentVolumeClaims(ns).Get(ctx, "data", metav1.GetOptions{})
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(pvc.Status.ModifyVolumeStatus).To(HaveValue(HaveField("Status", corev1.PersistentVolumeClaimModifyVolumeInfeasible)))
		g.Expect(pvc.Status.CurrentVolumeAttributesClassName).To(HaveValue(Equal("slow")))
	}).WithContext(ctx).WithTimeout(2 * time.Minute).Should(Succeed())
	// Events are recorded after the status they explain, asynchronously.
	g.Eventually(func(g Gomega) {
		events, err := gc.CoreV1().Events(ns).List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=data,reason=VolumeModifyFailed"})
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(events.Items).To(ContainElement(HaveField("Message", ContainSubstring("which guest cluster "+in.Options.Guest.Name+" may not use"))))
	}).WithContext(ctx).WithTimeout(time.Minute).Should(Succeed())
	mgmtPVC, err := mc.CoreV1().PersistentVolumeClaims(mgmtNS).Get(ctx, mgmtClaim, metav1.GetOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(mgmtPVC.Spec.VolumeAttributesClassName).To(HaveValue(Equal("pvbridge-slow")))

	toggleAttributesClass(t, mgmtNS, mgmtClaim, "pvbridge-fast", "pvbridge-slow")
}

// toggleAttributesClass changes the class of a guest cluster's management claim back and
// forth, each change awaited, as a guest whose credential writes its claims could in a loop,
// until the management driver refuses for want of the cluster's budget of changes; then it
// waits for csi-resizer's retry to carry the refused change through once the budget refills,
// and leaves the claim with class keep, which it had.
func toggleAttributesClass(t *testing.T, ns, claim, other, keep string) {
	g := NewWithT(t)
	ctx := t.Context()
	claims := in.Mgmt.Client().CoreV1().PersistentVolumeClaims(ns)
	set := func(class string) {
		_, err := claims.Patch(ctx, claim, types.MergePatchType, fmt.Appendf(nil, `{"spec":{"volumeAttributesClassName":%q}}`, class), metav1.PatchOptions{})
		g.Expect(err).NotTo(HaveOccurred())
	}
	// The refusal (mgmt-csi/internal/driver/tenancy.go), in the claim's ModifyVolumeError condition.
	refusal := fmt.Sprintf("guest cluster %s/%s has spent its budget of VolumeAttributesClass changes (20 at once, then one every 6 s): PVC %s/%s changes class when the budget allows",
		ns, in.Options.Guest.Name, ns, claim)
	changed := func(g Gomega, class string) {
		pvc, err := claims.Get(ctx, claim, metav1.GetOptions{})
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(pvc.Status.CurrentVolumeAttributesClassName).To(HaveValue(Equal(class)))
	}

	t.Log("the guest cluster's management claim changes class in a loop, until the management driver refuses")
	start := time.Now()
	changes, refused, target := 0, false, keep
	for !refused {
		g.Expect(changes).To(BeNumerically("<", 60), "no refusal after %d changes", changes)
		target = map[string]string{keep: other, other: keep}[target]
		set(target)
		g.Eventually(func(g Gomega) {
			pvc, err := claims.Get(ctx, claim, metav1.GetOptions{})
			g.Expect(err).NotTo(HaveOccurred())
			for _, c := range pvc.Status.Conditions {
				if c.Type == corev1.PersistentVolumeClaimVolumeModifyVolumeError && strings.Contains(c.Message, refusal) {
					refused = true
					return
				}
			}
			changed(g, target)
		}).WithContext(ctx).WithTimeout(2 * time.Minute).WithPolling(200 * time.Millisecond).Should(Succeed())
		if !refused {
			changes++
		}
	}
	t.Logf("%d changes in %v, then: %s", changes, time.Since(start).Round(time.Millisecond), refusal)
	g.Expect(changes).To(BeNumerically(">=", 19), "the budget's burst (20, one spent by the guest's own change before)")

	t.Log("csi-resizer calls again after its backoff; the change goes through once the budget refills")
	start = time.Now()
	g.Eventually(changed).WithArguments(target).WithContext(ctx).WithTimeout(2 * time.Minute).Should(Succeed())
	t.Logf("changed %v after the refusal", time.Since(start).Round(time.Millisecond))
	if target != keep {
		set(keep)
		g.Eventually(changed).WithArguments(keep).WithContext(ctx).WithTimeout(2 * time.Minute).Should(Succeed())
	}
}

// allowAttributesClasses creates management VolumeAttributesClasses, each limiting a disk to
// its bytes per second, and allows the guest cluster to use them (the platform admin's
// annotation on its Cluster), until the test ends.
func allowAttributesClasses(t *testing.T, classes map[string]string) {
	g := NewWithT(t)
	ctx := t.Context()
	mc, ns := in.Mgmt.Client(), in.Options.Guest.Namespace
	var list []string
	for name, limit := range classes {
		_, err := mc.StorageV1().VolumeAttributesClasses().Create(ctx, &storagev1.VolumeAttributesClass{
			ObjectMeta: metav1.ObjectMeta{Name: name}, DriverName: names.PmemDriver,
			Parameters: map[string]string{qos.MaxBytesPerSecondParam: limit},
		}, metav1.CreateOptions{})
		g.Expect(err).NotTo(HaveOccurred())
		list = append(list, name)
	}
	slices.Sort(list)
	dc, err := dynamic.NewForConfig(in.Mgmt.RESTConfig())
	g.Expect(err).NotTo(HaveOccurred())
	clusters := dc.Resource(schema.GroupVersionResource{Group: "cluster.x-k8s.io", Version: "v1beta2", Resource: "clusters"}).Namespace(ns)
	c, err := clusters.Get(ctx, in.Options.Guest.Name, metav1.GetOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	annotate := func(ctx context.Context, value string) error {
		patch := fmt.Appendf(nil, `{"metadata":{"annotations":{%q:%q}}}`, tenancy.AttributesClassesAnnotation, value)
		_, err := clusters.Patch(ctx, in.Options.Guest.Name, types.MergePatchType, patch, metav1.PatchOptions{})
		return err
	}
	g.Expect(annotate(ctx, strings.Join(list, ","))).To(Succeed())
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		g.Expect(annotate(ctx, c.GetAnnotations()[tenancy.AttributesClassesAnnotation])).To(Succeed())
		for name := range classes {
			// Deleted once no claim uses it (kube-controller-manager's vac-protection).
			g.Expect(mc.StorageV1().VolumeAttributesClasses().Delete(ctx, name, metav1.DeleteOptions{})).To(Succeed())
		}
	})
	g.Eventually(func(g Gomega) {
		params, err := mc.CoreV1().ConfigMaps(ns).Get(ctx, tenancy.ParamsConfigMap, metav1.GetOptions{})
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(params.Data).To(HaveKeyWithValue(in.Options.Guest.Name+tenancy.ParamAttributesClasses, strings.Join(list, ",")))
	}).WithContext(ctx).WithTimeout(time.Minute).Should(Succeed())
}

// diskClass is the class whose limits the VM's disk of a management claim has, as its status says.
func diskClass(ctx context.Context, g Gomega, c client.Client, ns, vm, claim string) string {
	obj := &vmv1.VirtualMachine{}
	var class string
	g.Eventually(func(g Gomega) {
		g.Expect(c.Get(ctx, types.NamespacedName{Namespace: ns, Name: vm}, obj)).To(Succeed())
		i := -1
		for j, e := range obj.Status.Volumes {
			if e.Name == claim {
				i = j
			}
		}
		g.Expect(i).NotTo(Equal(-1), "VM %s has no entry for %s", vm, claim)
		class = obj.Status.Volumes[i].VolumeAttributesClassName
		g.Expect(class).NotTo(BeEmpty())
	}).WithContext(ctx).WithTimeout(time.Minute).Should(Succeed())
	return class
}

// execIn runs a command in the container of a pod of cluster cp and returns its output, stdout
// and stderr together.
func execIn(ctx context.Context, g Gomega, cp *cluster.ControlPlane, ns, pod string, command ...string) string {
	req := cp.Client().CoreV1().RESTClient().Post().Resource("pods").Namespace(ns).Name(pod).SubResource("exec").
		VersionedParams(&corev1.PodExecOptions{Container: "app", Command: command, Stdout: true, Stderr: true}, scheme.ParameterCodec)
	exe, err := remotecommand.NewSPDYExecutor(cp.RESTConfig(), "POST", req.URL())
	g.Expect(err).NotTo(HaveOccurred())
	var out bytes.Buffer
	g.Expect(exe.StreamWithContext(ctx, remotecommand.StreamOptions{Stdout: &out, Stderr: &out})).To(Succeed(), out.String())
	return out.String()
}
