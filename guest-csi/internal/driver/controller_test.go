package driver

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	. "github.com/onsi/gomega"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"

	"pvbridge.io/guest-csi/internal/request"
	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/pkg/names"
	"pvbridge.io/pkg/tenancy"
)

// A guest PVC's labels are copied for people to read; labels longer than the admission policy
// lets a guest write are left out rather than failing the provisioning.
func TestCreateVolumeLeavesOutLabelsTooLongToCopy(t *testing.T) {
	g := NewWithT(t)
	e := newGuestEnv(t, envOptions{})
	labels := map[string]string{}
	for i := range 80 {
		labels[fmt.Sprintf("label-%02d", i)] = strings.Repeat("v", 50)
	}
	guestPVC := &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: "data-" + e.ns, Labels: labels},
		Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			Resources:   corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Mi")}},
		},
	}
	g.Expect(e.admin.Create(t.Context(), guestPVC)).To(Succeed())

	resp, err := retried(t, e.ctrl.CreateVolume, createReq(guestPVC.Name, envHost, envMountSize))
	g.Expect(err).NotTo(HaveOccurred())
	pvc := e.claimOf(t, resp.GetVolume().GetVolumeId())
	g.Expect(pvc.Annotations).To(HaveKeyWithValue(tenancy.GuestPVCAnnotation, "default/"+guestPVC.Name))
	g.Expect(pvc.Annotations).NotTo(HaveKey(tenancy.GuestLabelsAnnotation))
}

func TestCreateVolumeMirrorsTheGuestPVC(t *testing.T) {
	g := NewWithT(t)
	e := newGuestEnv(t, envOptions{})
	guestPVC := &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: "data-" + e.ns, Labels: map[string]string{"app": "db"}},
		Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			Resources:   corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Mi")}},
		},
	}
	g.Expect(e.admin.Create(t.Context(), guestPVC)).To(Succeed())
	req := createReq(guestPVC.Name, envHost, envMountSize)

	resp, err := retried(t, e.ctrl.CreateVolume, req)
	g.Expect(err).NotTo(HaveOccurred())
	vol := resp.GetVolume()
	g.Expect(vol.GetVolumeId()).To(Equal(e.cluster.UID + "-" + req.Name[len("pvc-"):]))
	g.Expect(vol.GetCapacityBytes()).To(Equal(envMountSize))
	g.Expect(vol.GetAccessibleTopology()).To(HaveExactElements(HaveField("Segments", Equal(map[string]string{TopologyKey: envHost}))))

	pvc := e.claimOf(t, vol.GetVolumeId())
	g.Expect(pvc.Labels).To(Equal(e.cluster.Labels()))
	g.Expect(pvc.Annotations).To(HaveKeyWithValue(tenancy.GuestPVCAnnotation, "default/"+guestPVC.Name))
	g.Expect(pvc.Annotations).To(HaveKeyWithValue(tenancy.GuestPVAnnotation, "pv-"+guestPVC.Name))
	g.Expect(pvc.Annotations).To(HaveKeyWithValue(selectedNodeAnnotation, envHost))
	labels := map[string]string{}
	g.Expect(json.Unmarshal([]byte(pvc.Annotations[tenancy.GuestLabelsAnnotation]), &labels)).To(Succeed())
	g.Expect(labels).To(Equal(map[string]string{"app": "db"}))
	g.Expect(pvc.Spec.VolumeMode).To(HaveValue(Equal(corev1.PersistentVolumeBlock)))
	g.Expect(pvc.Spec.StorageClassName).To(HaveValue(Equal(envClass)))

	again, err := call(t, e.ctrl.CreateVolume, req)
	g.Expect(err).NotTo(HaveOccurred(), "CreateVolume is idempotent")
	g.Expect(again.GetVolume()).To(Equal(vol))

	bigger := createReq(guestPVC.Name, envHost, 2*envMountSize)
	bigger.Name = req.Name
	_, err = call(t, e.ctrl.CreateVolume, bigger)
	expectCodeIn(g, err, codes.AlreadyExists, "fewer than")
	other := createReq(guestPVC.Name, envHost, envMountSize)
	other.Name = req.Name
	other.Parameters[request.ParamMgmtStorageClass] = "premium"
	_, err = call(t, e.ctrl.CreateVolume, other)
	expectCodeIn(g, err, codes.AlreadyExists, `StorageClass "pmem", not "premium"`)

	_, err = call(t, e.ctrl.DeleteVolume, &csi.DeleteVolumeRequest{VolumeId: vol.GetVolumeId()})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(e.admin.Get(t.Context(), client.ObjectKeyFromObject(pvc), pvc)).To(MatchError(apierrors.IsNotFound, "the management PVC is deleted"))
	_, err = call(t, e.ctrl.DeleteVolume, &csi.DeleteVolumeRequest{VolumeId: vol.GetVolumeId()})
	g.Expect(err).NotTo(HaveOccurred(), "DeleteVolume is idempotent")
}

