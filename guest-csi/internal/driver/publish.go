package driver

import (
	"context"
	"slices"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/util/retry"
	"k8s.io/klog/v2"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pvbridge.io/guest-csi/internal/request"
	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/pkg/csiserver"
	"pvbridge.io/pkg/tenancy"
)

// ControllerPublishVolume attaches a volume to a guest node: it adds the management PVC to the
// node's VirtualMachine's spec.volumes and waits until vm-operator reports the disk attached,
// with its serial, which the node finds the disk by. A volume that does not fit the VM's
// hot-plug slots (status.maxVolumes) is ResourceExhausted, never added.
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
	klog.FromContext(ctx).V(4).Info("Attaching")
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
		case e.Error != "" && strings.Contains(e.Error, vmv1.NoFreeSlotError):
			// The hypervisor's own limit, reached by entries not written here (an admin's):
			// kubelet reads the node's volume limit again after this code.
			return false, status.Errorf(codes.ResourceExhausted, "VirtualMachine %s/%s cannot attach management PVC %s: %s", c.Namespace, node, id, e.Error)
		case e.Error != "":
			return false, status.Errorf(codes.FailedPrecondition, "VirtualMachine %s/%s cannot attach management PVC %s: %s", c.Namespace, node, id, e.Error)
		}
		return false, nil
	}); err != nil {
		return nil, err
	}
	klog.FromContext(ctx).V(2).Info("Attached", "diskSerial", serial)
	return &csi.ControllerPublishVolumeResponse{PublishContext: map[string]string{request.PublishContextSerial: serial}}, nil
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
// a disk is attached to one VM at a time. A VM the cache shows with it is read live first (see
// liveHolder): right after an unpublish from one VM the publish to the next must not be refused
// for an entry the cache still shows.
func (s *controllerServer) attachedElsewhere(ctx context.Context, c tenancy.Cluster, claim, node string) error {
	vms := &vmv1.VirtualMachineList{}
	if err := s.mgmt.List(ctx, vms); err != nil {
		return csiserver.APIError(err, "list the cluster's VirtualMachines")
	}
	others := slices.DeleteFunc(vms.Items, func(vm vmv1.VirtualMachine) bool { return vm.Name == node })
	holder, err := s.liveHolder(ctx, others, claim)
	if err != nil || holder == nil {
		return err
	}
	return status.Errorf(codes.FailedPrecondition, "management PVC %s/%s is attached to VirtualMachine %s", c.Namespace, claim, holder.Name)
}

// liveHolder returns, as the apiserver has it now, the first VM of cached (VMs as the cache
// shows them) that has the claim in its spec or its status and still has it live, nil if none
// does. The cache sees a VM's deletion or an entry's removal late: an answer that refuses a call
// is the apiserver's. It costs a Get only for a VM the cache shows with the claim.
func (s *controllerServer) liveHolder(ctx context.Context, cached []vmv1.VirtualMachine, claim string) (*vmv1.VirtualMachine, error) {
	for i := range cached {
		if !usesClaim(&cached[i], claim) {
			continue
		}
		vm := &vmv1.VirtualMachine{}
		err := s.mgmt.Live().Get(ctx, client.ObjectKeyFromObject(&cached[i]), vm)
		switch {
		case err == nil && usesClaim(vm, claim):
			return vm, nil
		case err != nil && !apierrors.IsNotFound(err):
			return nil, csiserver.APIError(err, "read VirtualMachine %s/%s", cached[i].Namespace, cached[i].Name)
		}
	}
	return nil, nil
}

// usesClaim reports whether vm has the claim in its spec or still in its status.
func usesClaim(vm *vmv1.VirtualMachine, claim string) bool {
	return slices.ContainsFunc(vm.Spec.Volumes, func(v vmv1.VirtualMachineVolume) bool { return v.PersistentVolumeClaim.ClaimName == claim }) ||
		volumeStatus(vm, claim) != nil
}

// volumesError turns an error of a write of the VM's spec.volumes into the RPC's status.
func volumesError(vm *vmv1.VirtualMachine, err error) error {
	switch {
	case err == nil:
		return nil
	case apierrors.IsNotFound(err):
		return status.Errorf(codes.NotFound, "VirtualMachine %s/%s does not exist", vm.Namespace, vm.Name)
	}
	return csiserver.APIError(err, "update the volumes of VirtualMachine %s/%s", vm.Namespace, vm.Name)
}

// update applies change to obj with optimistic concurrency: the patch carries the
// resourceVersion it was made from, and a conflict (someone changed the object meanwhile, or
// the cache was behind) rereads it from the apiserver and applies change again. A list such as
// spec.volumes is never written blind, so no concurrent change is lost. change reports whether
// it changed anything; obj starts as the caller read it.
func (s *controllerServer) update(ctx context.Context, obj client.Object, change func() bool) error {
	return s.tryUpdate(ctx, obj, func() (bool, error) { return change(), nil })
}

// tryUpdate is update with a change that may refuse: its error ends the update, as it is.
func (s *controllerServer) tryUpdate(ctx context.Context, obj client.Object, change func() (bool, error)) error {
	first := true
	return retry.RetryOnConflict(retry.DefaultBackoff, func() error {
		if !first {
			if err := s.mgmt.Live().Get(ctx, client.ObjectKeyFromObject(obj), obj); err != nil {
				return err
			}
		}
		first = false
		base := obj.DeepCopyObject().(client.Object)
		if changed, err := change(); err != nil || !changed {
			return err
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
