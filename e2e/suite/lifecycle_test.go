package suite_test

import (
	"context"
	"fmt"
	"strings"

	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pvbridge.io/e2e/deploy"
	"pvbridge.io/pkg/names"
	"pvbridge.io/pkg/tenancy"
)

// storageClass creates a StorageClass (WaitForFirstConsumer, with the reclaim policy,
// expandable as the shipped classes are) in c for the spec.
func storageClass(ctx context.Context, c client.Client, name, provisioner string, policy corev1.PersistentVolumeReclaimPolicy, params map[string]string) {
	GinkgoHelper()
	sc := &storagev1.StorageClass{
		ObjectMeta:           metaName("", name),
		Provisioner:          provisioner,
		Parameters:           params,
		ReclaimPolicy:        ptr.To(policy),
		VolumeBindingMode:    ptr.To(storagev1.VolumeBindingWaitForFirstConsumer),
		AllowVolumeExpansion: ptr.To(true),
	}
	Expect(c.Create(ctx, sc)).To(Succeed())
	DeferCleanup(func(ctx SpecContext) { Expect(c.Delete(ctx, sc)).To(Succeed()) })
}

// setReclaim changes a PV's reclaim policy, as an admin reclaims a retained volume.
func setReclaim(ctx context.Context, c client.Client, pv *corev1.PersistentVolume, policy corev1.PersistentVolumeReclaimPolicy) {
	GinkgoHelper()
	Expect(c.Get(ctx, client.ObjectKeyFromObject(pv), pv)).To(Succeed())
	patch := client.MergeFrom(pv.DeepCopy())
	pv.Spec.PersistentVolumeReclaimPolicy = policy
	Expect(c.Patch(ctx, pv, patch)).To(Succeed())
}

// released waits until pv is Released and returns it.
func released(ctx context.Context, c client.Client, pv *corev1.PersistentVolume) {
	GinkgoHelper()
	Eventually(func(g Gomega) {
		g.Expect(c.Get(ctx, client.ObjectKeyFromObject(pv), pv)).To(Succeed())
		g.Expect(pv.Status.Phase).To(Equal(corev1.VolumeReleased))
	}).WithContext(ctx).WithTimeout(timeout).Should(Succeed())
}

var _ = Describe("Reclaim policy", Label("reclaim"), func() {
	const (
		del = corev1.PersistentVolumeReclaimDelete
		ret = corev1.PersistentVolumeReclaimRetain
	)
	DescribeTable("deleting a guest PVC follows the reclaim policy of each layer",
		func(ctx SpecContext, guestPolicy, mgmtPolicy corev1.PersistentVolumeReclaimPolicy) {
			suffix := strings.ToLower(fmt.Sprintf("%s-%s", guestPolicy, mgmtPolicy))
			mgmtClass, guestClass := "pmem-"+suffix, "pvbridge-"+suffix
			storageClass(ctx, mc, mgmtClass, names.PmemDriver, mgmtPolicy, map[string]string{"csi.storage.k8s.io/fstype": "ext4"})
			allowClass(ctx, alpha, tenancy.StorageClassesAnnotation, tenancy.ParamStorageClasses, mgmtClass)
			storageClass(ctx, alpha.c, guestClass, names.GuestDriver, guestPolicy, map[string]string{names.MgmtStorageClassParam: mgmtClass})

			ns := alpha.namespace(ctx)
			alpha.create(ctx, deploy.PVC(ns, "data", guestClass, "256Mi", false))
			pod := alpha.runPod(ctx, ns, "app", "data", "vm-1", false)
			pvc, pv := alpha.bound(ctx, ns, "data")
			mpvc := mgmtClaim(ctx, alpha, pv)
			mpv := &corev1.PersistentVolume{ObjectMeta: metaName("", mpvc.Spec.VolumeName)}
			alpha.deletePod(ctx, pod)
			Expect(alpha.c.Delete(ctx, pvc)).To(Succeed())

			if guestPolicy == ret {
				By("the guest PV is retained, and with it the management PVC and its volume")
				released(ctx, alpha.c, pv)
				Expect(mc.Get(ctx, client.ObjectKeyFromObject(mpvc), mpvc)).To(Succeed())
				Expect(mpvc.DeletionTimestamp).To(BeNil())
				Expect(mpvc.Status.Phase).To(Equal(corev1.ClaimBound))
				By("the guest admin reclaims the guest PV")
				setReclaim(ctx, alpha.c, pv, del)
			}
			gone(ctx, alpha.c, pv)
			gone(ctx, mc, mpvc)
			if mgmtPolicy == ret {
				By("the management PV is retained, with its PMEM")
				released(ctx, mc, mpv)
				By("the platform admin reclaims the management PV")
				setReclaim(ctx, mc, mpv, del)
			}
			gone(ctx, mc, mpv)
		},
		Entry("Delete in the guest, Delete in the management cluster", del, del),
		Entry("Delete in the guest, Retain in the management cluster", del, ret),
		Entry("Retain in the guest, Delete in the management cluster", ret, del),
		Entry("Retain in the guest, Retain in the management cluster", ret, ret),
	)
})