// A volume of a replicated class is made near the VM the guest scheduler chose (its management
// PVC names that host) and has no host topology: any VM may use it.
func TestCreateVolumeOfAReplicatedClassHasNoTopology(t *testing.T) {
	g := NewWithT(t)
	e := newGuestEnv(t, envOptions{})
	req := createReq("data-"+e.ns, envHost, envMountSize)
	req.Parameters[request.ParamReplicated] = "true"

	resp, err := retried(t, e.ctrl.CreateVolume, req)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(resp.GetVolume().GetAccessibleTopology()).To(BeEmpty())
	g.Expect(e.claimOf(t, resp.GetVolume().GetVolumeId()).Annotations).To(HaveKeyWithValue(selectedNodeAnnotation, envHost))
	again, err := call(t, e.ctrl.CreateVolume, req)
	g.Expect(err).NotTo(HaveOccurred(), "CreateVolume is idempotent")
	g.Expect(again.GetVolume()).To(Equal(resp.GetVolume()))
}

func TestCreateVolumeOnAFullHostLeavesNothing(t *testing.T) {
	g := NewWithT(t)
	e := newGuestEnv(t, envOptions{fullHosts: []string{envFullHost}})
	req := createReq("full", envFullHost, envMountSize)

	_, err := call(t, e.ctrl.CreateVolume, req)
	expectCodeIn(g, err, codes.ResourceExhausted, "no node has room: "+envFullHost)
	g.Eventually(func(g Gomega) []corev1.PersistentVolumeClaim {
		pvcs := &corev1.PersistentVolumeClaimList{}
		g.Expect(e.admin.List(t.Context(), pvcs, client.InNamespace(e.ns))).To(Succeed())
		return pvcs.Items
	}).WithTimeout(eventually).Should(BeEmpty(), "the claim that never had a volume is removed")

	// The guest scheduler picks a VM of another host: the same volume lands there.
	req.AccessibilityRequirements = createReq("full", envHost, envMountSize).AccessibilityRequirements
	resp, err := retried(t, e.ctrl.CreateVolume, req)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(e.claimOf(t, resp.GetVolume().GetVolumeId()).Annotations).To(HaveKeyWithValue(selectedNodeAnnotation, envHost))
}

func TestCreateVolumePendingSaysWhy(t *testing.T) {
	g := NewWithT(t)
	e := newGuestEnv(t, envOptions{})
	req := createReq("pending", envHost, envMountSize)
	req.Parameters[request.ParamMgmtStorageClass] = neverClass

	g.Eventually(func(g Gomega) {
		// A call of a few seconds, not callTimeout: it waits until just before its deadline.
		ctx, cancel := context.WithTimeout(t.Context(), 3*time.Second)
		defer cancel()
		_, err := e.ctrl.CreateVolume(ctx, req)
		expectCodeIn(g, err, codes.DeadlineExceeded, `ProvisioningFailed: storageclass.storage.k8s.io "never" not found`)
	}).WithTimeout(eventually).Should(Succeed(), "the management side's warning reaches the guest")
}

func TestPublishFindsTheDisk(t *testing.T) {
	g := NewWithT(t)
	e := newGuestEnv(t, envOptions{})
	id := e.createVolume(t, "publish")

	resp, err := retried(t, e.ctrl.ControllerPublishVolume, e.publishReq(id, "vm-1"))
	g.Expect(err).NotTo(HaveOccurred())
	serial := resp.GetPublishContext()[request.PublishContextSerial]
	g.Expect(serial).To(HavePrefix("pvb"))
	dev, err := disks{root: e.roots["vm-1"]}.bySerial(serial)
	g.Expect(err).NotTo(HaveOccurred(), "the disk with the serial is in the VM")
	g.Expect(dev).To(BeAnExistingFile())
	g.Expect(e.vmVolumes(t, "vm-1")).To(Equal([]string{id}))

	again, err := call(t, e.ctrl.ControllerPublishVolume, e.publishReq(id, "vm-1"))
	g.Expect(err).NotTo(HaveOccurred(), "ControllerPublishVolume is idempotent")
	g.Expect(again.GetPublishContext()).To(Equal(resp.GetPublishContext()))
	g.Expect(e.vmVolumes(t, "vm-1")).To(Equal([]string{id}), "the volume is in the VM once")

	_, err = call(t, e.ctrl.ControllerPublishVolume, e.publishReq(id, "vm-2"))
	expectCodeIn(g, err, codes.FailedPrecondition, "is attached to VirtualMachine vm-1")
	_, err = call(t, e.ctrl.DeleteVolume, &csi.DeleteVolumeRequest{VolumeId: id})
	expectCodeIn(g, err, codes.FailedPrecondition, "still attached to VirtualMachine vm-1")

	_, err = retried(t, e.ctrl.ControllerUnpublishVolume, e.unpublishReq(id, "vm-1"))
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(e.vmVolumes(t, "vm-1")).To(BeEmpty())
	g.Expect(disks{root: e.roots["vm-1"]}.bySerial(serial)).Error().To(HaveOccurred(), "the disk left the VM")
	_, err = call(t, e.ctrl.ControllerUnpublishVolume, e.unpublishReq(id, "vm-1"))
	g.Expect(err).NotTo(HaveOccurred(), "ControllerUnpublishVolume is idempotent")
	_, err = call(t, e.ctrl.DeleteVolume, &csi.DeleteVolumeRequest{VolumeId: id})
	g.Expect(err).NotTo(HaveOccurred())
}

