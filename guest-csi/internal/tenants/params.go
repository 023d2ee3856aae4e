package tenants

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	groupsnapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumegroupsnapshot/v1"
	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	corev1ac "k8s.io/client-go/applyconfigurations/core/v1"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/pkg/tenancy"
)

const (
	// ParamsFinalizer holds a namespace's parameters while the namespace is enforced or, once
	// deleted, still has claims, snapshots, group snapshots or VirtualMachines: the admission policy denies
	// every write it matches, whoever sends it, when the parameters are missing.
	ParamsFinalizer = "pvbridge.io/tenancy-params"
	// drainRetry is how often a deleted namespace is looked at again until its objects are gone.
	drainRetry = 2 * time.Second
)

// ParamsReconciler keeps the ConfigMap pvbridge-tenancy of each enforced namespace and of each
// namespace with opted-in Clusters: what the admission policy, which cannot look up other
// objects, knows of them. An enforced namespace always has one, empty when no Cluster opts in,
// so that the policy never runs without parameters (it then denies).
type ParamsReconciler struct {
	Client client.Client
}

// +kubebuilder:rbac:groups="",resources=namespaces,verbs=get;list;watch
// +kubebuilder:rbac:groups="",resources=persistentvolumeclaims,verbs=get;list;watch
// +kubebuilder:rbac:groups=snapshot.storage.k8s.io,resources=volumesnapshots,verbs=get;list;watch
// +kubebuilder:rbac:groups=groupsnapshot.storage.k8s.io,resources=volumegroupsnapshots,verbs=get;list;watch
// +kubebuilder:rbac:groups=vm.pvbridge.io,resources=virtualmachines,verbs=get;list;watch
// +kubebuilder:rbac:groups="",resources=configmaps,verbs=get;list;watch;create;patch;delete
// +kubebuilder:rbac:groups="",resources=serviceaccounts,verbs=get;list;watch

// SetupWithManager reconciles a namespace whenever it, one of its Clusters, the guest
// identities, the hosts of its VirtualMachines, its shared PVCs or VolumeSnapshots, its group
// snapshots (that come, go or change labels) and their members, or its parameters ConfigMap
// change. PVCs, VolumeSnapshots and VolumeGroupSnapshots are watched by their metadata only.
func (r *ParamsReconciler) SetupWithManager(mgr ctrl.Manager) error {
	return ctrl.NewControllerManagedBy(mgr).
		Named("tenancy-params").
		// Every Cluster: one that loses its label must leave the ConfigMap.
		Watches(&clusterv1.Cluster{}, handler.EnqueueRequestsFromMapFunc(paramsOfNamespace),
			builder.WithPredicates(predicate.Or(predicate.LabelChangedPredicate{}, predicate.AnnotationChangedPredicate{}))).
		// Labels, annotations and deletion: namespaces change seldom.
		Watches(&corev1.Namespace{}, handler.EnqueueRequestsFromMapFunc(paramsOfNamespace)).
		// The cache holds only the controller's own ServiceAccounts (CacheOptions).
		Watches(&corev1.ServiceAccount{}, handler.EnqueueRequestsFromMapFunc(paramsOfNamespace)).
		Watches(&vmv1.VirtualMachine{}, handler.EnqueueRequestsFromMapFunc(paramsOfNamespace),
			builder.WithPredicates(hostChanged)).
		Watches(&corev1.PersistentVolumeClaim{}, handler.EnqueueRequestsFromMapFunc(paramsOfNamespace),
			builder.OnlyMetadata, builder.WithPredicates(sharedChanged)).
		Watches(&snapshotv1.VolumeSnapshot{}, handler.EnqueueRequestsFromMapFunc(paramsOfNamespace),
			builder.OnlyMetadata, builder.WithPredicates(predicate.Or[client.Object](sharedChanged, groupMemberChanged))).
		// A group's label, not its name, makes its members a cluster's (tenancy.GroupMember).
		Watches(&groupsnapshotv1.VolumeGroupSnapshot{}, handler.EnqueueRequestsFromMapFunc(paramsOfNamespace),
			builder.OnlyMetadata, builder.WithPredicates(predicate.LabelChangedPredicate{})).
		Watches(&corev1.ConfigMap{}, handler.EnqueueRequestsFromMapFunc(paramsOfNamespace),
			builder.WithPredicates(predicate.NewPredicateFuncs(func(obj client.Object) bool { return obj.GetName() == tenancy.ParamsConfigMap }))).
		Complete(r)
}