var _ = Describe("Online expansion", Label("expansion"), func() {
	It("grows the filesystem a running pod sees in the guest", func(ctx SpecContext) {
		ns := alpha.namespace(ctx)
		// xfs: ext4 cannot grow while mounted without CAP_SYS_RESOURCE, which the lab lacks.
		alpha.create(ctx, deploy.PVC(ns, "data", deploy.StorageClassGuestXFS, "320Mi", false))
		pod := alpha.runPod(ctx, ns, "app", "data", "vm-2", false)
		pvc, pv := alpha.bound(ctx, ns, "data")
		want := alpha.writeBlob(pod, pv.Name, 3)
		before := fsSize(alpha.volumePath(pod, pv.Name))

		Expect(requestSize(ctx, alpha.c, pvc, "512Mi")).To(Succeed())
		Eventually(func(g Gomega) {
			g.Expect(alpha.c.Get(ctx, client.ObjectKeyFromObject(pvc), pvc)).To(Succeed())
			g.Expect(pvc.Status.Capacity.Storage().Cmp(resource.MustParse("512Mi"))).To(BeNumerically(">=", 0))
		}).WithContext(ctx).WithTimeout(timeout).Should(Succeed())
		Eventually(fsSize).WithArguments(alpha.volumePath(pod, pv.Name)).WithContext(ctx).WithTimeout(timeout).
			Should(BeNumerically(">", before+150<<20), "the filesystem in the guest grew")
		Expect(mgmtClaim(ctx, alpha, pv).Status.Capacity.Storage().Cmp(resource.MustParse("512Mi"))).To(BeNumerically(">=", 0))
		Expect(alpha.readBlob(pod, pv.Name)).To(Equal(want))
	})
})

// requestSize asks for size in claim pvc of c's cluster.
func requestSize(ctx context.Context, c client.Client, pvc *corev1.PersistentVolumeClaim, size string) error {
	patch := client.MergeFrom(pvc.DeepCopy())
	pvc.Spec.Resources.Requests[corev1.ResourceStorage] = resource.MustParse(size)
	return c.Patch(ctx, pvc, patch)
}

// fsSize is the size of the filesystem mounted at path, in bytes.
func fsSize(path string) uint64 {
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		return 0
	}
	return st.Blocks * uint64(st.Bsize)
}

var _ = Describe("Snapshots and clones", Label("snapshot"), func() {
	It("restores a snapshot and clones a volume with identical data", func(ctx SpecContext) {
		ns := alpha.namespace(ctx)
		alpha.create(ctx, deploy.PVC(ns, "data", "", "256Mi", false))
		writer := alpha.runPod(ctx, ns, "writer", "data", "vm-1", false)
		_, pv := alpha.bound(ctx, ns, "data")
		want := alpha.writeBlob(writer, pv.Name, 4)

		By("taking a snapshot")
		alpha.readySnapshot(ctx, alpha.snapshot(ctx, ns, "snap", "data"))
		msnaps := &snapshotv1.VolumeSnapshotList{}
		Expect(mc.List(ctx, msnaps, client.InNamespace(alpha.Options.Namespace), client.MatchingLabels{tenancy.ClusterUIDLabel: alpha.UID})).To(Succeed())
		Expect(msnaps.Items).To(ContainElement(HaveField("ObjectMeta.Annotations", HaveKeyWithValue(tenancy.GuestSnapshotAnnotation, ns+"/snap"))))

		By("restoring it and cloning the volume, on the source's host")
		restore := deploy.PVC(ns, "restored", "", "256Mi", false)
		restore.Spec.DataSource = &corev1.TypedLocalObjectReference{APIGroup: ptr.To(snapshotv1.GroupName), Kind: "VolumeSnapshot", Name: "snap"}
		clone := deploy.PVC(ns, "clone", "", "256Mi", false)
		clone.Spec.DataSource = &corev1.TypedLocalObjectReference{Kind: "PersistentVolumeClaim", Name: "data"}
		alpha.create(ctx, restore)
		alpha.create(ctx, clone)
		// PMEM is node-local: a copy lives on the host of its source, so its pods go to a VM there.
		for _, claim := range []string{"restored", "clone"} {
			pod := alpha.runPod(ctx, ns, "read-"+claim, claim, "vm-3", false)
			_, cpv := alpha.bound(ctx, ns, claim)
			Expect(alpha.readBlob(pod, cpv.Name)).To(Equal(want), claim)
		}
	})
})
