// Package controller holds the reconcilers of the vm-operator controller role, one concern
// each over the same VirtualMachines:
//
//   - placement (PlacementReconciler): status.host, status.uniqueID, the Placed condition, and
//     status.phase, derived from the placement and the host agent's Ready condition;
//   - attachments (AttachmentReconciler): one management VolumeAttachment per volume, the
//     vm.pvbridge.io/volumes finalizer, the errors of volumes that cannot be attached in
//     status.volumes and the VolumesAttached condition.
//
// The host agent (one per host) writes the rest of the status: the Ready condition and
// status.volumes. Every status write, here and there, fails when what it was computed from
// changed (vmstatus), so no writer loses another's update; vm_status.go says which
// status.volumes entries the controller may write.
package controller

import (
	"context"
	"errors"
	"fmt"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/klog/v2"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/vm-operator/internal/vmstatus"
)

const (
	// fieldManager names the controller in managedFields and Events.
	fieldManager = "vm-operator"
	// conflictRetry is how soon a reconcile whose status write lost a race runs again. The
	// winner's update triggers one anyway; this is the safety net.
	conflictRetry = 200 * time.Millisecond
)

// SetupWithManager registers the controller role's reconcilers with mgr.
func SetupWithManager(mgr ctrl.Manager) error {
	placement := &PlacementReconciler{
		Client:    mgr.GetClient(),
		APIReader: mgr.GetAPIReader(),
		Recorder:  mgr.GetEventRecorder(fieldManager),
	}
	if err := placement.SetupWithManager(mgr); err != nil {
		return fmt.Errorf("set up the placement controller: %w", err)
	}
	attachments := &AttachmentReconciler{
		Client:    mgr.GetClient(),
		APIReader: mgr.GetAPIReader(),
		liveReads: newReadBudget(),
		Recorder:  mgr.GetEventRecorder(fieldManager),
	}
	if err := attachments.SetupWithManager(mgr); err != nil {
		return fmt.Errorf("set up the attachment controller: %w", err)
	}
	return nil
}

// patchStatus writes the status changes made to vm since base, if there are any (vmstatus): each
// status.volumes entry the controller changes must still be as base read it, because the
// controller writes an entry only while the host agent has not taken it up. It reports whether it
// wrote. An error for which vmstatus.Stale holds means someone else wrote in between: the caller
// reconciles again from the new object instead of overwriting it.
func patchStatus(ctx context.Context, c client.Client, base, vm *vmv1.VirtualMachine) (bool, error) {
	patch, err := vmstatus.Patch(base, vm)
	if patch == nil || err != nil {
		return false, err
	}
	if err := c.Status().Patch(ctx, vm, patch, client.FieldOwner(fieldManager)); err != nil {
		return false, fmt.Errorf("patch status of VirtualMachine %s: %w", klog.KObj(vm), err)
	}
	return true, nil
}

// finishStatus is the deferred end of a reconcile: it writes the status and folds the outcome
// into the reconcile's result. A lost race is retried shortly, without an error in the logs; a
// VirtualMachine that is gone needs nothing more.
func finishStatus(ctx context.Context, c client.Client, base, vm *vmv1.VirtualMachine, res *ctrl.Result, reterr *error) bool {
	wrote, err := patchStatus(ctx, c, base, vm)
	switch {
	case err == nil:
		return wrote
	case apierrors.IsNotFound(err):
	case vmstatus.Stale(err):
		ctrl.LoggerFrom(ctx).V(2).Info("VirtualMachine changed meanwhile, reconciling again", "err", err)
		if *reterr == nil && (res.RequeueAfter == 0 || res.RequeueAfter > conflictRetry) {
			res.RequeueAfter = conflictRetry
		}
	default:
		*reterr = errors.Join(*reterr, err)
	}
	return false
}
