package suite_test

import (
	"context"
	"crypto/sha256"
	"os"
	"path/filepath"

	groupsnapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumegroupsnapshot/v1"
	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	"github.com/onsi/gomega/types"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pvbridge.io/e2e/deploy"
	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/pkg/tenancy"
)

// namespace makes a namespace of guest g for one spec; when the spec ends its pods and claims
// are deleted and every guest PV bound to them is gone.
func (g *guestCluster) namespace(ctx context.Context) string {
	ns, err := deploy.CreateNamespace(ctx, g.CP.Client(), "e2e")
	Expect(err).NotTo(HaveOccurred())
	DeferCleanup(func(ctx SpecContext) {
		Expect(g.c.DeleteAllOf(ctx, &corev1.Pod{}, client.InNamespace(ns))).To(Succeed())
		Expect(g.c.DeleteAllOf(ctx, &corev1.PersistentVolumeClaim{}, client.InNamespace(ns))).To(Succeed())
		// A pod whose volume was never attached terminates only once kubelet's wait for its
		// volumes gives up (about two minutes); only then is the VolumeAttachment deleted.
		Eventually(func(g2 Gomega) {
			pvs := &corev1.PersistentVolumeList{}
			g2.Expect(g.c.List(ctx, pvs)).To(Succeed())
			for _, pv := range pvs.Items {
				g2.Expect(pv.Spec.ClaimRef).NotTo(HaveField("Namespace", ns), "guest PV %s", pv.Name)
			}
		}).WithContext(ctx).WithTimeout(2 * timeout).Should(Succeed())
	}, NodeTimeout(2*timeout+30e9))
	return ns
}

// create creates obj in guest g.
func (g *guestCluster) create(ctx context.Context, obj client.Object) {
	GinkgoHelper()
	Expect(g.c.Create(ctx, obj)).To(Succeed())
}

// runPod creates pod name with claim on vm ("" lets the scheduler choose) and waits until it
// runs.
func (g *guestCluster) runPod(ctx context.Context, ns, name, claim, vm string, block bool) *corev1.Pod {
	GinkgoHelper()
	g.create(ctx, deploy.Pod(ns, name, claim, vm, block))
	return g.running(ctx, ns, name)
}

// running waits until pod ns/name exists and runs, and returns it.
func (g *guestCluster) running(ctx context.Context, ns, name string) *corev1.Pod {
	GinkgoHelper()
	pod := &corev1.Pod{}
	Eventually(func(g2 Gomega) {
		g2.Expect(g.c.Get(ctx, client.ObjectKey{Namespace: ns, Name: name}, pod)).To(Succeed())
		g2.Expect(pod.Status.Phase).To(Equal(corev1.PodRunning))
	}).WithContext(ctx).WithTimeout(timeout).Should(Succeed())
	return pod
}

// deletePod deletes a pod and waits until nothing is attached to its VM any more.
func (g *guestCluster) deletePod(ctx context.Context, pod *corev1.Pod) {
	GinkgoHelper()
	Expect(g.c.Delete(ctx, pod)).To(Succeed())
	Eventually(func(g2 Gomega) {
		vas := &storagev1.VolumeAttachmentList{}
		g2.Expect(g.c.List(ctx, vas)).To(Succeed())
		for _, va := range vas.Items {
			g2.Expect(va.Spec.NodeName).NotTo(Equal(pod.Spec.NodeName), "VolumeAttachment %s", va.Name)
		}
	}).WithContext(ctx).WithTimeout(timeout).Should(Succeed())
}

// bound waits until claim is bound and returns it with its PV.
func (g *guestCluster) bound(ctx context.Context, ns, claim string) (*corev1.PersistentVolumeClaim, *corev1.PersistentVolume) {
	GinkgoHelper()
	pvc := &corev1.PersistentVolumeClaim{}
	Eventually(func(g2 Gomega) {
		g2.Expect(g.c.Get(ctx, client.ObjectKey{Namespace: ns, Name: claim}, pvc)).To(Succeed())
		g2.Expect(pvc.Status.Phase).To(Equal(corev1.ClaimBound))
	}).WithContext(ctx).WithTimeout(timeout).Should(Succeed())
	pv := &corev1.PersistentVolume{}
	Expect(g.c.Get(ctx, client.ObjectKey{Name: pvc.Spec.VolumeName}, pv)).To(Succeed())
	return pvc, pv
}

// snapshot creates VolumeSnapshot name of claim in guest g (the guest's class), deleted when
// the spec ends.
func (g *guestCluster) snapshot(ctx context.Context, ns, name, claim string) *snapshotv1.VolumeSnapshot {
	GinkgoHelper()
	return snapshotOf(ctx, g.c, ns, name, claim, deploy.SnapshotClassGuest)
}

// readySnapshot waits until snap is ready to use.
func (g *guestCluster) readySnapshot(ctx context.Context, snap *snapshotv1.VolumeSnapshot) {
	GinkgoHelper()
	readySnapshot(ctx, g.c, snap)
}

