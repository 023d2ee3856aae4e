package driver

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os/exec"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	groupsnapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumegroupsnapshot/v1"
	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/config"
	"sigs.k8s.io/controller-runtime/pkg/controller"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/pkg/csinode/csinodetest"
)

const (
	// neverClass is a management StorageClass the responder never provisions.
	neverClass = "never"
	// infeasibleAttributesClass is a management VolumeAttributesClass the responder refuses,
	// as csi-resizer does one its driver answers InvalidArgument to.
	infeasibleAttributesClass = "infeasible"
	// nextAttachAttributesClass is a class whose limits the responder's "hypervisor" applies
	// only at the next attach (vmv1.LimitsAtNextAttach).
	nextAttachAttributesClass = "next-attach"
	// responderDriver is the driver of the responder's PVs.
	responderDriver = "pmem.csi.pvbridge.io"
)

// responder plays the management side of one guest namespace on the test apiserver, the part
// that mgmt-csi, vm-operator and kube-controller-manager play in the lab: it binds PVCs to PVs
// of their size (except on full hosts, where it drops the selected host as csi-provisioner
// does, and for neverClass), grows them, makes VolumeSnapshots ready, takes VolumeGroupSnapshots
// as snapshot-controller does (a member VolumeSnapshot per selected claim, owned by the group,
// then the group ready; members deleted with their group), and attaches each volume
// in a VM's spec.volumes as a real loop device under that VM's device root, reporting the disk
// serial in status.volumes. A bound claim's new VolumeAttributesClass becomes its current one
// (csi-resizer's part, refused for infeasibleAttributesClass) and is reported applied in the
// status entry of each VM that has the claim attached (the host agent's).
type responder struct {
	c client.Client
	// live reads around the cache: a claim bound a moment ago is not reported unbound, as
	// vm-operator confirms it.
	live  client.Reader
	ns    string
	dir   string
	roots map[string]string // VM → device root
	full  map[string]bool   // hosts without room

	mu    sync.Mutex
	disks map[string]*testDisk // "<vm>/<volume>" → disk
	next  int

	// holdGroups, while set, keeps VolumeGroupSnapshots from being taken: they stay not ready.
	holdGroups atomic.Bool
}

type testDisk struct {
	file, name, serial string
}

// startResponder starts a responder for namespace ns until the test ends, then detaches every
// disk it attached. roots are the VMs' device roots.
func startResponder(t *testing.T, ns string, roots map[string]string, fullHosts ...string) *responder {
	t.Helper()
	// The test apiserver's own admin config: envtest gives it 1000 requests/s, where a config
	// loaded from a kubeconfig gets client-go's 5/s, which paced the tests' fixtures.
	cfg := rest.CopyConfig(testEnv.Config)
	scheme, err := newScheme()
	if err != nil {
		t.Fatal(err)
	}
	mgr, err := ctrl.NewManager(cfg, ctrl.Options{
		Scheme:                 scheme,
		Cache:                  cache.Options{DefaultNamespaces: map[string]cache.Config{ns: {}}},
		Controller:             config.Controller{SkipNameValidation: ptr.To(true)},
		Metrics:                metricsserver.Options{BindAddress: "0"},
		HealthProbeBindAddress: "0",
	})
	if err != nil {
		t.Fatal(err)
	}
	r := &responder{c: mgr.GetClient(), live: mgr.GetAPIReader(), ns: ns, dir: t.TempDir(), roots: roots, full: map[string]bool{}, disks: map[string]*testDisk{}}
	for _, h := range fullHosts {
		r.full[h] = true
	}
	for obj, rec := range map[client.Object]reconcile.Func{
		&corev1.PersistentVolumeClaim{}:        r.claim,
		&snapshotv1.VolumeSnapshot{}:           r.snapshot,
		&groupsnapshotv1.VolumeGroupSnapshot{}: r.groupSnapshot,
		&vmv1.VirtualMachine{}:                 r.vm,
	} {
		if err := ctrl.NewControllerManagedBy(mgr).For(obj).WithOptions(controllerOptions).Complete(rec); err != nil {
			t.Fatal(err)
		}
	}
	ctx, cancel := context.WithCancel(context.WithoutCancel(t.Context()))
	done := make(chan error, 1)
	go func() { done <- mgr.Start(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("responder: %v", err)
		}
		r.mu.Lock()
		defer r.mu.Unlock()
		for key, d := range r.disks {
			if err := unplugDisk(r.roots[filepath.Dir(key)], d.file, d.name, d.serial); err != nil {
				t.Errorf("responder: %v", err)
			}
		}
	})
	return r
}

