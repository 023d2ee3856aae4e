package capi_test

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	groupsnapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumegroupsnapshot/v1"
	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pvbridge.io/e2e/deploy"
	"pvbridge.io/pkg/names"
	"pvbridge.io/pkg/tenancy"
)

// storageOnTheGuest runs what e2e/suite proves on the process lab's guests (its expansion,
// snapshot, static, reclaim and isolation specs; provisioning and data are the StatefulSet's
// step) on the guest that Cluster API made, in real containers: every datum is written and read
// back in a container. Each part leaves nothing behind in either cluster.
func storageOnTheGuest(t *testing.T) {
	for _, step := range []struct {
		name string
		run  func(*testing.T)
	}{
		{"OnlineExpansion", onlineExpansion},
		{"SnapshotRestoreAndClone", snapshotRestoreAndClone},
		{"StaticVolumeReleasedNotDeleted", staticVolumeReleasedNotDeleted},
		{"RetainedInTheGuest", retainedInTheGuest},
		{"ForeignVolumeRefused", foreignVolumeRefused},
	} {
		t.Run(step.name, step.run)
	}
}

// onlineExpansion: a running pod's xfs volume grows from 320 MiB to 512 MiB; the pod sees the
// larger filesystem and its data unchanged.
func onlineExpansion(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	c := in.Guest.Client()
	ns := guestNamespace(t, g, "expand")
	_, err := c.CoreV1().PersistentVolumeClaims(ns).Create(ctx, deploy.PVC(ns, "data", deploy.StorageClassGuestXFS, "320Mi", false), metav1.CreateOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	startPod(ctx, g, ns, "app", "data", "")
	sum := writeBlob(ctx, g, ns, "app")
	before, err := fsKiB(ctx, ns, "app")
	g.Expect(err).NotTo(HaveOccurred())

	pvc, err := c.CoreV1().PersistentVolumeClaims(ns).Get(ctx, "data", metav1.GetOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	pvc.Spec.Resources.Requests[corev1.ResourceStorage] = resource.MustParse("512Mi")
	_, err = c.CoreV1().PersistentVolumeClaims(ns).Update(ctx, pvc, metav1.UpdateOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	g.Eventually(fsKiB).WithArguments(ctx, ns, "app").WithContext(ctx).WithTimeout(3*time.Minute).WithPolling(2*time.Second).
		Should(BeNumerically(">", before+150<<10), "the filesystem the pod sees grew")
	g.Expect(readBlobSum(ctx, g, ns, "app")).To(Equal(sum))
}

// snapshotRestoreAndClone: a snapshot of a written volume, restored, and a clone of the volume
// read back the same data in pods of their own.
func snapshotRestoreAndClone(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	c := in.Guest.Client()
	gc := guestClient(g)
	ns := guestNamespace(t, g, "snap")
	_, err := c.CoreV1().PersistentVolumeClaims(ns).Create(ctx, deploy.PVC(ns, "data", "", "256Mi", false), metav1.CreateOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	node := startPod(ctx, g, ns, "writer", "data", "")
	sum := writeBlob(ctx, g, ns, "writer")

	snap := &snapshotv1.VolumeSnapshot{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "snap"},
		Spec: snapshotv1.VolumeSnapshotSpec{
			VolumeSnapshotClassName: ptr.To(deploy.SnapshotClassGuest),
			Source:                  snapshotv1.VolumeSnapshotSource{PersistentVolumeClaimName: ptr.To("data")},
		},
	}
	g.Expect(gc.Create(ctx, snap)).To(Succeed())
	g.Eventually(func(g Gomega) {
		g.Expect(gc.Get(ctx, client.ObjectKeyFromObject(snap), snap)).To(Succeed())
		g.Expect(snap.Status).NotTo(BeNil())
		g.Expect(snap.Status.Error).To(BeNil())
		g.Expect(snap.Status.ReadyToUse).To(HaveValue(BeTrue()))
	}).WithContext(ctx).WithTimeout(3 * time.Minute).WithPolling(time.Second).Should(Succeed())

	restored := deploy.PVC(ns, "restored", "", "256Mi", false)
	restored.Spec.DataSource = &corev1.TypedLocalObjectReference{APIGroup: ptr.To(snapshotv1.GroupName), Kind: "VolumeSnapshot", Name: "snap"}
	clone := deploy.PVC(ns, "clone", "", "256Mi", false)
	clone.Spec.DataSource = &corev1.TypedLocalObjectReference{Kind: "PersistentVolumeClaim", Name: "data"}
	for _, claim := range []*corev1.PersistentVolumeClaim{restored, clone} {
		_, err := c.CoreV1().PersistentVolumeClaims(ns).Create(ctx, claim, metav1.CreateOptions{})
		g.Expect(err).NotTo(HaveOccurred())
		// PMEM is node-local: a copy is on its source's host, so its pod goes to a VM there
		// (the scheduler does not know where the snapshot is), the writer's.
		startPod(ctx, g, ns, "read-"+claim.Name, claim.Name, node)
		g.Expect(readBlobSum(ctx, g, ns, "read-"+claim.Name)).To(Equal(sum), claim.Name)
	}
	g.Expect(gc.Delete(ctx, snap)).To(Succeed())
}

// staticVolumeReleasedNotDeleted: a management PVC a platform admin shares with the cluster,
// imported by a guest PV, is written; deleting the guest's claim (and so its PV, reclaim policy
// Delete) releases the management PVC without deleting it, and imported again it reads the same
// data.
func staticVolumeReleasedNotDeleted(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	c := in.Guest.Client()
	ns := guestNamespace(t, g, "static")
	host := workerHost(ctx, g)
	mpvc := managementClaim(t, g, "imported-"+ns, host, in.Options.Guest.Name)

	importVolume(t, g, ns, "first", mpvc.Name, host)
	startPod(ctx, g, ns, "writer", "first", "")
	sum := writeBlob(ctx, g, ns, "writer")
	g.Expect(c.CoreV1().Pods(ns).Delete(ctx, "writer", metav1.DeleteOptions{})).To(Succeed())
	g.Expect(c.CoreV1().PersistentVolumeClaims(ns).Delete(ctx, "first", metav1.DeleteOptions{})).To(Succeed())
	g.Eventually(func() bool {
		_, err := c.CoreV1().PersistentVolumes().Get(ctx, ns+"-first", metav1.GetOptions{})
		return apierrors.IsNotFound(err)
	}).WithContext(ctx).WithTimeout(3*time.Minute).WithPolling(time.Second).Should(BeTrue(), "the guest PV is deleted")
	mc := mgmtClient(g)
	g.Expect(mc.Get(ctx, client.ObjectKeyFromObject(mpvc), mpvc)).To(Succeed())
	g.Expect(mpvc.DeletionTimestamp).To(BeNil(), "the shared management PVC is released, not deleted")
	g.Expect(mpvc.Status.Phase).To(Equal(corev1.ClaimBound))

	importVolume(t, g, ns, "again", mpvc.Name, host)
	startPod(ctx, g, ns, "reader", "again", "")
	g.Expect(readBlobSum(ctx, g, ns, "reader")).To(Equal(sum))
}

// retainedInTheGuest: a guest class whose reclaim policy is Retain keeps the guest PV, and with
// it the management claim, when the guest's claim is deleted; once the guest admin reclaims the
// PV (policy Delete), the volume goes in both clusters.
func retainedInTheGuest(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	c := in.Guest.Client()
	ns := guestNamespace(t, g, "retain")
	class := &storagev1.StorageClass{
		ObjectMeta:  metav1.ObjectMeta{Name: ns + "-retain"},
		Provisioner: names.GuestDriver, ReclaimPolicy: ptr.To(corev1.PersistentVolumeReclaimRetain),
		VolumeBindingMode: ptr.To(storagev1.VolumeBindingWaitForFirstConsumer),
	}
	_, err := c.StorageV1().StorageClasses().Create(ctx, class, metav1.CreateOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	t.Cleanup(func() {
		g.Expect(c.StorageV1().StorageClasses().Delete(context.Background(), class.Name, metav1.DeleteOptions{})).To(Succeed())
	})
	_, err = c.CoreV1().PersistentVolumeClaims(ns).Create(ctx, deploy.PVC(ns, "data", class.Name, "256Mi", false), metav1.CreateOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	startPod(ctx, g, ns, "app", "data", "")
	writeBlob(ctx, g, ns, "app")
	pvc, err := c.CoreV1().PersistentVolumeClaims(ns).Get(ctx, "data", metav1.GetOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	pv, err := c.CoreV1().PersistentVolumes().Get(ctx, pvc.Spec.VolumeName, metav1.GetOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	mc := mgmtClient(g)
	mpvc := &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Namespace: in.Options.Guest.Namespace, Name: pv.Spec.CSI.VolumeHandle}}

	g.Expect(c.CoreV1().Pods(ns).Delete(ctx, "app", metav1.DeleteOptions{})).To(Succeed())
	g.Expect(c.CoreV1().PersistentVolumeClaims(ns).Delete(ctx, "data", metav1.DeleteOptions{})).To(Succeed())
	g.Eventually(func(g Gomega) {
		pv, err = c.CoreV1().PersistentVolumes().Get(ctx, pv.Name, metav1.GetOptions{})
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(pv.Status.Phase).To(Equal(corev1.VolumeReleased))
	}).WithContext(ctx).WithTimeout(3 * time.Minute).WithPolling(time.Second).Should(Succeed())
	g.Expect(mc.Get(ctx, client.ObjectKeyFromObject(mpvc), mpvc)).To(Succeed())
	g.Expect(mpvc.DeletionTimestamp).To(BeNil(), "the management claim of a retained guest PV stays")

	pv.Spec.PersistentVolumeReclaimPolicy = corev1.PersistentVolumeReclaimDelete
	_, err = c.CoreV1().PersistentVolumes().Update(ctx, pv, metav1.UpdateOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	g.Eventually(func(g Gomega) {
		_, err := c.CoreV1().PersistentVolumes().Get(ctx, pv.Name, metav1.GetOptions{})
		g.Expect(apierrors.IsNotFound(err)).To(BeTrue(), "guest PV %s", pv.Name)
		g.Expect(apierrors.IsNotFound(mc.Get(ctx, client.ObjectKeyFromObject(mpvc), mpvc))).To(BeTrue(), "management PVC %s", mpvc.Name)
	}).WithContext(ctx).WithTimeout(3 * time.Minute).WithPolling(time.Second).Should(Succeed())
}

// foreignVolumeRefused: a guest PV naming a management PVC of the cluster's namespace that is
// not shared with it is never attached; its attach error says why.
func foreignVolumeRefused(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	ns := guestNamespace(t, g, "foreign")
	host := workerHost(ctx, g)
	mpvc := managementClaim(t, g, "foreign-"+ns, host, "")
	importVolume(t, g, ns, "data", mpvc.Name, host)
	_, err := in.Guest.Client().CoreV1().Pods(ns).Create(ctx, deploy.Pod(ns, "app", "data", "", false), metav1.CreateOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	g.Eventually(func(g Gomega) {
		vas, err := in.Guest.Client().StorageV1().VolumeAttachments().List(ctx, metav1.ListOptions{})
		g.Expect(err).NotTo(HaveOccurred())
		var errs []string
		for _, va := range vas.Items {
			if ptr.Deref(va.Spec.Source.PersistentVolumeName, "") == ns+"-data" && va.Status.AttachError != nil {
				errs = append(errs, va.Status.AttachError.Message)
			}
		}
		g.Expect(errs).To(ContainElement(ContainSubstring("was not created for cluster " + in.Options.Guest.Name + " and is not shared with it")))
	}).WithContext(ctx).WithTimeout(3 * time.Minute).WithPolling(time.Second).Should(Succeed())
	g.Expect(vmAttachments(ctx, g, mgmtClient(g), in.Options.Guest.Namespace)).NotTo(ContainElement(HaveField("Spec.Source.PersistentVolumeName", HaveValue(Equal(mpvc.Spec.VolumeName)))), "never attached")
}

// guestNamespace creates a namespace of the guest for the test; when the test ends it is
// deleted, and the test waits until its claims are gone in both clusters.
func guestNamespace(t *testing.T, g Gomega, prefix string) string {
	c := in.Guest.Client()
	ns, err := deploy.CreateNamespace(t.Context(), c, prefix)
	g.Expect(err).NotTo(HaveOccurred())
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		defer cancel()
		g.Expect(c.CoreV1().Namespaces().Delete(ctx, ns, metav1.DeleteOptions{})).To(Succeed())
		mc := mgmtClient(g)
		g.Eventually(func(g Gomega) {
			_, err := c.CoreV1().Namespaces().Get(ctx, ns, metav1.GetOptions{})
			g.Expect(apierrors.IsNotFound(err)).To(BeTrue(), "namespace %s", ns)
			claims := &corev1.PersistentVolumeClaimList{}
			g.Expect(mc.List(ctx, claims, client.InNamespace(in.Options.Guest.Namespace))).To(Succeed())
			for _, pvc := range claims.Items {
				g.Expect(pvc.Annotations[tenancy.GuestPVCAnnotation]).NotTo(HavePrefix(ns+"/"), "management claim %s of the guest's %s", pvc.Name, ns)
			}
		}).WithContext(ctx).WithTimeout(5 * time.Minute).WithPolling(time.Second).Should(Succeed())
	})
	return ns
}

// managementClaim creates a management PVC in the guest's namespace as a platform admin
// imports a volume: a raw block volume bound at once on host, shared with the clusters named
// (or none). It is deleted when the test ends.
func managementClaim(t *testing.T, g Gomega, name, host, sharedWith string) *corev1.PersistentVolumeClaim {
	ctx := t.Context()
	mc := mgmtClient(g)
	pvc := deploy.PVC(in.Options.Guest.Namespace, name, deploy.StorageClassPmemImmediate, "256Mi", true)
	pvc.Annotations = map[string]string{"volume.kubernetes.io/selected-node": host}
	if sharedWith != "" {
		pvc.Annotations[tenancy.SharedWithAnnotation] = sharedWith
	}
	g.Expect(mc.Create(ctx, pvc)).To(Succeed())
	t.Cleanup(func() {
		g.Expect(client.IgnoreNotFound(mc.Delete(context.Background(), pvc))).To(Succeed())
	})
	g.Eventually(func(g Gomega) {
		g.Expect(mc.Get(ctx, client.ObjectKeyFromObject(pvc), pvc)).To(Succeed())
		g.Expect(pvc.Status.Phase).To(Equal(corev1.ClaimBound))
	}).WithContext(ctx).WithTimeout(2 * time.Minute).WithPolling(time.Second).Should(Succeed())
	return pvc
}

// importVolume creates a guest PV <ns>-<claim> for management PVC handle on host, as an
// operator imports a volume, and a claim of ns bound to it.
func importVolume(t *testing.T, g Gomega, ns, claim, handle, host string) {
	ctx := t.Context()
	c := in.Guest.Client()
	pvc := deploy.PVC(ns, claim, "", "256Mi", false)
	pvc.Spec.StorageClassName, pvc.Spec.VolumeName = ptr.To(""), ns+"-"+claim
	pv := deploy.ImportedPV(pvc.Spec.VolumeName, handle, host, pvc)
	_, err := c.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	t.Cleanup(func() {
		err := c.CoreV1().PersistentVolumes().Delete(context.Background(), pv.Name, metav1.DeleteOptions{})
		g.Expect(client.IgnoreNotFound(err)).To(Succeed())
	})
	_, err = c.CoreV1().PersistentVolumeClaims(ns).Create(ctx, pvc, metav1.CreateOptions{})
	g.Expect(err).NotTo(HaveOccurred())
}

// workerHost is the management host of a worker of the guest: where a volume its pods can use
// is imported from.
func workerHost(ctx context.Context, g Gomega) string {
	node, err := in.Guest.Client().CoreV1().Nodes().Get(ctx, in.Workers()[0], metav1.GetOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(node.Labels).To(HaveKey(names.GuestTopologyKey))
	return node.Labels[names.GuestTopologyKey]
}

// startPod starts a pod of the guest that mounts claim at /data (on node, when set), waits
// until it runs and returns the node it runs on.
func startPod(ctx context.Context, g Gomega, ns, name, claim, node string) string {
	c := in.Guest.Client()
	_, err := c.CoreV1().Pods(ns).Create(ctx, deploy.Pod(ns, name, claim, node, false), metav1.CreateOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	g.Eventually(func(g Gomega) {
		p, err := c.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(p.Status.Phase).To(Equal(corev1.PodRunning), "pod %s", name)
		node = p.Spec.NodeName
	}).WithContext(ctx).WithTimeout(5 * time.Minute).WithPolling(time.Second).Should(Succeed())
	return node
}

// writeBlob has pod write 3 MB of random data to /data/blob, synced, and returns its md5 sum.
func writeBlob(ctx context.Context, g Gomega, ns, pod string) string {
	out, err := kubectl(ctx, "exec", "-n", ns, pod, "--", "sh", "-c", "head -c 3000000 /dev/urandom > /data/blob && sync && md5sum /data/blob")
	g.Expect(err).NotTo(HaveOccurred())
	return strings.Fields(out)[0]
}

// readBlobSum is the md5 sum of /data/blob as pod reads it.
func readBlobSum(ctx context.Context, g Gomega, ns, pod string) string {
	out, err := kubectl(ctx, "exec", "-n", ns, pod, "--", "md5sum", "/data/blob")
	g.Expect(err).NotTo(HaveOccurred())
	return strings.Fields(out)[0]
}

// fsKiB is the size of the filesystem at /data as pod sees it, in KiB (df -P: one line per
// filesystem, however long its device's name).
func fsKiB(ctx context.Context, ns, pod string) (int, error) {
	out, err := kubectl(ctx, "exec", "-n", ns, pod, "--", "sh", "-c", "df -Pk /data | awk 'END { print $2 }'")
	if err != nil {
		return 0, err
	}
	return strconv.Atoi(strings.TrimSpace(out))
}

// guestClient is a client of the guest that knows VolumeSnapshots and VolumeGroupSnapshots.
func guestClient(g Gomega) client.Client {
	s := runtime.NewScheme()
	g.Expect(clientgoscheme.AddToScheme(s)).To(Succeed())
	g.Expect(snapshotv1.AddToScheme(s)).To(Succeed())
	g.Expect(groupsnapshotv1.AddToScheme(s)).To(Succeed())
	c, err := client.New(in.Guest.RESTConfig(), client.Options{Scheme: s})
	g.Expect(err).NotTo(HaveOccurred())
	return c
}
