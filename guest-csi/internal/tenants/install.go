package tenants

import (
	"bytes"
	"context"
	_ "embed" // the guest install
	"errors"
	"fmt"
	"io"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/tools/events"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	"pvbridge.io/pkg/names"
	"pvbridge.io/pkg/tenancy"
)

// DefaultInstallResync is how often the guest install is applied again, putting back what was
// changed or deleted in the guest.
const DefaultInstallResync = 10 * time.Minute

// Events of the guest install, on the Cluster.
const (
	eventGuestInstalled     = "GuestInstalled"
	eventGuestInstallFailed = "GuestInstallFailed"
	eventGuestClassSkipped  = "GuestClassSkipped"
	eventGuestInstallOff    = "GuestInstallDisabled"
	installAction           = "InstallGuest"
)

// installYAML is the guest side of pvbridge as the tenants controller installs it: the guest
// overlay without the snapshot CRDs and snapshot-controller (guest/kustomization.yaml),
// rendered by hack/render-guest-install.sh.
//
//go:embed guest/install.yaml
var installYAML []byte

// guestInstall is installYAML parsed, once.
var guestInstall = sync.OnceValues(func() ([]*unstructured.Unstructured, error) {
	return parseInstall(installYAML)
})

// parseInstall decodes a multi-document YAML install and checks that it has what the
// controller fills in per cluster: the ConfigMap pvbridge-cluster with both keys and the
// guest driver's StorageClasses with a mgmtStorageClass parameter.
func parseInstall(data []byte) ([]*unstructured.Unstructured, error) {
	dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(data), 4096)
	var objs []*unstructured.Unstructured
	identity, classes := false, 0
	for {
		u := &unstructured.Unstructured{}
		if err := dec.Decode(&u.Object); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			return nil, fmt.Errorf("guest install: %w", err)
		}
		if len(u.Object) == 0 {
			continue
		}
		if u.GetKind() == "" || u.GetName() == "" {
			return nil, fmt.Errorf("guest install: an object without kind or name: %v", u.Object)
		}
		switch {
		case isClusterConfigMap(u):
			data, _, err := unstructured.NestedStringMap(u.Object, "data")
			if err != nil {
				return nil, fmt.Errorf("guest install: ConfigMap %s: %w", tenancy.GuestIdentityConfigMap, err)
			}
			if _, ok := data[tenancy.GuestIdentityNameKey]; !ok {
				return nil, fmt.Errorf("guest install: ConfigMap %s has no %q", tenancy.GuestIdentityConfigMap, tenancy.GuestIdentityNameKey)
			}
			if _, ok := data[tenancy.GuestIdentityUIDKey]; !ok {
				return nil, fmt.Errorf("guest install: ConfigMap %s has no %q", tenancy.GuestIdentityConfigMap, tenancy.GuestIdentityUIDKey)
			}
			identity = true
		case isGuestStorageClass(u):
			if _, ok, _ := unstructured.NestedString(u.Object, "parameters", names.MgmtStorageClassParam); !ok {
				return nil, fmt.Errorf("guest install: StorageClass %s has no %s parameter", u.GetName(), names.MgmtStorageClassParam)
			}
			classes++
		}
		objs = append(objs, u)
	}
	if !identity {
		return nil, fmt.Errorf("guest install: no ConfigMap %s with the cluster's identity", tenancy.GuestIdentityConfigMap)
	}
	if classes == 0 {
		return nil, fmt.Errorf("guest install: no StorageClass of %s", names.GuestDriver)
	}
	return objs, nil
}

func isClusterConfigMap(u *unstructured.Unstructured) bool {
	return u.GetAPIVersion() == "v1" && u.GetKind() == "ConfigMap" && u.GetName() == tenancy.GuestIdentityConfigMap
}

func isGuestStorageClass(u *unstructured.Unstructured) bool {
	provisioner, _, _ := unstructured.NestedString(u.Object, "provisioner")
	return u.GroupVersionKind().GroupKind() == storageClassKind && provisioner == names.GuestDriver
}

var (
	storageClassKind             = schema.GroupKind{Group: "storage.k8s.io", Kind: "StorageClass"}
	volumeSnapshotClassKind      = schema.GroupKind{Group: "snapshot.storage.k8s.io", Kind: "VolumeSnapshotClass"}
	volumeGroupSnapshotClassKind = schema.GroupKind{Group: "groupsnapshot.storage.k8s.io", Kind: "VolumeGroupSnapshotClass"}
)

