package driver

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"

	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/pkg/csiserver"
)

// Reasons of the volume health the controller reports.
const (
	// ReasonManagementVolumeLost: the management PVC lost its PersistentVolume (phase Lost).
	ReasonManagementVolumeLost = "ManagementVolumeLost"
	// ReasonAttachFailed: a VirtualMachine of the cluster reports an error attaching or
	// detaching the volume (status.volumes[].error).
	ReasonAttachFailed = "AttachFailed"
)

// ControllerGetVolumeHealth reports what the management cluster knows of a volume: INACCESSIBLE
// when its management PVC lost its PersistentVolume, and for each VirtualMachine of the cluster
// whose status reports an error with the volume (the host agent's hot-plug, the controller's
// "PVC not bound", "volume on another host"), with vm-operator's words. A volume whose management
// PVC is gone is NotFound, as the spec asks; another cluster's volume FailedPrecondition. Nothing
// in Kubernetes 1.37 itself calls it: the external-health-monitor controller does, which turns
// an abnormal answer into an Event on the guest PVC (docs/design.md).
func (s *controllerServer) ControllerGetVolumeHealth(ctx context.Context, req *csi.ControllerGetVolumeHealthRequest) (*csi.ControllerGetVolumeHealthResponse, error) {
	id := req.GetVolumeId()
	if id == "" {
		return nil, status.Error(codes.InvalidArgument, "volume_id is required")
	}
	c, err := s.cluster()
	if err != nil {
		return nil, err
	}
	obj, _, err := s.accessible(ctx, c, kindPVC, id)
	if err != nil {
		return nil, err
	}
	pvc := obj.(*corev1.PersistentVolumeClaim)
	ctx = klog.NewContext(ctx, klog.FromContext(ctx).WithValues("volumeID", id))
	health := &csi.VolumeHealth{VolumeId: id}
	if pvc.Status.Phase == corev1.ClaimLost {
		health.HealthStatuses = append(health.HealthStatuses, &csi.VolumeHealth_VolumeHealthEntry{
			Status: csi.VolumeHealthErrorType_INACCESSIBLE, Reason: ReasonManagementVolumeLost,
			Message: fmt.Sprintf("management PVC %s/%s lost its volume %s", pvc.Namespace, pvc.Name, pvc.Spec.VolumeName),
		})
	}
	vms := &vmv1.VirtualMachineList{}
	if err := s.mgmt.List(ctx, vms); err != nil {
		return nil, csiserver.APIError(err, "list the cluster's VirtualMachines")
	}
	// One entry per (status, reason), as the spec asks: the VMs' errors in one message.
	var errs []string
	slices.SortFunc(vms.Items, func(a, b vmv1.VirtualMachine) int { return strings.Compare(a.Name, b.Name) })
	for i := range vms.Items {
		if e := volumeStatus(&vms.Items[i], id); e != nil && e.Error != "" {
			errs = append(errs, fmt.Sprintf("VirtualMachine %s: %s", vms.Items[i].Name, e.Error))
		}
	}
	if len(errs) > 0 {
		health.HealthStatuses = append(health.HealthStatuses, &csi.VolumeHealth_VolumeHealthEntry{
			Status: csi.VolumeHealthErrorType_INACCESSIBLE, Reason: ReasonAttachFailed,
			Message: fmt.Sprintf("management PVC %s/%s: %s", pvc.Namespace, pvc.Name, strings.Join(errs, "; ")),
		})
	}
	if len(health.HealthStatuses) > 0 {
		klog.FromContext(ctx).V(2).Info("Volume is not healthy", "reasons", len(health.HealthStatuses))
	}
	return &csi.ControllerGetVolumeHealthResponse{VolumeHealth: health}, nil
}