func TestPublishErrors(t *testing.T) {
	g := NewWithT(t)
	e := newGuestEnv(t, envOptions{})
	id := e.createVolume(t, "errors")
	e.createVM(t, "vm-beta", envHost, "beta")

	for _, tc := range []struct {
		name string
		req  *csi.ControllerPublishVolumeRequest
		code codes.Code
		msg  string
	}{
		{"unknown VM", e.publishReq(id, "vm-9"), codes.NotFound, "VirtualMachine " + e.ns + "/vm-9 of cluster alpha does not exist"},
		{"VM of another cluster", e.publishReq(id, "vm-beta"), codes.NotFound, "vm-beta of cluster alpha does not exist"},
		{"unknown volume", e.publishReq(e.cluster.UID+"-nothing", "vm-1"), codes.NotFound, "does not exist"},
		{"volume handle that is no name", e.publishReq("../other/pvc", "vm-1"), codes.NotFound, "is not the name of a management"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := call(t, e.ctrl.ControllerPublishVolume, tc.req)
			expectCodeIn(NewWithT(t), err, tc.code, tc.msg)
		})
	}
	g.Expect(e.vmVolumes(t, "vm-1")).To(BeEmpty(), "failed calls change no VM")

	// What vm-operator reports about the volume reaches the guest.
	pending := &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: e.cluster.UID + "-pending", Labels: e.cluster.Labels()},
		Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes:      []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			StorageClassName: ptr.To(neverClass),
			Resources:        corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: volumeQuantity(envMountSize)}},
		},
	}
	g.Expect(e.admin.Create(t.Context(), pending)).To(Succeed())
	g.Eventually(func(g Gomega) {
		_, err := call(t, e.ctrl.ControllerPublishVolume, e.publishReq(pending.Name, "vm-1"))
		expectCodeIn(g, err, codes.FailedPrecondition, "cannot attach management PVC "+pending.Name+": PersistentVolumeClaim "+pending.Name+" is not bound")
	}).WithTimeout(eventually).Should(Succeed())
	_, err := retried(t, e.ctrl.ControllerUnpublishVolume, e.unpublishReq(pending.Name, "vm-1"))
	g.Expect(err).NotTo(HaveOccurred())
}

// Fifty volumes published to one VM at once, then unpublished at once: the entries are
// appended and removed with JSON patches that the apiserver applies to the object as it stores
// it, so no entry is lost and no call is answered Aborted for a conflict.
func TestConcurrentPublishesToOneVM(t *testing.T) {
	g := NewWithT(t)
	e := newGuestEnv(t, envOptions{vms: []string{"vm-1"}})
	const n = 50
	ids := make([]string, n)
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := range n {
		wg.Go(func() {
			resp, err := retried(t, e.ctrl.CreateVolume, createReq(fmt.Sprintf("c-%d", i), envHost, envMountSize))
			if err != nil {
				errs <- err
				return
			}
			ids[i] = resp.GetVolume().GetVolumeId()
		})
	}
	wg.Wait()
	g.Expect(errs).To(BeEmpty())

	var aborted atomic.Int32
	counted := func(err error) {
		if status.Code(err) == codes.Aborted {
			t.Log(err)
			aborted.Add(1)
		}
	}
	serials := make([]string, n)
	for i, id := range ids {
		wg.Go(func() {
			resp, err := retriedSeeing(t, e.ctrl.ControllerPublishVolume, e.publishReq(id, "vm-1"), counted)
			if err != nil {
				errs <- err
				return
			}
			serials[i] = resp.GetPublishContext()[request.PublishContextSerial]
		})
	}
	wg.Wait()
	g.Expect(errs).To(BeEmpty())
	g.Expect(e.vmVolumes(t, "vm-1")).To(ConsistOf(ids), "no entry is lost")
	for _, serial := range serials {
		g.Expect(disks{root: e.roots["vm-1"]}.bySerial(serial)).Error().NotTo(HaveOccurred())
	}

	for _, id := range ids {
		wg.Go(func() {
			if _, err := retriedSeeing(t, e.ctrl.ControllerUnpublishVolume, e.unpublishReq(id, "vm-1"), counted); err != nil {
				errs <- err
			}
		})
	}
	wg.Wait()
	g.Expect(errs).To(BeEmpty())
	g.Expect(e.vmVolumes(t, "vm-1")).To(BeEmpty())
	g.Expect(aborted.Load()).To(BeZero(), "calls answered Aborted")
}

