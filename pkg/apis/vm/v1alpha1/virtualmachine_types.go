package v1alpha1

import (
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// PowerState is the power state a VirtualMachine is asked to be in. The values are not "On" and
// "Off" because YAML 1.1, which kubectl speaks, reads those unquoted as booleans.
// +kubebuilder:validation:Enum=PoweredOn;PoweredOff
type PowerState string

const (
	// PowerStateOn asks for a running VirtualMachine.
	PowerStateOn PowerState = "PoweredOn"
	// PowerStateOff asks for a stopped VirtualMachine.
	PowerStateOff PowerState = "PoweredOff"
)

// Phase summarizes where a VirtualMachine is in its life. Conditions carry the details.
// +kubebuilder:validation:Enum=Pending;Running;Stopped;Failed
type Phase string

const (
	// PhasePending means the VirtualMachine is not placed on a host or not started yet.
	PhasePending Phase = "Pending"
	// PhaseRunning means the VirtualMachine runs on status.host.
	PhaseRunning Phase = "Running"
	// PhaseStopped means the VirtualMachine is placed but powered off.
	PhaseStopped Phase = "Stopped"
	// PhaseFailed means the hypervisor cannot run the VirtualMachine; see the Ready condition.
	PhaseFailed Phase = "Failed"
)

// Condition types of a VirtualMachine.
const (
	// ReadyCondition is True when the VirtualMachine is in the requested power state.
	ReadyCondition = "Ready"
	// PlacedCondition is True when the VirtualMachine has a host.
	PlacedCondition = "Placed"
	// VolumesAttachedCondition is True when every volume in spec.volumes is attached.
	VolumesAttachedCondition = "VolumesAttached"
)

// Condition reasons of a VirtualMachine.
const (
	// PoweredOnReason (Ready=True): the VirtualMachine runs.
	PoweredOnReason = "PoweredOn"
	// PoweredOffReason (Ready=True when powerState is PoweredOff, False while it should be
	// PoweredOn).
	PoweredOffReason = "PoweredOff"
	// HypervisorErrorReason (Ready=False): the hypervisor refused or failed an operation.
	HypervisorErrorReason = "HypervisorError"
	// InsufficientMemoryReason (Ready=False): the host has less memory available than the
	// VirtualMachine would boot with; it is not started smaller, and is tried again.
	InsufficientMemoryReason = "InsufficientMemory"
	// ClassNotFoundReason (Ready=False): the VirtualMachineClass named by spec.className does not
	// exist; the VirtualMachine starts once it does.
	ClassNotFoundReason = "ClassNotFound"
	// ClassExceededReason (Ready=False): spec.resources or spec.maxVolumes ask for more than the
	// VirtualMachine's class gives.
	ClassExceededReason = "ClassExceeded"
	// ImageNotFoundReason (Ready=False): the host's image store has no image named by
	// spec.image; the VirtualMachine starts once it has.
	ImageNotFoundReason = "ImageNotFound"
	// BootstrapDataUnavailableReason (Ready=False): the Secret named by spec.bootstrap cannot be
	// read, or has no key "value".
	BootstrapDataUnavailableReason = "BootstrapDataUnavailable"
	// HostLostReason (Ready=False): status.host is declared lost (its Node is gone or tainted
	// node.kubernetes.io/out-of-service): the VirtualMachine went with it and never runs again.
	// The vm-operator controller writes it, as the host's agent is gone; guest-csi then lets its
	// guest cluster detach the VM's volumes at once (out-of-service taint on the guest Node).
	HostLostReason = "HostLost"
	// HostAssignedReason (Placed=True): status.host is set.
	HostAssignedReason = "HostAssigned"
	// NoHostAvailableReason (Placed=False): no host can take the VirtualMachine.
	NoHostAvailableReason = "NoHostAvailable"
	// AttachedReason (VolumesAttached=True): every volume is attached.
	AttachedReason = "Attached"
	// AttachPendingReason (VolumesAttached=False): a volume is being attached or detached.
	AttachPendingReason = "AttachPending"
	// AttachFailedReason (VolumesAttached=False): a volume reports an error in status.volumes.
	AttachFailedReason = "AttachFailed"
)

// VirtualMachineSpec is the desired state of a VirtualMachine.
// +kubebuilder:validation:XValidation:rule="!has(oldSelf.host) || has(self.host)",message="host cannot be removed once set"
// +kubebuilder:validation:XValidation:rule="!has(oldSelf.bootstrap) || has(self.bootstrap)",message="bootstrap cannot be removed once set"
// +kubebuilder:validation:XValidation:rule="!has(oldSelf.image) || has(self.image)",message="image cannot be removed once set"
type VirtualMachineSpec struct {
	// className names the VirtualMachineClass, the size the VirtualMachine boots with. Without
	// one it boots with spec.resources, or the defaults of its host's hypervisor driver.
	// +optional
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	ClassName string `json:"className,omitempty"`

	// resources overrides the CPU and memory of the class; with a class, each may only be less.
	// +optional
	Resources *VirtualMachineResources `json:"resources,omitempty"`

	// image names the machine image the VirtualMachine boots: an image of its host's image
	// store (qemu: the directory <--qemu-image-dir>/<image>, whose disk.qcow2 the VM boots a
	// copy-on-write overlay of, with the image's own kernel if it has one). Images are named by
	// what they hold and never changed in place, node-<Kubernetes version> for pvbridge's node
	// images, so that a machine's image says what it runs. Without one the VM boots its
	// host's default. It cannot change once set: a new image is a new machine. The local
	// hypervisor, whose VMs share the host's kernel, ignores it.
	// +optional
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9._]*[a-z0-9])?$`
	// +kubebuilder:validation:XValidation:rule="self == oldSelf",message="image is immutable once set"
	Image string `json:"image,omitempty"`

	// host pins the VirtualMachine to a management host (a Node name). When empty the
	// vm-operator places it. It cannot change once set: a VirtualMachine does not migrate.
	// +optional
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:XValidation:rule="self == oldSelf",message="host is immutable once set"
	Host string `json:"host,omitempty"`

	// powerState is the requested power state.
	// +optional
	// +kubebuilder:default=PoweredOn
	PowerState PowerState `json:"powerState,omitempty"`

	// bootstrap is the data the VirtualMachine boots with (cloud-init user data of a Cluster
	// API bootstrap provider). It cannot change once set: a machine boots its data once.
	// +optional
	// +kubebuilder:validation:XValidation:rule="self == oldSelf",message="bootstrap is immutable once set"
	Bootstrap *VirtualMachineBootstrap `json:"bootstrap,omitempty"`

	// maxVolumes is how many volumes the VirtualMachine can hold hot-plugged at once: the
	// hot-plug slots of its virtual hardware (qemu: PCIe root ports). Empty means its class's,
	// or without one the default of its host's hypervisor driver; with a class, at most the
	// class's. The qemu driver gives a VM its slots when it starts; the
	// local driver applies a change at once. status.maxVolumes is what the VM has.
	// +optional
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=64
	MaxVolumes *int32 `json:"maxVolumes,omitempty"`

	// volumes are the disks attached to the VirtualMachine, keyed by name. Adding an entry
	// hot-plugs the volume, removing it unplugs the volume.
	// +optional
	// +listType=map
	// +listMapKey=name
	// +kubebuilder:validation:MaxItems=64
	Volumes []VirtualMachineVolume `json:"volumes,omitempty"`
}

// VirtualMachineBootstrap names the bootstrap data of a VirtualMachine.
type VirtualMachineBootstrap struct {
	// dataSecretName is a Secret of the VirtualMachine's namespace whose key "value" holds the
	// user data (cloud-init) the VirtualMachine runs at first boot; the host agent reads it and
	// hands it to the hypervisor with meta-data naming the VirtualMachine.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	DataSecretName string `json:"dataSecretName"`
}

// VirtualMachineResources are the CPU and memory of a VirtualMachine.
type VirtualMachineResources struct {
	// cpu is the number of virtual CPUs, as a quantity (whole CPUs).
	// +optional
	CPU *resource.Quantity `json:"cpu,omitempty"`

	// memory is the guest memory.
	// +optional
	Memory *resource.Quantity `json:"memory,omitempty"`
}

// VirtualMachineVolume is a disk of a VirtualMachine, backed by a PersistentVolumeClaim in the
// VirtualMachine's namespace.
type VirtualMachineVolume struct {
	// name identifies the volume in spec and status. For volumes of a guest cluster it is the
	// management PVC name, `<cluster UID>-<guest PV UID>` (73 characters), hence the length.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`
	Name string `json:"name"`

	// persistentVolumeClaim is the claim whose volume is attached.
	// +required
	PersistentVolumeClaim PersistentVolumeClaimVolumeSource `json:"persistentVolumeClaim"`
}

