// Package replicated reports, in the mgmt-csi controller, how the replicated volumes stand: a
// volume with a faulted replica runs degraded, and says so, never silently.
package replicated

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/recorder"

	pmemv1 "pvbridge.io/pkg/apis/pmem/v1alpha1"
	"pvbridge.io/pkg/hostloss"
)

// degradedVolumes counts the replicated volumes with a faulted replica: the alert
// PvbridgeVolumeDegraded fires while it is above zero.
var degradedVolumes = prometheus.NewGaugeFunc(prometheus.GaugeOpts{
	Name: "pvbridge_replicated_volumes_degraded",
	Help: "Replicated volumes that run without one of their replicas (a PmemReplica Faulted, being rebuilt, or deleted): kubectl get pmemvolumes shows which.",
}, func() float64 { return float64(degraded.count()) })

// Reconciler keeps the Degraded condition of every replicated PmemVolume: True, with an Event
// on the volume when it becomes so, while one of its PmemReplicas is Faulted, or fewer than
// spec.replicas have its data (one is being rebuilt, or was deleted). And it has the volume's
// replicas repaired.
type Reconciler struct {
	Client   client.Client
	Recorder recorder.EventRecorder
	// Repairer, unless nil, repairs the replicas of a volume that is Ready.
	Repairer Repairer
}

// Repairer replaces a replicated volume's faulted replicas, moves its replicas off drained
// nodes, and deletes those that are out of it (mgmt-csi's controller service, which places
// replicas).
type Repairer interface {
	Repair(ctx context.Context, vol *pmemv1.PmemVolume) error
}

// SetupWithManager registers the reconciler and its metric.
func (r *Reconciler) SetupWithManager(mgr ctrl.Manager, reg prometheus.Registerer) error {
	if err := reg.Register(degradedVolumes); err != nil {
		if _, ok := err.(prometheus.AlreadyRegisteredError); !ok { //nolint:errorlint // a plain type switch in client_golang's own examples
			return err
		}
	}
	return ctrl.NewControllerManagedBy(mgr).
		For(&pmemv1.PmemVolume{}).
		Named("replicated-volume").
		Watches(&pmemv1.PmemReplica{}, handler.EnqueueRequestsFromMapFunc(func(_ context.Context, o client.Object) []ctrl.Request {
			return []ctrl.Request{{NamespacedName: client.ObjectKey{Name: o.(*pmemv1.PmemReplica).Spec.VolumeID}}}
		})).
		// A drain's start or end, or a loss: the volumes with a replica there.
		Watches(&corev1.Node{}, handler.EnqueueRequestsFromMapFunc(r.volumesOn), builder.WithPredicates(hostloss.StateChanged())).
		Complete(r)
}

// volumesOn maps a Node to the volumes that have a replica there.
func (r *Reconciler) volumesOn(ctx context.Context, o client.Object) []ctrl.Request {
	list := &pmemv1.PmemReplicaList{}
	if err := r.Client.List(ctx, list, client.MatchingLabels{pmemv1.NodeLabel: o.GetName()}); err != nil {
		ctrl.LoggerFrom(ctx).Error(err, "List the PmemReplicas of a node", "node", o.GetName())
		return nil
	}
	var reqs []ctrl.Request
	for _, rep := range list.Items {
		reqs = append(reqs, ctrl.Request{NamespacedName: client.ObjectKey{Name: rep.Spec.VolumeID}})
	}
	return reqs
}