// A VM takes as many volumes as its hot-plug slots (status.maxVolumes), also when they come at
// once in one batch; one more is ResourceExhausted until a detach frees a slot.
func TestPublishBeyondTheVMsSlotsIsResourceExhausted(t *testing.T) {
	g := NewWithT(t)
	const name = "vm-slots"
	e := newGuestEnv(t, envOptions{vms: []string{name}})
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}}
	g.Expect(e.admin.Create(t.Context(), node)).To(Succeed())
	t.Cleanup(func() { _ = e.admin.Delete(context.WithoutCancel(t.Context()), node) })
	vm := &vmv1.VirtualMachine{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: name}}
	g.Expect(e.admin.Status().Patch(t.Context(), vm, client.RawPatch(types.MergePatchType, []byte(`{"status":{"maxVolumes":2}}`)))).To(Succeed())
	// The guest Node is annotated from the driver's cache of the VM: once it shows the slots,
	// so does the cache that publishes read.
	g.Eventually(func() map[string]string {
		g.Expect(e.admin.Get(t.Context(), client.ObjectKeyFromObject(node), node)).To(Succeed())
		return node.Annotations
	}).WithTimeout(eventually).Should(HaveKeyWithValue("guest.csi.pvbridge.io/max-volumes", "2"))
	ids := []string{e.createVolume(t, "slot-1"), e.createVolume(t, "slot-2"), e.createVolume(t, "slot-3")}

	var wg sync.WaitGroup
	errs := make([]error, len(ids))
	for i, id := range ids {
		wg.Go(func() { _, errs[i] = retried(t, e.ctrl.ControllerPublishVolume, e.publishReq(id, name)) })
	}
	wg.Wait()
	var attached []string
	refused := ""
	for i, err := range errs {
		if err == nil {
			attached = append(attached, ids[i])
			continue
		}
		expectCodeIn(g, err, codes.ResourceExhausted, "as many as its hot-plug slots")
		g.Expect(refused).To(BeEmpty(), "one publish is refused, not two")
		refused = ids[i]
	}
	g.Expect(attached).To(HaveLen(2))
	g.Expect(e.vmVolumes(t, name)).To(ConsistOf(attached), "the refused volume was not added")

	_, err := call(t, e.ctrl.ControllerPublishVolume, e.publishReq(attached[0], name))
	g.Expect(err).NotTo(HaveOccurred(), "a volume that has its slot publishes again")
	_, err = retried(t, e.ctrl.ControllerUnpublishVolume, e.unpublishReq(attached[0], name))
	g.Expect(err).NotTo(HaveOccurred())
	// The unpublish returned once the disk left the VM's status; the cache may show it a
	// moment later.
	g.Eventually(func() error {
		_, err := call(t, e.ctrl.ControllerPublishVolume, e.publishReq(refused, name))
		return err
	}).WithTimeout(eventually).Should(Succeed(), "the detach freed a slot")
	g.Expect(e.vmVolumes(t, name)).To(ConsistOf(attached[1], refused))
	for _, id := range []string{attached[1], refused} {
		_, err := retried(t, e.ctrl.ControllerUnpublishVolume, e.unpublishReq(id, name))
		g.Expect(err).NotTo(HaveOccurred())
	}
}

// An entry of spec.volumes that another writer also owns (an earlier guest-csi, which wrote the
// list with updates, or an admin's edit) is removed all the same.
func TestUnpublishRemovesAnEntryOthersWrote(t *testing.T) {
	g := NewWithT(t)
	e := newGuestEnv(t, envOptions{})
	ids := []string{e.createVolume(t, "theirs-1"), e.createVolume(t, "theirs-2")}
	vm := &vmv1.VirtualMachine{}
	g.Expect(e.admin.Get(t.Context(), client.ObjectKey{Namespace: e.ns, Name: "vm-1"}, vm)).To(Succeed())
	for _, id := range ids {
		vm.Spec.Volumes = append(vm.Spec.Volumes, vmv1.VirtualMachineVolume{Name: id, PersistentVolumeClaim: vmv1.PersistentVolumeClaimVolumeSource{ClaimName: id}})
	}
	g.Expect(e.admin.Update(t.Context(), vm)).To(Succeed())
	for _, id := range ids {
		_, err := retried(t, e.ctrl.ControllerPublishVolume, e.publishReq(id, "vm-1"))
		g.Expect(err).NotTo(HaveOccurred())
	}

	_, err := retried(t, e.ctrl.ControllerUnpublishVolume, e.unpublishReq(ids[1], "vm-1"))
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(e.vmVolumes(t, "vm-1")).To(Equal(ids[:1]))
	_, err = retried(t, e.ctrl.ControllerUnpublishVolume, e.unpublishReq(ids[0], "vm-1"))
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(e.vmVolumes(t, "vm-1")).To(BeEmpty())
}

// A VM whose spec.volumes is stored as an empty list (as a template may write it, or as the last
// removal leaves it) gets its first entry all the same: a list read empty, stored empty or not
// at all, is written whole under the resourceVersion.
func TestPublishToAnEmptyStoredList(t *testing.T) {
	g := NewWithT(t)
	e := newGuestEnv(t, envOptions{})
	id := e.createVolume(t, "first")
	vm := &vmv1.VirtualMachine{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "vm-1"}}
	g.Expect(e.admin.Patch(t.Context(), vm, client.RawPatch(types.MergePatchType, []byte(`{"spec":{"volumes":[]}}`)))).To(Succeed())

	_, err := retried(t, e.ctrl.ControllerPublishVolume, e.publishReq(id, "vm-1"))
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(e.vmVolumes(t, "vm-1")).To(Equal([]string{id}))
}

func TestUnpublishFromADeletedVM(t *testing.T) {
	g := NewWithT(t)
	e := newGuestEnv(t, envOptions{})
	id := e.createVolume(t, "gone")
	_, err := retried(t, e.ctrl.ControllerPublishVolume, e.publishReq(id, "vm-2"))
	g.Expect(err).NotTo(HaveOccurred())

	vm := &vmv1.VirtualMachine{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "vm-2"}}
	g.Expect(e.admin.Delete(t.Context(), vm)).To(Succeed())
	g.Eventually(func() error {
		return e.admin.Get(t.Context(), client.ObjectKeyFromObject(vm), vm)
	}).Should(MatchError(apierrors.IsNotFound, "NotFound"))

	_, err = retried(t, e.ctrl.ControllerUnpublishVolume, e.unpublishReq(id, "vm-2"))
	g.Expect(err).NotTo(HaveOccurred(), "a VM that is gone has no disks")
}

