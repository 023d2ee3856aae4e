package capi

import (
	"context"
	"fmt"
	"slices"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/klog/v2"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"

	infrav1 "pvbridge.io/pkg/apis/infrastructure/v1alpha1"
	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/pkg/hostloss"
)

// reconcileDelete takes a deleted PVBridgeMachine's VirtualMachine down in the order a guest's
// volumes need: Cluster API has drained the Node and waited for its volumes to detach before it
// deleted the PVBridgeMachine, so the VM's spec.volumes and status.volumes normally empty soon;
// the provider waits for both (up to VolumeDetachTimeout, counted from the PVBridgeMachine's
// deletionTimestamp, so a restart neither resets nor shortens it), then powers the VM off,
// deletes it, waits until it is gone (vm-operator's own finalizer keeps it until its disks are
// unplugged), and only then releases the PVBridgeMachine. While the Cluster is deleted (or gone:
// clusterGoing) it does not wait for the volumes, as Cluster API does not drain then. Every step
// reads its state from the API objects, so a provider restarted at any step goes on from there.
func (r *MachineReconciler) reconcileDelete(ctx context.Context, pm *infrav1.PVBridgeMachine, clusterGoing bool) (ctrl.Result, error) {
	log := ctrl.LoggerFrom(ctx)
	reader := r.APIReader
	if reader == nil {
		reader = r.Client
	}
	vm := &vmv1.VirtualMachine{}
	if err := reader.Get(ctx, client.ObjectKeyFromObject(pm), vm); err != nil {
		if !apierrors.IsNotFound(err) {
			return ctrl.Result{}, fmt.Errorf("get VirtualMachine %s: %w", klog.KObj(pm), err)
		}
		return r.release(ctx, pm)
	}
	if !metav1.IsControlledBy(vm, pm) {
		// Not ours (a VM of that name that predates the machine): leave it alone.
		return r.release(ctx, pm)
	}
	if vm.DeletionTimestamp.IsZero() {
		attached := attachedVolumes(vm)
		lost := false
		if len(attached) > 0 && vm.Status.Host != "" {
			var err error
			if lost, err = hostloss.Lost(ctx, r.Client, r.Client, vm.Status.Host); err != nil {
				return ctrl.Result{}, err
			}
		}
		switch {
		case len(attached) > 0 && clusterGoing:
			log.Info("The Cluster is being deleted: powering the VM off without waiting for its volumes", "vm", klog.KObj(vm), "volumes", attached)
		case lost:
			// Its host agent, which would unplug them, went with its host.
			log.Info("The VM's host is lost: deleting the VM without waiting for its volumes", "vm", klog.KObj(vm), "host", vm.Status.Host, "volumes", attached)
			r.event(pm, corev1.EventTypeWarning, "HostLost", "Host %s of VirtualMachine %s is lost: deleting it without waiting for volumes %v", vm.Status.Host, vm.Name, attached)
		case len(attached) > 0:
			wait, timedOut := r.detachWait(pm)
			if !timedOut {
				msg := fmt.Sprintf("waiting for %d volume(s) of VirtualMachine %s to detach: %v", len(attached), vm.Name, attached)
				if wait > 0 {
					msg += fmt.Sprintf("; powered off anyway in %s", wait.Round(time.Second))
				}
				setCondition(&pm.Status.Conditions, pm.Generation, infrav1.ReadyCondition, metav1.ConditionFalse, infrav1.WaitingForVolumeDetachReason, msg)
				// The VM's changes bring us back; the requeue is for the timeout.
				return ctrl.Result{RequeueAfter: wait}, nil
			}
			log.Info("Volumes did not detach in time, powering the VM off anyway", "vm", klog.KObj(vm), "volumes", attached, "timeout", r.VolumeDetachTimeout)
			r.event(pm, corev1.EventTypeWarning, infrav1.VolumeDetachTimedOutReason,
				"Volumes %v of VirtualMachine %s did not detach within %s; powering it off and deleting it", attached, vm.Name, r.VolumeDetachTimeout)
		}
		if vm.Spec.PowerState != vmv1.PowerStateOff {
			base := vm.DeepCopy()
			vm.Spec.PowerState = vmv1.PowerStateOff
			if err := r.Client.Patch(ctx, vm, client.MergeFrom(base), client.FieldOwner(fieldManager)); err != nil {
				return ctrl.Result{}, client.IgnoreNotFound(fmt.Errorf("power off VirtualMachine %s: %w", klog.KObj(vm), err))
			}
		}
		if err := r.Client.Delete(ctx, vm, client.Preconditions{UID: &vm.UID}); err != nil && !apierrors.IsNotFound(err) {
			return ctrl.Result{}, fmt.Errorf("delete VirtualMachine %s: %w", klog.KObj(vm), err)
		}
		log.Info("Deleting the VirtualMachine", "vm", klog.KObj(vm))
		r.event(pm, corev1.EventTypeNormal, "VirtualMachineDeleting", "Powered off and deleting VirtualMachine %s", vm.Name)
	}
	setCondition(&pm.Status.Conditions, pm.Generation, infrav1.ReadyCondition, metav1.ConditionFalse, infrav1.DeletingReason,
		fmt.Sprintf("waiting for VirtualMachine %s to be deleted", vm.Name))
	return ctrl.Result{}, nil
}

// release removes the finalizer: the machine's VirtualMachine is gone.
func (r *MachineReconciler) release(ctx context.Context, pm *infrav1.PVBridgeMachine) (ctrl.Result, error) {
	if controllerutil.RemoveFinalizer(pm, infrav1.MachineFinalizer) {
		ctrl.LoggerFrom(ctx).Info("VirtualMachine gone, releasing the PVBridgeMachine")
	}
	return ctrl.Result{}, nil
}

// detachWait returns how long a deleted machine still waits for its volumes, and whether its
// wait is over. Without a timeout it waits for ever (and is woken by the VM's changes).
func (r *MachineReconciler) detachWait(pm *infrav1.PVBridgeMachine) (time.Duration, bool) {
	if r.VolumeDetachTimeout <= 0 || pm.DeletionTimestamp == nil {
		return 0, false
	}
	left := pm.DeletionTimestamp.Add(r.VolumeDetachTimeout).Sub(r.clock())
	return left, left <= 0
}

// attachedVolumes names the volumes a VM still has in spec or status.
func attachedVolumes(vm *vmv1.VirtualMachine) []string {
	var names []string
	for _, v := range vm.Spec.Volumes {
		names = append(names, v.Name)
	}
	for _, v := range vm.Status.Volumes {
		if !slices.Contains(names, v.Name) {
			names = append(names, v.Name)
		}
	}
	return names
}
