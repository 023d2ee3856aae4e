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

// TestHostsOfOwner: the owner of an object is the cluster whose UID starts its name; its hosts
// are the parameters' list, possibly empty.
func TestHostsOfOwner(t *testing.T) {
	params := map[string]string{
		"a.uid": "uid-a", "a.hosts": "host-1, host-2,",
		"b.uid": "uid-b", "b.hosts": "",
		"z.uid": "",
	}
	for _, tc := range []struct {
		name, object string
		cluster      string
		hosts        []string
		ok           bool
	}{
		{name: "a's claim", object: "uid-a-pvc-1", cluster: "a", hosts: []string{"host-1", "host-2"}, ok: true},
		{name: "b's claim, b runs no VM", object: "uid-b-pvc-1", cluster: "b", ok: true},
		{name: "an admin's claim", object: "shared-data"},
		{name: "a prefix of a UID is not it", object: "uid-abc"},
		{name: "an empty UID owns nothing", object: "-pvc"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			cluster, hosts, ok := HostsOfOwner(params, tc.object)
			g.Expect(ok).To(Equal(tc.ok))
			g.Expect(cluster).To(Equal(tc.cluster))
			g.Expect(hosts).To(Equal(tc.hosts))
		})
	}
}