// The cluster's cache holds only its own VMs: DeleteVolume asks the apiserver before it deletes,
// and refuses while a VM of another cluster of the namespace has the claim.
func TestDeleteVolumeInUseByAnotherClustersVM(t *testing.T) {
	g := NewWithT(t)
	e := newGuestEnv(t, envOptions{})
	id := e.createVolume(t, "elsewhere")
	e.createVM(t, "vm-beta", envHost, "beta")
	vm := &vmv1.VirtualMachine{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "vm-beta"}}
	entry := fmt.Sprintf(`{"spec":{"volumes":[{"name":%q,"persistentVolumeClaim":{"claimName":%q}}]}}`, id, id)
	g.Expect(e.admin.Patch(t.Context(), vm, client.RawPatch(types.MergePatchType, []byte(entry)))).To(Succeed())

	_, err := call(t, e.ctrl.DeleteVolume, &csi.DeleteVolumeRequest{VolumeId: id})
	expectCodeIn(g, err, codes.FailedPrecondition, "still attached to VirtualMachine vm-beta")
	g.Expect(e.claimOf(t, id).DeletionTimestamp).To(BeNil(), "the management PVC stays")
}

// "In use" and "attached elsewhere" are the apiserver's answers: a VM the cache still shows
// with the claim after its deletion or the entry's removal holds nothing (CI saw it: the test's
// unpublish found the VM gone, and DeleteVolume still answered "attached" from the cache), while
// for DeleteVolume a publish the cache has not seen, or a VM of another cluster, does.
func TestInUseAnswersFromTheAPIServer(t *testing.T) {
	scheme, err := newScheme()
	if err != nil {
		t.Fatal(err)
	}
	const ns, claim = "tenant", "c-1"
	vm := func(name string, claims ...string) client.Object {
		v := &vmv1.VirtualMachine{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}}
		for _, c := range claims {
			v.Spec.Volumes = append(v.Spec.Volumes, vmv1.VirtualMachineVolume{Name: c, PersistentVolumeClaim: vmv1.PersistentVolumeClaimVolumeSource{ClaimName: c}})
		}
		return v
	}
	detaching := &vmv1.VirtualMachine{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "vm-1"},
		Status: vmv1.VirtualMachineStatus{Volumes: []vmv1.VirtualMachineVolumeStatus{{Name: claim, Attached: true}}}}
	cluster := tenancy.Cluster{Namespace: ns, Name: "alpha"}
	deleteVolume := func(s *controllerServer) error { return s.notInUse(t.Context(), cluster, claim) }
	publishToVM2 := func(s *controllerServer) error { return s.attachedElsewhere(t.Context(), cluster, claim, "vm-2") }
	for _, tc := range []struct {
		name         string
		check        func(*controllerServer) error
		cached, live []client.Object
		heldBy       string // "": the call goes on
	}{
		{name: "delete: the cache is behind the VM's deletion", check: deleteVolume, cached: []client.Object{vm("vm-1", claim)}},
		{name: "delete: the cache is behind the entry's removal", check: deleteVolume, cached: []client.Object{vm("vm-1", claim)}, live: []client.Object{vm("vm-1")}},
		{name: "delete: in use in both", check: deleteVolume, cached: []client.Object{vm("vm-1", claim)}, live: []client.Object{vm("vm-1", claim)}, heldBy: "still attached to VirtualMachine vm-1"},
		{name: "delete: still detaching", check: deleteVolume, cached: []client.Object{vm("vm-1", claim)}, live: []client.Object{detaching}, heldBy: "still attached to VirtualMachine vm-1"},
		{name: "delete: a publish the cache has not seen", check: deleteVolume, cached: []client.Object{vm("vm-1")}, live: []client.Object{vm("vm-1", claim)}, heldBy: "still attached to VirtualMachine vm-1"},
		{name: "delete: a VM of another cluster, never cached", check: deleteVolume, live: []client.Object{vm("vm-1"), vm("vm-beta", claim)}, heldBy: "still attached to VirtualMachine vm-beta"},
		{name: "delete: used by none", check: deleteVolume, cached: []client.Object{vm("vm-1", "c-2")}, live: []client.Object{vm("vm-1", "c-2")}},
		{name: "publish: the cache is behind the unpublish from vm-1", check: publishToVM2, cached: []client.Object{vm("vm-1", claim)}, live: []client.Object{vm("vm-1")}},
		{name: "publish: the cache is behind vm-1's deletion", check: publishToVM2, cached: []client.Object{vm("vm-1", claim)}},
		{name: "publish: attached to vm-1", check: publishToVM2, cached: []client.Object{vm("vm-1", claim)}, live: []client.Object{detaching}, heldBy: "is attached to VirtualMachine vm-1"},
		{name: "publish: already on vm-2 itself", check: publishToVM2, cached: []client.Object{vm("vm-2", claim)}, live: []client.Object{vm("vm-2", claim)}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			s := &controllerServer{mgmt: splitClient{
				Client: fake.NewClientBuilder().WithScheme(scheme).WithObjects(tc.cached...).Build(),
				live:   fake.NewClientBuilder().WithScheme(scheme).WithObjects(tc.live...).Build(),
			}}
			err := tc.check(s)
			if tc.heldBy == "" {
				g.Expect(err).NotTo(HaveOccurred())
				return
			}
			expectCodeIn(g, err, codes.FailedPrecondition, tc.heldBy)
		})
	}
}