// controllerOptions let the responder work on several objects at once, as the real parts do.
var controllerOptions = controller.Options{MaxConcurrentReconciles: 4}

func (r *responder) claim(ctx context.Context, req reconcile.Request) (reconcile.Result, error) {
	pvc := &corev1.PersistentVolumeClaim{}
	if err := r.c.Get(ctx, req.NamespacedName, pvc); err != nil {
		return reconcile.Result{}, client.IgnoreNotFound(err)
	}
	if pvc.DeletionTimestamp != nil {
		// kube-controller-manager's part: release the protection, delete the volume.
		if pvc.Spec.VolumeName != "" {
			pv := &corev1.PersistentVolume{ObjectMeta: metav1.ObjectMeta{Name: pvc.Spec.VolumeName}}
			if err := r.c.Delete(ctx, pv); client.IgnoreNotFound(err) != nil {
				return reconcile.Result{}, err
			}
		}
		base := pvc.DeepCopy()
		pvc.Finalizers = nil
		return reconcile.Result{}, client.IgnoreNotFound(r.c.Patch(ctx, pvc, client.MergeFrom(base)))
	}
	want := pvc.Spec.Resources.Requests[corev1.ResourceStorage]
	switch {
	case pvc.Status.Phase == corev1.ClaimBound:
		if have := pvc.Status.Capacity[corev1.ResourceStorage]; have.Cmp(want) < 0 {
			if err := r.grow(pvc.Name, want.Value()); err != nil {
				return reconcile.Result{}, err
			}
			pvc.Status.Capacity[corev1.ResourceStorage] = want
			return reconcile.Result{}, r.c.Status().Update(ctx, pvc)
		}
		return reconcile.Result{}, r.modify(ctx, pvc)
	case ptr.Deref(pvc.Spec.StorageClassName, "") == neverClass:
		return reconcile.Result{}, r.warn(ctx, pvc, "ProvisioningFailed", "storageclass.storage.k8s.io \""+neverClass+"\" not found")
	case r.full[pvc.Annotations[selectedNodeAnnotation]]:
		host := pvc.Annotations[selectedNodeAnnotation]
		if err := r.warn(ctx, pvc, "ProvisioningFailed", "rpc error: code = ResourceExhausted desc = no node has room: "+host); err != nil {
			return reconcile.Result{}, err
		}
		base := pvc.DeepCopy()
		delete(pvc.Annotations, selectedNodeAnnotation)
		return reconcile.Result{}, r.c.Patch(ctx, pvc, client.MergeFrom(base))
	}
	pv := &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: "pv-" + string(pvc.UID)},
		Spec: corev1.PersistentVolumeSpec{
			Capacity:                      corev1.ResourceList{corev1.ResourceStorage: want},
			AccessModes:                   pvc.Spec.AccessModes,
			VolumeMode:                    pvc.Spec.VolumeMode,
			PersistentVolumeReclaimPolicy: corev1.PersistentVolumeReclaimDelete,
			ClaimRef:                      &corev1.ObjectReference{Kind: "PersistentVolumeClaim", Namespace: pvc.Namespace, Name: pvc.Name, UID: pvc.UID},
			PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{
				Driver: responderDriver, VolumeHandle: string(pvc.UID),
			}},
		},
	}
	if err := r.c.Create(ctx, pv); err != nil && !apierrors.IsAlreadyExists(err) {
		return reconcile.Result{}, err
	}
	if pvc.Spec.VolumeName == "" {
		pvc.Spec.VolumeName = pv.Name
		if err := r.c.Update(ctx, pvc); err != nil {
			return reconcile.Result{}, err
		}
	}
	pvc.Status.Phase = corev1.ClaimBound
	pvc.Status.AccessModes = pvc.Spec.AccessModes
	pvc.Status.Capacity = corev1.ResourceList{corev1.ResourceStorage: want}
	return reconcile.Result{}, r.c.Status().Update(ctx, pvc)
}

