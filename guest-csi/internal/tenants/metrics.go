package tenants

import (
	"context"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/metrics"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"
)

// What the tenants controller tells an operator to act on (the alerts of
// manifests/components/monitoring): a guest credential whose renewal is overdue, and a tenant's
// quota used up, which makes its guests' provisioning fail with ResourceExhausted.
var (
	credentialRenewAt = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "pvbridge_guest_credential_renew_timestamp_seconds",
		Help: "When the management credential in the guest cluster is due for renewal (Unix time); " +
			"past it, the controller could not deliver a new token yet.",
	}, []string{"namespace", "guest_cluster"})
	quotaUsedRatio = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "pvbridge_tenant_quota_used_ratio",
		Help: "Used over hard of each resource of a ResourceQuota in a namespace that pvbridge's tenancy enforces; 1 is exhausted.",
	}, []string{"namespace", "resourcequota", "resource"})
)

func init() {
	metrics.Registry.MustRegister(credentialRenewAt, quotaUsedRatio)
}

// QuotaUsageReconciler reports, for every ResourceQuota of an enforced namespace
// (tenancy.TenancyNamespaceLabel), how much of each resource is used (quotaUsedRatio), from the
// usage kube-controller-manager writes in its status: an admin's quotas on requests.storage and
// persistentvolumeclaims as much as the controller's own snapshot quota.
type QuotaUsageReconciler struct {
	Client client.Client
}

// +kubebuilder:rbac:groups="",resources=resourcequotas,verbs=get;list;watch
// +kubebuilder:rbac:groups="",resources=namespaces,verbs=get;list;watch

// SetupWithManager reconciles every ResourceQuota, and those of a namespace when it becomes
// enforced or stops being so.
func (r *QuotaUsageReconciler) SetupWithManager(mgr ctrl.Manager) error {
	return ctrl.NewControllerManagedBy(mgr).
		Named("tenancy-quota-usage").
		For(&corev1.ResourceQuota{}).
		Watches(&corev1.Namespace{}, handler.EnqueueRequestsFromMapFunc(r.quotasOf),
			builder.WithPredicates(predicate.LabelChangedPredicate{})).
		Complete(r)
}

// quotasOf maps a Namespace to its ResourceQuotas.
func (r *QuotaUsageReconciler) quotasOf(ctx context.Context, ns client.Object) []reconcile.Request {
	quotas := &corev1.ResourceQuotaList{}
	if err := r.Client.List(ctx, quotas, client.InNamespace(ns.GetName())); err != nil {
		ctrl.LoggerFrom(ctx).Error(err, "Cannot list the ResourceQuotas of a namespace", "namespace", ns.GetName())
		return nil
	}
	reqs := make([]reconcile.Request, 0, len(quotas.Items))
	for i := range quotas.Items {
		reqs = append(reqs, reconcile.Request{NamespacedName: client.ObjectKeyFromObject(&quotas.Items[i])})
	}
	return reqs
}

// Reconcile sets the quota's ratios, or removes them when the quota or its namespace's
// enforcement is gone.
func (r *QuotaUsageReconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	quotaUsedRatio.DeletePartialMatch(prometheus.Labels{"namespace": req.Namespace, "resourcequota": req.Name})
	quota := &corev1.ResourceQuota{}
	if err := r.Client.Get(ctx, req.NamespacedName, quota); err != nil {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	ns := &corev1.Namespace{}
	if err := r.Client.Get(ctx, client.ObjectKey{Name: req.Namespace}, ns); err != nil {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	if !enforced(ns) {
		return ctrl.Result{}, nil
	}
	for name, hard := range quota.Status.Hard {
		used, ok := quota.Status.Used[name]
		if !ok || hard.IsZero() {
			continue // not counted yet; or a resource the admin forbids, which is not "used up"
		}
		quotaUsedRatio.WithLabelValues(quota.Namespace, quota.Name, string(name)).Set(used.AsApproximateFloat64() / hard.AsApproximateFloat64())
	}
	return ctrl.Result{}, nil
}