// splitClient is a management client whose cache (Client) and apiserver (live) differ.
type splitClient struct {
	client.Client
	live client.Reader
}

func (c splitClient) Live() client.Reader { return c.live }
func (c splitClient) Namespace() string   { return "tenant" }

// A management PVC a platform admin shared with the cluster can be attached, but a guest
// releases it instead of deleting it and never expands it. One that is neither owned nor
// shared is refused by every call, with the reason, except that deleting it releases it
// untouched.
func TestStaticVolumes(t *testing.T) {
	g := NewWithT(t)
	e := newGuestEnv(t, envOptions{})
	shared := e.importClaim(t, "imported-shared", map[string]string{tenancy.SharedWithAnnotation: "beta, alpha"})
	foreign := e.importClaim(t, "imported-foreign", map[string]string{tenancy.SharedWithAnnotation: "beta"})

	resp, err := retried(t, e.ctrl.ControllerPublishVolume, e.publishReq(shared, "vm-1"))
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(resp.GetPublishContext()).To(HaveKey(request.PublishContextSerial))
	_, err = call(t, e.ctrl.ControllerExpandVolume, &csi.ControllerExpandVolumeRequest{VolumeId: shared, CapacityRange: &csi.CapacityRange{RequiredBytes: 2 * envMountSize}})
	expectCodeIn(g, err, codes.FailedPrecondition, "shared with cluster alpha, not owned by it")
	_, err = retried(t, e.ctrl.ControllerUnpublishVolume, e.unpublishReq(shared, "vm-1"))
	g.Expect(err).NotTo(HaveOccurred())
	_, err = call(t, e.ctrl.DeleteVolume, &csi.DeleteVolumeRequest{VolumeId: shared})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(e.claimOf(t, shared).DeletionTimestamp).To(BeNil(), "a shared volume is released, never deleted")

	refused := "was not created for cluster alpha and is not shared with it"
	for range 2 { // every call, not only the first
		_, err = call(t, e.ctrl.ControllerPublishVolume, e.publishReq(foreign, "vm-1"))
		expectCodeIn(g, err, codes.FailedPrecondition, refused)
		_, err = call(t, e.ctrl.DeleteVolume, &csi.DeleteVolumeRequest{VolumeId: foreign})
		g.Expect(err).NotTo(HaveOccurred(), "deleting the guest PV releases it; the foreign PVC is untouched (checked below)")
		_, err = call(t, e.ctrl.ControllerExpandVolume, &csi.ControllerExpandVolumeRequest{VolumeId: foreign, CapacityRange: &csi.CapacityRange{RequiredBytes: 2 * envMountSize}})
		expectCodeIn(g, err, codes.FailedPrecondition, refused)
		_, err = call(t, e.ctrl.CreateSnapshot, &csi.CreateSnapshotRequest{Name: "snap", SourceVolumeId: foreign})
		expectCodeIn(g, err, codes.FailedPrecondition, refused)
		clone := createReq("clone", envHost, envMountSize)
		clone.VolumeContentSource = &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: foreign}}}
		_, err = call(t, e.ctrl.CreateVolume, clone)
		expectCodeIn(g, err, codes.FailedPrecondition, refused)
		_, err = call(t, e.ctrl.ValidateVolumeCapabilities, &csi.ValidateVolumeCapabilitiesRequest{VolumeId: foreign, VolumeCapabilities: []*csi.VolumeCapability{fsCap("")}})
		expectCodeIn(g, err, codes.FailedPrecondition, refused)
	}
	g.Expect(e.vmVolumes(t, "vm-1")).To(BeEmpty())
	g.Expect(e.claimOf(t, foreign).DeletionTimestamp).To(BeNil())

	// Another tenant's namespace is out of reach: the handle names a PVC of this namespace.
	other := newGuestEnv(t, envOptions{vms: []string{"vm-x"}})
	theirs := other.createVolume(t, "theirs")
	_, err = call(t, e.ctrl.ControllerPublishVolume, e.publishReq(theirs, "vm-1"))
	expectCodeIn(g, err, codes.NotFound, "does not exist")
	_, err = call(t, e.ctrl.DeleteVolume, &csi.DeleteVolumeRequest{VolumeId: theirs})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(other.claimOf(t, theirs).DeletionTimestamp).To(BeNil(), "nothing of another namespace is touched")
}

func TestExpandVolume(t *testing.T) {
	g := NewWithT(t)
	e := newGuestEnv(t, envOptions{})
	id := e.createVolume(t, "grow")

	resp, err := retried(t, e.ctrl.ControllerExpandVolume, &csi.ControllerExpandVolumeRequest{
		VolumeId: id, CapacityRange: &csi.CapacityRange{RequiredBytes: 2 * envMountSize}, VolumeCapability: fsCap("ext4"),
	})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(resp.GetCapacityBytes()).To(Equal(2 * envMountSize))
	g.Expect(resp.GetNodeExpansionRequired()).To(BeTrue(), "a filesystem grows on the node")
	requested := e.claimOf(t, id).Spec.Resources.Requests[corev1.ResourceStorage]
	g.Expect(requested.Value()).To(Equal(2 * envMountSize))

	resp, err = call(t, e.ctrl.ControllerExpandVolume, &csi.ControllerExpandVolumeRequest{
		VolumeId: id, CapacityRange: &csi.CapacityRange{RequiredBytes: envMountSize}, VolumeCapability: rawCap(),
	})
	g.Expect(err).NotTo(HaveOccurred(), "a smaller size is already there")
	g.Expect(resp.GetNodeExpansionRequired()).To(BeFalse(), "a raw block volume needs nothing on the node")
}

