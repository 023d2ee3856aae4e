package operator

import (
	"testing"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	toolscache "k8s.io/client-go/tools/cache"
	"k8s.io/utils/ptr"

	vmv1alpha1 "pvbridge.io/pkg/apis/vm/v1alpha1"
)

func TestCacheTrimsClaimsAndVolumes(t *testing.T) {
	now := metav1.Now()
	meta := metav1.ObjectMeta{
		Name: "data", Namespace: "tenant-a", UID: "uid-1", ResourceVersion: "42", DeletionTimestamp: &now,
		Labels: map[string]string{"app": "db"}, Annotations: map[string]string{"pv.kubernetes.io/bind-completed": "yes"},
		Finalizers: []string{"kubernetes.io/pvc-protection"},
	}
	kept := metav1.ObjectMeta{Name: "data", Namespace: "tenant-a", UID: "uid-1", ResourceVersion: "42", DeletionTimestamp: &now}
	affinity := &corev1.VolumeNodeAffinity{Required: &corev1.NodeSelector{NodeSelectorTerms: []corev1.NodeSelectorTerm{{
		MatchExpressions: []corev1.NodeSelectorRequirement{{Key: "topology.pmem.csi.pvbridge.io/node", Operator: corev1.NodeSelectorOpIn, Values: []string{"host-a"}}},
	}}}}
	tests := []struct {
		name     string
		in, want any
	}{{
		name: "claim",
		in: &corev1.PersistentVolumeClaim{
			ObjectMeta: meta,
			Spec: corev1.PersistentVolumeClaimSpec{
				VolumeName: "pv-1", StorageClassName: ptr.To("pmem"), AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
				Resources: corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")}},
			},
			Status: corev1.PersistentVolumeClaimStatus{Phase: corev1.ClaimBound, Capacity: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")}},
		},
		want: &corev1.PersistentVolumeClaim{
			ObjectMeta: kept,
			Spec:       corev1.PersistentVolumeClaimSpec{VolumeName: "pv-1"},
			Status:     corev1.PersistentVolumeClaimStatus{Phase: corev1.ClaimBound},
		},
	}, {
		name: "volume",
		in: &corev1.PersistentVolume{
			ObjectMeta: meta,
			Spec: corev1.PersistentVolumeSpec{
				Capacity:                  corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")},
				VolumeMode:                ptr.To(corev1.PersistentVolumeBlock),
				NodeAffinity:              affinity,
				VolumeAttributesClassName: ptr.To("gold"),
				ClaimRef:                  &corev1.ObjectReference{Kind: "PersistentVolumeClaim", Namespace: "tenant-a", Name: "data", UID: "uid-2", ResourceVersion: "7"},
				PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{
					Driver: "pmem.csi.pvbridge.io", VolumeHandle: "vol-1", VolumeAttributes: map[string]string{"storage.kubernetes.io/csiProvisionerIdentity": "x"},
				}},
			},
			Status: corev1.PersistentVolumeStatus{Phase: corev1.VolumeBound},
		},
		want: &corev1.PersistentVolume{
			ObjectMeta: kept,
			Spec: corev1.PersistentVolumeSpec{
				VolumeMode:                ptr.To(corev1.PersistentVolumeBlock),
				NodeAffinity:              affinity,
				VolumeAttributesClassName: ptr.To("gold"),
				ClaimRef:                  &corev1.ObjectReference{Namespace: "tenant-a", Name: "data", UID: "uid-2"},
				PersistentVolumeSource:    corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{Driver: "pmem.csi.pvbridge.io", VolumeHandle: "vol-1"}},
			},
		},
	}, {
		name: "a volume without claim or CSI source",
		in:   &corev1.PersistentVolume{ObjectMeta: meta},
		want: &corev1.PersistentVolume{ObjectMeta: kept},
	}, {
		name: "another object loses its managedFields",
		in: &storagev1.VolumeAttachment{ObjectMeta: metav1.ObjectMeta{
			Name: "va", Labels: map[string]string{"app": "db"}, ManagedFields: []metav1.ManagedFieldsEntry{{Manager: "vm-operator"}},
		}},
		want: &storagev1.VolumeAttachment{ObjectMeta: metav1.ObjectMeta{Name: "va", Labels: map[string]string{"app": "db"}}},
	}, {
		name: "a deletion whose final state is unknown passes unchanged",
		in:   toolscache.DeletedFinalStateUnknown{Key: "tenant-a/data"},
		want: toolscache.DeletedFinalStateUnknown{Key: "tenant-a/data"},
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			got, err := trim(tt.in)
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(got).To(Equal(tt.want))
		})
	}
}

func TestCacheOptionsPerRole(t *testing.T) {
	g := NewWithT(t)
	g.Expect(cacheOptions(Options{Role: RoleController}).ByObject).To(BeEmpty(), "the controller's cache is set up without the API server")
	g.Expect(cacheOptions(Options{Role: RoleInfrastructureProvider}).DefaultNamespaces).To(BeEmpty(), "every namespace")
	g.Expect(cacheOptions(Options{Role: RoleInfrastructureProvider, WatchNamespace: "tenant-a"}).DefaultNamespaces).To(HaveKey("tenant-a"))
	agent := cacheOptions(Options{Role: RoleHostAgent, NodeName: "host-a"}).ByObject
	g.Expect(agent).To(HaveLen(1))
	for obj, by := range agent {
		g.Expect(obj).To(BeAssignableToTypeOf(&vmv1alpha1.VirtualMachine{}))
		g.Expect(by.Field.String()).To(Equal("status.host=host-a"))
	}
}
