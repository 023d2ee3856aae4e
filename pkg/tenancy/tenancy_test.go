package tenancy

import (
	"testing"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func TestAccessOf(t *testing.T) {
	c := Cluster{Namespace: "tenant-a", Name: "alpha", UID: "uid-1"}
	pvc := func(ns string, labels, annotations map[string]string) *corev1.PersistentVolumeClaim {
		return &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "v", Labels: labels, Annotations: annotations}}
	}
	for _, tc := range []struct {
		name string
		obj  *corev1.PersistentVolumeClaim
		want Access
	}{
		{"created for the cluster", pvc("tenant-a", c.Labels(), nil), Owned},
		{"created for an earlier cluster of the same name", pvc("tenant-a", map[string]string{ClusterNameLabel: "alpha", ClusterUIDLabel: "uid-0"}, nil), Foreign},
		{"created for another cluster", pvc("tenant-a", map[string]string{ClusterUIDLabel: "uid-2"}, nil), Foreign},
		{"shared with the cluster", pvc("tenant-a", nil, map[string]string{SharedWithAnnotation: "alpha"}), Shared},
		{"shared with several clusters", pvc("tenant-a", nil, map[string]string{SharedWithAnnotation: "beta, alpha ,gamma"}), Shared},
		{"shared with others", pvc("tenant-a", nil, map[string]string{SharedWithAnnotation: "alphabet,beta"}), Foreign},
		{"shared with an empty list", pvc("tenant-a", nil, map[string]string{SharedWithAnnotation: ""}), Foreign},
		{"no marks", pvc("tenant-a", nil, nil), Foreign},
		{"labelled for the cluster in another namespace", pvc("tenant-b", c.Labels(), nil), Foreign},
		{"shared in another namespace", pvc("tenant-b", nil, map[string]string{SharedWithAnnotation: "alpha"}), Foreign},
		{"owned and shared", pvc("tenant-a", c.Labels(), map[string]string{SharedWithAnnotation: "alpha"}), Owned},
	} {
		t.Run(tc.name, func(t *testing.T) {
			NewWithT(t).Expect(AccessOf(tc.obj, c)).To(Equal(tc.want))
		})
	}
}

func TestAccessOfNeedsAnIdentity(t *testing.T) {
	g := NewWithT(t)
	anonymous := Cluster{Namespace: "tenant-a"}
	obj := &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{
		Namespace: "tenant-a", Labels: map[string]string{ClusterUIDLabel: ""}, Annotations: map[string]string{SharedWithAnnotation: ","},
	}}
	g.Expect(AccessOf(obj, anonymous)).To(Equal(Foreign))
}

func FuzzSharedWith(f *testing.F) {
	f.Add("alpha,beta", "alpha")
	f.Add(" , ,", "")
	f.Fuzz(func(t *testing.T, value, cluster string) {
		if SharedWith(value, cluster) && cluster == "" {
			t.Fatalf("an empty cluster name is shared by %q", value)
		}
	})
}