func TestModifyVolume(t *testing.T) {
	g := NewWithT(t)
	e := newGuestEnv(t, envOptions{})
	id := e.createVolume(t, "qos")
	_, err := retried(t, e.ctrl.ControllerPublishVolume, e.publishReq(id, "vm-1"))
	g.Expect(err).NotTo(HaveOccurred())
	modify := func(params map[string]string) *csi.ControllerModifyVolumeRequest {
		return &csi.ControllerModifyVolumeRequest{VolumeId: id, MutableParameters: params}
	}

	_, err = retried(t, e.ctrl.ControllerModifyVolume, modify(map[string]string{request.ParamMgmtAttributesClass: "gold"}))
	g.Expect(err).NotTo(HaveOccurred())
	pvc := e.claimOf(t, id)
	g.Expect(pvc.Spec.VolumeAttributesClassName).To(HaveValue(Equal("gold")))
	g.Expect(pvc.Status.CurrentVolumeAttributesClassName).To(HaveValue(Equal("gold")))
	vm := &vmv1.VirtualMachine{}
	g.Expect(e.admin.Get(t.Context(), client.ObjectKey{Namespace: e.ns, Name: "vm-1"}, vm)).To(Succeed())
	g.Expect(volumeStatus(vm, id)).To(HaveField("VolumeAttributesClassName", "gold"), "answered once the VM's disk has the class")
	_, err = call(t, e.ctrl.ControllerModifyVolume, modify(map[string]string{request.ParamMgmtAttributesClass: "gold"}))
	g.Expect(err).NotTo(HaveOccurred(), "the class it has")

	_, err = retried(t, e.ctrl.ControllerModifyVolume, modify(map[string]string{request.ParamMgmtAttributesClass: nextAttachAttributesClass}))
	g.Expect(err).NotTo(HaveOccurred(), "accepted by a hypervisor that applies it at the next attach")

	_, err = retried(t, e.ctrl.ControllerModifyVolume, modify(map[string]string{request.ParamMgmtAttributesClass: infeasibleAttributesClass}))
	expectCodeIn(g, err, codes.InvalidArgument, "cannot give management PVC "+e.ns+"/"+id+" VolumeAttributesClass infeasible: ModifyVolume failed")
	_, err = call(t, e.ctrl.ControllerModifyVolume, modify(map[string]string{"maxIOPS": "100"}))
	expectCodeIn(g, err, codes.InvalidArgument, `mutable parameter "maxIOPS" is not supported`)
	_, err = call(t, e.ctrl.ControllerModifyVolume, modify(nil))
	expectCodeIn(g, err, codes.InvalidArgument, "must name a management VolumeAttributesClass")
	_, err = call(t, e.ctrl.ControllerModifyVolume, modify(map[string]string{request.ParamMgmtAttributesClass: "Gold!"}))
	expectCodeIn(g, err, codes.InvalidArgument, "is no VolumeAttributesClass name")
	_, err = call(t, e.ctrl.ControllerModifyVolume, &csi.ControllerModifyVolumeRequest{VolumeId: e.cluster.UID + "-missing", MutableParameters: map[string]string{request.ParamMgmtAttributesClass: "gold"}})
	expectCodeIn(g, err, codes.NotFound, "missing")

	shared := e.importClaim(t, "shared", map[string]string{tenancy.SharedWithAnnotation: e.cluster.Name})
	_, err = call(t, e.ctrl.ControllerModifyVolume, &csi.ControllerModifyVolumeRequest{VolumeId: shared, MutableParameters: map[string]string{request.ParamMgmtAttributesClass: "gold"}})
	expectCodeIn(g, err, codes.FailedPrecondition, "only the management cluster's admin can change its class")

	req := createReq("with-class", envHost, envMountSize)
	req.MutableParameters = map[string]string{request.ParamMgmtAttributesClass: "silver"}
	created, err := retried(t, e.ctrl.CreateVolume, req)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(e.claimOf(t, created.GetVolume().GetVolumeId()).Spec.VolumeAttributesClassName).To(HaveValue(Equal("silver")))
}

