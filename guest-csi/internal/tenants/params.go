package tenants

import (
	"context"
	"fmt"
	"slices"
	"strings"

	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	corev1ac "k8s.io/client-go/applyconfigurations/core/v1"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	"pvbridge.io/pkg/tenancy"
)

// Keys of the parameters ConfigMap, after the Cluster's name: <cluster><suffix>.
const (
	paramUID             = ".uid"
	paramStorageClasses  = ".storageClasses"
	paramSharedClaims    = ".sharedClaims"
	paramSharedSnapshots = ".sharedSnapshots"
)

// ParamsReconciler keeps the ConfigMap pvbridge-tenancy of each namespace with opted-in
// Clusters: what the admission policy, which cannot look up other objects, knows of them.
type ParamsReconciler struct {
	Client client.Client
}

// +kubebuilder:rbac:groups="",resources=namespaces,verbs=get;list;watch
// +kubebuilder:rbac:groups="",resources=persistentvolumeclaims,verbs=get;list;watch
// +kubebuilder:rbac:groups=snapshot.storage.k8s.io,resources=volumesnapshots,verbs=get;list;watch
// +kubebuilder:rbac:groups="",resources=configmaps,verbs=get;list;watch;create;patch;delete

// SetupWithManager reconciles a namespace whenever one of its Clusters, its annotations, its
// shared PVCs or VolumeSnapshots, or its parameters ConfigMap change. PVCs and VolumeSnapshots
// are watched by their metadata only.
func (r *ParamsReconciler) SetupWithManager(mgr ctrl.Manager) error {
	return ctrl.NewControllerManagedBy(mgr).
		Named("tenancy-params").
		// Every Cluster: one that loses its label must leave the ConfigMap.
		Watches(&clusterv1.Cluster{}, handler.EnqueueRequestsFromMapFunc(paramsOfNamespace),
			builder.WithPredicates(predicate.Or(predicate.LabelChangedPredicate{}, predicate.AnnotationChangedPredicate{}))).
		Watches(&corev1.Namespace{}, handler.EnqueueRequestsFromMapFunc(paramsOfNamespace),
			builder.WithPredicates(predicate.AnnotationChangedPredicate{})).
		Watches(&corev1.PersistentVolumeClaim{}, handler.EnqueueRequestsFromMapFunc(paramsOfNamespace),
			builder.OnlyMetadata, builder.WithPredicates(sharedChanged)).
		Watches(&snapshotv1.VolumeSnapshot{}, handler.EnqueueRequestsFromMapFunc(paramsOfNamespace),
			builder.OnlyMetadata, builder.WithPredicates(sharedChanged)).
		Watches(&corev1.ConfigMap{}, handler.EnqueueRequestsFromMapFunc(paramsOfNamespace),
			builder.WithPredicates(predicate.NewPredicateFuncs(func(obj client.Object) bool { return obj.GetName() == tenancy.ParamsConfigMap }))).
		Complete(r)
}

// paramsOfNamespace maps an object to the parameters of its namespace (a Namespace to its own).
func paramsOfNamespace(_ context.Context, obj client.Object) []reconcile.Request {
	ns := obj.GetNamespace()
	if _, isNamespace := obj.(*corev1.Namespace); isNamespace {
		ns = obj.GetName()
	}
	return []reconcile.Request{{NamespacedName: client.ObjectKey{Namespace: ns, Name: tenancy.ParamsConfigMap}}}
}

// sharedChanged passes PVCs and VolumeSnapshots whose SharedWithAnnotation is, or was, set.
var sharedChanged = predicate.Funcs{
	CreateFunc: func(e event.CreateEvent) bool { return hasShared(e.Object) },
	DeleteFunc: func(e event.DeleteEvent) bool { return hasShared(e.Object) },
	UpdateFunc: func(e event.UpdateEvent) bool {
		return e.ObjectOld.GetAnnotations()[tenancy.SharedWithAnnotation] != e.ObjectNew.GetAnnotations()[tenancy.SharedWithAnnotation]
	},
	GenericFunc: func(e event.GenericEvent) bool { return hasShared(e.Object) },
}

func hasShared(obj client.Object) bool {
	_, ok := obj.GetAnnotations()[tenancy.SharedWithAnnotation]
	return ok
}

