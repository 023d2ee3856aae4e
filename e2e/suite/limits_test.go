package suite_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	"google.golang.org/grpc/codes"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pvbridge.io/e2e/deploy"
	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/pkg/csinode/csinodetest"
	"pvbridge.io/pkg/mounter"
	"pvbridge.io/pkg/names"
)

// localDefaultSlots is the local hypervisor's slots of a VM that asks for none: the lab's VMs.
const localDefaultSlots = 64

var _ = Describe("Volume limits", Label("limits"), func() {
	It("places no more volumes on a VM than its hot-plug slots, and refuses one more attach with ResourceExhausted", func(ctx SpecContext) {
		// vm-1 and vm-3 run on host-a: a volume of host-a can go to either.
		const full, other = "vm-1", "vm-3"
		By("vm-1 gets one hot-plug slot, and its guest node says so to the scheduler")
		setSlots(ctx, alpha, full, ptr.To[int32](1))
		DeferCleanup(func(ctx SpecContext) { // after the namespace's cleanup: the VM is empty then
			setSlots(ctx, alpha, full, nil)
			waitVolumeLimit(ctx, alpha, full, localDefaultSlots)
		})
		waitVolumeLimit(ctx, alpha, full, 1)
		ns := alpha.namespace(ctx)
		alpha.create(ctx, deploy.PVC(ns, "first", "", "64Mi", false))
		alpha.runPod(ctx, ns, "first", "first", full, false)

		By("a pod that must run on the full VM is not scheduled, for the scheduler's reason")
		alpha.create(ctx, deploy.PVC(ns, "pinned", "", "64Mi", false))
		alpha.create(ctx, deploy.Pod(ns, "pinned", "pinned", full, false))
		Eventually(func(g Gomega) {
			pod := &corev1.Pod{}
			g.Expect(alpha.c.Get(ctx, client.ObjectKey{Namespace: ns, Name: "pinned"}, pod)).To(Succeed())
			g.Expect(pod.Spec.NodeName).To(BeEmpty())
			g.Expect(pod.Status.Conditions).To(ContainElement(And(
				HaveField("Type", corev1.PodScheduled), HaveField("Status", corev1.ConditionFalse),
				HaveField("Message", ContainSubstring("node(s) exceed max volume count")),
			)))
		}).WithContext(ctx).WithTimeout(timeout).Should(Succeed())

		By("a pod that prefers the full VM runs on the other VM of its host")
		alpha.create(ctx, deploy.PVC(ns, "elsewhere", "", "64Mi", false))
		pod := deploy.Pod(ns, "elsewhere", "elsewhere", "", false)
		pod.Spec.Affinity = &corev1.Affinity{NodeAffinity: &corev1.NodeAffinity{
			RequiredDuringSchedulingIgnoredDuringExecution: &corev1.NodeSelector{NodeSelectorTerms: []corev1.NodeSelectorTerm{{
				MatchExpressions: []corev1.NodeSelectorRequirement{{Key: corev1.LabelHostname, Operator: corev1.NodeSelectorOpIn, Values: []string{full, other}}},
			}}},
			PreferredDuringSchedulingIgnoredDuringExecution: []corev1.PreferredSchedulingTerm{{Weight: 100, Preference: corev1.NodeSelectorTerm{
				MatchExpressions: []corev1.NodeSelectorRequirement{{Key: corev1.LabelHostname, Operator: corev1.NodeSelectorOpIn, Values: []string{full}}},
			}}},
		}}
		alpha.create(ctx, pod)
		pod = alpha.running(ctx, ns, "elsewhere")
		Expect(pod.Spec.NodeName).To(Equal(other))

		By("a pod bound to the full VM beside the scheduler: its attach is ResourceExhausted, and kubelet rejects it")
		_, pv := alpha.bound(ctx, ns, "elsewhere")
		alpha.deletePod(ctx, pod)
		bypass := deploy.Pod(ns, "bypass", "elsewhere", "", false)
		bypass.Spec.NodeName = full // no scheduler, no count
		alpha.create(ctx, bypass)
		Eventually(func(g Gomega) {
			vas := &storagev1.VolumeAttachmentList{}
			g.Expect(alpha.c.List(ctx, vas)).To(Succeed())
			g.Expect(vas.Items).To(ContainElement(And(
				HaveField("Spec.NodeName", full), HaveField("Spec.Source.PersistentVolumeName", HaveValue(Equal(pv.Name))),
				HaveField("Status.Attached", false),
				HaveField("Status.AttachError", And(
					HaveField("ErrorCode", HaveValue(BeEquivalentTo(codes.ResourceExhausted))),
					HaveField("Message", ContainSubstring("as many as its hot-plug slots")),
				)),
			)))
		}).WithContext(ctx).WithTimeout(timeout).Should(Succeed())
		Expect(vm(ctx, alpha.Options.Namespace, full).Spec.Volumes).To(HaveLen(1), "only the first pod's volume is in the VM")
		// kubelet waits 2 min 3 s for a pod's volumes, then reads the VolumeAttachment's code,
		// asks NodeGetInfo again and rejects the pod.
		Eventually(func(g Gomega) {
			g.Expect(alpha.c.Get(ctx, client.ObjectKeyFromObject(bypass), bypass)).To(Succeed())
			g.Expect(bypass.Status.Phase).To(Equal(corev1.PodFailed))
			g.Expect(bypass.Status.Reason).To(Equal("VolumeAttachmentLimitExceeded"))
		}).WithContext(ctx).WithTimeout(2*timeout + time.Minute).Should(Succeed())
	})
})