func TestSnapshots(t *testing.T) {
	g := NewWithT(t)
	e := newGuestEnv(t, envOptions{})
	id := e.createVolume(t, "source")
	req := &csi.CreateSnapshotRequest{Name: "snapshot-1b4e28ba-2fa1-11d2-883f-0016d3cca427", SourceVolumeId: id,
		Parameters: map[string]string{request.ParamMgmtSnapshotClass: "pmem", request.ParamSnapName: "snap", request.ParamSnapNamespace: "default"}}

	resp, err := retried(t, e.ctrl.CreateSnapshot, req)
	g.Expect(err).NotTo(HaveOccurred())
	snap := resp.GetSnapshot()
	g.Expect(snap.GetSnapshotId()).To(Equal(e.cluster.UID + "-1b4e28ba-2fa1-11d2-883f-0016d3cca427"))
	g.Expect(snap.GetReadyToUse()).To(BeTrue())
	g.Expect(snap.GetSizeBytes()).To(Equal(envMountSize))
	vs := &snapshotv1.VolumeSnapshot{}
	g.Expect(e.admin.Get(t.Context(), client.ObjectKey{Namespace: e.ns, Name: snap.GetSnapshotId()}, vs)).To(Succeed())
	g.Expect(vs.Labels).To(Equal(e.cluster.Labels()))
	g.Expect(vs.Annotations).To(HaveKeyWithValue(tenancy.GuestSnapshotAnnotation, "default/snap"))
	g.Expect(vs.Spec.VolumeSnapshotClassName).To(HaveValue(Equal("pmem")))

	other := proto.Clone(req).(*csi.CreateSnapshotRequest)
	other.SourceVolumeId = e.createVolume(t, "other")
	_, err = call(t, e.ctrl.CreateSnapshot, other)
	expectCodeIn(g, err, codes.AlreadyExists, "exists for volume "+id)

	list, err := call(t, e.ctrl.ListSnapshots, &csi.ListSnapshotsRequest{SourceVolumeId: id})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(list.GetEntries()).To(HaveExactElements(HaveField("Snapshot.SnapshotId", snap.GetSnapshotId())))

	restored, err := retried(t, e.ctrl.CreateVolume, restoreReq("restored", snap.GetSnapshotId()))
	g.Expect(err).NotTo(HaveOccurred())
	e.expectRestoredFrom(t, restored.GetVolume().GetVolumeId(), snap.GetSnapshotId())

	_, err = call(t, e.ctrl.DeleteSnapshot, &csi.DeleteSnapshotRequest{SnapshotId: snap.GetSnapshotId()})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(e.admin.Get(t.Context(), client.ObjectKeyFromObject(vs), vs)).To(MatchError(apierrors.IsNotFound, "NotFound"))
}

// GetCapacity answers from the management cluster's CSIStorageCapacity objects of the hosts
// that run the cluster's VMs.
func TestGetCapacity(t *testing.T) {
	g := NewWithT(t)
	e := newGuestEnv(t, envOptions{})
	e.createVM(t, "vm-3", "host-b", e.cluster.Name)
	e.createVM(t, "vm-other", "host-c", "beta")
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: capacityNS}}
	if err := e.admin.Create(t.Context(), ns); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	for _, c := range []struct {
		host, class string
		free        int64
	}{{"host-a", envClass, 10 * mib}, {"host-b", envClass, 20 * mib}, {"host-c", envClass, 40 * mib}, {"host-a", "premium", 80 * mib}} {
		obj := &storagev1.CSIStorageCapacity{
			ObjectMeta:        metav1.ObjectMeta{Namespace: capacityNS, GenerateName: "csisc-"},
			NodeTopology:      &metav1.LabelSelector{MatchLabels: map[string]string{names.PmemTopologyKey: c.host}},
			StorageClassName:  c.class,
			Capacity:          ptr.To(volumeQuantity(c.free)),
			MaximumVolumeSize: ptr.To(volumeQuantity(c.free / 2)),
		}
		g.Expect(e.admin.Create(t.Context(), obj)).To(Succeed())
		t.Cleanup(func() { _ = e.admin.Delete(t.Context(), obj) })
	}
	topo := func(host string) *csi.Topology { return &csi.Topology{Segments: map[string]string{TopologyKey: host}} }
	for _, tc := range []struct {
		name          string
		req           *csi.GetCapacityRequest
		want, largest int64
	}{
		{"one host", &csi.GetCapacityRequest{AccessibleTopology: topo("host-b")}, 20 * mib, 10 * mib},
		{"the cluster's hosts", &csi.GetCapacityRequest{}, 30 * mib, 10 * mib},
		{"another class", &csi.GetCapacityRequest{AccessibleTopology: topo("host-a"), Parameters: map[string]string{request.ParamMgmtStorageClass: "premium"}}, 80 * mib, 40 * mib},
		{"a host without capacity", &csi.GetCapacityRequest{AccessibleTopology: topo("host-z")}, 0, 0},
		{"an unsupported capability", &csi.GetCapacityRequest{VolumeCapabilities: []*csi.VolumeCapability{withMode(fsCap(""), csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER)}}, 0, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			g.Eventually(func(g Gomega) {
				resp, err := call(t, e.ctrl.GetCapacity, tc.req)
				g.Expect(err).NotTo(HaveOccurred())
				g.Expect(resp.GetAvailableCapacity()).To(Equal(tc.want))
				g.Expect(resp.GetMaximumVolumeSize().GetValue()).To(Equal(tc.largest))
			}).WithTimeout(eventually).Should(Succeed(), "once the cache has seen the VMs' hosts")
		})
	}
}

// The controller labels every guest Node with the host of its VM; the node plugin reads that.
func TestNodesAreLabelledWithTheirHost(t *testing.T) {
	g := NewWithT(t)
	e := newGuestEnv(t, envOptions{vms: []string{}})
	name := "vm-" + e.ns
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}}
	g.Expect(e.admin.Create(t.Context(), node)).To(Succeed())
	t.Cleanup(func() { _ = e.admin.Delete(t.Context(), node) })
	e.createVM(t, name, "host-b", e.cluster.Name)

	g.Eventually(func() map[string]string {
		g.Expect(e.admin.Get(t.Context(), client.ObjectKeyFromObject(node), node)).To(Succeed())
		return node.Labels
	}).WithTimeout(eventually).Should(HaveKeyWithValue(TopologyKey, "host-b"))
}
