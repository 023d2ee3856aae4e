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
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/tools/events"
	"k8s.io/klog/v2"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/pkg/tenancy"
)

// Kinds the cleanup reads by their metadata only.
var (
	pvcKind           = corev1.SchemeGroupVersion.WithKind("PersistentVolumeClaim")
	snapshotKind      = snapshotv1.SchemeGroupVersion.WithKind("VolumeSnapshot")
	groupSnapshotKind = groupsnapshotv1.SchemeGroupVersion.WithKind("VolumeGroupSnapshot")
	vmKind            = vmv1.GroupVersion.WithKind("VirtualMachine")
)

// Events of the cleanup controller, on the Cluster.
const (
	eventWaitingVMs     = "WaitingForVirtualMachines"
	eventDeleting       = "DeletingVolumes"
	eventReleased       = "ReleasedSharedVolumes"
	eventWaitingVolumes = "WaitingForVolumes"
	eventCleanedUp      = "CleanedUp"
	cleanupAction       = "Cleanup"
	// cleanupRetry is the safety net of a cleanup that waits: the deletions of the VMs and
	// volumes it waits for trigger it anyway.
	cleanupRetry = 30 * time.Second
)

// CleanupReconciler holds each opted-in Cluster with the finalizer pvbridge.io/cleanup and, when
// the Cluster is deleted, removes what it leaves in the management cluster.
type CleanupReconciler struct {
	Client client.Client
	// APIReader reads around the cache: what is deleted is decided on the apiserver's current
	// state, never on a cache that may lag behind.
	APIReader         client.Reader
	CapacityNamespace string
	Recorder          events.EventRecorder
}

// +kubebuilder:rbac:groups=cluster.x-k8s.io,resources=clusters,verbs=get;list;watch;patch
// +kubebuilder:rbac:groups=vm.pvbridge.io,resources=virtualmachines,verbs=get;list;watch
// +kubebuilder:rbac:groups="",resources=persistentvolumeclaims,verbs=get;list;watch;patch;delete
// +kubebuilder:rbac:groups=snapshot.storage.k8s.io,resources=volumesnapshots,verbs=get;list;watch;patch;delete
// +kubebuilder:rbac:groups=groupsnapshot.storage.k8s.io,resources=volumegroupsnapshots,verbs=get;list;watch;patch;delete

// SetupWithManager watches Clusters that opted in or still carry the finalizer, and the
// deletions of the VirtualMachines and volumes a deleted Cluster waits for.
func (r *CleanupReconciler) SetupWithManager(mgr ctrl.Manager) error {
	onlyDeletions := builder.WithPredicates(deletions)
	return ctrl.NewControllerManagedBy(mgr).
		Named("cleanup").
		For(&clusterv1.Cluster{}, builder.WithPredicates(predicate.NewPredicateFuncs(func(obj client.Object) bool {
			return optedIn(obj) || controllerutil.ContainsFinalizer(obj, CleanupFinalizer)
		}))).
		Watches(&vmv1.VirtualMachine{}, handler.EnqueueRequestsFromMapFunc(clusterByLabel(tenancy.CAPIClusterNameLabel)),
			builder.OnlyMetadata, onlyDeletions).
		Watches(&corev1.PersistentVolumeClaim{}, handler.EnqueueRequestsFromMapFunc(clusterByLabel(tenancy.ClusterNameLabel)),
			builder.OnlyMetadata, onlyDeletions).
		Watches(&snapshotv1.VolumeSnapshot{}, handler.EnqueueRequestsFromMapFunc(clusterByLabel(tenancy.ClusterNameLabel)),
			builder.OnlyMetadata, onlyDeletions).
		Watches(&groupsnapshotv1.VolumeGroupSnapshot{}, handler.EnqueueRequestsFromMapFunc(clusterByLabel(tenancy.ClusterNameLabel)),
			builder.OnlyMetadata, onlyDeletions).
		Complete(r)
}

// clusterByLabel maps an object to the Cluster of its namespace that label names.
func clusterByLabel(label string) handler.MapFunc {
	return func(_ context.Context, obj client.Object) []reconcile.Request {
		name := obj.GetLabels()[label]
		if name == "" {
			return nil
		}
		return []reconcile.Request{{NamespacedName: client.ObjectKey{Namespace: obj.GetNamespace(), Name: name}}}
	}
}