// renderInstall is the install for cluster: the ConfigMap pvbridge-cluster with its name and
// UID, the pod templates that read it annotated with them (so that a changed identity restarts
// the pods), the StorageClasses' mgmtStorageClass set to mgmtClass (and replicated "true" when
// that class keeps replicas on several hosts) — or, when mgmtClass is empty, the StorageClasses
// left out and named in skipped —, every image moved to registry when it is set, and every
// object labelled as managed by this controller. base is not changed.
func renderInstall(base []*unstructured.Unstructured, cluster *clusterv1.Cluster, mgmtClass string, replicated bool, registry string) (objs []*unstructured.Unstructured, skipped []string, err error) {
	for _, b := range base {
		u := b.DeepCopy()
		labels := u.GetLabels()
		if labels == nil {
			labels = map[string]string{}
		}
		labels[ManagedByLabel] = fieldManager
		u.SetLabels(labels)
		switch {
		case isClusterConfigMap(u):
			err = errors.Join(
				unstructured.SetNestedField(u.Object, cluster.Name, "data", tenancy.GuestIdentityNameKey),
				unstructured.SetNestedField(u.Object, string(cluster.UID), "data", tenancy.GuestIdentityUIDKey))
		case isGuestStorageClass(u):
			if mgmtClass == "" {
				skipped = append(skipped, "StorageClass "+u.GetName())
				continue
			}
			err = unstructured.SetNestedField(u.Object, mgmtClass, "parameters", names.MgmtStorageClassParam)
			if err == nil && replicated {
				err = unstructured.SetNestedField(u.Object, "true", "parameters", names.ReplicatedParam)
			}
		case readsClusterConfigMap(u):
			annotations, _, _ := unstructured.NestedStringMap(u.Object, "spec", "template", "metadata", "annotations")
			if annotations == nil {
				annotations = map[string]string{}
			}
			annotations[tenancy.ClusterNameLabel] = cluster.Name
			annotations[tenancy.ClusterUIDLabel] = string(cluster.UID)
			err = unstructured.SetNestedStringMap(u.Object, annotations, "spec", "template", "metadata", "annotations")
		}
		if err == nil && registry != "" {
			err = mirrorImages(u, registry)
		}
		if err != nil {
			return nil, nil, fmt.Errorf("fill in %s %s: %w", u.GetKind(), u.GetName(), err)
		}
		objs = append(objs, u)
	}
	return objs, skipped, nil
}

// mirrorImages moves the images of a workload's containers and init containers to registry.
func mirrorImages(u *unstructured.Unstructured, registry string) error {
	for _, field := range []string{"containers", "initContainers"} {
		path := []string{"spec", "template", "spec", field}
		containers, found, err := unstructured.NestedSlice(u.Object, path...)
		if err != nil || !found {
			return err
		}
		for _, c := range containers {
			if container, ok := c.(map[string]any); ok {
				if image, ok := container["image"].(string); ok {
					container["image"] = mirrorImage(image, registry)
				}
			}
		}
		if err := unstructured.SetNestedSlice(u.Object, containers, path...); err != nil {
			return err
		}
	}
	return nil
}

// mirrorImage is image from registry: its registry (the first component of its name when that
// has a dot or a colon or is localhost, as container runtimes read names; else Docker Hub's)
// replaced. ghcr.io/pvbridge/guest-csi:v0.1.0 becomes <registry>/pvbridge/guest-csi:v0.1.0;
// busybox:1.36 (Docker Hub) <registry>/library/busybox:1.36.
func mirrorImage(image, registry string) string {
	first, rest, found := strings.Cut(image, "/")
	switch {
	case found && (strings.ContainsAny(first, ".:") || first == "localhost"):
		return registry + "/" + rest
	case found:
		return registry + "/" + image
	default:
		return registry + "/library/" + image
	}
}

// readsClusterConfigMap is true for a workload whose containers take an environment variable
// from the ConfigMap pvbridge-cluster.
func readsClusterConfigMap(u *unstructured.Unstructured) bool {
	containers, _, _ := unstructured.NestedSlice(u.Object, "spec", "template", "spec", "containers")
	for _, c := range containers {
		container, _ := c.(map[string]any)
		env, _, _ := unstructured.NestedSlice(container, "env")
		for _, e := range env {
			variable, _ := e.(map[string]any)
			if name, _, _ := unstructured.NestedString(variable, "valueFrom", "configMapKeyRef", "name"); name == tenancy.GuestIdentityConfigMap {
				return true
			}
		}
	}
	return false
}