// Reconcile sets the Degraded condition of a replicated volume from its replicas.
func (r *Reconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	vol := &pmemv1.PmemVolume{}
	if err := r.Client.Get(ctx, req.NamespacedName, vol); err != nil {
		if apierrors.IsNotFound(err) {
			degraded.set(req.Name, false)
		}
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	if vol.Spec.Replicas <= 1 || !vol.DeletionTimestamp.IsZero() {
		degraded.set(vol.Name, false)
		return ctrl.Result{}, nil
	}
	list := &pmemv1.PmemReplicaList{}
	if err := r.Client.List(ctx, list, client.MatchingLabels{pmemv1.VolumeLabel: vol.Name}); err != nil {
		return ctrl.Result{}, err
	}
	var faulted, rebuilding []string
	synced := 0
	for _, rep := range list.Items {
		switch {
		case rep.Faulted():
			why := meta.FindStatusCondition(rep.Status.Conditions, pmemv1.ReadyCondition).Message
			faulted = append(faulted, fmt.Sprintf("%s on node %s (%s)", rep.Name, rep.Spec.Node, why))
		case rep.Retired():
			// Out of the volume: a replica elsewhere took its place.
		case !rep.HasData():
			rebuilding = append(rebuilding, fmt.Sprintf("%s on node %s", rep.Name, rep.Spec.Node))
		case rep.DeletionTimestamp.IsZero():
			synced++
		}
	}
	slices.Sort(faulted)
	slices.Sort(rebuilding)
	cond := metav1.Condition{
		Type: pmemv1.DegradedCondition, Status: metav1.ConditionFalse, Reason: pmemv1.AllReplicasReason,
		Message: fmt.Sprintf("%d replicas", vol.Spec.Replicas), ObservedGeneration: vol.Generation,
	}
	switch {
	case len(faulted) > 0:
		cond.Status, cond.Reason = metav1.ConditionTrue, pmemv1.ReplicaFaultedReason
		cond.Message = fmt.Sprintf("%d of %d replicas faulted: %s", len(faulted), vol.Spec.Replicas, strings.Join(faulted, "; "))
	case synced < int(vol.Spec.Replicas) && meta.IsStatusConditionTrue(vol.Status.Conditions, pmemv1.ReadyCondition):
		// (Not while CreateVolume makes the replicas: the volume is Ready once they are.)
		cond.Status, cond.Reason = metav1.ConditionTrue, pmemv1.ReplicasMissingReason
		cond.Message = fmt.Sprintf("%d of %d replicas have the volume's data", synced, vol.Spec.Replicas)
		if len(rebuilding) > 0 {
			cond.Message += "; rebuilding: " + strings.Join(rebuilding, "; ")
		}
	}
	degraded.set(vol.Name, cond.Status == metav1.ConditionTrue)
	if err := r.setDegraded(ctx, vol, cond); err != nil {
		return ctrl.Result{}, err
	}
	if r.Repairer != nil && meta.IsStatusConditionTrue(vol.Status.Conditions, pmemv1.ReadyCondition) {
		if err := r.Repairer.Repair(ctx, vol); err != nil {
			// No host with room, or every other host lost or drained: retried at a steady
			// pace, not with a backoff that grows to minutes, so that a host that gets room
			// (no event of a watched object says so) takes the replica soon.
			ctrl.LoggerFrom(ctx).Error(err, "Repair the replicas; retrying", "after", RepairRetry)
			return ctrl.Result{RequeueAfter: RepairRetry}, nil
		}
	}
	return ctrl.Result{}, nil
}

// RepairRetry is how soon a repair that failed is tried again.
const RepairRetry = 15 * time.Second

// setDegraded writes cond, the Degraded condition, into vol's status, with a Warning Event when
// it becomes True or says something else.
func (r *Reconciler) setDegraded(ctx context.Context, vol *pmemv1.PmemVolume, cond metav1.Condition) error {
	before := vol.DeepCopy()
	patch := client.MergeFrom(before)
	// From the copy: SetStatusCondition changes the condition in place.
	was := meta.FindStatusCondition(before.Status.Conditions, pmemv1.DegradedCondition)
	if !meta.SetStatusCondition(&vol.Status.Conditions, cond) {
		return nil
	}
	if err := r.Client.Status().Patch(ctx, vol, patch); err != nil {
		return client.IgnoreNotFound(err)
	}
	if cond.Status == metav1.ConditionTrue && (was == nil || was.Status != metav1.ConditionTrue || was.Message != cond.Message) && r.Recorder != nil {
		r.Recorder.Eventf(vol, nil, corev1.EventTypeWarning, cond.Reason, "Degrade", "%s", cond.Message)
	}
	return nil
}
