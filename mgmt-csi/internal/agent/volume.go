// Package agent is the node agent of mgmt-csi: it owns the PMEM of one host. It realizes the
// PmemVolume and PmemSnapshot objects the controller records for its node through the PMEM back
// end, reports each result in the object's status, and publishes the node's capacity in its
// PmemNode. Everything it knows survives a restart: intent in the API objects, state on the
// device.
package agent

import (
	"cmp"
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

// Finalizer is set by the controller on every PmemVolume and PmemSnapshot; the agent removes it
// once the data is gone from the device.
const Finalizer = "pmem.pvbridge.io/device"

const (
	// inUseRetry is how soon a deletion blocked by an open device is tried again.
	inUseRetry = 5 * time.Second
	// concurrentReconciles bounds the volumes (and snapshots) realized at once. The back ends
	// serialize what must be (space accounting, LVM calls) and let copies run in parallel.
	concurrentReconciles = 4
)

// VolumeReconciler realizes the PmemVolumes of one node.
type VolumeReconciler struct {
	Client  client.Client
	Backend pmem.Backend
	Node    string
	// Capacity is refreshed after every change of the node's allocations.
	Capacity *NodeReporter
}

// SetupWithManager registers the reconciler. The manager's cache holds only this node's
// PmemVolumes (a field selector on spec.node).
func (r *VolumeReconciler) SetupWithManager(mgr ctrl.Manager) error {
	return ctrl.NewControllerManagedBy(mgr).
		For(&pmemv1.PmemVolume{}).
		Named("pmemvolume").
		WithOptions(controller.Options{MaxConcurrentReconciles: concurrentReconciles}).
		Complete(r)
}

// Reconcile makes the device of a PmemVolume match its spec, or removes it.
func (r *VolumeReconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	vol := &pmemv1.PmemVolume{}
	if err := r.Client.Get(ctx, req.NamespacedName, vol); err != nil {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	if vol.Spec.Node != r.Node {
		return ctrl.Result{}, nil
	}
	if !vol.DeletionTimestamp.IsZero() {
		return r.reconcileDelete(ctx, vol)
	}
	return r.reconcileNormal(ctx, vol)
}

func (r *VolumeReconciler) reconcileNormal(ctx context.Context, vol *pmemv1.PmemVolume) (ctrl.Result, error) {
	dev, err := carve(ctx, r.Backend, r.Capacity, vol.Name, vol.Spec.Size.Value(), backendSource(vol.Spec.Source), vol.Status.Device)
	if errors.Is(err, errDisappeared) {
		return ctrl.Result{}, r.setStatus(ctx, vol, nil, metav1.ConditionFalse, pmemv1.FailedReason, err.Error())
	}
	if err != nil {
		return r.failed(ctx, vol, err)
	}
	return ctrl.Result{}, r.setStatus(ctx, vol, &dev, metav1.ConditionTrue, pmemv1.CreatedReason, "")
}

// backendSource is the back end's name of what a volume or replica starts from: the snapshot,
// or the volume to clone, which for a replicated one is the replica on this node.
func backendSource(s *pmemv1.PmemVolumeSource) *pmem.Source {
	if s == nil {
		return nil
	}
	return &pmem.Source{SnapshotID: s.SnapshotID, VolumeID: cmp.Or(s.SourceReplica, s.VolumeID)}
}

// errDisappeared is carve's error for a device that existed and is gone.
var errDisappeared = errors.New("has disappeared from the node")

// carve makes the back end's volume name exist with at least size bytes: it creates it (from
// src), or grows it. known is the device the object reported last: if that is gone, carve
// fails with errDisappeared rather than hand out a new, empty volume under the old name.
func carve(ctx context.Context, b pmem.Backend, capacity *NodeReporter, name string, size int64, src *pmem.Source, known string) (pmem.Volume, error) {
	log := ctrl.LoggerFrom(ctx)
	dev, err := b.GetVolume(ctx, name)
	switch {
	case errors.Is(err, pmem.ErrNotFound) && known != "":
		return pmem.Volume{}, fmt.Errorf("the device %s of %s %w", known, name, errDisappeared)
	case errors.Is(err, pmem.ErrNotFound):
		if dev, err = b.CreateVolume(ctx, name, size, src); err != nil {
			return pmem.Volume{}, err
		}
		log.Info("Created volume", "device", dev.Device, "size", dev.Size)
		capacity.Refresh(ctx)
	case err != nil:
		return pmem.Volume{}, err
	}
	if dev.Size < size {
		grown, err := b.ExpandVolume(ctx, name, size)
		if err != nil {
			return pmem.Volume{}, err
		}
		log.Info("Expanded volume", "device", grown.Device, "from", dev.Size, "to", grown.Size)
		dev = grown
		capacity.Refresh(ctx)
	}
	return dev, nil
}

// failed reports a back-end error. Lack of space and a missing source are final for this
// generation of the spec (the controller reacts); anything else is retried with backoff.
func (r *VolumeReconciler) failed(ctx context.Context, vol *pmemv1.PmemVolume, err error) (ctrl.Result, error) {
	return reportFailure(err, func(reason string) error {
		return r.setStatus(ctx, vol, nil, metav1.ConditionFalse, reason, err.Error())
	})
}

// reportFailure reports a back-end error with set, which writes the Ready condition of
// reason, and asks for a retry when the error is not final (failureReason).
func reportFailure(err error, set func(reason string) error) (ctrl.Result, error) {
	reason, retry := failureReason(err)
	if serr := set(reason); serr != nil {
		return ctrl.Result{}, serr
	}
	if retry {
		return ctrl.Result{}, err
	}
	return ctrl.Result{}, nil
}

func (r *VolumeReconciler) reconcileDelete(ctx context.Context, vol *pmemv1.PmemVolume) (ctrl.Result, error) {
	if !controllerutil.ContainsFinalizer(vol, Finalizer) {
		return ctrl.Result{}, nil
	}
	return release(ctx, r.Client, r.Backend, r.Capacity, vol, func(msg string) error {
		return r.setStatus(ctx, vol, nil, metav1.ConditionFalse, pmemv1.InUseReason, msg)
	})
}

// release removes the back end's volume named after obj and then obj's finalizer. While the
// device is in use, it reports that with inUse and tries again after inUseRetry.
func release(ctx context.Context, c client.Client, b pmem.Backend, capacity *NodeReporter, obj client.Object, inUse func(string) error) (ctrl.Result, error) {
	err := b.DeleteVolume(ctx, obj.GetName())
	if errors.Is(err, pmem.ErrInUse) {
		if serr := inUse(err.Error()); serr != nil {
			return ctrl.Result{}, serr
		}
		return ctrl.Result{RequeueAfter: inUseRetry}, nil
	}
	if err != nil {
		return ctrl.Result{}, err
	}
	ctrl.LoggerFrom(ctx).Info("Deleted volume")
	capacity.Refresh(ctx)
	return ctrl.Result{}, removeFinalizer(ctx, c, obj)
}

// setStatus writes the Ready condition, and the device when dev is set.
func (r *VolumeReconciler) setStatus(ctx context.Context, vol *pmemv1.PmemVolume, dev *pmem.Volume, st metav1.ConditionStatus, reason, msg string) error {
	patch := client.MergeFrom(vol.DeepCopy())
	if dev != nil {
		vol.Status.Device = dev.Device
		vol.Status.AllocatedSize = resource.NewQuantity(dev.Size, resource.BinarySI)
	}
	changed := meta.SetStatusCondition(&vol.Status.Conditions, metav1.Condition{
		Type: pmemv1.ReadyCondition, Status: st, Reason: reason, Message: msg, ObservedGeneration: vol.Generation,
	})
	if !changed && dev == nil {
		return nil
	}
	if err := r.Client.Status().Patch(ctx, vol, patch); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("update status of PmemVolume %s: %w", vol.Name, err)
	}
	return nil
}

// failureReason maps a back-end error to the Ready reason and whether to retry.
func failureReason(err error) (string, bool) {
	switch {
	case errors.Is(err, pmem.ErrNoSpace):
		return pmemv1.InsufficientCapacityReason, false
	case errors.Is(err, pmem.ErrNotFound):
		return pmemv1.SourceNotFoundReason, false
	case errors.Is(err, pmem.ErrInvalid):
		return pmemv1.FailedReason, false
	}
	return pmemv1.FailedReason, true
}

func removeFinalizer(ctx context.Context, c client.Client, obj client.Object) error {
	patch := client.MergeFromWithOptions(obj.DeepCopyObject().(client.Object), client.MergeFromWithOptimisticLock{})
	controllerutil.RemoveFinalizer(obj, Finalizer)
	if err := c.Patch(ctx, obj, patch); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("remove finalizer of %s: %w", obj.GetName(), err)
	}
	return nil
}
