package tenants

import (
	"context"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	"pvbridge.io/pkg/tenancy"
)

const (
	// SnapshotQuota is the ResourceQuota the quota controller gives every enforced namespace.
	SnapshotQuota = "pvbridge-snapshots"
	// groupSnapshotCount counts VolumeGroupSnapshots: their members count as snapshots (mgmt-csi
	// refuses a group its namespace's snapshot quota has no room for), but groups taken at once
	// may each pass that check, and each one holds its VMs' writes on a shared host.
	groupSnapshotCount corev1.ResourceName = "count/volumegroupsnapshots.groupsnapshot.storage.k8s.io"
)

// QuotaReconciler gives every enforced namespace (tenancy.TenancyNamespaceLabel) the
// ResourceQuota SnapshotQuota, a count of VolumeSnapshots and of VolumeGroupSnapshots, when it
// has none: without it a guest could fill its hosts, and those of any volume shared with it,
// with snapshots, or hold its hosts' writers with group snapshots. The quota is
// created and never updated, so that a platform admin may change it; a deleted one comes back
// (an admin who wants none runs the controller with --snapshot-quota=0).
type QuotaReconciler struct {
	Client client.Client
	// Snapshots and GroupSnapshots are the counts the quota allows; 0 leaves one out.
	Snapshots, GroupSnapshots int64
}

// +kubebuilder:rbac:groups="",resources=resourcequotas,verbs=get;list;watch;create

// SetupWithManager reconciles an enforced namespace when it becomes so and when its quota goes.
func (r *QuotaReconciler) SetupWithManager(mgr ctrl.Manager) error {
	return ctrl.NewControllerManagedBy(mgr).
		Named("tenancy-quota").
		For(&corev1.Namespace{}, builder.WithPredicates(predicate.NewPredicateFuncs(enforced))).
		Watches(&corev1.ResourceQuota{}, handler.EnqueueRequestsFromMapFunc(namespaceOf), builder.OnlyMetadata,
			builder.WithPredicates(deletions, predicate.NewPredicateFuncs(func(obj client.Object) bool { return obj.GetName() == SnapshotQuota }))).
		Complete(r)
}

// namespaceOf maps a namespaced object to its Namespace.
func namespaceOf(_ context.Context, obj client.Object) []reconcile.Request {
	return []reconcile.Request{{NamespacedName: client.ObjectKey{Name: obj.GetNamespace()}}}
}

// Reconcile creates the quota of an enforced namespace that has none.
func (r *QuotaReconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	ns := &corev1.Namespace{}
	if err := r.Client.Get(ctx, req.NamespacedName, ns); err != nil {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	if !enforced(ns) || !ns.DeletionTimestamp.IsZero() {
		return ctrl.Result{}, nil
	}
	hard := corev1.ResourceList{}
	for name, n := range map[corev1.ResourceName]int64{tenancy.SnapshotCountResource: r.Snapshots, groupSnapshotCount: r.GroupSnapshots} {
		if n > 0 {
			hard[name] = *resource.NewQuantity(n, resource.DecimalSI)
		}
	}
	quota := &corev1.ResourceQuota{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns.Name, Name: SnapshotQuota, Labels: map[string]string{ManagedByLabel: fieldManager}},
		Spec:       corev1.ResourceQuotaSpec{Hard: hard},
	}
	err := r.Client.Create(ctx, quota, client.FieldOwner(fieldManager))
	switch {
	case apierrors.IsAlreadyExists(err):
		return ctrl.Result{}, nil // the admin's to change
	case err != nil:
		return ctrl.Result{}, fmt.Errorf("create ResourceQuota %s/%s: %w", ns.Name, SnapshotQuota, err)
	}
	ctrl.LoggerFrom(ctx).Info("Created the snapshot quota of an enforced namespace", "resourceQuota", client.ObjectKeyFromObject(quota),
		"snapshots", r.Snapshots, "groupSnapshots", r.GroupSnapshots)
	return ctrl.Result{}, nil
}
