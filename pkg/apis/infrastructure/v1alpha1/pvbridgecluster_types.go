package v1alpha1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// PVBridgeClusterSpec is the desired state of a PVBridgeCluster.
type PVBridgeClusterSpec struct {
	// controlPlaneEndpoint is where the guest cluster's API server is reached, given by the
	// user (pvbridge runs no load balancer): Cluster API copies it to the Cluster.
	// +optional
	ControlPlaneEndpoint APIEndpoint `json:"controlPlaneEndpoint,omitempty,omitzero"`

	// failureDomains are the management hosts (Node names) the guest cluster's machines may be
	// placed on. When empty, every management Node labelled vm.pvbridge.io/host=true is one.
	// +optional
	// +listType=map
	// +listMapKey=name
	// +kubebuilder:validation:MaxItems=100
	FailureDomains []FailureDomain `json:"failureDomains,omitempty"`
}

// PVBridgeClusterInitializationStatus is the initialization of a PVBridgeCluster (contract).
// +kubebuilder:validation:MinProperties=1
type PVBridgeClusterInitializationStatus struct {
	// provisioned is true once the cluster's infrastructure is provisioned: its control plane
	// endpoint is known. Part of the Cluster API contract; never reset.
	// +optional
	Provisioned *bool `json:"provisioned,omitempty"`
}

// PVBridgeClusterStatus is the observed state of a PVBridgeCluster.
type PVBridgeClusterStatus struct {
	// initialization reports the provisioning of the cluster's infrastructure (contract).
	// +optional
	Initialization PVBridgeClusterInitializationStatus `json:"initialization,omitempty,omitzero"`

	// failureDomains are the hosts Cluster API spreads the cluster's Machines over: those of
	// spec.failureDomains, or else the management hosts.
	// +optional
	// +listType=map
	// +listMapKey=name
	// +kubebuilder:validation:MaxItems=100
	FailureDomains []FailureDomain `json:"failureDomains,omitempty"`

	// conditions are Ready and Paused.
	// +optional
	// +listType=map
	// +listMapKey=type
	// +kubebuilder:validation:MaxItems=32
	Conditions []metav1.Condition `json:"conditions,omitempty"`
}

// PVBridgeCluster is the infrastructure of a Cluster API guest cluster whose nodes are pvbridge
// VirtualMachines: its control plane endpoint and its failure domains (management hosts).
//
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:resource:path=pvbridgeclusters,shortName=pvbc,categories=cluster-api;pvbridge
// +kubebuilder:storageversion
// +kubebuilder:printcolumn:name="Cluster",type=string,JSONPath=`.metadata.labels['cluster\.x-k8s\.io/cluster-name']`
// +kubebuilder:printcolumn:name="Endpoint",type=string,JSONPath=`.spec.controlPlaneEndpoint.host`
// +kubebuilder:printcolumn:name="Provisioned",type=boolean,JSONPath=`.status.initialization.provisioned`
// +kubebuilder:printcolumn:name="Ready",type=string,JSONPath=`.status.conditions[?(@.type=="Ready")].status`
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
type PVBridgeCluster struct {
	metav1.TypeMeta `json:",inline"`
	// metadata is the object's metadata.
	// +optional
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// spec is the desired state of the PVBridgeCluster.
	// +optional
	Spec PVBridgeClusterSpec `json:"spec,omitempty,omitzero"`

	// status is the observed state of the PVBridgeCluster.
	// +optional
	Status PVBridgeClusterStatus `json:"status,omitempty,omitzero"`
}

// PVBridgeClusterList is a list of PVBridgeClusters.
//
// +kubebuilder:object:root=true
type PVBridgeClusterList struct {
	metav1.TypeMeta `json:",inline"`
	// metadata is the list's metadata.
	// +optional
	metav1.ListMeta `json:"metadata,omitempty"`

	// items are the PVBridgeClusters.
	// +required
	Items []PVBridgeCluster `json:"items"`
}

// PVBridgeClusterTemplateResource is what a PVBridgeCluster is made from.
type PVBridgeClusterTemplateResource struct {
	// metadata is given to each PVBridgeCluster made from the template.
	// +optional
	ObjectMeta ObjectMeta `json:"metadata,omitempty,omitzero"`

	// spec is the spec of each PVBridgeCluster made from the template; a ClusterClass's
	// patches set the control plane endpoint of each cluster.
	// +required
	Spec PVBridgeClusterSpec `json:"spec"`
}

// PVBridgeClusterTemplateSpec is the spec of a PVBridgeClusterTemplate.
type PVBridgeClusterTemplateSpec struct {
	// template is what the PVBridgeClusters are made from.
	// +required
	Template PVBridgeClusterTemplateResource `json:"template"`
}

// PVBridgeClusterTemplate is the template a ClusterClass makes its clusters' PVBridgeClusters
// from (Cluster API's InfraClusterTemplate contract). Its spec is immutable, as every template
// a ClusterClass names: a change is a new template the class is pointed at.
//
// +kubebuilder:object:root=true
// +kubebuilder:resource:path=pvbridgeclustertemplates,shortName=pvbct,categories=cluster-api;pvbridge
// +kubebuilder:storageversion
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
type PVBridgeClusterTemplate struct {
	metav1.TypeMeta `json:",inline"`
	// metadata is the object's metadata.
	// +optional
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// spec is the template.
	// +required
	// +kubebuilder:validation:XValidation:rule="self == oldSelf",message="the spec of a template is immutable: create a new template and point the ClusterClass at it"
	Spec PVBridgeClusterTemplateSpec `json:"spec"`
}

// PVBridgeClusterTemplateList is a list of PVBridgeClusterTemplates.
//
// +kubebuilder:object:root=true
type PVBridgeClusterTemplateList struct {
	metav1.TypeMeta `json:",inline"`
	// metadata is the list's metadata.
	// +optional
	metav1.ListMeta `json:"metadata,omitempty"`

	// items are the PVBridgeClusterTemplates.
	// +required
	Items []PVBridgeClusterTemplate `json:"items"`
}
