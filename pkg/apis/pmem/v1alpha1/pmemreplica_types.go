package v1alpha1

import (
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// PmemReplicaSpec is one copy of a replicated volume, in the PMEM of one node.
type PmemReplicaSpec struct {
	// volumeID is the CSI volume ID (the PmemVolume name) of the volume this is a replica of.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=63
	// +kubebuilder:validation:XValidation:rule="self == oldSelf",message="volumeID is immutable"
	VolumeID string `json:"volumeID"`

	// node is the name of the Node whose PMEM holds the replica. No two replicas of a volume
	// are on one node.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:XValidation:rule="self == oldSelf",message="node is immutable"
	Node string `json:"node"`

	// size is the volume's size, which every replica has.
	// +required
	// +kubebuilder:validation:XValidation:rule="quantity(string(self)).isGreaterThan(quantity('0'))",message="size must be positive"
	// +kubebuilder:validation:XValidation:rule="quantity(string(self)).compareTo(quantity(string(oldSelf))) >= 0",message="size cannot shrink"
	Size resource.Quantity `json:"size"`

	// rebuild marks a replica made after its volume was first written (to replace a faulted
	// one): it holds none of the volume's data until the node that serves the volume has
	// copied it in (condition InSync), and until then no target reads from it. A replica made
	// with its volume is in sync from the start.
	// +optional
	// +kubebuilder:validation:XValidation:rule="self == oldSelf",message="rebuild is immutable"
	Rebuild bool `json:"rebuild,omitempty"`

	// source, when set, is the data the replica starts with, on node: the first replica of a
	// volume restored from a snapshot or cloned from a volume of one replica (the others are
	// rebuilt from it).
	// +optional
	// +kubebuilder:validation:XValidation:rule="self == oldSelf",message="source is immutable"
	Source *PmemVolumeSource `json:"source,omitempty"`
}

// PmemReplicaStatus is what the node agent of spec.node realized.
type PmemReplicaStatus struct {
	// conditions describe the replica; Ready is True once its device exists with spec.size
	// and the node's replica server exports it; InSync (a rebuilt replica's) once it has the
	// volume's data.
	// +optional
	// +listType=map
	// +listMapKey=type
	// +kubebuilder:validation:MaxItems=8
	Conditions []metav1.Condition `json:"conditions,omitempty"`

	// device is the path of the replica's block device on its node.
	// +optional
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=4096
	Device string `json:"device,omitempty"`

	// allocatedSize is the size of the device: spec.size rounded up to the alignment.
	// +optional
	AllocatedSize *resource.Quantity `json:"allocatedSize,omitempty"`

	// address is the host:port of the node's replica server, which exports the replica under
	// the object's name to the other nodes' agents.
	// +optional
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=261
	Address string `json:"address,omitempty"`
}

// PmemReplica is one copy of a replicated volume (a PmemVolume with spec.replicas above 1).
// The mgmt-csi controller creates one per replica, each on another node, and deletes them with
// the volume; the node agent of spec.node carves the replica from its PMEM and exports it to
// the other nodes, whose agents write to every replica of a volume attached there. Its name is
// derived from the volume ID, and it is the replica's name on the device and in the export.
// spec.node is a selectable field, so that a node agent lists and watches only its own
// replicas.
//
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:resource:scope=Cluster,shortName=pmr,categories=pvbridge
// +kubebuilder:selectablefield:JSONPath=`.spec.node`
// +kubebuilder:selectablefield:JSONPath=`.spec.volumeID`
// +kubebuilder:printcolumn:name="Volume",type=string,JSONPath=`.spec.volumeID`
// +kubebuilder:printcolumn:name="Node",type=string,JSONPath=`.spec.node`
// +kubebuilder:printcolumn:name="Size",type=string,JSONPath=`.spec.size`
// +kubebuilder:printcolumn:name="Ready",type=string,JSONPath=`.status.conditions[?(@.type=="Ready")].status`
// +kubebuilder:printcolumn:name="Reason",type=string,JSONPath=`.status.conditions[?(@.type=="Ready")].reason`
// +kubebuilder:printcolumn:name="Device",type=string,JSONPath=`.status.device`,priority=1
// +kubebuilder:printcolumn:name="Address",type=string,JSONPath=`.status.address`,priority=1
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
type PmemReplica struct {
	metav1.TypeMeta `json:",inline"`
	// metadata is the object's metadata.
	// +optional
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// spec is the replica the controller wants.
	// +required
	Spec PmemReplicaSpec `json:"spec"`

	// status is what the node agent realized.
	// +optional
	Status PmemReplicaStatus `json:"status,omitempty"`
}

// PmemReplicaList is a list of PmemReplicas.
//
// +kubebuilder:object:root=true
type PmemReplicaList struct {
	metav1.TypeMeta `json:",inline"`
	// metadata is the list's metadata.
	// +optional
	metav1.ListMeta `json:"metadata,omitempty"`

	// items are the PmemReplicas.
	// +required
	Items []PmemReplica `json:"items"`
}

// Faulted tells whether the replica is faulted (condition Ready, reason Faulted): it may have
// missed writes, and is never served again.
func (r *PmemReplica) Faulted() bool {
	c := meta.FindStatusCondition(r.Status.Conditions, ReadyCondition)
	return c != nil && c.Reason == FaultedReason
}

// Retired tells whether the replica is retired (condition Ready, reason Retired): its node is
// drained, a replica elsewhere took its place, and no target writes to it any more.
func (r *PmemReplica) Retired() bool {
	c := meta.FindStatusCondition(r.Status.Conditions, ReadyCondition)
	return c != nil && c.Reason == RetiredReason
}

// Live tells whether the replica has, or is being given, the volume's data and keeps getting
// its writes: not faulted, not retired, not being deleted.
func (r *PmemReplica) Live() bool {
	return !r.Faulted() && !r.Retired() && r.DeletionTimestamp.IsZero()
}

// HasData tells whether the replica was given the volume's data: made with its volume, or
// rebuilt (InSync). A faulted one may have missed writes since.
func (r *PmemReplica) HasData() bool {
	return !r.Spec.Rebuild || meta.IsStatusConditionTrue(r.Status.Conditions, InSyncCondition)
}
