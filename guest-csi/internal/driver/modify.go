package driver

import (
	"context"
	"slices"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"

	"pvbridge.io/guest-csi/internal/request"
	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/pkg/csiserver"
	"pvbridge.io/pkg/tenancy"
)

// ControllerModifyVolume gives a volume the cluster owns another management
// VolumeAttributesClass (the guest class's mgmtVolumeAttributesClass): it sets the class on the
// management PVC and answers success only once the management driver accepted it (the claim's
// current class) and the VM that has the volume attached enforces its limits (the VM's
// status.volumes names the class), or will at its next attach (a hypervisor that cannot
// change a disk's limits live). Until then DeadlineExceeded: csi-resizer keeps the guest
// claim's modification InProgress and calls again. A class the management cluster refuses
// (its tenancy policy, or its driver finds it infeasible) is InvalidArgument: the guest
// claim's modification becomes Infeasible, with the reason.
func (s *controllerServer) ControllerModifyVolume(ctx context.Context, req *csi.ControllerModifyVolumeRequest) (*csi.ControllerModifyVolumeResponse, error) {
	id := req.GetVolumeId()
	if id == "" {
		return nil, status.Error(codes.InvalidArgument, "volume_id is required")
	}
	class, err := request.ParseMutableParameters(req.GetMutableParameters())
	if err != nil {
		return nil, err
	}
	if class == "" {
		return nil, status.Errorf(codes.InvalidArgument, "mutable_parameters must name a management VolumeAttributesClass (%s)", request.ParamMgmtAttributesClass)
	}
	c, err := s.cluster()
	if err != nil {
		return nil, err
	}
	ctx = klog.NewContext(ctx, klog.FromContext(ctx).WithValues("volumeID", id, "volumeAttributesClass", class))
	// Locked only while the claim is written, as in ControllerExpandVolume.
	unlock, err := s.lock(id)
	if err != nil {
		return nil, err
	}
	err = s.requestClass(ctx, c, id, class)
	unlock()
	if err != nil {
		return nil, err
	}
	got := &corev1.PersistentVolumeClaim{}
	if err := s.await(ctx, kindPVC, id, got, func(found bool) (bool, error) {
		if !found {
			return false, status.Errorf(codes.NotFound, "management PVC %s/%s is gone", c.Namespace, id)
		}
		if m := got.Status.ModifyVolumeStatus; m != nil && m.TargetVolumeAttributesClassName == class && m.Status == corev1.PersistentVolumeClaimModifyVolumeInfeasible {
			return false, status.Errorf(codes.InvalidArgument, "the management cluster cannot give management PVC %s/%s VolumeAttributesClass %s: %s", c.Namespace, id, class, modifyError(got))
		}
		return ptr.Deref(got.Status.CurrentVolumeAttributesClassName, "") == class, nil
	}); err != nil {
		return nil, err
	}
	if err := s.awaitLimitsApplied(ctx, id, class); err != nil {
		return nil, err
	}
	klog.FromContext(ctx).V(2).Info("Modified volume")
	return &csi.ControllerModifyVolumeResponse{}, nil
}

// requestClass asks for VolumeAttributesClass class in management PVC id of cluster c, which
// the cluster must own.
func (s *controllerServer) requestClass(ctx context.Context, c tenancy.Cluster, id, class string) error {
	pvc, err := s.ownedClaim(ctx, c, id, "change its class")
	if err != nil {
		return err
	}
	if err := s.update(ctx, pvc, func() bool {
		if ptr.Deref(pvc.Spec.VolumeAttributesClassName, "") == class {
			return false
		}
		pvc.Spec.VolumeAttributesClassName = ptr.To(class)
		klog.FromContext(ctx).V(2).Info("Changing the management PVC's VolumeAttributesClass")
		return true
	}); err != nil {
		if apierrors.IsForbidden(err) || apierrors.IsInvalid(err) {
			// The tenancy policy's refusal (a class the cluster may not use) or the API's:
			// another call with the same class cannot succeed.
			return status.Errorf(codes.InvalidArgument, "management PVC %s/%s cannot have VolumeAttributesClass %s: %v", c.Namespace, id, class, err)
		}
		return csiserver.APIError(err, "set the VolumeAttributesClass of management PVC %s/%s", c.Namespace, id)
	}
	return nil
}

// modifyError is the message of a claim's ModifyVolumeError condition.
func modifyError(pvc *corev1.PersistentVolumeClaim) string {
	for _, cond := range pvc.Status.Conditions {
		if cond.Type == corev1.PersistentVolumeClaimVolumeModifyVolumeError {
			return cond.Message
		}
	}
	return "infeasible"
}

// awaitLimitsApplied waits until the VM of the cluster that has the claim attached, if one
// does, reports the class's limits applied to its disk, or to be applied at the disk's next
// attach where its hypervisor cannot change them live (vmv1.LimitsAtNextAttach).
func (s *controllerServer) awaitLimitsApplied(ctx context.Context, claim, class string) error {
	vms := &vmv1.VirtualMachineList{}
	if err := s.mgmt.List(ctx, vms); err != nil {
		return csiserver.APIError(err, "list the cluster's VirtualMachines")
	}
	i := slices.IndexFunc(vms.Items, func(vm vmv1.VirtualMachine) bool {
		e := volumeStatus(&vm, claim)
		return e != nil && e.Attached
	})
	if i < 0 {
		return nil // applied when it is attached
	}
	vm := &vmv1.VirtualMachine{}
	return s.await(ctx, kindVM, vms.Items[i].Name, vm, func(found bool) (bool, error) {
		e := volumeStatus(vm, claim)
		return !found || e == nil || !e.Attached || e.VolumeAttributesClassName == class ||
			strings.HasPrefix(e.Error, vmv1.LimitsAtNextAttach(class)), nil
	})
}
