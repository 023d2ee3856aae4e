// Package v1alpha1 holds the pmem.pvbridge.io/v1alpha1 API, through which the mgmt-csi
// controller records the intent for persistent-memory volumes and snapshots, and each node
// agent reports what it realized and how much PMEM its host has left.
//
// Every kind here is cluster-scoped: the objects describe storage on a Node, which is itself
// cluster-scoped, and the CSI volume and snapshot IDs they are named after are unique in the
// whole cluster, not per namespace (TopoLVM's LogicalVolume and OpenEBS's LVMNode do the same).
//
// +kubebuilder:object:generate=true
// +groupName=pmem.pvbridge.io
package v1alpha1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

// GroupVersion is the group and version of this API.
var GroupVersion = schema.GroupVersion{Group: "pmem.pvbridge.io", Version: "v1alpha1"}

var (
	// SchemeBuilder registers this API's types; it uses apimachinery only, so that importing the
	// API does not pull in a client library.
	SchemeBuilder = runtime.NewSchemeBuilder(addKnownTypes)
	// AddToScheme adds this API's types to a scheme.
	AddToScheme = SchemeBuilder.AddToScheme
)

func addKnownTypes(s *runtime.Scheme) error {
	s.AddKnownTypes(GroupVersion,
		&PmemVolume{}, &PmemVolumeList{},
		&PmemReplica{}, &PmemReplicaList{},
		&PmemSnapshot{}, &PmemSnapshotList{},
		&PmemNode{}, &PmemNodeList{},
	)
	metav1.AddToGroupVersion(s, GroupVersion)
	return nil
}
