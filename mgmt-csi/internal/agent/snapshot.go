package agent

import (
	"context"
	"fmt"
	"sync"
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

// SnapshotReconciler realizes the PmemSnapshots of one node.
type SnapshotReconciler struct {
	Client   client.Client
	Backend  pmem.Backend
	Node     string
	Capacity *NodeReporter
	// HoldSocket is where the host's holder serves leases on the writers of its volumes
	// (pkg/hold), which a group snapshot's cut takes.
	HoldSocket string
	// InUse reports whether a volume's block device is in use (mounted or claimed); nil: an
	// exclusive open tells. A group's member whose volume no holder held must not be.
	InUse func(device string) (bool, error)
	// Reader reads a replicated volume, which the cache of this node's objects lacks (its
	// node serving it: status.target), and TargetDevice the device of its target on this
	// node, "" when none runs (replication.Targets.Device; nil on a node without keys).
	Reader       client.Reader
	TargetDevice func(volumeID string) (string, error)

	groupMu sync.Mutex // one group cut at a time: the holder holds one lease at a time too
}

// SetupWithManager registers the reconciler; the cache holds only this node's snapshots.
func (r *SnapshotReconciler) SetupWithManager(mgr ctrl.Manager) error {
	return ctrl.NewControllerManagedBy(mgr).
		For(&pmemv1.PmemSnapshot{}).
		Named("pmemsnapshot").
		WithOptions(controller.Options{MaxConcurrentReconciles: concurrentReconciles}).
		Complete(r)
}

// Reconcile cuts a snapshot once, or removes it.
func (r *SnapshotReconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	snap := &pmemv1.PmemSnapshot{}
	if err := r.Client.Get(ctx, req.NamespacedName, snap); err != nil {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	if snap.Spec.Node != r.Node {
		return ctrl.Result{}, nil
	}
	if !snap.DeletionTimestamp.IsZero() {
		if !controllerutil.ContainsFinalizer(snap, Finalizer) {
			return ctrl.Result{}, nil
		}
		if err := r.Backend.DeleteSnapshot(ctx, snap.Name); err != nil {
			return ctrl.Result{}, err
		}
		ctrl.LoggerFrom(ctx).Info("Deleted snapshot")
		r.Capacity.Refresh(ctx)
		return ctrl.Result{}, removeFinalizer(ctx, r.Client, snap)
	}
	if meta.IsStatusConditionTrue(snap.Status.Conditions, pmemv1.ReadyCondition) {
		return ctrl.Result{}, nil // cut once; a snapshot never changes
	}
	if snap.Spec.Group != nil {
		return r.cutGroup(ctx, snap)
	}
	got, err := r.Backend.CreateSnapshot(ctx, snap.Name, snapshotSource(snap))
	if err != nil {
		reason, retry := failureReason(err)
		if serr := r.setStatus(ctx, snap, nil, metav1.ConditionFalse, reason, err.Error()); serr != nil {
			return ctrl.Result{}, serr
		}
		if retry {
			return ctrl.Result{}, err
		}
		return ctrl.Result{}, nil
	}
	ctrl.LoggerFrom(ctx).Info("Cut snapshot", "sourceVolumeID", got.SourceVolumeID, "size", got.Size)
	r.Capacity.Refresh(ctx)
	return ctrl.Result{}, r.setStatus(ctx, snap, &got, metav1.ConditionTrue, pmemv1.CreatedReason, "")
}

// snapshotSource is the back end's volume a snapshot is cut from: its source volume, or of a
// replicated volume its replica on this node.
func snapshotSource(snap *pmemv1.PmemSnapshot) string {
	if snap.Spec.SourceReplica != "" {
		return snap.Spec.SourceReplica
	}
	return snap.Spec.SourceVolumeID
}

func (r *SnapshotReconciler) setStatus(ctx context.Context, snap *pmemv1.PmemSnapshot, got *pmem.Snapshot, st metav1.ConditionStatus, reason, msg string) error {
	patch := client.MergeFrom(snap.DeepCopy())
	if got != nil {
		snap.Status.Size = resource.NewQuantity(got.Size, resource.BinarySI)
		t := metav1.NewTime(time.Unix(0, got.CreationTime))
		snap.Status.CreationTime = &t
	}
	meta.SetStatusCondition(&snap.Status.Conditions, metav1.Condition{
		Type: pmemv1.ReadyCondition, Status: st, Reason: reason, Message: msg, ObservedGeneration: snap.Generation,
	})
	if err := r.Client.Status().Patch(ctx, snap, patch); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("update status of PmemSnapshot %s: %w", snap.Name, err)
	}
	return nil
}
