package capi

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	infrav1 "pvbridge.io/pkg/apis/infrastructure/v1alpha1"
	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
)

// ClusterReconciler reconciles PVBridgeClusters. A PVBridgeCluster owns no infrastructure of its
// own (pvbridge runs no load balancer: the control plane endpoint is the user's), so it needs no
// finalizer: it reports the failure domains and, once the endpoint is set (on it, or on the
// Cluster by a hosted control plane), that it is provisioned; it blocks clusterctl move
// (infrav1.BlockMoveAnnotation). One with Cluster API's managed-by annotation is left alone.
type ClusterReconciler struct {
	Client client.Client
	// Filter picks the PVBridgeClusters of this provider instance.
	Filter WatchFilter
}

// +kubebuilder:rbac:groups=infrastructure.cluster.x-k8s.io,resources=pvbridgeclusters,verbs=get;list;watch;patch
// +kubebuilder:rbac:groups=infrastructure.cluster.x-k8s.io,resources=pvbridgeclusters/status,verbs=get;patch
// +kubebuilder:rbac:groups=cluster.x-k8s.io,resources=clusters,verbs=get;list;watch
// +kubebuilder:rbac:groups="",resources=nodes,verbs=get;list;watch

// SetupWithManager registers the reconciler: a PVBridgeCluster is reconciled when it, its
// Cluster, or a management host changes.
func (r *ClusterReconciler) SetupWithManager(mgr ctrl.Manager) error {
	return ctrl.NewControllerManagedBy(mgr).
		For(&infrav1.PVBridgeCluster{}).
		Named("pvbridgecluster").
		Watches(&clusterv1.Cluster{}, handler.EnqueueRequestsFromMapFunc(infraClusterOf)).
		Watches(&corev1.Node{}, handler.EnqueueRequestsFromMapFunc(r.allClusters),
			builder.WithPredicates(hostChanged())).
		Complete(r)
}

// infraClusterOf maps a Cluster to its PVBridgeCluster.
func infraClusterOf(_ context.Context, obj client.Object) []reconcile.Request {
	c, ok := obj.(*clusterv1.Cluster)
	if !ok || c.Spec.InfrastructureRef.Kind != "PVBridgeCluster" || c.Spec.InfrastructureRef.APIGroup != infrav1.GroupVersion.Group {
		return nil
	}
	return []reconcile.Request{{NamespacedName: client.ObjectKey{Namespace: c.Namespace, Name: c.Spec.InfrastructureRef.Name}}}
}

// allClusters maps a host change to every PVBridgeCluster (their failure domains may be the hosts).
func (r *ClusterReconciler) allClusters(ctx context.Context, _ client.Object) []reconcile.Request {
	list := &infrav1.PVBridgeClusterList{}
	if err := r.Client.List(ctx, list); err != nil {
		ctrl.LoggerFrom(ctx).Error(err, "List PVBridgeClusters")
		return nil
	}
	reqs := make([]reconcile.Request, 0, len(list.Items))
	for i := range list.Items {
		if len(list.Items[i].Spec.FailureDomains) == 0 {
			reqs = append(reqs, reconcile.Request{NamespacedName: client.ObjectKeyFromObject(&list.Items[i])})
		}
	}
	return reqs
}

// hostChanged passes the creation and deletion of a Node and the change of its host label.
func hostChanged() predicate.Predicate {
	return predicate.Funcs{
		UpdateFunc: func(e event.UpdateEvent) bool {
			oldNode, ok1 := e.ObjectOld.(*corev1.Node)
			newNode, ok2 := e.ObjectNew.(*corev1.Node)
			return !ok1 || !ok2 || oldNode.Labels[vmv1.HostLabel] != newNode.Labels[vmv1.HostLabel] || vmv1.HostTakesNewVMs(oldNode) != vmv1.HostTakesNewVMs(newNode)
		},
		GenericFunc: func(event.GenericEvent) bool { return false },
	}
}

