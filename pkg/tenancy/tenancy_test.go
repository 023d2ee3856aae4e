package tenancy

import (
	"testing"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
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

// TestGroupMember: a member snapshot is the cluster's when a VolumeGroupSnapshot labelled with
// the cluster's UID owns it (by UID), both in the cluster's namespace; the group's name tells
// nothing.
func TestGroupMember(t *testing.T) {
	c := Cluster{Namespace: "tenant-a", Name: "alpha", UID: "uid-1"}
	ref := func(apiVersion, kind, uid string) metav1.OwnerReference {
		return metav1.OwnerReference{APIVersion: apiVersion, Kind: kind, Name: "nightly", UID: types.UID(uid)}
	}
	vgs := ref("groupsnapshot.storage.k8s.io/v1", "VolumeGroupSnapshot", "g")
	member := func(ns string, refs ...metav1.OwnerReference) *metav1.PartialObjectMetadata {
		return &metav1.PartialObjectMetadata{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "snapshot-0f", OwnerReferences: refs}}
	}
	group := func(ns, name, uid, clusterUID string) *metav1.PartialObjectMetadata {
		return &metav1.PartialObjectMetadata{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, UID: types.UID(uid),
			Labels: map[string]string{ClusterUIDLabel: clusterUID}}}
	}
	ownGroup := group("tenant-a", "nightly", "g", "uid-1")
	for _, tc := range []struct {
		name   string
		member *metav1.PartialObjectMetadata
		group  *metav1.PartialObjectMetadata
		want   bool
	}{
		{"a member of the cluster's group", member("tenant-a", vgs), ownGroup, true},
		{"of another version of the API", member("tenant-a", ref("groupsnapshot.storage.k8s.io/v1beta2", "VolumeGroupSnapshot", "g")), ownGroup, true},
		{"beside another owner", member("tenant-a", ref("v1", "ConfigMap", "x"), vgs), ownGroup, true},
		{"a member of another cluster's group", member("tenant-a", vgs), group("tenant-a", "nightly", "g", "uid-2"), false},
		{"a group named after the cluster, labelled for another", member("tenant-a", vgs), group("tenant-a", "uid-1-nightly", "g", "uid-2"), false},
		{"a group labelled for the cluster, named after another", member("tenant-a", vgs), group("tenant-a", "uid-2-nightly", "g", "uid-1"), true},
		{"owned by another group than the one given", member("tenant-a", ref("groupsnapshot.storage.k8s.io/v1", "VolumeGroupSnapshot", "h")), ownGroup, false},
		{"a member in another namespace", member("tenant-b", vgs), ownGroup, false},
		{"a group in another namespace", member("tenant-a", vgs), group("tenant-b", "nightly", "g", "uid-1"), false},
		{"owned by another kind", member("tenant-a", ref("v1", "ConfigMap", "g")), ownGroup, false},
		{"owned by a kind of that name in another group", member("tenant-a", ref("example.com/v1", "VolumeGroupSnapshot", "g")), ownGroup, false},
		{"no owner", member("tenant-a"), ownGroup, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			NewWithT(t).Expect(GroupMember(tc.member, tc.group, c)).To(Equal(tc.want))
		})
	}
	NewWithT(t).Expect(GroupMember(member("tenant-a", vgs), group("tenant-a", "nightly", "g", ""), Cluster{Namespace: "tenant-a"})).
		To(BeFalse(), "a cluster without a UID has no members")
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