// modify makes a bound claim's VolumeAttributesClass its current one, and the one of its disks.
func (r *responder) modify(ctx context.Context, pvc *corev1.PersistentVolumeClaim) error {
	class := ptr.Deref(pvc.Spec.VolumeAttributesClassName, "")
	switch {
	case class == ptr.Deref(pvc.Status.CurrentVolumeAttributesClassName, ""):
		return nil
	case class == infeasibleAttributesClass:
		pvc.Status.ModifyVolumeStatus = &corev1.ModifyVolumeStatus{TargetVolumeAttributesClassName: class, Status: corev1.PersistentVolumeClaimModifyVolumeInfeasible}
		pvc.Status.Conditions = []corev1.PersistentVolumeClaimCondition{{
			Type: corev1.PersistentVolumeClaimVolumeModifyVolumeError, Status: corev1.ConditionTrue,
			Message: "ModifyVolume failed with error. Waiting for retry: rpc error: code = InvalidArgument desc = invalid I/O limits",
		}}
		return r.c.Status().Update(ctx, pvc)
	}
	// Live: the cache may not have the attach the driver waited for yet, and nothing brings
	// the claim back here once its class is current.
	vms := &vmv1.VirtualMachineList{}
	if err := r.live.List(ctx, vms, client.InNamespace(pvc.Namespace)); err != nil {
		return err
	}
	for i := range vms.Items {
		vm := &vms.Items[i]
		if e := volumeStatus(vm, pvc.Name); e != nil && e.Attached && e.VolumeAttributesClassName != class {
			if class == nextAttachAttributesClass {
				e.Error = vmv1.LimitsAtNextAttach(class) + ": the disk's I/O limits cannot change while it is attached"
			} else {
				e.VolumeAttributesClassName = class
			}
			if err := r.c.Status().Update(ctx, vm); err != nil {
				return err
			}
		}
	}
	pvc.Status.CurrentVolumeAttributesClassName = ptr.To(class)
	pvc.Status.ModifyVolumeStatus = nil
	return r.c.Status().Update(ctx, pvc)
}

// warn records a Warning Event about obj, as the management side's controllers do.
func (r *responder) warn(ctx context.Context, pvc *corev1.PersistentVolumeClaim, reason, message string) error {
	now := metav1.Now()
	return r.c.Create(ctx, &corev1.Event{
		ObjectMeta:     metav1.ObjectMeta{Namespace: pvc.Namespace, GenerateName: pvc.Name + "."},
		InvolvedObject: corev1.ObjectReference{Kind: "PersistentVolumeClaim", Namespace: pvc.Namespace, Name: pvc.Name, UID: pvc.UID},
		Type:           corev1.EventTypeWarning, Reason: reason, Message: message,
		FirstTimestamp: now, LastTimestamp: now, Count: 1,
		Source: corev1.EventSource{Component: "responder"},
	})
}

func (r *responder) snapshot(ctx context.Context, req reconcile.Request) (reconcile.Result, error) {
	snap := &snapshotv1.VolumeSnapshot{}
	if err := r.c.Get(ctx, req.NamespacedName, snap); err != nil || ready(snap) {
		return reconcile.Result{}, client.IgnoreNotFound(err)
	}
	// The claim is read from the apiserver: the cache may not show the capacity the responder
	// bound it with a moment ago, and a snapshot is ready only with its restore size.
	pvc := &corev1.PersistentVolumeClaim{}
	if err := r.live.Get(ctx, client.ObjectKey{Namespace: snap.Namespace, Name: ptr.Deref(snap.Spec.Source.PersistentVolumeClaimName, "")}, pvc); err != nil {
		return reconcile.Result{}, client.IgnoreNotFound(err)
	}
	size, bound := pvc.Status.Capacity[corev1.ResourceStorage]
	if !bound {
		return reconcile.Result{RequeueAfter: 50 * time.Millisecond}, nil
	}
	snap.Status = &snapshotv1.VolumeSnapshotStatus{
		BoundVolumeSnapshotContentName: ptr.To("content-" + string(snap.UID)),
		CreationTime:                   ptr.To(metav1.Now()),
		ReadyToUse:                     ptr.To(true),
		RestoreSize:                    &size,
	}
	return reconcile.Result{}, r.c.Status().Update(ctx, snap)
}

