package operator

import (
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"

	vmv1alpha1 "pvbridge.io/pkg/apis/vm/v1alpha1"
)

// cacheOptions returns what the operator's cache holds. Both roles read every
// PersistentVolume a VirtualMachine names (and the controller every claim), which at 1 000
// volumes is most of the cache: it keeps only the fields they read. Nothing writes a claim or a
// volume from the cache (the operator may not), and a fresh read from the API server is whole.
// A host agent caches only the VirtualMachines placed on its host, an infrastructure provider
// with a namespace only that namespace's objects (and the cluster's Nodes). The controller's
// cache is set up without the API server: a per-type option (ByObject) would have the manager
// ask whether each type is namespaced.
func cacheOptions(o Options) cache.Options {
	opts := cache.Options{DefaultTransform: trim}
	switch {
	case o.Role == RoleHostAgent:
		opts.ByObject = map[client.Object]cache.ByObject{
			&vmv1alpha1.VirtualMachine{}: {Field: fields.OneTermEqualSelector("status.host", o.NodeName)},
		}
	case o.Role == RoleInfrastructureProvider && o.WatchNamespace != "":
		opts.DefaultNamespaces = map[string]cache.Config{o.WatchNamespace: {}}
	}
	return opts
}

// stripManagedFields is the transform of every other object: nothing here reads managedFields.
var stripManagedFields = cache.TransformStripManagedFields()

// trim is the cache's transform.
func trim(obj any) (any, error) {
	switch o := obj.(type) {
	case *corev1.PersistentVolumeClaim:
		return trimPersistentVolumeClaim(o), nil
	case *corev1.PersistentVolume:
		return trimPersistentVolume(o), nil
	}
	return stripManagedFields(obj)
}

// cachedMeta is the metadata the operator reads of a cached claim or volume.
func cachedMeta(m metav1.ObjectMeta) metav1.ObjectMeta {
	return metav1.ObjectMeta{
		Name: m.Name, Namespace: m.Namespace, UID: m.UID, ResourceVersion: m.ResourceVersion,
		DeletionTimestamp: m.DeletionTimestamp,
	}
}

// trimPersistentVolumeClaim keeps what the controller reads of a claim: whether it is being
// deleted, its phase and its volume.
func trimPersistentVolumeClaim(pvc *corev1.PersistentVolumeClaim) *corev1.PersistentVolumeClaim {
	return &corev1.PersistentVolumeClaim{
		TypeMeta:   pvc.TypeMeta,
		ObjectMeta: cachedMeta(pvc.ObjectMeta),
		Spec:       corev1.PersistentVolumeClaimSpec{VolumeName: pvc.Spec.VolumeName},
		Status:     corev1.PersistentVolumeClaimStatus{Phase: pvc.Status.Phase},
	}
}

// trimPersistentVolume keeps what the roles read of a volume: its claim, its CSI driver and
// handle, its volume mode, its node affinity (the host it lives on) and its
// VolumeAttributesClass (the I/O limits of its disk).
func trimPersistentVolume(pv *corev1.PersistentVolume) *corev1.PersistentVolume {
	out := &corev1.PersistentVolume{
		TypeMeta:   pv.TypeMeta,
		ObjectMeta: cachedMeta(pv.ObjectMeta),
		Spec: corev1.PersistentVolumeSpec{
			VolumeMode:                pv.Spec.VolumeMode,
			NodeAffinity:              pv.Spec.NodeAffinity,
			VolumeAttributesClassName: pv.Spec.VolumeAttributesClassName,
		},
	}
	if c := pv.Spec.ClaimRef; c != nil {
		out.Spec.ClaimRef = &corev1.ObjectReference{Namespace: c.Namespace, Name: c.Name, UID: c.UID}
	}
	if c := pv.Spec.CSI; c != nil {
		out.Spec.CSI = &corev1.CSIPersistentVolumeSource{Driver: c.Driver, VolumeHandle: c.VolumeHandle}
	}
	return out
}