// Reconcile adds the finalizer to an opted-in Cluster, or cleans up after a deleted one.
func (r *CleanupReconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	cluster := &clusterv1.Cluster{}
	if err := r.Client.Get(ctx, req.NamespacedName, cluster); err != nil {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	if cluster.DeletionTimestamp.IsZero() {
		// A Cluster that opts out keeps the finalizer: the volumes it made while in still
		// need their cleanup.
		if !optedIn(cluster) || controllerutil.ContainsFinalizer(cluster, CleanupFinalizer) {
			return ctrl.Result{}, nil
		}
		return ctrl.Result{}, r.patchFinalizer(ctx, cluster, controllerutil.AddFinalizer)
	}
	if !controllerutil.ContainsFinalizer(cluster, CleanupFinalizer) {
		return ctrl.Result{}, nil
	}
	return r.reconcileDelete(ctx, cluster)
}

// reconcileDelete runs the cleanup in order, each phase waiting (by requeue, never blocking a
// worker) for the one before: the VMs gone, then the owned volumes deleted and the shared
// ones released, then the owned volumes gone; last the capacity access and the finalizer.
func (r *CleanupReconciler) reconcileDelete(ctx context.Context, cluster *clusterv1.Cluster) (ctrl.Result, error) {
	log := ctrl.LoggerFrom(ctx)
	vms, err := listMetadata(ctx, r.APIReader, vmKind, client.InNamespace(cluster.Namespace),
		client.MatchingLabels{tenancy.CAPIClusterNameLabel: cluster.Name})
	if err != nil {
		return ctrl.Result{}, err
	}
	if len(vms) > 0 {
		names := objectNames(vms)
		log.Info("Waiting for the cluster's VirtualMachines to be deleted before its volumes", "virtualMachines", names)
		r.Recorder.Eventf(cluster, nil, corev1.EventTypeNormal, eventWaitingVMs, cleanupAction,
			"%d VirtualMachines of the cluster remain (%s); its volumes are cleaned up once they are gone", len(vms), strings.Join(names, ", "))
		return ctrl.Result{RequeueAfter: cleanupRetry}, nil
	}

	remaining := 0
	for _, kind := range []schema.GroupVersionKind{pvcKind, snapshotKind, groupSnapshotKind} {
		n, err := r.cleanupKind(ctx, cluster, kind)
		if err != nil {
			return ctrl.Result{}, err
		}
		remaining += n
	}
	if remaining > 0 {
		log.Info("Waiting for the cluster's volumes to be deleted", "remaining", remaining)
		r.Recorder.Eventf(cluster, nil, corev1.EventTypeNormal, eventWaitingVolumes, cleanupAction,
			"%d PersistentVolumeClaims, VolumeSnapshots and VolumeGroupSnapshots of the cluster are being deleted", remaining)
		return ctrl.Result{RequeueAfter: cleanupRetry}, nil
	}

	name := capacityName(cluster)
	for _, obj := range []client.Object{
		&rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Namespace: r.CapacityNamespace, Name: name}},
		&rbacv1.Role{ObjectMeta: metav1.ObjectMeta{Namespace: r.CapacityNamespace, Name: name}},
	} {
		if err := r.Client.Delete(ctx, obj); err != nil && !apierrors.IsNotFound(err) {
			return ctrl.Result{}, fmt.Errorf("delete %T %s/%s: %w", obj, r.CapacityNamespace, name, err)
		}
	}
	if err := r.patchFinalizer(ctx, cluster, controllerutil.RemoveFinalizer); err != nil {
		return ctrl.Result{}, err
	}
	log.Info("Cleaned up after the deleted Cluster")
	r.Recorder.Eventf(cluster, nil, corev1.EventTypeNormal, eventCleanedUp, cleanupAction,
		"the cluster's volumes are deleted, the shared ones released; finalizer %s removed", CleanupFinalizer)
	return ctrl.Result{}, nil
}