// PersistentVolumeClaimVolumeSource references a PersistentVolumeClaim in the namespace of the
// VirtualMachine.
type PersistentVolumeClaimVolumeSource struct {
	// claimName is the name of the PersistentVolumeClaim. It cannot change for a given volume
	// name: swapping the disk under an attached name would hide a detach, so remove the volume
	// and add another one instead.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`
	// +kubebuilder:validation:XValidation:rule="self == oldSelf",message="claimName is immutable; remove the volume and add a new one"
	ClaimName string `json:"claimName"`
}

// VirtualMachineStatus is the observed state of a VirtualMachine.
type VirtualMachineStatus struct {
	// host is the management host (Node name) the VirtualMachine is placed on.
	// +optional
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	Host string `json:"host,omitempty"`

	// uniqueID is the hypervisor's identifier of the VirtualMachine (for example its
	// SMBIOS UUID). It changes when the VirtualMachine is recreated.
	// +optional
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=128
	UniqueID string `json:"uniqueID,omitempty"`

	// phase summarizes the state of the VirtualMachine.
	// +optional
	Phase Phase `json:"phase,omitempty"`

	// maxVolumes is how many volumes the running VirtualMachine can hold hot-plugged at once,
	// as its hypervisor reports it (qemu: the PCIe root ports it was started with; local: its
	// configured count). One more entry in spec.volumes than that is not attached. The host
	// agent writes it; a guest cluster reports it to its scheduler as the node's volume limit.
	// Empty while the VirtualMachine does not run.
	// +optional
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=64
	MaxVolumes *int32 `json:"maxVolumes,omitempty"`

	// addresses are the IP addresses of the VirtualMachine's NIC as its guest reports them
	// (qemu: through the QEMU guest agent, which pvbridge's node image runs), IPv4 first. Empty
	// while the guest has not said, and for a VirtualMachine without a NIC.
	// +optional
	// +listType=atomic
	// +kubebuilder:validation:MaxItems=16
	// +kubebuilder:validation:items:MaxLength=45
	Addresses []string `json:"addresses,omitempty"`

	// conditions describe the state of the VirtualMachine: Ready, Placed and VolumesAttached.
	// +optional
	// +listType=map
	// +listMapKey=type
	// +kubebuilder:validation:MaxItems=16
	Conditions []metav1.Condition `json:"conditions,omitempty"`

	// volumes report the attachment of each volume, keyed by name. An entry stays while the
	// hypervisor still holds the disk, also after it was removed from spec.volumes.
	// +optional
	// +listType=map
	// +listMapKey=name
	// +kubebuilder:validation:MaxItems=128
	Volumes []VirtualMachineVolumeStatus `json:"volumes,omitempty"`
}

