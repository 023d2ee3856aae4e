package driver

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/util/retry"
	"k8s.io/klog/v2"
	"sigs.k8s.io/controller-runtime/pkg/client"

	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/pkg/csiserver"
	"pvbridge.io/pkg/tenancy"
)

// ControllerPublishVolume attaches a volume to a guest node: it adds the management PVC to the
// node's VirtualMachine's spec.volumes and waits until vm-operator reports the disk attached,
// with its serial, which the node finds the disk by.
func (s *controllerServer) ControllerPublishVolume(ctx context.Context, req *csi.ControllerPublishVolumeRequest) (*csi.ControllerPublishVolumeResponse, error) {
	id, node := req.GetVolumeId(), req.GetNodeId()
	switch {
	case id == "":
		return nil, status.Error(codes.InvalidArgument, "volume_id is required")
	case node == "":
		return nil, status.Error(codes.InvalidArgument, "node_id is required")
	}
	if err := validateNodeCapability(req.GetVolumeCapability()); err != nil {
		return nil, err
	}
	c, err := s.cluster()
	if err != nil {
		return nil, err
	}
	if _, _, err := s.accessible(ctx, c, kindPVC, id); err != nil {
		return nil, err
	}
	vm, err := s.vm(ctx, c, node)
	if err != nil {
		return nil, err
	}
	if vm == nil || vm.DeletionTimestamp != nil {
		return nil, status.Errorf(codes.NotFound, "VirtualMachine %s/%s of cluster %s does not exist or is being deleted", c.Namespace, node, c.Name)
	}
	unlock, err := s.lock(id)
	if err != nil {
		return nil, err
	}
	defer unlock()
	ctx = klog.NewContext(ctx, klog.FromContext(ctx).WithValues("volumeID", id, "vm", node))
	if err := s.attachedElsewhere(ctx, c, id, node); err != nil {
		return nil, err
	}
	if err := s.addVolume(ctx, vm, id); err != nil {
		return nil, err
	}

	var serial string
	got := &vmv1.VirtualMachine{}
	if err := s.await(ctx, kindVM, node, got, func(found bool) (bool, error) {
		switch {
		case !found:
			return false, status.Errorf(codes.NotFound, "VirtualMachine %s/%s is gone", c.Namespace, node)
		case got.DeletionTimestamp != nil:
			return false, status.Errorf(codes.NotFound, "VirtualMachine %s/%s is being deleted", c.Namespace, node)
		}
		e := volumeStatus(got, id)
		switch {
		case e == nil:
			return false, nil
		case e.Attached && e.DiskSerial != "":
			serial = e.DiskSerial
			return true, nil
		case e.Error != "":
			return false, status.Errorf(codes.FailedPrecondition, "VirtualMachine %s/%s cannot attach management PVC %s: %s", c.Namespace, node, id, e.Error)
		}
		return false, nil
	}); err != nil {
		return nil, err
	}
	klog.FromContext(ctx).V(2).Info("Attached", "diskSerial", serial)
	return &csi.ControllerPublishVolumeResponse{PublishContext: map[string]string{PublishContextSerial: serial}}, nil
}

// ControllerUnpublishVolume detaches a volume: it removes the volume from the VM's spec.volumes
// and waits until vm-operator has removed it from status, which it does only once the disk is
// unplugged and released on the host. A VM that is gone has no disks: vm-operator's finalizer
// keeps a deleted VM until every disk is detached.
func (s *controllerServer) ControllerUnpublishVolume(ctx context.Context, req *csi.ControllerUnpublishVolumeRequest) (*csi.ControllerUnpublishVolumeResponse, error) {
	id, node := req.GetVolumeId(), req.GetNodeId()
	if id == "" {
		return nil, status.Error(codes.InvalidArgument, "volume_id is required")
	}
	if node == "" {
		// Detach from every VM: the CO does not know where the volume is.
		return nil, status.Error(codes.InvalidArgument, "node_id is required: this driver does not detach a volume from all nodes at once")
	}
	c, err := s.cluster()
	if err != nil {
		return nil, err
	}
	vm, err := s.vm(ctx, c, node)
	if err != nil {
		return nil, err
	}
	if vm == nil {
		return &csi.ControllerUnpublishVolumeResponse{}, nil
	}
	unlock, err := s.lock(id)
	if err != nil {
		return nil, err
	}
	defer unlock()
	ctx = klog.NewContext(ctx, klog.FromContext(ctx).WithValues("volumeID", id, "vm", node))
	err = s.removeVolume(ctx, vm, id)
	switch {
	case status.Code(err) == codes.NotFound:
		// The cache still had a VM that is gone by now: it has no disks.
		return &csi.ControllerUnpublishVolumeResponse{}, nil
	case err != nil:
		return nil, err
	}
	var lastError string
	got := &vmv1.VirtualMachine{}
	err = s.await(ctx, kindVM, node, got, func(found bool) (bool, error) {
		if !found {
			return true, nil
		}
		e := volumeStatus(got, id)
		if e != nil {
			lastError = e.Error
		}
		return e == nil, nil
	})
	if status.Code(err) == codes.DeadlineExceeded && lastError != "" {
		return nil, status.Errorf(codes.DeadlineExceeded, "VirtualMachine %s/%s is still detaching management PVC %s: %s", c.Namespace, node, id, lastError)
	}
	if err != nil {
		return nil, err
	}
	klog.FromContext(ctx).V(2).Info("Detached")
	return &csi.ControllerUnpublishVolumeResponse{}, nil
}

