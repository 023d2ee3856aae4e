package suite_test

import (
	"context"

	"github.com/container-storage-interface/spec/lib/go/csi"
	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pvbridge.io/e2e/deploy"
	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/pkg/tenancy"
)

var _ = Describe("Isolation between guest clusters", Label("isolation"), func() {
	var (
		handle string // alpha's management PVC
		size   resource.Quantity
	)
	BeforeEach(func(ctx SpecContext) {
		ns := alpha.namespace(ctx)
		alpha.create(ctx, deploy.PVC(ns, "data", "", "256Mi", false))
		alpha.runPod(ctx, ns, "app", "data", "vm-1", false)
		_, pv := alpha.bound(ctx, ns, "data")
		handle = pv.Spec.CSI.VolumeHandle
		size = *mgmtClaim(ctx, alpha, pv).Status.Capacity.Storage()
	})

	// untouched checks that alpha's volume is as it was: same size, attached to vm-1 only, no
	// snapshot of it, and that beta's VM never named it.
	untouched := func(ctx context.Context) {
		GinkgoHelper()
		mpvc := &corev1.PersistentVolumeClaim{}
		Expect(mc.Get(ctx, client.ObjectKey{Namespace: alpha.Options.Namespace, Name: handle}, mpvc)).To(Succeed())
		Expect(mpvc.DeletionTimestamp).To(BeNil())
		Expect(mpvc.Spec.Resources.Requests.Storage().Cmp(size)).To(Equal(0), "not expanded")
		Expect(vm(ctx, betaOptions.Namespace, "vm-b1").Spec.Volumes).NotTo(ContainElement(HaveField("PersistentVolumeClaim.ClaimName", handle)))
		snaps := &snapshotv1.VolumeSnapshotList{}
		Expect(mc.List(ctx, snaps)).To(Succeed())
		Expect(snaps.Items).NotTo(ContainElement(HaveField("Spec.Source.PersistentVolumeClaimName", HaveValue(Equal(handle)))))
	}

	It("cannot attach, expand or snapshot the other cluster's volume through a static PV", func(ctx SpecContext) {
		ns := beta.namespace(ctx)
		pv := "steal-" + ns
		// An expandable class, so that the resizer calls the driver.
		staticVolume(ctx, beta, ns, pv, deploy.StorageClassGuest, handle)
		By("attaching")
		beta.create(ctx, deploy.Pod(ns, "app", "data", "vm-b1", false))
		Eventually(attachErrors).WithContext(ctx).WithArguments(beta, pv).WithTimeout(timeout).
			Should(ContainElement(ContainSubstring("management PersistentVolumeClaim tenant-b/" + handle + " does not exist")))
		untouched(ctx)

		By("expanding")
		pvc, _ := beta.bound(ctx, ns, "data")
		Expect(requestSize(ctx, beta.c, pvc, "1Gi")).To(Succeed())
		Eventually(events).WithContext(ctx).WithArguments(beta.c, ns, "data").WithTimeout(timeout).
			Should(ContainElement(And(ContainSubstring("VolumeResizeFailed"), ContainSubstring("does not exist"))))
		untouched(ctx)

		By("taking a snapshot")
		beta.snapshot(ctx, ns, "snap", "data")
		Eventually(func(g Gomega) {
			contents := &snapshotv1.VolumeSnapshotContentList{}
			g.Expect(beta.c.List(ctx, contents)).To(Succeed())
			var messages []string
			for _, c := range contents.Items {
				if c.Spec.VolumeSnapshotRef.Namespace == ns && c.Status != nil && c.Status.Error != nil {
					messages = append(messages, ptr.Deref(c.Status.Error.Message, ""))
				}
			}
			g.Expect(messages).To(ContainElement(ContainSubstring("does not exist")))
		}).WithContext(ctx).WithTimeout(timeout).Should(Succeed())
		untouched(ctx)
	})

	It("cannot create from, or reach with its own identity, the other cluster's volume", func(ctx SpecContext) {
		By("a clone whose source is the other cluster's volume, through beta's controller")
		ctrl := controllerClient(beta.Guest)
		_, err := ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{
			Name:          "pvc-isolation-clone",
			CapacityRange: &csi.CapacityRange{RequiredBytes: 256 << 20},
			VolumeCapabilities: []*csi.VolumeCapability{{
				AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
				AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
			}},
			VolumeContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: handle}}},
		})
		Expect(status.Code(err)).To(Equal(codes.NotFound), "%v", err)
		Expect(ownedClaims(ctx, beta)).To(BeEmpty())

		By("beta's management identity, used directly")
		bc := identity(beta)
		key := client.ObjectKey{Namespace: alpha.Options.Namespace, Name: handle}
		mpvc := &corev1.PersistentVolumeClaim{}
		Expect(bc.Get(ctx, key, mpvc)).To(Satisfy(apierrors.IsForbidden), "read")
		Expect(mc.Get(ctx, key, mpvc)).To(Succeed())
		patch := client.MergeFrom(mpvc.DeepCopy())
		mpvc.Spec.Resources.Requests[corev1.ResourceStorage] = resource.MustParse("1Gi")
		Expect(bc.Patch(ctx, mpvc, patch)).To(Satisfy(apierrors.IsForbidden), "expand")
		Expect(bc.Delete(ctx, &corev1.PersistentVolumeClaim{ObjectMeta: metaName(alpha.Options.Namespace, handle)})).To(Satisfy(apierrors.IsForbidden), "delete")
		stolen := deploy.PVC(alpha.Options.Namespace, "stolen", deploy.StorageClassPmem, "256Mi", true)
		stolen.Labels = map[string]string{tenancy.ClusterUIDLabel: alpha.UID}
		Expect(bc.Create(ctx, stolen)).To(Satisfy(apierrors.IsForbidden), "create in the other namespace")
		target := vm(ctx, alpha.Options.Namespace, "vm-1")
		vmPatch := client.MergeFrom(target.DeepCopy())
		target.Spec.Volumes = append(target.Spec.Volumes, vmv1.VirtualMachineVolume{Name: "stolen", PersistentVolumeClaim: vmv1.PersistentVolumeClaimVolumeSource{ClaimName: handle}})
		Expect(bc.Patch(ctx, target, vmPatch)).To(Satisfy(apierrors.IsForbidden), "attach to the other cluster's VM")
		untouched(ctx)
	})
})

// events returns "<reason>: <message>" of the events of object ns/name of c's cluster.
func events(ctx context.Context, c client.Client, ns, name string) ([]string, error) {
	l := &corev1.EventList{}
	if err := c.List(ctx, l, client.InNamespace(ns)); err != nil {
		return nil, err
	}
	var out []string
	for _, e := range l.Items {
		if e.InvolvedObject.Name == name {
			out = append(out, e.Reason+": "+e.Message)
		}
	}
	return out, nil
}