// allowedClasses is the cluster's allow-list of management StorageClasses in its written order:
// the Cluster's tenancy.StorageClassesAnnotation, else the Namespace's (the same source as the tenancy
// parameters).
func allowedClasses(cluster *clusterv1.Cluster, namespace *corev1.Namespace) []string {
	list, ok := cluster.Annotations[tenancy.StorageClassesAnnotation]
	if !ok {
		list = namespace.Annotations[tenancy.StorageClassesAnnotation]
	}
	var classes []string
	for item := range strings.SplitSeq(list, ",") {
		if item = strings.TrimSpace(item); item != "" {
			classes = append(classes, item)
		}
	}
	return classes
}

// InstallReconciler installs the guest side of pvbridge (guest/install.yaml: guest-csi's
// CSIDriver, RBAC, controller and node plugin, its StorageClasses and VolumeSnapshotClass) into
// the guest cluster of each opted-in Cluster by server-side apply, and applies it again every
// Resync. It never deletes anything from a guest.
type InstallReconciler struct {
	Client   client.Client
	Guests   *GuestClients
	Recorder events.EventRecorder
	// Resync is how often the install is applied again; zero: DefaultInstallResync.
	Resync time.Duration
	// Registry, when set, replaces the registry of every image of the install (mirrorImage).
	Registry string

	mu sync.Mutex
	// applied remembers per Cluster what the last apply left in its guest, so that Events
	// tell changes, not every resync.
	applied map[types.NamespacedName]installState
}

// installState is the outcome of a Cluster's last apply.
type installState struct {
	versions map[string]string // by objectName: generation, or resourceVersion without one
	skipped  string            // what was skipped and why
}

// +kubebuilder:rbac:groups="",resources=namespaces,verbs=get;list;watch
// +kubebuilder:rbac:groups=storage.k8s.io,resources=storageclasses,verbs=get;list;watch

// SetupWithManager watches opted-in Clusters, Cluster API's kubeconfig Secrets and the
// Namespaces' allow-lists.
func (r *InstallReconciler) SetupWithManager(mgr ctrl.Manager) error {
	if _, err := guestInstall(); err != nil {
		return err
	}
	if r.Resync <= 0 {
		r.Resync = DefaultInstallResync
	}
	r.applied = map[types.NamespacedName]installState{}
	return ctrl.NewControllerManagedBy(mgr).
		Named("guest-install").
		For(&clusterv1.Cluster{}, optedInClusters, builder.WithPredicates(predicate.Or(
			predicate.GenerationChangedPredicate{}, predicate.LabelChangedPredicate{}, predicate.AnnotationChangedPredicate{}))).
		Watches(&corev1.Secret{}, handler.EnqueueRequestsFromMapFunc(clusterOfKubeconfig)).
		Watches(&corev1.Namespace{}, handler.EnqueueRequestsFromMapFunc(r.clustersOfNamespace),
			builder.WithPredicates(predicate.AnnotationChangedPredicate{})).
		WithOptions(controller.Options{MaxConcurrentReconciles: guestWorkers}).
		Complete(r)
}

// clustersOfNamespace maps a Namespace to its opted-in Clusters, whose allow-list may come from it.
func (r *InstallReconciler) clustersOfNamespace(ctx context.Context, obj client.Object) []reconcile.Request {
	var clusters clusterv1.ClusterList
	if err := r.Client.List(ctx, &clusters, client.InNamespace(obj.GetName()), client.MatchingLabels{tenancy.EnabledLabel: "true"}); err != nil {
		ctrl.LoggerFrom(ctx).Error(err, "List the Clusters of a Namespace", "namespace", obj.GetName())
		return nil
	}
	reqs := make([]reconcile.Request, 0, len(clusters.Items))
	for _, c := range clusters.Items {
		reqs = append(reqs, reconcile.Request{NamespacedName: client.ObjectKeyFromObject(&c)})
	}
	return reqs
}

