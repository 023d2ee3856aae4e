package agent

import (
	"context"
	"errors"
	"fmt"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"

	"pvbridge.io/mgmt-csi/internal/pmem"
	pmemv1 "pvbridge.io/pkg/apis/pmem/v1alpha1"
)

// exportCheckInterval is how often a Ready replica's export is checked: a replica server that
// crashed lost its exports, and the replicas it served are faulted.
const exportCheckInterval = 10 * time.Second

// Exporter is the host's replica server, which exports replicas to the other hosts' targets
// (replication.Server).
type Exporter interface {
	// Export exports device as name; exporting what is exported changes nothing.
	Export(ctx context.Context, name, device string) error
	// Unexport ends the export name, if any.
	Unexport(ctx context.Context, name string) error
	// Exported reports whether the server runs and exports name.
	Exported(ctx context.Context, name string) (bool, error)
}

// ReplicaReconciler realizes the PmemReplicas of one node: it carves each replica from the
// node's PMEM as a volume named after the replica, and exports it, once (again when it grew). A replica whose export
// is lost afterwards (the replica server crashed, the host rebooted) may have missed writes
// that its volume's targets made meanwhile; exported again, it would serve its stale data to
// a target that reconnects or opens it. It is faulted instead, for good.
type ReplicaReconciler struct {
	Client  client.Client
	Backend pmem.Backend
	Node    string
	// Server exports the node's replicas at Address.
	Server  Exporter
	Address string
	// Capacity is refreshed after every change of the node's allocations.
	Capacity *NodeReporter
}

// SetupWithManager registers the reconciler. The manager's cache holds only this node's
// PmemReplicas (a field selector on spec.node).
func (r *ReplicaReconciler) SetupWithManager(mgr ctrl.Manager) error {
	return ctrl.NewControllerManagedBy(mgr).
		For(&pmemv1.PmemReplica{}).
		Named("pmemreplica").
		WithOptions(controller.Options{MaxConcurrentReconciles: concurrentReconciles}).
		Complete(r)
}

// Reconcile makes the device and export of a PmemReplica match its spec, or removes them.
func (r *ReplicaReconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	rep := &pmemv1.PmemReplica{}
	if err := r.Client.Get(ctx, req.NamespacedName, rep); err != nil {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	if rep.Spec.Node != r.Node {
		return ctrl.Result{}, nil
	}
	if !rep.DeletionTimestamp.IsZero() {
		return r.reconcileDelete(ctx, rep)
	}
	return r.reconcileNormal(ctx, rep)
}

func (r *ReplicaReconciler) reconcileNormal(ctx context.Context, rep *pmemv1.PmemReplica) (ctrl.Result, error) {
	ready := meta.FindStatusCondition(rep.Status.Conditions, pmemv1.ReadyCondition)
	switch {
	case rep.Faulted(), rep.Retired():
		return ctrl.Result{}, nil // never served again
	case ready != nil && ready.Status == metav1.ConditionTrue && ready.ObservedGeneration == rep.Generation:
		exported, err := r.Server.Exported(ctx, rep.Name)
		if err != nil {
			return ctrl.Result{}, err
		}
		if !exported {
			ctrl.LoggerFrom(ctx).Info("Replica faulted: its export is gone", "volumeID", rep.Spec.VolumeID)
			return ctrl.Result{}, r.setStatus(ctx, rep, nil, metav1.ConditionFalse, pmemv1.FaultedReason,
				fmt.Sprintf("the replica server of node %s lost this replica's export (it restarted, or the host did): the replica may have missed writes and is not served again", r.Node))
		}
		return ctrl.Result{RequeueAfter: exportCheckInterval}, nil
	}
	dev, err := carve(ctx, r.Backend, r.Capacity, rep.Name, rep.Spec.Size.Value(), backendSource(rep.Spec.Source), rep.Status.Device)
	if errors.Is(err, errDisappeared) {
		return ctrl.Result{}, r.setStatus(ctx, rep, nil, metav1.ConditionFalse, pmemv1.FailedReason, err.Error())
	}
	if err != nil {
		return r.failed(ctx, rep, err)
	}
	if a := rep.Status.AllocatedSize; a != nil && dev.Size > a.Value() {
		// Grown: an export keeps the size it was made with, so it is made again. No target
		// is on it: the controller grows a replicated volume only while no node serves it, and
		// none serves it until its replicas are ready at their new size.
		if err := r.Server.Unexport(ctx, rep.Name); err != nil {
			return r.failed(ctx, rep, err)
		}
		ctrl.LoggerFrom(ctx).Info("Exporting the grown replica again", "volumeID", rep.Spec.VolumeID, "from", a.Value(), "to", dev.Size)
	}
	if err := r.Server.Export(ctx, rep.Name, dev.Device); err != nil {
		return r.failed(ctx, rep, err)
	}
	return ctrl.Result{RequeueAfter: exportCheckInterval}, r.setStatus(ctx, rep, &dev, metav1.ConditionTrue, pmemv1.CreatedReason, "")
}

// failed reports a back-end error as VolumeReconciler.failed does.
func (r *ReplicaReconciler) failed(ctx context.Context, rep *pmemv1.PmemReplica, err error) (ctrl.Result, error) {
	return reportFailure(err, func(reason string) error {
		return r.setStatus(ctx, rep, nil, metav1.ConditionFalse, reason, err.Error())
	})
}

// reconcileDelete ends the replica's export, which drops a target still writing to it, and
// removes its device.
func (r *ReplicaReconciler) reconcileDelete(ctx context.Context, rep *pmemv1.PmemReplica) (ctrl.Result, error) {
	if !controllerutil.ContainsFinalizer(rep, Finalizer) {
		return ctrl.Result{}, nil
	}
	if err := r.Server.Unexport(ctx, rep.Name); err != nil {
		return ctrl.Result{}, err
	}
	return release(ctx, r.Client, r.Backend, r.Capacity, rep, func(msg string) error {
		return r.setStatus(ctx, rep, nil, metav1.ConditionFalse, pmemv1.InUseReason, msg)
	})
}

// setStatus writes the Ready condition; with dev, the device and the server's address too.
func (r *ReplicaReconciler) setStatus(ctx context.Context, rep *pmemv1.PmemReplica, dev *pmem.Volume, st metav1.ConditionStatus, reason, msg string) error {
	patch := client.MergeFrom(rep.DeepCopy())
	changed := false
	if dev != nil {
		size := resource.NewQuantity(dev.Size, resource.BinarySI)
		changed = rep.Status.Device != dev.Device || rep.Status.Address != r.Address ||
			rep.Status.AllocatedSize == nil || !rep.Status.AllocatedSize.Equal(*size)
		rep.Status.Device, rep.Status.Address, rep.Status.AllocatedSize = dev.Device, r.Address, size
	}
	if meta.SetStatusCondition(&rep.Status.Conditions, metav1.Condition{
		Type: pmemv1.ReadyCondition, Status: st, Reason: reason, Message: msg, ObservedGeneration: rep.Generation,
	}) {
		changed = true
	}
	if !changed {
		return nil
	}
	if err := r.Client.Status().Patch(ctx, rep, patch); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("update status of PmemReplica %s: %w", rep.Name, err)
	}
	return nil
}
