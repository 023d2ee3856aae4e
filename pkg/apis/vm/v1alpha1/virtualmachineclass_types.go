package v1alpha1

import (
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// VirtualMachineClassSpec is the size of the VirtualMachines of a class.
type VirtualMachineClassSpec struct {
	// cpus is the number of virtual CPUs.
	// +required
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=64
	CPUs int32 `json:"cpus"`

	// memory is the guest memory, at least 64Mi.
	// +required
	// +kubebuilder:validation:XValidation:rule="quantity(self).compareTo(quantity('64Mi')) >= 0",message="memory must be at least 64Mi"
	Memory resource.Quantity `json:"memory"`

	// maxVolumes is how many volumes a VirtualMachine of the class can hold hot-plugged at once
	// (its hot-plug slots). Empty means the default of the host's hypervisor driver. A
	// VirtualMachine's own spec.maxVolumes, up to this many, overrides it.
	// +optional
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=64
	MaxVolumes *int32 `json:"maxVolumes,omitempty"`
}

// VirtualMachineClass is a size a platform admin offers for VirtualMachines: vCPUs, memory and
// hot-plug slots, named by a VirtualMachine's spec.className (and a PVBridgeMachine's). A
// VirtualMachine boots with its class's size; its spec.resources and spec.maxVolumes may ask for
// less, never more. A VirtualMachine whose class does not exist, or that asks for more than its
// class, is not started (Ready=False, ClassNotFound or ClassExceeded) rather than started at
// another size. A class is read when a VirtualMachine starts: changing it resizes a VirtualMachine
// at its next start.
//
// +kubebuilder:object:root=true
// +kubebuilder:resource:scope=Cluster,shortName=vmclass,categories=pvbridge
// +kubebuilder:printcolumn:name="CPUs",type=integer,JSONPath=`.spec.cpus`
// +kubebuilder:printcolumn:name="Memory",type=string,JSONPath=`.spec.memory`
// +kubebuilder:printcolumn:name="Volumes",type=integer,JSONPath=`.spec.maxVolumes`
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
type VirtualMachineClass struct {
	metav1.TypeMeta `json:",inline"`
	// metadata is the object's metadata.
	// +optional
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// spec is the size of the class's VirtualMachines.
	// +required
	Spec VirtualMachineClassSpec `json:"spec"`
}

// VirtualMachineClassList is a list of VirtualMachineClasses.
//
// +kubebuilder:object:root=true
type VirtualMachineClassList struct {
	metav1.TypeMeta `json:",inline"`
	// metadata is the list's metadata.
	// +optional
	metav1.ListMeta `json:"metadata,omitempty"`

	// items are the VirtualMachineClasses.
	// +required
	Items []VirtualMachineClass `json:"items"`
}