// vm returns the cluster's VirtualMachine name from the cache, nil if there is none.
func (s *controllerServer) vm(ctx context.Context, c tenancy.Cluster, name string) (*vmv1.VirtualMachine, error) {
	if len(validation.IsDNS1123Subdomain(name)) > 0 {
		return nil, nil
	}
	vm := &vmv1.VirtualMachine{}
	err := s.mgmt.Get(ctx, client.ObjectKey{Namespace: c.Namespace, Name: name}, vm)
	switch {
	case apierrors.IsNotFound(err):
		return nil, nil
	case err != nil:
		return nil, csiserver.APIError(err, "get VirtualMachine %s/%s", c.Namespace, name)
	}
	return vm, nil
}

// attachedElsewhere fails with FailedPrecondition when another VM of the cluster has the volume:
// a disk is attached to one VM at a time.
func (s *controllerServer) attachedElsewhere(ctx context.Context, c tenancy.Cluster, claim, node string) error {
	vms := &vmv1.VirtualMachineList{}
	if err := s.mgmt.List(ctx, vms); err != nil {
		return csiserver.APIError(err, "list the cluster's VirtualMachines")
	}
	for _, vm := range vms.Items {
		if vm.Name == node {
			continue
		}
		if slices.ContainsFunc(vm.Spec.Volumes, func(v vmv1.VirtualMachineVolume) bool { return v.PersistentVolumeClaim.ClaimName == claim }) ||
			volumeStatus(&vm, claim) != nil {
			return status.Errorf(codes.FailedPrecondition, "management PVC %s/%s is attached to VirtualMachine %s", c.Namespace, claim, vm.Name)
		}
	}
	return nil
}

// addVolume adds management PVC id to the VM's spec.volumes by server-side apply, as a field
// manager of its own (volumeManager): the apiserver merges the entry into spec.volumes, a map
// keyed by name, as the object is when it stores it. The publishes of a burst to one VM, and
// vm-operator's status writes, do not conflict with each other (with a resourceVersion they
// did: a 409 and a reread per concurrent writer).
func (s *controllerServer) addVolume(ctx context.Context, vm *vmv1.VirtualMachine, id string) error {
	if slices.ContainsFunc(vm.Spec.Volumes, named(id)) {
		return nil
	}
	_, err := s.applyVolume(ctx, vm, id, true)
	return volumesError(vm, err)
}

// removeVolume removes management PVC id from the VM's spec.volumes: the volume's field manager
// applies nothing, which removes the entry it owns. An entry that another writer also owns (one
// that an earlier guest-csi added with an update, or an admin edited) stays: a JSON patch then
// removes the entry at its index after testing that the index still holds it. A removal before
// it moves it, and the test fails (Invalid): the VM is read again and the index found anew.
func (s *controllerServer) removeVolume(ctx context.Context, vm *vmv1.VirtualMachine, id string) error {
	if !slices.ContainsFunc(vm.Spec.Volumes, named(id)) {
		return nil
	}
	applied, err := s.applyVolume(ctx, vm, id, false)
	if err != nil {
		return volumesError(vm, err)
	}
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(applied.Object, vm); err != nil {
		return status.Errorf(codes.Internal, "VirtualMachine %s/%s: %v", vm.Namespace, vm.Name, err)
	}
	for attempt := 0; ; attempt++ {
		i := slices.IndexFunc(vm.Spec.Volumes, named(id))
		if i < 0 {
			return nil
		}
		path := fmt.Sprintf("/spec/volumes/%d", i)
		err := s.jsonPatch(ctx, vm, jsonPatchOp{Op: "test", Path: path + "/name", Value: id}, jsonPatchOp{Op: "remove", Path: path})
		switch {
		case !apierrors.IsInvalid(err):
			return volumesError(vm, err)
		case attempt == removeAttempts:
			return status.Errorf(codes.Aborted, "VirtualMachine %s/%s: other removals moved the entry of %s %d times; retrying", vm.Namespace, vm.Name, id, attempt+1)
		}
		if err := s.mgmt.Live().Get(ctx, client.ObjectKeyFromObject(vm), vm); err != nil {
			return volumesError(vm, err)
		}
	}
}

