package v1alpha1

import (
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// PmemSnapshotSpec is the snapshot the mgmt-csi controller wants. It is immutable: a snapshot
// is taken once.
// +kubebuilder:validation:XValidation:rule="self == oldSelf",message="spec is immutable"
type PmemSnapshotSpec struct {
	// node is the name of the Node that holds the source volume and the snapshot.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	Node string `json:"node"`

	// snapshotID is the CSI snapshot ID; like a PmemVolume's volumeID it is written on the
	// device and equals the object's name.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=63
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?$`
	SnapshotID string `json:"snapshotID"`

	// sourceVolumeID is the CSI volume ID (the PmemVolume name) of the volume to snapshot.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=63
	SourceVolumeID string `json:"sourceVolumeID"`

	// sourceReplica, for a replicated source volume, is the replica on node that the snapshot
	// is cut from (the PmemReplica's name, which is its device's on the node). Every replica
	// has each write the volume acknowledged, so one replica is a crash-consistent copy.
	// +optional
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=63
	SourceReplica string `json:"sourceReplica,omitempty"`

	// group, when set, makes the snapshot a member of a CSI group snapshot: the node agent
	// cuts all of the group's members at once, while the writers of their volumes are held,
	// so that they show one instant.
	// +optional
	Group *PmemSnapshotGroup `json:"group,omitempty"`
}

// PmemSnapshotGroup names the group snapshot a PmemSnapshot is a member of. Every member
// carries it, and the label GroupLabel with the group's ID.
type PmemSnapshotGroup struct {
	// id is the CSI group snapshot ID.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=63
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?$`
	ID string `json:"id"`

	// size is how many members the group has: the node agent cuts none of them before it
	// sees them all.
	// +required
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=1024
	Size int32 `json:"size"`
}

// PmemSnapshotStatus is what the node agent realized.
type PmemSnapshotStatus struct {
	// conditions describe the snapshot; Ready is True once its data is cut.
	// +optional
	// +listType=map
	// +listMapKey=type
	// +kubebuilder:validation:MaxItems=8
	Conditions []metav1.Condition `json:"conditions,omitempty"`

	// size is the size of the source volume when the snapshot was taken, the smallest volume it
	// can be restored to (CSI restore size).
	// +optional
	Size *resource.Quantity `json:"size,omitempty"`

	// creationTime is when the snapshot was cut (CSI creation_time).
	// +optional
	CreationTime *metav1.Time `json:"creationTime,omitempty"`
}

// PmemSnapshot is a point-in-time copy of a PmemVolume, kept in the PMEM of the same node.
// Snapshot data lives where only the node agent can reach it, so, as for volumes, the
// controller records the intent here and the agent realizes it; ListSnapshots reads these
// objects, and a volume restored from one lands on its node. Its name is the CSI snapshot ID.
//
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:resource:scope=Cluster,shortName=pms,categories=pvbridge
// +kubebuilder:validation:XValidation:rule="self.metadata.name == self.spec.snapshotID",message="metadata.name must equal spec.snapshotID"
// +kubebuilder:validation:XValidation:rule="has(self.spec.group) == has(oldSelf.spec.group) && (!has(self.spec.group) || self.spec.group == oldSelf.spec.group)",message="spec.group is immutable"
// +kubebuilder:selectablefield:JSONPath=`.spec.node`
// +kubebuilder:printcolumn:name="Node",type=string,JSONPath=`.spec.node`
// +kubebuilder:printcolumn:name="Source",type=string,JSONPath=`.spec.sourceVolumeID`
// +kubebuilder:printcolumn:name="Group",type=string,JSONPath=`.spec.group.id`,priority=1
// +kubebuilder:printcolumn:name="Size",type=string,JSONPath=`.status.size`
// +kubebuilder:printcolumn:name="Ready",type=string,JSONPath=`.status.conditions[?(@.type=="Ready")].status`
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
type PmemSnapshot struct {
	metav1.TypeMeta `json:",inline"`
	// metadata is the object's metadata.
	// +optional
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// spec is the snapshot the controller wants.
	// +required
	Spec PmemSnapshotSpec `json:"spec"`

	// status is what the node agent realized.
	// +optional
	Status PmemSnapshotStatus `json:"status,omitempty"`
}

// PmemSnapshotList is a list of PmemSnapshots.
//
// +kubebuilder:object:root=true
type PmemSnapshotList struct {
	metav1.TypeMeta `json:",inline"`
	// metadata is the list's metadata.
	// +optional
	metav1.ListMeta `json:"metadata,omitempty"`

	// items are the PmemSnapshots.
	// +required
	Items []PmemSnapshot `json:"items"`
}