// Reconcile applies the install to the Cluster's guest, unless the Cluster opts out.
func (r *InstallReconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	log := ctrl.LoggerFrom(ctx)
	cluster := &clusterv1.Cluster{}
	if err := r.Client.Get(ctx, req.NamespacedName, cluster); err != nil {
		if apierrors.IsNotFound(err) {
			r.forget(req.NamespacedName)
			return ctrl.Result{}, nil
		}
		return ctrl.Result{}, err
	}
	// A deleted Cluster's guest goes with it: nothing is removed from it, nothing applied.
	if !optedIn(cluster) || !cluster.DeletionTimestamp.IsZero() {
		return ctrl.Result{}, nil
	}
	if cluster.Annotations[tenancy.GuestInstallAnnotation] == "false" {
		log.V(2).Info("The guest install is off for this Cluster", "annotation", tenancy.GuestInstallAnnotation)
		if r.forget(req.NamespacedName) {
			r.Recorder.Eventf(cluster, nil, corev1.EventTypeNormal, eventGuestInstallOff, installAction,
				"%s=false: the guest cluster is left as it is; nothing is applied to it or removed from it", tenancy.GuestInstallAnnotation)
		}
		return ctrl.Result{}, nil
	}
	namespace := &corev1.Namespace{}
	if err := r.Client.Get(ctx, client.ObjectKey{Name: cluster.Namespace}, namespace); err != nil {
		return ctrl.Result{}, fmt.Errorf("read Namespace %s: %w", cluster.Namespace, err)
	}
	guest, err := r.Guests.For(ctx, r.Client, cluster)
	if errors.Is(err, errNoKubeconfig) {
		// The credentials controller tells it (WaitingForKubeconfig); the Secret's creation
		// triggers the next reconcile.
		log.V(2).Info("Waiting for Cluster API's kubeconfig Secret", "secret", kubeconfigSecretName(cluster.Name))
		return ctrl.Result{}, nil
	}
	if err != nil {
		r.Recorder.Eventf(cluster, nil, corev1.EventTypeWarning, eventGuestInstallFailed, installAction, "connect to the guest cluster: %v", err)
		return ctrl.Result{}, err
	}

	base, err := guestInstall()
	if err != nil {
		return ctrl.Result{}, err
	}
	var mgmtClass, skipReason string
	replicated := false
	if classes := allowedClasses(cluster, namespace); len(classes) > 0 {
		mgmtClass = classes[0]
		if replicated, err = r.replicated(ctx, mgmtClass); err != nil {
			return ctrl.Result{}, err
		}
	} else {
		skipReason = fmt.Sprintf("the cluster may use no management StorageClass (annotation %s of the Cluster, else of its Namespace, names none)",
			tenancy.StorageClassesAnnotation)
	}
	objs, skipped, err := renderInstall(base, cluster, mgmtClass, replicated, r.Registry)
	if err != nil {
		return ctrl.Result{}, err
	}
	var skips []string
	if len(skipped) > 0 {
		skips = append(skips, strings.Join(skipped, ", ")+": "+skipReason)
	}

	versions := make(map[string]string, len(objs))
	for _, obj := range objs {
		name := objectName(obj)
		err := r.apply(ctx, guest, obj)
		if gk := obj.GroupVersionKind().GroupKind(); (gk == volumeSnapshotClassKind || gk == volumeGroupSnapshotClassKind) && meta.IsNoMatchError(err) {
			skips = append(skips, name+": the guest cluster does not serve "+gk.Kind+"es (install the CSI snapshot CRDs and snapshot-controller there)")
			continue
		}
		if err != nil && ctx.Err() != nil {
			return ctrl.Result{}, ctx.Err() // stopping
		}
		if err != nil {
			log.Error(err, "Cannot install the guest side of pvbridge", "object", name)
			r.Recorder.Eventf(cluster, nil, corev1.EventTypeWarning, eventGuestInstallFailed, installAction, "apply %s: %v", name, err)
			return ctrl.Result{RequeueAfter: unreachableGuestRetry}, nil
		}
		versions[name] = version(obj)
	}
	r.report(ctx, cluster, mgmtClass, versions, strings.Join(skips, "; "))
	return ctrl.Result{RequeueAfter: r.Resync}, nil
}

// replicated reports whether management StorageClass name keeps replicas of its volumes on
// several hosts (mgmt-csi's parameter replicas above 1). A class that does not exist (yet) does
// not; the next resync looks again.
func (r *InstallReconciler) replicated(ctx context.Context, name string) (bool, error) {
	class := &storagev1.StorageClass{}
	if err := r.Client.Get(ctx, client.ObjectKey{Name: name}, class); err != nil {
		return false, client.IgnoreNotFound(err)
	}
	n, err := strconv.Atoi(class.Parameters[names.ReplicasParam])
	return err == nil && n > 1, nil
}