// Reconcile brings a PVBridgeCluster's status up to date.
func (r *ClusterReconciler) Reconcile(ctx context.Context, req ctrl.Request) (_ ctrl.Result, reterr error) {
	ic := &infrav1.PVBridgeCluster{}
	if err := r.Client.Get(ctx, req.NamespacedName, ic); err != nil || !r.Filter.Matches(ic) {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	if _, ok := ic.Annotations[clusterv1.ManagedByAnnotation]; ok {
		// Externally managed infrastructure (the contract): whoever manages it sets its status.
		return ctrl.Result{}, nil
	}
	cluster := &clusterv1.Cluster{}
	found, err := getOwned(ctx, r.Client, ic.Namespace, ownerOfKind(ic, "Cluster"), cluster)
	if err != nil || !found {
		// Cluster API sets the owner reference; the Cluster's watch brings us back.
		return ctrl.Result{}, err
	}
	log := ctrl.LoggerFrom(ctx).WithValues("cluster", client.ObjectKeyFromObject(cluster))
	ctx = ctrl.LoggerInto(ctx, log)

	base := ic.DeepCopy()
	defer func() {
		if err := patchObject(ctx, r.Client, base, ic); err != nil {
			reterr = errors.Join(reterr, err)
		}
	}()
	// Kept while paused: clusterctl move pauses the Cluster before it waits for the annotation.
	metav1.SetMetaDataAnnotation(&ic.ObjectMeta, infrav1.BlockMoveAnnotation, infrav1.BlockMoveReason)
	paused := isPaused(cluster, ic)
	pausedCondition(&ic.Status.Conditions, ic.Generation, paused)
	if paused || !ic.DeletionTimestamp.IsZero() {
		return ctrl.Result{}, nil
	}

	hosts := &corev1.NodeList{}
	if len(ic.Spec.FailureDomains) == 0 {
		if err := r.Client.List(ctx, hosts, client.MatchingLabels{vmv1.HostLabel: "true"}); err != nil {
			return ctrl.Result{}, fmt.Errorf("list management hosts: %w", err)
		}
	}
	ic.Status.FailureDomains = failureDomains(ic.Spec.FailureDomains, hosts.Items)
	endpoint := ic.Spec.ControlPlaneEndpoint
	if !endpoint.IsValid() && cluster.Spec.ControlPlaneEndpoint.IsValid() {
		// Set on the Cluster by someone else: a hosted control plane (Kamaji, k0smotron), or the user.
		endpoint = infrav1.APIEndpoint{Host: cluster.Spec.ControlPlaneEndpoint.Host, Port: cluster.Spec.ControlPlaneEndpoint.Port}
	}
	if !endpoint.IsValid() {
		setCondition(&ic.Status.Conditions, ic.Generation, infrav1.ReadyCondition, metav1.ConditionFalse,
			infrav1.WaitingForControlPlaneEndpointReason, "spec.controlPlaneEndpoint (or the Cluster's) needs a host and a port")
		return ctrl.Result{}, nil
	}
	if !ptr.Deref(ic.Status.Initialization.Provisioned, false) {
		log.Info("PVBridgeCluster provisioned", "endpoint", endpoint)
	}
	ic.Status.Initialization.Provisioned = ptr.To(true)
	setCondition(&ic.Status.Conditions, ic.Generation, infrav1.ReadyCondition, metav1.ConditionTrue, infrav1.ProvisionedReason, "")
	return ctrl.Result{}, nil
}

// failureDomains are a cluster's failure domains: those of its spec, each suitable for the
// control plane unless it says otherwise; else every management host that can take a new VM
// (vmv1.HostTakesNewVMs), all suitable for the control plane. Sorted by name, so the status changes
// only when the hosts do.
func failureDomains(spec []infrav1.FailureDomain, hosts []corev1.Node) []infrav1.FailureDomain {
	var out []infrav1.FailureDomain
	if len(spec) > 0 {
		for _, fd := range spec {
			fd = *fd.DeepCopy()
			if fd.ControlPlane == nil {
				fd.ControlPlane = ptr.To(true)
			}
			out = append(out, fd)
		}
	} else {
		for i := range hosts {
			if vmv1.HostTakesNewVMs(&hosts[i]) {
				out = append(out, infrav1.FailureDomain{Name: hosts[i].Name, ControlPlane: ptr.To(true)})
			}
		}
	}
	slices.SortFunc(out, func(a, b infrav1.FailureDomain) int { return strings.Compare(a.Name, b.Name) })
	return out
}