// removeAttempts bounds the rereads of a removal whose index moved: each one means another
// removal from the same VM landed between a read and a patch.
const removeAttempts = 10

// volumeManager is the field manager that owns the VM volume entry of management PVC id.
func volumeManager(id string) string { return "guest-csi/" + id }

// applyVolume applies, as the volume's field manager, a VM whose spec.volumes holds the entry of
// management PVC id (or nothing), and returns the VM the apiserver stored. The applied object
// carries the VM's UID: were the VM gone, server-side apply would create one; with the UID the
// apiserver answers Conflict instead (and Invalid for another VM of the same name).
func (s *controllerServer) applyVolume(ctx context.Context, vm *vmv1.VirtualMachine, id string, attached bool) (*unstructured.Unstructured, error) {
	u := &unstructured.Unstructured{}
	u.SetGroupVersionKind(vmv1.GroupVersion.WithKind("VirtualMachine"))
	u.SetNamespace(vm.Namespace)
	u.SetName(vm.Name)
	u.SetUID(vm.UID)
	if attached {
		entry := map[string]any{"name": id, "persistentVolumeClaim": map[string]any{"claimName": id}}
		if err := unstructured.SetNestedSlice(u.Object, []any{entry}, "spec", "volumes"); err != nil {
			return nil, err
		}
	}
	err := s.mgmt.Apply(ctx, client.ApplyConfigurationFromUnstructured(u), client.FieldOwner(volumeManager(id)), client.ForceOwnership)
	return u, err
}

// jsonPatchOp is an operation of a JSON patch (RFC 6902).
type jsonPatchOp struct {
	Op    string `json:"op"`
	Path  string `json:"path"`
	Value any    `json:"value,omitempty"`
}

// jsonPatch applies ops to obj, which it updates to what the apiserver stored.
func (s *controllerServer) jsonPatch(ctx context.Context, obj client.Object, ops ...jsonPatchOp) error {
	data, err := json.Marshal(ops)
	if err != nil {
		return err
	}
	return s.mgmt.Patch(ctx, obj, client.RawPatch(types.JSONPatchType, data))
}

// volumesError turns an error of a write of the VM's spec.volumes into the RPC's status.
func volumesError(vm *vmv1.VirtualMachine, err error) error {
	switch {
	case err == nil:
		return nil
	case apierrors.IsNotFound(err), apierrors.IsConflict(err):
		// A conflict is applyVolume's UID precondition: the VM is gone.
		return status.Errorf(codes.NotFound, "VirtualMachine %s/%s does not exist", vm.Namespace, vm.Name)
	}
	return csiserver.APIError(err, "update the volumes of VirtualMachine %s/%s", vm.Namespace, vm.Name)
}

// named matches the VM volume entry of management PVC id.
func named(id string) func(vmv1.VirtualMachineVolume) bool {
	return func(v vmv1.VirtualMachineVolume) bool { return v.Name == id }
}

// update applies change to obj with optimistic concurrency: the patch carries the
// resourceVersion it was made from, and a conflict (someone changed the object meanwhile, or
// the cache was behind) rereads it from the apiserver and applies change again. A list such as
// spec.volumes is never written blind, so no concurrent change is lost. change reports whether
// it changed anything; obj starts as the caller read it.
func (s *controllerServer) update(ctx context.Context, obj client.Object, change func() bool) error {
	first := true
	return retry.RetryOnConflict(retry.DefaultBackoff, func() error {
		if !first {
			if err := s.mgmt.Live().Get(ctx, client.ObjectKeyFromObject(obj), obj); err != nil {
				return err
			}
		}
		first = false
		base := obj.DeepCopyObject().(client.Object)
		if !change() {
			return nil
		}
		return s.mgmt.Patch(ctx, obj, client.MergeFromWithOptions(base, client.MergeFromWithOptimisticLock{}))
	})
}

// volumeStatus is the status entry of volume name in vm, nil if there is none.
func volumeStatus(vm *vmv1.VirtualMachine, name string) *vmv1.VirtualMachineVolumeStatus {
	i := slices.IndexFunc(vm.Status.Volumes, func(e vmv1.VirtualMachineVolumeStatus) bool { return e.Name == name })
	if i < 0 {
		return nil
	}
	return &vm.Status.Volumes[i]
}