// groupSnapshot takes a VolumeGroupSnapshot as snapshot-controller does: the claims its
// selector's matchLabels select (read from the apiserver) each get a member VolumeSnapshot named
// snapshot-<sha256 of the group's UID and the claim>, owned by the group; once every member is
// ready, so is the group. A deleted group's members go with it (deletionPolicy Delete).
func (r *responder) groupSnapshot(ctx context.Context, req reconcile.Request) (reconcile.Result, error) {
	vgs := &groupsnapshotv1.VolumeGroupSnapshot{}
	if err := r.c.Get(ctx, req.NamespacedName, vgs); err != nil {
		if apierrors.IsNotFound(err) {
			return reconcile.Result{}, r.deleteMembers(ctx, req.Name)
		}
		return reconcile.Result{}, err
	}
	switch {
	case groupReady(vgs) || vgs.Spec.Source.Selector == nil:
		return reconcile.Result{}, nil
	case r.holdGroups.Load():
		return reconcile.Result{RequeueAfter: 100 * time.Millisecond}, nil
	}
	claims := &corev1.PersistentVolumeClaimList{}
	if err := r.live.List(ctx, claims, client.InNamespace(vgs.Namespace), client.MatchingLabels(vgs.Spec.Source.Selector.MatchLabels)); err != nil {
		return reconcile.Result{}, err
	}
	owner := metav1.OwnerReference{APIVersion: groupsnapshotv1.SchemeGroupVersion.String(), Kind: "VolumeGroupSnapshot", Name: vgs.Name, UID: vgs.UID}
	for i := range claims.Items {
		sum := sha256.Sum256([]byte(string(vgs.UID) + claims.Items[i].Name))
		member := &snapshotv1.VolumeSnapshot{
			ObjectMeta: metav1.ObjectMeta{Namespace: vgs.Namespace, Name: "snapshot-" + hex.EncodeToString(sum[:]), OwnerReferences: []metav1.OwnerReference{owner}},
			Spec:       snapshotv1.VolumeSnapshotSpec{Source: snapshotv1.VolumeSnapshotSource{PersistentVolumeClaimName: ptr.To(claims.Items[i].Name)}},
		}
		if err := r.c.Create(ctx, member); err != nil && !apierrors.IsAlreadyExists(err) {
			return reconcile.Result{}, err
		}
		if err := r.live.Get(ctx, client.ObjectKeyFromObject(member), member); err != nil {
			return reconcile.Result{}, err
		}
		if !ready(member) {
			return reconcile.Result{RequeueAfter: 100 * time.Millisecond}, nil
		}
	}
	vgs.Status = &groupsnapshotv1.VolumeGroupSnapshotStatus{
		BoundVolumeGroupSnapshotContentName: ptr.To("groupcontent-" + string(vgs.UID)),
		CreationTime:                        ptr.To(metav1.Now()),
		ReadyToUse:                          ptr.To(true),
	}
	return reconcile.Result{}, r.c.Status().Update(ctx, vgs)
}

// deleteMembers deletes the members of the deleted group snapshot name.
func (r *responder) deleteMembers(ctx context.Context, name string) error {
	snaps := &snapshotv1.VolumeSnapshotList{}
	if err := r.c.List(ctx, snaps, client.InNamespace(r.ns)); err != nil {
		return err
	}
	for i := range snaps.Items {
		for _, ref := range snaps.Items[i].OwnerReferences {
			if ref.Kind == "VolumeGroupSnapshot" && ref.Name == name {
				if err := r.c.Delete(ctx, &snaps.Items[i]); client.IgnoreNotFound(err) != nil {
					return err
				}
			}
		}
	}
	return nil
}