var _ = Describe("Volume health", Label("health"), func() {
	// In both clusters kubelet (CSIVolumeHealth) asks the node plugin about each volume in use
	// and writes the answer into the pod's status: guest-csi sees a disk of its VM without
	// capacity, mgmt-csi the device of a PMEM volume of its host.
	DescribeTable("shows a volume whose PMEM file lost its capacity in the pod's status, and its recovery",
		func(ctx SpecContext, guest bool) {
			var c client.Client
			var pod *corev1.Pod
			var handle string
			if guest {
				ns := alpha.namespace(ctx)
				alpha.create(ctx, deploy.PVC(ns, "data", "", "64Mi", false))
				pod = alpha.runPod(ctx, ns, "app", "data", "vm-2", false)
				_, pv := alpha.bound(ctx, ns, "data")
				mpv := &corev1.PersistentVolume{}
				Expect(mc.Get(ctx, client.ObjectKey{Name: mgmtClaim(ctx, alpha, pv).Spec.VolumeName}, mpv)).To(Succeed())
				c, handle = alpha.c, mpv.Spec.CSI.VolumeHandle
			} else {
				ns := mgmtNamespace(ctx)
				Expect(mc.Create(ctx, deploy.PVC(ns, "data", deploy.StorageClassPmem, "64Mi", false))).To(Succeed())
				Expect(mc.Create(ctx, deploy.Pod(ns, "app", "data", "host-b", false))).To(Succeed())
				pod = &corev1.Pod{}
				Eventually(func(g Gomega) {
					g.Expect(mc.Get(ctx, client.ObjectKey{Namespace: ns, Name: "app"}, pod)).To(Succeed())
					g.Expect(pod.Status.Phase).To(Equal(corev1.PodRunning))
				}).WithContext(ctx).WithTimeout(timeout).Should(Succeed())
				pvc := &corev1.PersistentVolumeClaim{}
				Expect(mc.Get(ctx, client.ObjectKey{Namespace: ns, Name: "data"}, pvc)).To(Succeed())
				pv := &corev1.PersistentVolume{}
				Expect(mc.Get(ctx, client.ObjectKey{Name: pvc.Spec.VolumeName}, pv)).To(Succeed())
				c, handle = mc, pv.Spec.CSI.VolumeHandle
			}
			// kubelet writes an entry only once a volume had a condition: a healthy one has none.
			Expect(volumeHealth(ctx, c, pod)).NotTo(HaveKey("data"))

			By("the PMEM file behind the volume on host-b loses its capacity")
			file := filepath.Join(mgmtHost("host-b").PmemDir, "volumes", handle+".img")
			st, err := os.Stat(file)
			Expect(err).NotTo(HaveOccurred())
			resize(file, 0)
			DeferCleanup(resize, file, st.Size()) // before the namespace's cleanup: the volume is deleted then
			Eventually(volumeHealth).WithContext(ctx).WithArguments(c, pod).WithTimeout(timeout).Should(
				HaveKeyWithValue("data", ContainElement(And(
					HaveField("Status", corev1.VolumeHealthInaccessible), HaveField("Reason", mounter.ReasonDeviceGone),
				))))

			By("the capacity is back: the entry stays, without conditions")
			resize(file, st.Size())
			Eventually(volumeHealth).WithContext(ctx).WithArguments(c, pod).WithTimeout(timeout).Should(
				HaveKeyWithValue("data", BeEmpty()))
		},
		Entry("guest-csi, a guest pod on vm-2", true),
		Entry("mgmt-csi, a management pod on host-b", false),
	)
})