// snapshotOf creates VolumeSnapshot name of claim, of class, in the cluster of c, deleted when
// the spec ends.
func snapshotOf(ctx context.Context, c client.Client, ns, name, claim, class string) *snapshotv1.VolumeSnapshot {
	GinkgoHelper()
	snap := &snapshotv1.VolumeSnapshot{
		ObjectMeta: metaName(ns, name),
		Spec: snapshotv1.VolumeSnapshotSpec{
			Source:                  snapshotv1.VolumeSnapshotSource{PersistentVolumeClaimName: ptr.To(claim)},
			VolumeSnapshotClassName: ptr.To(class),
		},
	}
	Expect(c.Create(ctx, snap)).To(Succeed())
	DeferCleanup(func(ctx SpecContext) {
		Expect(client.IgnoreNotFound(c.Delete(ctx, snap))).To(Succeed())
		gone(ctx, c, snap)
	})
	return snap
}

// readySnapshot waits until snap, of the cluster of c, is ready to use.
func readySnapshot(ctx context.Context, c client.Client, snap *snapshotv1.VolumeSnapshot) {
	GinkgoHelper()
	Eventually(func(g Gomega) {
		g.Expect(c.Get(ctx, client.ObjectKeyFromObject(snap), snap)).To(Succeed())
		g.Expect(snap.Status).NotTo(BeNil())
		g.Expect(snap.Status.ReadyToUse).To(HaveValue(BeTrue()))
	}).WithContext(ctx).WithTimeout(timeout).Should(Succeed())
}

// refused waits until snapshot or group snapshot obj of guest g reports an error whose message
// matches m (snapshot-controller copies the driver's refusal there).
func (g *guestCluster) refused(ctx context.Context, obj client.Object, m types.GomegaMatcher) {
	GinkgoHelper()
	Eventually(func(g2 Gomega) {
		g2.Expect(g.c.Get(ctx, client.ObjectKeyFromObject(obj), obj)).To(Succeed())
		var err *snapshotv1.VolumeSnapshotError
		switch o := obj.(type) {
		case *snapshotv1.VolumeSnapshot:
			if o.Status != nil {
				err = o.Status.Error
			}
		case *groupsnapshotv1.VolumeGroupSnapshot:
			if o.Status != nil {
				err = o.Status.Error
			}
		}
		g2.Expect(err).NotTo(BeNil())
		g2.Expect(ptr.Deref(err.Message, "")).To(m)
	}).WithContext(ctx).WithTimeout(timeout).Should(Succeed())
}

// volumePath is where the pod's filesystem volume is mounted, as its container would see it.
func (g *guestCluster) volumePath(pod *corev1.Pod, pv string) string {
	return deploy.PodVolumePath(g.Nodes[pod.Spec.NodeName], pod.UID, pv, false)
}

// writeBlob writes 4 MiB of data derived from seed into the pod's volume and returns its
// checksum.
func (g *guestCluster) writeBlob(pod *corev1.Pod, pv string, seed byte) [sha256.Size]byte {
	GinkgoHelper()
	content := make([]byte, 4<<20)
	for i := range content {
		content[i] = byte(i*7) ^ seed
	}
	Expect(writeSynced(filepath.Join(g.volumePath(pod, pv), "blob"), content)).To(Succeed())
	return sha256.Sum256(content)
}

// writeSynced writes a file and syncs it, as an application that wants its data to outlive a
// snapshot or a crash does.
func writeSynced(path string, content []byte) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if _, err := f.Write(content); err != nil {
		_ = f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		_ = f.Close()
		return err
	}
	return f.Close()
}

// readBlob returns the checksum of the blob in the pod's volume.
func (g *guestCluster) readBlob(pod *corev1.Pod, pv string) [sha256.Size]byte {
	GinkgoHelper()
	got, err := os.ReadFile(filepath.Join(g.volumePath(pod, pv), "blob"))
	Expect(err).NotTo(HaveOccurred())
	return sha256.Sum256(got)
}

// mgmtClaim returns the management PVC behind a guest PV.
func mgmtClaim(ctx context.Context, g *guestCluster, pv *corev1.PersistentVolume) *corev1.PersistentVolumeClaim {
	GinkgoHelper()
	pvc := &corev1.PersistentVolumeClaim{}
	Expect(mc.Get(ctx, client.ObjectKey{Namespace: g.Options.Namespace, Name: pv.Spec.CSI.VolumeHandle}, pvc)).To(Succeed())
	return pvc
}

// gone waits until obj no longer exists in c.
func gone(ctx context.Context, c client.Client, obj client.Object) {
	GinkgoHelper()
	Eventually(func() bool {
		return apierrors.IsNotFound(c.Get(ctx, client.ObjectKeyFromObject(obj), obj))
	}).WithContext(ctx).WithTimeout(timeout).Should(BeTrue(), "%T %s is deleted", obj, obj.GetName())
}

// ownedClaims lists the management PVCs of guest g.
func ownedClaims(ctx context.Context, g *guestCluster) []corev1.PersistentVolumeClaim {
	GinkgoHelper()
	pvcs := &corev1.PersistentVolumeClaimList{}
	Expect(mc.List(ctx, pvcs, client.InNamespace(g.Options.Namespace), client.MatchingLabels{tenancy.ClusterUIDLabel: g.UID})).To(Succeed())
	return pvcs.Items
}

// vm returns a management VirtualMachine.
func vm(ctx context.Context, ns, name string) *vmv1.VirtualMachine {
	GinkgoHelper()
	obj := &vmv1.VirtualMachine{}
	Expect(mc.Get(ctx, client.ObjectKey{Namespace: ns, Name: name}, obj)).To(Succeed())
	return obj
}

// metaName is a shorthand for object metadata.
func metaName(ns, name string) metav1.ObjectMeta { return metav1.ObjectMeta{Namespace: ns, Name: name} }