func (r *responder) vm(ctx context.Context, req reconcile.Request) (reconcile.Result, error) {
	vm := &vmv1.VirtualMachine{}
	if err := r.c.Get(ctx, req.NamespacedName, vm); err != nil {
		if apierrors.IsNotFound(err) {
			return reconcile.Result{}, r.unplugAll(req.Name)
		}
		return reconcile.Result{}, err
	}
	var entries []vmv1.VirtualMachineVolumeStatus
	for _, v := range vm.Spec.Volumes {
		if e := volumeStatus(vm, v.Name); e != nil && e.Attached {
			entries = append(entries, *e)
			continue
		}
		pvc := &corev1.PersistentVolumeClaim{}
		key := client.ObjectKey{Namespace: vm.Namespace, Name: v.PersistentVolumeClaim.ClaimName}
		err := r.c.Get(ctx, key, pvc)
		if err != nil || pvc.Status.Phase != corev1.ClaimBound {
			pvc = &corev1.PersistentVolumeClaim{}
			err = r.live.Get(ctx, key, pvc)
		}
		if client.IgnoreNotFound(err) != nil {
			return reconcile.Result{}, err
		}
		if err != nil || pvc.Status.Phase != corev1.ClaimBound {
			entries = append(entries, vmv1.VirtualMachineVolumeStatus{Name: v.Name, Error: fmt.Sprintf("PersistentVolumeClaim %s is not bound", v.PersistentVolumeClaim.ClaimName)})
			continue
		}
		size := pvc.Status.Capacity[corev1.ResourceStorage]
		serial, err := r.plug(vm.Name, v.Name, pvc.Spec.VolumeName, size.Value())
		if err != nil {
			return reconcile.Result{}, err
		}
		// The host agent attaches a disk with the limits of its claim's current class.
		entries = append(entries, vmv1.VirtualMachineVolumeStatus{Name: v.Name, Attached: true, DiskSerial: serial,
			VolumeAttributesClassName: ptr.Deref(pvc.Status.CurrentVolumeAttributesClassName, "")})
	}
	for _, e := range vm.Status.Volumes {
		if !slices.ContainsFunc(vm.Spec.Volumes, func(v vmv1.VirtualMachineVolume) bool { return v.Name == e.Name }) {
			if err := r.unplug(vm.Name, e.Name); err != nil {
				return reconcile.Result{}, err
			}
		}
	}
	vm.Status.Volumes = entries
	return reconcile.Result{}, r.c.Status().Update(ctx, vm)
}

// plug attaches a disk for volume to vm, once.
func (r *responder) plug(vm, volume, pv string, size int64) (string, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	key := vm + "/" + volume
	if d, ok := r.disks[key]; ok {
		return d.serial, nil
	}
	sum := sha256.Sum256([]byte(pv))
	r.next++
	d := &testDisk{
		file:   filepath.Join(r.dir, fmt.Sprintf("disk-%d.img", r.next)),
		name:   fmt.Sprintf("vd%d", r.next),
		serial: "pvb" + hex.EncodeToString(sum[:])[:17],
	}
	if _, err := plugDisk(r.roots[vm], d.file, d.name, d.serial, size, true, true); err != nil {
		return "", err
	}
	r.disks[key] = d
	return d.serial, nil
}

func (r *responder) unplug(vm, volume string) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	key := vm + "/" + volume
	d, ok := r.disks[key]
	if !ok {
		return nil
	}
	if err := unplugDisk(r.roots[vm], d.file, d.name, d.serial); err != nil {
		return err
	}
	delete(r.disks, key)
	return nil
}

func (r *responder) unplugAll(vm string) error {
	r.mu.Lock()
	var volumes []string
	for key := range r.disks {
		if filepath.Dir(key) == vm {
			volumes = append(volumes, filepath.Base(key))
		}
	}
	r.mu.Unlock()
	for _, v := range volumes {
		if err := r.unplug(vm, v); err != nil {
			return err
		}
	}
	return nil
}

// grow grows the attached disks of volume to size bytes, as the hypervisor resizes a disk.
func (r *responder) grow(volume string, size int64) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	for key, d := range r.disks {
		if filepath.Base(key) != volume {
			continue
		}
		if out, err := exec.Command("truncate", "-s", fmt.Sprint(size), d.file).CombinedOutput(); err != nil {
			return fmt.Errorf("truncate: %w: %s", err, out)
		}
		devices, err := csinodetest.LoopDevices(d.file)
		if err != nil {
			return err
		}
		for _, dev := range devices {
			if out, err := exec.Command("losetup", "--set-capacity", dev).CombinedOutput(); err != nil {
				return fmt.Errorf("losetup --set-capacity: %w: %s", err, out)
			}
		}
	}
	return nil
}

// volumeQuantity is size bytes as a quantity.
func volumeQuantity(size int64) resource.Quantity {
	return *resource.NewQuantity(size, resource.BinarySI)
}

// eventually is how long a test waits for the management side.
const eventually = time.Minute