// setSlots sets, or with nil removes, spec.maxVolumes of guest g's VM name, as a platform admin.
func setSlots(ctx context.Context, g *guestCluster, name string, slots *int32) {
	GinkgoHelper()
	value := "null"
	if slots != nil {
		value = fmt.Sprint(*slots)
	}
	obj := &vmv1.VirtualMachine{ObjectMeta: metaName(g.Options.Namespace, name)}
	Expect(mc.Patch(ctx, obj, client.RawPatch(types.MergePatchType, []byte(`{"spec":{"maxVolumes":`+value+`}}`)))).To(Succeed())
}

// waitVolumeLimit waits until guest g's CSINode of vm says that it takes n volumes of guest-csi,
// as the scheduler reads it.
func waitVolumeLimit(ctx context.Context, g *guestCluster, vm string, n int32) {
	GinkgoHelper()
	Eventually(func(g2 Gomega) {
		csiNode := &storagev1.CSINode{}
		g2.Expect(g.c.Get(ctx, client.ObjectKey{Name: vm}, csiNode)).To(Succeed())
		g2.Expect(csiNode.Spec.Drivers).To(ContainElement(And(
			HaveField("Name", names.GuestDriver),
			HaveField("Allocatable", HaveField("Count", HaveValue(Equal(n)))),
		)))
	}).WithContext(ctx).WithTimeout(timeout).Should(Succeed())
}

// volumeHealth returns the conditions kubelet reports in the pod's status.volumeHealth, by
// volume name; c is the pod's cluster.
func volumeHealth(ctx context.Context, c client.Client, pod *corev1.Pod) (map[string][]corev1.VolumeHealthCondition, error) {
	got := &corev1.Pod{}
	if err := c.Get(ctx, client.ObjectKeyFromObject(pod), got); err != nil {
		return nil, err
	}
	health := map[string][]corev1.VolumeHealthCondition{}
	for _, v := range got.Status.VolumeHealth {
		health[v.Name] = v.HealthConditions
	}
	return health, nil
}

// mgmtNamespace makes a namespace of the management cluster for one spec; when the spec ends its
// pods and claims are deleted and every PV bound to them is gone.
func mgmtNamespace(ctx context.Context) string {
	GinkgoHelper()
	ns, err := deploy.CreateNamespace(ctx, mgmt.CP.Client(), "e2e")
	Expect(err).NotTo(HaveOccurred())
	DeferCleanup(func(ctx SpecContext) {
		Expect(mc.DeleteAllOf(ctx, &corev1.Pod{}, client.InNamespace(ns))).To(Succeed())
		Expect(mc.DeleteAllOf(ctx, &corev1.PersistentVolumeClaim{}, client.InNamespace(ns))).To(Succeed())
		Eventually(func(g Gomega) {
			pvs := &corev1.PersistentVolumeList{}
			g.Expect(mc.List(ctx, pvs)).To(Succeed())
			for _, pv := range pvs.Items {
				g.Expect(pv.Spec.ClaimRef).NotTo(HaveField("Namespace", ns), "PV %s", pv.Name)
			}
		}).WithContext(ctx).WithTimeout(timeout).Should(Succeed())
		Expect(mc.Delete(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}})).To(Succeed())
	}, NodeTimeout(timeout+30e9))
	return ns
}

// mgmtHost returns the lab's management host name.
func mgmtHost(name string) *deploy.Host {
	GinkgoHelper()
	h := mgmt.Host(name)
	if h == nil {
		Fail("no management host " + name)
	}
	return h
}

// resize makes a PMEM volume's file size bytes and tells its loop devices, as a host whose
// backing storage shrank (or came back) would.
func resize(file string, size int64) {
	GinkgoHelper()
	Expect(os.Truncate(file, size)).To(Succeed())
	loops, err := csinodetest.LoopDevices(file)
	Expect(err).NotTo(HaveOccurred())
	Expect(loops).NotTo(BeEmpty())
	for _, loop := range loops {
		out, err := exec.Command("losetup", "--set-capacity", loop).CombinedOutput()
		Expect(err).NotTo(HaveOccurred(), "%s", strings.TrimSpace(string(out)))
	}
}
