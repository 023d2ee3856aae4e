package v1alpha1

import (
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// PmemVolumeSpec is the volume the mgmt-csi controller wants: on a node, or replicated on
// several.
// +kubebuilder:validation:XValidation:rule="has(self.source) == has(oldSelf.source)",message="source is immutable"
// +kubebuilder:validation:XValidation:rule="has(self.node) == (!has(self.replicas) || self.replicas == 1)",message="a volume of one replica has a node; a replicated one has PmemReplicas instead"
type PmemVolumeSpec struct {
	// node is the name of the Node whose PMEM holds the volume; not set on a replicated
	// volume, whose PmemReplicas say where its copies are.
	// +optional
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:XValidation:rule="self == oldSelf",message="node is immutable"
	Node string `json:"node,omitempty"`

	// replicas is how many copies of the volume exist, each in the PMEM of another node: 1, the
	// volume on spec.node; 2 or 3, a PmemReplica each, every write acknowledged once every
	// healthy replica has it.
	// +optional
	// +kubebuilder:default=1
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=3
	// +kubebuilder:validation:XValidation:rule="self == oldSelf",message="replicas is immutable"
	Replicas int32 `json:"replicas,omitempty"`

	// volumeID is the CSI volume ID. The node agent writes it on the device (file name, LV tag,
	// namespace name), which is how it finds its volumes again after a restart; that is why it
	// is short and plain. It equals the object's name, so that a volume ID is looked up with a
	// Get.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=63
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?$`
	// +kubebuilder:validation:XValidation:rule="self == oldSelf",message="volumeID is immutable"
	VolumeID string `json:"volumeID"`

	// size is the requested size. It may grow (volume expansion) but never shrink. The node
	// agent rounds it up to the back end's alignment, see status.allocatedSize.
	// +required
	// +kubebuilder:validation:XValidation:rule="quantity(string(self)).isGreaterThan(quantity('0'))",message="size must be positive"
	// +kubebuilder:validation:XValidation:rule="quantity(string(self)).compareTo(quantity(string(oldSelf))) >= 0",message="size cannot shrink"
	Size resource.Quantity `json:"size"`

	// source, when set, fills the new volume from a snapshot or another volume on the same node.
	// +optional
	// +kubebuilder:validation:XValidation:rule="self == oldSelf",message="source is immutable"
	Source *PmemVolumeSource `json:"source,omitempty"`
}

// PmemVolumeSource is the data a volume starts with: exactly one of snapshotID or volumeID.
// +kubebuilder:validation:XValidation:rule="has(self.snapshotID) != has(self.volumeID)",message="exactly one of snapshotID and volumeID must be set"
// +kubebuilder:validation:XValidation:rule="!has(self.sourceReplica) || has(self.volumeID)",message="sourceReplica is the replica of the volume to clone"
type PmemVolumeSource struct {
	// snapshotID is the CSI snapshot ID (the PmemSnapshot name) to restore.
	// +optional
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=63
	SnapshotID string `json:"snapshotID,omitempty"`

	// volumeID is the CSI volume ID (the PmemVolume name) to clone.
	// +optional
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=63
	VolumeID string `json:"volumeID,omitempty"`

	// sourceReplica, for a replicated volume to clone, is the replica the clone is copied
	// from (the PmemReplica's name, which is its device's on its node): the clone, or its
	// first replica, is made on that replica's node. Every replica with the volume's data has
	// every write the volume acknowledged, so its copy is crash-consistent.
	// +optional
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=63
	SourceReplica string `json:"sourceReplica,omitempty"`
}

// PmemVolumeStatus is what the node agent realized.
type PmemVolumeStatus struct {
	// conditions describe the volume; Ready is True once the device exists with spec.size.
	// +optional
	// +listType=map
	// +listMapKey=type
	// +kubebuilder:validation:MaxItems=8
	Conditions []metav1.Condition `json:"conditions,omitempty"`

	// device is the path of the block device on the node, for example /dev/loop3 or
	// /dev/pmem0.1.
	// +optional
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=4096
	Device string `json:"device,omitempty"`

	// allocatedSize is the size of the device: spec.size rounded up to the alignment.
	// +optional
	AllocatedSize *resource.Quantity `json:"allocatedSize,omitempty"`

	// target is the node whose agent serves a replicated volume (its target): the one node
	// that writes to the replicas. Another node stages the volume only once this one has
	// unstaged it, or is lost.
	// +optional
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	Target string `json:"target,omitempty"`
}

// PmemVolume is a volume carved from the PMEM of one node, or replicated on several. The
// mgmt-csi controller creates it in CreateVolume and deletes it in DeleteVolume; the node agent
// of spec.node creates, grows and removes the device and reports it in status. Of a replicated
// volume, the node agents carve the PmemReplicas, and the controller reports in status what they
// realized together. Its name is the CSI volume ID. spec.node is a
// selectable field, so that a node agent lists and watches only its own volumes.
//
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:resource:scope=Cluster,shortName=pmv,categories=pvbridge
// +kubebuilder:validation:XValidation:rule="self.metadata.name == self.spec.volumeID",message="metadata.name must equal spec.volumeID"
// +kubebuilder:selectablefield:JSONPath=`.spec.node`
// +kubebuilder:printcolumn:name="Node",type=string,JSONPath=`.spec.node`
// +kubebuilder:printcolumn:name="Replicas",type=integer,JSONPath=`.spec.replicas`
// +kubebuilder:printcolumn:name="Size",type=string,JSONPath=`.spec.size`
// +kubebuilder:printcolumn:name="Device",type=string,JSONPath=`.status.device`
// +kubebuilder:printcolumn:name="Ready",type=string,JSONPath=`.status.conditions[?(@.type=="Ready")].status`
// +kubebuilder:printcolumn:name="Reason",type=string,JSONPath=`.status.conditions[?(@.type=="Ready")].reason`
// +kubebuilder:printcolumn:name="Allocated",type=string,JSONPath=`.status.allocatedSize`,priority=1
// +kubebuilder:printcolumn:name="Degraded",type=string,JSONPath=`.status.conditions[?(@.type=="Degraded")].status`,priority=1
// +kubebuilder:printcolumn:name="Target",type=string,JSONPath=`.status.target`,priority=1
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
type PmemVolume struct {
	metav1.TypeMeta `json:",inline"`
	// metadata is the object's metadata.
	// +optional
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// spec is the volume the controller wants.
	// +required
	Spec PmemVolumeSpec `json:"spec"`

	// status is what the node agent realized.
	// +optional
	Status PmemVolumeStatus `json:"status,omitempty"`
}

// PmemVolumeList is a list of PmemVolumes.
//
// +kubebuilder:object:root=true
type PmemVolumeList struct {
	metav1.TypeMeta `json:",inline"`
	// metadata is the list's metadata.
	// +optional
	metav1.ListMeta `json:"metadata,omitempty"`

	// items are the PmemVolumes.
	// +required
	Items []PmemVolume `json:"items"`
}