// apply applies obj to the guest by server-side apply, forcing ownership. A StorageClass whose
// parameters differ from the install's (they cannot be changed) is deleted and applied anew;
// the PersistentVolumes provisioned with it are not affected.
func (r *InstallReconciler) apply(ctx context.Context, guest client.Client, obj *unstructured.Unstructured) error {
	applied := obj.DeepCopy()
	err := guest.Apply(ctx, client.ApplyConfigurationFromUnstructured(applied), client.FieldOwner(fieldManager), client.ForceOwnership)
	if err != nil && apierrors.IsInvalid(err) && obj.GroupVersionKind().GroupKind() == storageClassKind {
		ctrl.LoggerFrom(ctx).Info("Replacing a guest StorageClass whose immutable fields differ from the install", "storageClass", obj.GetName(), "reason", err.Error())
		old := &unstructured.Unstructured{}
		old.SetGroupVersionKind(obj.GroupVersionKind())
		if err := guest.Get(ctx, client.ObjectKeyFromObject(obj), old); err != nil {
			return err
		}
		uid := old.GetUID()
		if err := guest.Delete(ctx, old, client.Preconditions{UID: &uid}); err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("delete the StorageClass to replace it: %w", err)
		}
		applied = obj.DeepCopy()
		err = guest.Apply(ctx, client.ApplyConfigurationFromUnstructured(applied), client.FieldOwner(fieldManager), client.ForceOwnership)
	}
	if err != nil {
		return err
	}
	obj.Object = applied.Object // as stored
	return nil
}

// report tells by an Event what changed in the guest since the last apply (everything after
// the controller started) and what was skipped, when that differs from the last time.
func (r *InstallReconciler) report(ctx context.Context, cluster *clusterv1.Cluster, mgmtClass string, versions map[string]string, skipped string) {
	key := client.ObjectKeyFromObject(cluster)
	r.mu.Lock()
	last, known := r.applied[key]
	r.applied[key] = installState{versions: versions, skipped: skipped}
	r.mu.Unlock()

	var changed []string
	for name, v := range versions {
		if last.versions[name] != v {
			changed = append(changed, name)
		}
	}
	slices.Sort(changed)
	log := ctrl.LoggerFrom(ctx)
	switch {
	case !known:
		log.Info("Applied the guest install", "objects", slices.Sorted(maps.Keys(versions)), "mgmtStorageClass", mgmtClass, "skipped", skipped)
		r.Recorder.Eventf(cluster, nil, corev1.EventTypeNormal, eventGuestInstalled, installAction,
			"applied the %d objects of the guest install to the guest cluster (mgmtStorageClass %q)", len(versions), mgmtClass)
	case len(changed) > 0:
		log.Info("Applied the guest install; objects changed", "changed", changed, "mgmtStorageClass", mgmtClass)
		r.Recorder.Eventf(cluster, nil, corev1.EventTypeNormal, eventGuestInstalled, installAction,
			"applied the %d objects of the guest install to the guest cluster (mgmtStorageClass %q); changed or put back: %s",
			len(versions), mgmtClass, firstNames(changed, 8))
	default:
		log.V(2).Info("Applied the guest install; nothing changed", "objects", len(versions))
	}
	if skipped != "" && (!known || skipped != last.skipped) {
		r.Recorder.Eventf(cluster, nil, corev1.EventTypeWarning, eventGuestClassSkipped, installAction, "not installed: %s", skipped)
	}
}

// forget drops what is known of a Cluster's install and tells whether there was anything.
func (r *InstallReconciler) forget(key types.NamespacedName) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	_, known := r.applied[key]
	delete(r.applied, key)
	return known
}

// objectName is "Kind namespace/name" or "Kind name".
func objectName(u *unstructured.Unstructured) string {
	if u.GetNamespace() == "" {
		return u.GetKind() + " " + u.GetName()
	}
	return u.GetKind() + " " + u.GetNamespace() + "/" + u.GetName()
}

// version tells a change of an applied object: its generation, which moves with its spec only
// (a Deployment's status does not count), or its resourceVersion for kinds without one.
func version(u *unstructured.Unstructured) string {
	if g := u.GetGeneration(); g > 0 {
		return fmt.Sprint(g)
	}
	return u.GetResourceVersion()
}

// firstNames joins up to n names and says how many more there are.
func firstNames(names []string, n int) string {
	if len(names) <= n {
		return strings.Join(names, ", ")
	}
	return fmt.Sprintf("%s and %d more", strings.Join(names[:n], ", "), len(names)-n)
}
