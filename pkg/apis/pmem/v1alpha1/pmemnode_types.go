package v1alpha1

import (
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// Mode is the back end a node agent uses to carve volumes from PMEM.
// +kubebuilder:validation:Enum=file;lvm;ndctl
type Mode string

const (
	// ModeFile keeps volumes in sparse files on a (DAX-mounted) filesystem, exposed as loop devices.
	ModeFile Mode = "file"
	// ModeLVM makes a volume group per PMEM region and a logical volume per volume.
	ModeLVM Mode = "lvm"
	// ModeNdctl makes one fsdax namespace per volume.
	ModeNdctl Mode = "ndctl"
)

// PmemNodeStatus is the PMEM capacity of a node as its agent sees it.
type PmemNodeStatus struct {
	// mode is the back end the node agent runs.
	// +optional
	Mode Mode `json:"mode,omitempty"`

	// total is the PMEM capacity the back end manages.
	// +optional
	Total *resource.Quantity `json:"total,omitempty"`

	// free is the PMEM not allocated to volumes or snapshots.
	// +optional
	Free *resource.Quantity `json:"free,omitempty"`

	// largestAllocatable is the largest volume that can be created now. It is at most free,
	// and less when free space is fragmented or split across regions; it becomes the
	// maximum_volume_size of GetCapacity.
	// +optional
	LargestAllocatable *resource.Quantity `json:"largestAllocatable,omitempty"`

	// alignment is the granularity of allocations; every volume is rounded up to it.
	// +optional
	Alignment *resource.Quantity `json:"alignment,omitempty"`

	// replicaAddress is the host:port of the node's replica server, when its agent serves the
	// replicas of replicated volumes: the controller places replicas only on such nodes.
	// +optional
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=261
	ReplicaAddress string `json:"replicaAddress,omitempty"`

	// conditions describe the node's back end; Ready is True when it serves.
	// +optional
	// +listType=map
	// +listMapKey=type
	// +kubebuilder:validation:MaxItems=8
	Conditions []metav1.Condition `json:"conditions,omitempty"`
}

// PmemNode reports the PMEM of one node. Its name is the Node name. The node agent owns it and
// writes only its status; it has no spec because everything about a node's PMEM is observed,
// and the back-end mode is the agent's configuration.
//
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:resource:scope=Cluster,shortName=pmn,categories=pvbridge
// +kubebuilder:printcolumn:name="Mode",type=string,JSONPath=`.status.mode`
// +kubebuilder:printcolumn:name="Total",type=string,JSONPath=`.status.total`
// +kubebuilder:printcolumn:name="Free",type=string,JSONPath=`.status.free`
// +kubebuilder:printcolumn:name="Largest",type=string,JSONPath=`.status.largestAllocatable`
// +kubebuilder:printcolumn:name="Ready",type=string,JSONPath=`.status.conditions[?(@.type=="Ready")].status`
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
type PmemNode struct {
	metav1.TypeMeta `json:",inline"`
	// metadata is the object's metadata.
	// +optional
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// status is the node's PMEM capacity.
	// +optional
	Status PmemNodeStatus `json:"status,omitempty"`
}

// PmemNodeList is a list of PmemNodes.
//
// +kubebuilder:object:root=true
type PmemNodeList struct {
	metav1.TypeMeta `json:",inline"`
	// metadata is the list's metadata.
	// +optional
	metav1.ListMeta `json:"metadata,omitempty"`

	// items are the PmemNodes.
	// +required
	Items []PmemNode `json:"items"`
}