// VirtualMachineVolumeStatus is the attachment state of one volume.
type VirtualMachineVolumeStatus struct {
	// name is the name of the volume in spec.volumes.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	Name string `json:"name"`

	// attached is true when the disk is plugged into the VirtualMachine.
	// +optional
	Attached bool `json:"attached,omitempty"`

	// diskSerial is the serial the guest sees on the disk (/sys/block/*/serial). It is at most
	// 20 characters, the virtio-blk limit.
	// +optional
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=20
	// +kubebuilder:validation:Pattern=`^[A-Za-z0-9_-]+$`
	DiskSerial string `json:"diskSerial,omitempty"`

	// volumeAttributesClassName is the VolumeAttributesClass whose I/O limits the hypervisor
	// enforces on the attached disk: the class of the volume's PersistentVolume once the host
	// agent applied it. Empty for a disk without limits, or while the limits of a new class
	// are not applied yet (the error says why).
	// +optional
	// +kubebuilder:validation:MaxLength=253
	VolumeAttributesClassName string `json:"volumeAttributesClassName,omitempty"`

	// error is the last attach or detach error, empty when there is none.
	// +optional
	// +kubebuilder:validation:MaxLength=1024
	Error string `json:"error,omitempty"`
}

// VirtualMachine is a management-cluster virtual machine that serves as a node of a guest
// cluster. Its name is the guest Node name and the guest CSI node ID. status.host is a
// selectable field, so that a host agent watches only the VirtualMachines on its host.
//
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:resource:shortName=vm,categories=pvbridge
// +kubebuilder:selectablefield:JSONPath=`.status.host`
// +kubebuilder:printcolumn:name="Host",type=string,JSONPath=`.status.host`
// +kubebuilder:printcolumn:name="Power",type=string,JSONPath=`.spec.powerState`
// +kubebuilder:printcolumn:name="Phase",type=string,JSONPath=`.status.phase`
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
type VirtualMachine struct {
	metav1.TypeMeta `json:",inline"`
	// metadata is the object's metadata.
	// +optional
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// spec is the desired state of the VirtualMachine.
	// +required
	Spec VirtualMachineSpec `json:"spec"`

	// status is the observed state of the VirtualMachine.
	// +optional
	Status VirtualMachineStatus `json:"status,omitempty"`
}

// VirtualMachineList is a list of VirtualMachines.
//
// +kubebuilder:object:root=true
type VirtualMachineList struct {
	metav1.TypeMeta `json:",inline"`
	// metadata is the list's metadata.
	// +optional
	metav1.ListMeta `json:"metadata,omitempty"`

	// items are the VirtualMachines.
	// +required
	Items []VirtualMachine `json:"items"`
}