// Reconcile writes the namespace's parameters, or deletes them when no Cluster there opts in.
func (r *ParamsReconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	log := ctrl.LoggerFrom(ctx)
	ns := req.Namespace
	var clusters clusterv1.ClusterList
	if err := r.Client.List(ctx, &clusters, client.InNamespace(ns)); err != nil {
		return ctrl.Result{}, fmt.Errorf("list Clusters: %w", err)
	}
	var tenants []paramsCluster
	for i := range clusters.Items {
		c := &clusters.Items[i]
		if !optedIn(c) {
			continue
		}
		classes, ok := c.Annotations[tenancy.StorageClassesAnnotation]
		tenants = append(tenants, paramsCluster{name: c.Name, uid: string(c.UID), storageClasses: classes, hasStorageClasses: ok})
	}
	key := client.ObjectKey{Namespace: ns, Name: tenancy.ParamsConfigMap}
	if len(tenants) == 0 {
		// Looked up in the cache first: most namespaces never had parameters.
		cm := &corev1.ConfigMap{}
		if err := r.Client.Get(ctx, key, cm); err != nil {
			return ctrl.Result{}, client.IgnoreNotFound(err)
		}
		if err := r.Client.Delete(ctx, cm, client.Preconditions{UID: &cm.UID}); err != nil && !apierrors.IsNotFound(err) {
			return ctrl.Result{}, fmt.Errorf("delete ConfigMap %s: %w", key, err)
		}
		log.Info("Deleted the tenancy parameters: no Cluster of the namespace opts in", "configMap", key)
		return ctrl.Result{}, nil
	}

	namespace := &corev1.Namespace{}
	if err := r.Client.Get(ctx, client.ObjectKey{Name: ns}, namespace); err != nil {
		return ctrl.Result{}, fmt.Errorf("read Namespace %s: %w", ns, err)
	}
	claims, err := listMetadata(ctx, r.Client, pvcKind, client.InNamespace(ns))
	if err != nil {
		return ctrl.Result{}, err
	}
	snapshots, err := listMetadata(ctx, r.Client, snapshotKind, client.InNamespace(ns))
	if err != nil {
		return ctrl.Result{}, err
	}
	data := paramsData(tenants, namespace.Annotations[tenancy.StorageClassesAnnotation], claims, snapshots)
	cm := corev1ac.ConfigMap(tenancy.ParamsConfigMap, ns).WithLabels(map[string]string{ManagedByLabel: fieldManager}).WithData(data)
	if err := r.Client.Apply(ctx, cm, client.FieldOwner(fieldManager), client.ForceOwnership); err != nil {
		return ctrl.Result{}, fmt.Errorf("apply ConfigMap %s: %w", key, err)
	}
	log.V(2).Info("Applied the tenancy parameters", "configMap", key, "clusters", len(tenants))
	return ctrl.Result{}, nil
}

// paramsCluster is what the parameters say of one opted-in Cluster.
type paramsCluster struct {
	name, uid string
	// storageClasses is the Cluster's tenancy.StorageClassesAnnotation, if hasStorageClasses.
	storageClasses    string
	hasStorageClasses bool
}

// paramsData is the content of a namespace's parameters ConfigMap (docs/tenants.md): per
// Cluster its UID, its storage classes (its own annotation, else the namespace's), and the
// names of the claims and snapshots whose SharedWithAnnotation names it. Lists are sorted,
// without duplicates or blanks, comma-separated.
func paramsData(clusters []paramsCluster, namespaceClasses string, claims, snapshots []metav1.PartialObjectMetadata) map[string]string {
	data := make(map[string]string, 4*len(clusters))
	for _, c := range clusters {
		classes := namespaceClasses
		if c.hasStorageClasses {
			classes = c.storageClasses
		}
		data[c.name+paramUID] = c.uid
		data[c.name+paramStorageClasses] = normalizeList(strings.Split(classes, ","))
		data[c.name+paramSharedClaims] = normalizeList(sharedWith(claims, c.name))
		data[c.name+paramSharedSnapshots] = normalizeList(sharedWith(snapshots, c.name))
	}
	return data
}

// sharedWith returns the names of the objects whose SharedWithAnnotation names cluster.
func sharedWith(objs []metav1.PartialObjectMetadata, cluster string) []string {
	var names []string
	for i := range objs {
		if tenancy.SharedWith(objs[i].Annotations[tenancy.SharedWithAnnotation], cluster) {
			names = append(names, objs[i].Name)
		}
	}
	return names
}

// normalizeList trims the items, drops blanks and duplicates, sorts and joins them with commas.
func normalizeList(items []string) string {
	out := make([]string, 0, len(items))
	for _, item := range items {
		if item = strings.TrimSpace(item); item != "" {
			out = append(out, item)
		}
	}
	slices.Sort(out)
	return strings.Join(slices.Compact(out), ",")
}
