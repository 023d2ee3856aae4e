package v1alpha1

import (
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// PVBridgeMachineSpec is the desired state of a PVBridgeMachine.
// +kubebuilder:validation:XValidation:rule="!has(oldSelf.providerID) || (has(self.providerID) && self.providerID == oldSelf.providerID)",message="providerID cannot change once set"
type PVBridgeMachineSpec struct {
	// providerID is the provider ID of the machine's guest Node, pvbridge://<namespace>/<name>,
	// set by the provider once the VirtualMachine runs (contract).
	// +optional
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=512
	ProviderID string `json:"providerID,omitempty"`

	// className names the VirtualMachineClass (vm.pvbridge.io) of the machine's VirtualMachine:
	// the size it boots with.
	// +optional
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	ClassName string `json:"className,omitempty"`

	// resources overrides the CPU and memory of the class; with a class, each may only be less.
	// +optional
	Resources *MachineResources `json:"resources,omitempty"`

	// image names the machine image of the machine's VirtualMachine (vm.pvbridge.io
	// spec.image), an image of its host's image store: node-<Kubernetes version> for
	// pvbridge's node images (make node-image), which the cluster template picks by the
	// Machine's version.
	// +optional
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9._]*[a-z0-9])?$`
	Image string `json:"image,omitempty"`
}

// MachineResources are the CPU and memory of a machine.
type MachineResources struct {
	// cpu is the number of virtual CPUs, as a quantity (whole CPUs).
	// +optional
	CPU *resource.Quantity `json:"cpu,omitempty"`

	// memory is the guest memory.
	// +optional
	Memory *resource.Quantity `json:"memory,omitempty"`
}

// PVBridgeMachineInitializationStatus is the initialization of a PVBridgeMachine (contract).
// +kubebuilder:validation:MinProperties=1
type PVBridgeMachineInitializationStatus struct {
	// provisioned is true once the machine's VirtualMachine runs. Part of the Cluster API
	// contract; never reset.
	// +optional
	Provisioned *bool `json:"provisioned,omitempty"`
}

// PVBridgeMachineStatus is the observed state of a PVBridgeMachine.
type PVBridgeMachineStatus struct {
	// initialization reports the provisioning of the machine (contract).
	// +optional
	Initialization PVBridgeMachineInitializationStatus `json:"initialization,omitempty,omitzero"`

	// addresses are the machine's addresses: its name as Hostname and InternalDNS (the guest
	// Node name).
	// +optional
	// +listType=atomic
	// +kubebuilder:validation:MaxItems=32
	Addresses []MachineAddress `json:"addresses,omitempty"`

	// failureDomain is the management host the VirtualMachine runs on.
	// +optional
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=256
	FailureDomain string `json:"failureDomain,omitempty"`

	// conditions are Ready, VirtualMachineProvisioned and Paused.
	// +optional
	// +listType=map
	// +listMapKey=type
	// +kubebuilder:validation:MaxItems=32
	Conditions []metav1.Condition `json:"conditions,omitempty"`
}

// PVBridgeMachine is a Cluster API machine realized as a pvbridge VirtualMachine of the same
// name and namespace, whose name is also the guest Node's.
//
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:resource:path=pvbridgemachines,shortName=pvbm,categories=cluster-api;pvbridge
// +kubebuilder:storageversion
// +kubebuilder:printcolumn:name="Cluster",type=string,JSONPath=`.metadata.labels['cluster\.x-k8s\.io/cluster-name']`
// +kubebuilder:printcolumn:name="Host",type=string,JSONPath=`.status.failureDomain`
// +kubebuilder:printcolumn:name="ProviderID",type=string,JSONPath=`.spec.providerID`
// +kubebuilder:printcolumn:name="Ready",type=string,JSONPath=`.status.conditions[?(@.type=="Ready")].status`
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
type PVBridgeMachine struct {
	metav1.TypeMeta `json:",inline"`
	// metadata is the object's metadata.
	// +optional
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// spec is the desired state of the PVBridgeMachine.
	// +optional
	Spec PVBridgeMachineSpec `json:"spec,omitempty,omitzero"`

	// status is the observed state of the PVBridgeMachine.
	// +optional
	Status PVBridgeMachineStatus `json:"status,omitempty,omitzero"`
}

// PVBridgeMachineList is a list of PVBridgeMachines.
//
// +kubebuilder:object:root=true
type PVBridgeMachineList struct {
	metav1.TypeMeta `json:",inline"`
	// metadata is the list's metadata.
	// +optional
	metav1.ListMeta `json:"metadata,omitempty"`

	// items are the PVBridgeMachines.
	// +required
	Items []PVBridgeMachine `json:"items"`
}

// ObjectMeta is the metadata a template gives the objects made from it (Cluster API's
// ObjectMeta).
type ObjectMeta struct {
	// labels are added to the objects made from the template.
	// +optional
	Labels map[string]string `json:"labels,omitempty"`

	// annotations are added to the objects made from the template.
	// +optional
	Annotations map[string]string `json:"annotations,omitempty"`
}

// PVBridgeMachineTemplateResource is what a PVBridgeMachine is made from.
type PVBridgeMachineTemplateResource struct {
	// metadata is given to each PVBridgeMachine made from the template.
	// +optional
	ObjectMeta ObjectMeta `json:"metadata,omitempty,omitzero"`

	// spec is the spec of each PVBridgeMachine made from the template.
	// +required
	Spec PVBridgeMachineSpec `json:"spec"`
}

// PVBridgeMachineTemplateSpec is the spec of a PVBridgeMachineTemplate.
type PVBridgeMachineTemplateSpec struct {
	// template is what the PVBridgeMachines are made from.
	// +required
	Template PVBridgeMachineTemplateResource `json:"template"`
}

// PVBridgeMachineTemplateStatus is the observed state of a PVBridgeMachineTemplate.
type PVBridgeMachineTemplateStatus struct {
	// capacity is what the guest Node of a machine made from the template has: the cpu and
	// memory of its VirtualMachineClass, or of spec.template.spec.resources where they are set
	// (the contract: Cluster API's autoscaler scales a MachineDeployment up from zero with it).
	// Empty while the class does not exist.
	// +optional
	Capacity corev1.ResourceList `json:"capacity,omitempty"`
}

// PVBridgeMachineTemplate is the template Cluster API makes PVBridgeMachines from (for
// MachineDeployments and KubeadmControlPlanes). Its spec is immutable: Cluster API rolls
// machines out when a MachineDeployment or KubeadmControlPlane is pointed at a new template, never
// when a template changes in place (a ClusterClass makes a new one for each change).
//
// +kubebuilder:object:root=true
// +kubebuilder:resource:path=pvbridgemachinetemplates,shortName=pvbmt,categories=cluster-api;pvbridge
// +kubebuilder:subresource:status
// +kubebuilder:storageversion
// +kubebuilder:printcolumn:name="Class",type=string,JSONPath=`.spec.template.spec.className`
// +kubebuilder:printcolumn:name="CPU",type=string,JSONPath=`.status.capacity.cpu`
// +kubebuilder:printcolumn:name="Memory",type=string,JSONPath=`.status.capacity.memory`
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
type PVBridgeMachineTemplate struct {
	metav1.TypeMeta `json:",inline"`
	// metadata is the object's metadata.
	// +optional
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// spec is the template.
	// +required
	// +kubebuilder:validation:XValidation:rule="self == oldSelf",message="the spec of a template is immutable: create a new template and point the MachineDeployment or KubeadmControlPlane at it"
	Spec PVBridgeMachineTemplateSpec `json:"spec"`

	// status is the observed state of the template.
	// +optional
	Status PVBridgeMachineTemplateStatus `json:"status,omitempty,omitzero"`
}

// PVBridgeMachineTemplateList is a list of PVBridgeMachineTemplates.
//
// +kubebuilder:object:root=true
type PVBridgeMachineTemplateList struct {
	metav1.TypeMeta `json:",inline"`
	// metadata is the list's metadata.
	// +optional
	metav1.ListMeta `json:"metadata,omitempty"`

	// items are the PVBridgeMachineTemplates.
	// +required
	Items []PVBridgeMachineTemplate `json:"items"`
}