// hostChanged passes VirtualMachines that come, go, or change host or cluster.
var hostChanged = predicate.Funcs{
	UpdateFunc: func(e event.UpdateEvent) bool {
		o, okOld := e.ObjectOld.(*vmv1.VirtualMachine)
		n, okNew := e.ObjectNew.(*vmv1.VirtualMachine)
		return !okOld || !okNew || o.Status.Host != n.Status.Host ||
			o.Labels[tenancy.CAPIClusterNameLabel] != n.Labels[tenancy.CAPIClusterNameLabel]
	},
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

// groupMemberChanged passes VolumeSnapshots owned by a VolumeGroupSnapshot (group snapshot
// members, of any cluster) that come or go, and those that gain or lose such an owner.
var groupMemberChanged = predicate.Funcs{
	CreateFunc:  func(e event.CreateEvent) bool { return groupOwned(e.Object) },
	DeleteFunc:  func(e event.DeleteEvent) bool { return groupOwned(e.Object) },
	UpdateFunc:  func(e event.UpdateEvent) bool { return groupOwned(e.ObjectOld) != groupOwned(e.ObjectNew) },
	GenericFunc: func(e event.GenericEvent) bool { return groupOwned(e.Object) },
}

func groupOwned(obj client.Object) bool {
	return slices.ContainsFunc(obj.GetOwnerReferences(), func(ref metav1.OwnerReference) bool { return ref.Kind == groupSnapshotKind.Kind })
}

// Reconcile writes the namespace's parameters while it is enforced or has opted-in Clusters,
// and otherwise deletes them; in a deleted namespace it keeps them until the objects the
// policy guards are gone.
func (r *ParamsReconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	log := ctrl.LoggerFrom(ctx)
	ns := req.Namespace
	key := client.ObjectKey{Namespace: ns, Name: tenancy.ParamsConfigMap}
	namespace := &corev1.Namespace{}
	if err := r.Client.Get(ctx, client.ObjectKey{Name: ns}, namespace); err != nil {
		return ctrl.Result{}, client.IgnoreNotFound(err) // its ConfigMap went with it
	}
	if !namespace.DeletionTimestamp.IsZero() {
		return r.reconcileDeletedNamespace(ctx, key)
	}
	var clusters clusterv1.ClusterList
	if err := r.Client.List(ctx, &clusters, client.InNamespace(ns)); err != nil {
		return ctrl.Result{}, fmt.Errorf("list Clusters: %w", err)
	}
	var accounts corev1.ServiceAccountList
	if err := r.Client.List(ctx, &accounts, client.InNamespace(ns)); err != nil {
		return ctrl.Result{}, fmt.Errorf("list ServiceAccounts: %w", err)
	}
	var tenants []paramsCluster
	for i := range clusters.Items {
		c := &clusters.Items[i]
		if !optedIn(c) {
			continue
		}
		tenants = append(tenants, paramsCluster{name: c.Name, uid: string(c.UID), account: identityUID(c, accounts.Items),
			annotations: c.Annotations})
	}
	if len(tenants) == 0 && !enforced(namespace) {
		return ctrl.Result{}, r.deleteParams(ctx, key)
	}

	claims, err := listMetadata(ctx, r.Client, pvcKind, client.InNamespace(ns))
	if err != nil {
		return ctrl.Result{}, err
	}
	snapshots, err := listMetadata(ctx, r.Client, snapshotKind, client.InNamespace(ns))
	if err != nil {
		return ctrl.Result{}, err
	}
	groups, err := listMetadata(ctx, r.Client, groupSnapshotKind, client.InNamespace(ns))
	if err != nil {
		return ctrl.Result{}, err
	}
	var vms vmv1.VirtualMachineList
	if err := r.Client.List(ctx, &vms, client.InNamespace(ns)); err != nil {
		return ctrl.Result{}, fmt.Errorf("list VirtualMachines: %w", err)
	}
	data := paramsData(ns, tenants, namespace.Annotations, claims, snapshots, groups, vms.Items)
	if err := r.applyParams(ctx, key, data, true); err != nil {
		return ctrl.Result{}, err
	}
	log.V(2).Info("Applied the tenancy parameters", "configMap", key, "clusters", len(tenants))
	return ctrl.Result{}, nil
}

// reconcileDeletedNamespace lets the parameters of a deleted namespace go once no claim,
// snapshot or VirtualMachine is left: until then their deletion (and the removal of their
// finalizers by kube-controller-manager) passes the admission policy only with parameters.
func (r *ParamsReconciler) reconcileDeletedNamespace(ctx context.Context, key client.ObjectKey) (ctrl.Result, error) {
	cm := &corev1.ConfigMap{}
	if err := r.Client.Get(ctx, key, cm); err != nil {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	if !controllerutil.ContainsFinalizer(cm, ParamsFinalizer) {
		return ctrl.Result{}, nil
	}
	for _, kind := range []schema.GroupVersionKind{pvcKind, snapshotKind, groupSnapshotKind, vmKind} {
		objs, err := listMetadata(ctx, r.Client, kind, client.InNamespace(key.Namespace), client.Limit(1))
		if err != nil {
			return ctrl.Result{}, err
		}
		if len(objs) > 0 {
			ctrl.LoggerFrom(ctx).V(2).Info("Keeping the tenancy parameters of a deleted namespace until its objects are gone",
				"configMap", key, "waitingFor", kind.Kind)
			return ctrl.Result{RequeueAfter: drainRetry}, nil
		}
	}
	return ctrl.Result{}, r.applyParams(ctx, key, cm.Data, false)
}

// applyParams applies the ConfigMap's data, held by ParamsFinalizer or released.
func (r *ParamsReconciler) applyParams(ctx context.Context, key client.ObjectKey, data map[string]string, hold bool) error {
	cm := corev1ac.ConfigMap(key.Name, key.Namespace).WithLabels(map[string]string{ManagedByLabel: fieldManager}).WithData(data)
	if hold {
		cm.WithFinalizers(ParamsFinalizer)
	}
	if err := r.Client.Apply(ctx, cm, client.FieldOwner(fieldManager), client.ForceOwnership); err != nil {
		return fmt.Errorf("apply ConfigMap %s: %w", key, err)
	}
	return nil
}

// deleteParams deletes the parameters of a namespace that needs none, releasing the finalizer.
func (r *ParamsReconciler) deleteParams(ctx context.Context, key client.ObjectKey) error {
	// Looked up in the cache first: most namespaces never had parameters.
	cm := &corev1.ConfigMap{}
	if err := r.Client.Get(ctx, key, cm); err != nil {
		return client.IgnoreNotFound(err)
	}
	if controllerutil.ContainsFinalizer(cm, ParamsFinalizer) {
		if err := r.applyParams(ctx, key, cm.Data, false); err != nil {
			return err
		}
	}
	if err := r.Client.Delete(ctx, cm, client.Preconditions{UID: &cm.UID}); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("delete ConfigMap %s: %w", key, err)
	}
	ctrl.LoggerFrom(ctx).Info("Deleted the tenancy parameters: the namespace is not enforced and no Cluster there opts in", "configMap", key)
	return nil
}

// identityUID is the UID of the Cluster's guest identity: its ServiceAccount, if the Cluster
// controls it. An account of that name left by an earlier Cluster is not it: its tokens stay
// valid until the credentials controller has replaced it.
func identityUID(c *clusterv1.Cluster, accounts []corev1.ServiceAccount) string {
	for i := range accounts {
		if accounts[i].Name == identityName(c.Name) && metav1.IsControlledBy(&accounts[i], c) {
			return string(accounts[i].UID)
		}
	}
	return ""
}

// paramsCluster is what the parameters say of one opted-in Cluster.
type paramsCluster struct {
	name, uid string
	// account is the UID of its guest identity's ServiceAccount, empty until there is one.
	account string
	// annotations are the Cluster's: its allow-lists (tenancy.StorageClassesAnnotation,
	// tenancy.AttributesClassesAnnotation, tenancy.SnapshotClassesAnnotation,
	// tenancy.GroupSnapshotClassesAnnotation) override the Namespace's.
	annotations map[string]string
}

// paramsData is the content of the parameters ConfigMap of namespace ns (docs/tenants.md): per
// Cluster its UID, the UID of its guest identity's ServiceAccount, the StorageClasses,
// VolumeAttributesClasses, VolumeSnapshotClasses and VolumeGroupSnapshotClasses it may name (see
// allowList), the hosts of its VirtualMachines (the
// only ones its claims may select), the names of the claims and snapshots whose
// SharedWithAnnotation names it, and the names of the members of its group snapshots (only its
// own: the ConfigMap's size stays bounded by each cluster's snapshots). Lists are sorted, without
// duplicates or blanks, comma-separated.
func paramsData(ns string, clusters []paramsCluster, namespaceAnnotations map[string]string, claims, snapshots, groups []metav1.PartialObjectMetadata, vms []vmv1.VirtualMachine) map[string]string {
	data := make(map[string]string, 8*len(clusters))
	for _, c := range clusters {
		var hosts []string
		for i := range vms {
			if vms[i].Labels[tenancy.CAPIClusterNameLabel] == c.name {
				hosts = append(hosts, vms[i].Status.Host)
			}
		}
		data[c.name+tenancy.ParamUID] = c.uid
		data[c.name+tenancy.ParamAccount] = c.account
		data[c.name+tenancy.ParamStorageClasses] = allowList(c.annotations, namespaceAnnotations, tenancy.StorageClassesAnnotation)
		data[c.name+tenancy.ParamAttributesClasses] = allowList(c.annotations, namespaceAnnotations, tenancy.AttributesClassesAnnotation)
		data[c.name+tenancy.ParamSnapshotClasses] = allowList(c.annotations, namespaceAnnotations, tenancy.SnapshotClassesAnnotation)
		data[c.name+tenancy.ParamGroupSnapshotClasses] = allowList(c.annotations, namespaceAnnotations, tenancy.GroupSnapshotClassesAnnotation)
		data[c.name+tenancy.ParamHosts] = normalizeList(hosts)
		data[c.name+tenancy.ParamSharedClaims] = normalizeList(sharedWith(claims, c.name))
		data[c.name+tenancy.ParamSharedSnapshots] = normalizeList(sharedWith(snapshots, c.name))
		data[c.name+tenancy.ParamGroupSnapshots] = normalizeList(groupMembers(snapshots, groups, tenancy.Cluster{Namespace: ns, Name: c.name, UID: c.uid}))
	}
	return data
}

// allowList is the allow-list annotation key of the Cluster, else of its Namespace, normalized:
// present on the Cluster, even empty, it wins.
func allowList(cluster, namespace map[string]string, key string) string {
	list, ok := cluster[key]
	if !ok {
		list = namespace[key]
	}
	return normalizeList(strings.Split(list, ","))
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

// groupMembers returns the names of the snapshots that are members of c's group snapshots, among
// groups, the namespace's VolumeGroupSnapshots (tenancy.GroupMember).
func groupMembers(snapshots, groups []metav1.PartialObjectMetadata, c tenancy.Cluster) []string {
	var names []string
	for i := range snapshots {
		ref, ok := tenancy.GroupOf(&snapshots[i])
		if !ok {
			continue
		}
		j := slices.IndexFunc(groups, func(g metav1.PartialObjectMetadata) bool { return g.UID == ref.UID })
		if j >= 0 && tenancy.GroupMember(&snapshots[i], &groups[j], c) {
			names = append(names, snapshots[i].Name)
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