// cleanupKind deletes the objects of kind (PVCs, VolumeSnapshots or VolumeGroupSnapshots) that
// cluster owns and releases those shared with it. It returns how many owned ones still exist.
// Objects of another cluster or namespace are never deleted; the members of a group snapshot go
// with it.
func (r *CleanupReconciler) cleanupKind(ctx context.Context, cluster *clusterv1.Cluster, kind schema.GroupVersionKind) (int, error) {
	log := ctrl.LoggerFrom(ctx)
	c := tenant(cluster)
	objs, err := listMetadata(ctx, r.APIReader, kind, client.InNamespace(cluster.Namespace))
	if err != nil {
		return 0, err
	}
	remaining := 0
	var deleted, released []string
	for i := range objs {
		obj := &objs[i]
		switch tenancy.AccessOf(obj, c) {
		case tenancy.Owned:
			remaining++
			if !obj.DeletionTimestamp.IsZero() {
				continue
			}
			// The PVC goes, its PV follows the StorageClass's reclaim policy (and a
			// VolumeSnapshot's content its class's deletion policy). The UID precondition
			// keeps a same-named newcomer safe.
			err := r.Client.Delete(ctx, obj, client.Preconditions{UID: &obj.UID}, client.PropagationPolicy(metav1.DeletePropagationBackground))
			if err != nil && !apierrors.IsNotFound(err) {
				return 0, fmt.Errorf("delete %s %s: %w", kind.Kind, klog.KObj(obj), err)
			}
			deleted = append(deleted, obj.Name)
		case tenancy.Shared:
			if err := r.release(ctx, obj, cluster.Name); err != nil {
				return 0, fmt.Errorf("release %s %s: %w", kind.Kind, klog.KObj(obj), err)
			}
			released = append(released, obj.Name)
		case tenancy.Foreign:
		}
	}
	if len(deleted) > 0 {
		log.Info("Deleted the cluster's volumes", "kind", kind.Kind, "names", deleted)
		r.Recorder.Eventf(cluster, nil, corev1.EventTypeNormal, eventDeleting, cleanupAction,
			"deleting %s %s", kind.Kind, strings.Join(deleted, ", "))
	}
	if len(released) > 0 {
		log.Info("Released the volumes shared with the cluster", "kind", kind.Kind, "names", released)
		r.Recorder.Eventf(cluster, nil, corev1.EventTypeNormal, eventReleased, cleanupAction,
			"removed the cluster from the %s annotation of %s %s", tenancy.SharedWithAnnotation, kind.Kind, strings.Join(released, ", "))
	}
	return remaining, nil
}

// release removes cluster from obj's SharedWithAnnotation, and the annotation when it is left
// empty; nothing else of obj changes. The patch carries obj's resourceVersion, so an edit
// made meanwhile is not lost but makes the reconcile run again.
func (r *CleanupReconciler) release(ctx context.Context, obj *metav1.PartialObjectMetadata, cluster string) error {
	base := obj.DeepCopy()
	var keep []string
	for name := range strings.SplitSeq(obj.Annotations[tenancy.SharedWithAnnotation], ",") {
		if name = strings.TrimSpace(name); name != "" && name != cluster {
			keep = append(keep, name)
		}
	}
	if len(keep) == 0 {
		delete(obj.Annotations, tenancy.SharedWithAnnotation)
	} else {
		obj.Annotations[tenancy.SharedWithAnnotation] = strings.Join(keep, ",")
	}
	return r.Client.Patch(ctx, obj, client.MergeFromWithOptions(base, client.MergeFromWithOptimisticLock{}), client.FieldOwner(fieldManager))
}

// patchFinalizer adds or removes the cleanup finalizer in a write of its own, with the
// Cluster's resourceVersion as a precondition.
func (r *CleanupReconciler) patchFinalizer(ctx context.Context, cluster *clusterv1.Cluster, change func(client.Object, string) bool) error {
	base := cluster.DeepCopy()
	change(cluster, CleanupFinalizer)
	err := r.Client.Patch(ctx, cluster, client.MergeFromWithOptions(base, client.MergeFromWithOptimisticLock{}), client.FieldOwner(fieldManager))
	if err != nil {
		return fmt.Errorf("patch the finalizers of Cluster %s: %w", klog.KObj(cluster), err)
	}
	return nil
}

// listMetadata lists the metadata of the objects of kind.
func listMetadata(ctx context.Context, c client.Reader, kind schema.GroupVersionKind, opts ...client.ListOption) ([]metav1.PartialObjectMetadata, error) {
	list := &metav1.PartialObjectMetadataList{}
	list.SetGroupVersionKind(kind.GroupVersion().WithKind(kind.Kind + "List"))
	if err := c.List(ctx, list, opts...); err != nil {
		return nil, fmt.Errorf("list %s: %w", kind.Kind, err)
	}
	for i := range list.Items {
		list.Items[i].SetGroupVersionKind(kind) // the list leaves its items' kind empty
	}
	return list.Items, nil
}

// objectNames are the sorted names of objs.
func objectNames(objs []metav1.PartialObjectMetadata) []string {
	names := make([]string, 0, len(objs))
	for i := range objs {
		names = append(names, objs[i].Name)
	}
	slices.Sort(names)
	return names
}
