package v1alpha1

import (
	"fmt"
	"strings"
)

// ProviderIDPrefix starts the provider ID of every pvbridge machine.
const ProviderIDPrefix = "pvbridge://"

// ProviderID is the provider ID of the guest Node that runs in the VirtualMachine namespace/name
// (the PVBridgeMachine's own namespace and name): pvbridge://<namespace>/<name>. The guest's
// kubelet is started with it (--provider-id, from the meta-data the host agent writes), and
// Cluster API matches the Node to its Machine by it.
func ProviderID(namespace, name string) string {
	return ProviderIDPrefix + namespace + "/" + name
}

// ParseProviderID returns the namespace and name of a pvbridge provider ID.
func ParseProviderID(id string) (namespace, name string, err error) {
	rest, ok := strings.CutPrefix(id, ProviderIDPrefix)
	if ok {
		namespace, name, ok = strings.Cut(rest, "/")
	}
	if !ok || namespace == "" || name == "" || strings.Contains(name, "/") {
		return "", "", fmt.Errorf("provider ID %q is not %s<namespace>/<name>", id, ProviderIDPrefix)
	}
	return namespace, name, nil
}

// Labels and finalizers of the provider.
const (
	// MachineFinalizer keeps a deleted PVBridgeMachine until its VirtualMachine is gone.
	MachineFinalizer = "pvbridgemachine.infrastructure.cluster.x-k8s.io"

	// MachineLabel, on a VirtualMachine, is the name of the PVBridgeMachine (and Cluster API
	// Machine) it realizes, when the name fits a label value (63 characters); the owner
	// reference names it in every case.
	MachineLabel = "infrastructure.cluster.x-k8s.io/pvbridgemachine"

	// BlockMoveAnnotation is clusterctl's block-move annotation, which the provider keeps on
	// every PVBridgeCluster: `clusterctl move` waits for it to go, and gives up. A guest's
	// VirtualMachines cannot leave the hosts of their management cluster, and a move would
	// delete them with their PVBridgeMachines (docs/deployment.md, "clusterctl move").
	BlockMoveAnnotation = "clusterctl.cluster.x-k8s.io/block-move"
	// BlockMoveReason is the value of BlockMoveAnnotation, for whoever reads the object.
	BlockMoveReason = "pvbridge: a guest's VirtualMachines cannot move to another management cluster"
)

// Condition types of the provider's kinds (Cluster API v1beta2 conventions: positive polarity,
// Ready summarizes, Paused reports the pause).
const (
	// ReadyCondition: on a PVBridgeCluster, the control plane endpoint is known; on a
	// PVBridgeMachine, its VirtualMachine runs (and, while deleting, what deletion waits for).
	// Cluster API mirrors a PVBridgeMachine's Ready into its Machine's InfrastructureReady.
	ReadyCondition = "Ready"
	// PausedCondition is True while the Cluster or the object is paused.
	PausedCondition = "Paused"
	// VirtualMachineProvisionedCondition is True once the PVBridgeMachine's VirtualMachine runs.
	VirtualMachineProvisionedCondition = "VirtualMachineProvisioned"
)

// Condition reasons of the provider's kinds.
const (
	// ProvisionedReason: Ready=True, VirtualMachineProvisioned=True.
	ProvisionedReason = "Provisioned"
	// PausedReason (Paused=True) and NotPausedReason (Paused=False).
	PausedReason = "Paused"
	// NotPausedReason: see PausedReason.
	NotPausedReason = "NotPaused"
	// WaitingForControlPlaneEndpointReason: a PVBridgeCluster without spec.controlPlaneEndpoint.
	WaitingForControlPlaneEndpointReason = "WaitingForControlPlaneEndpoint"
	// WaitingForClusterInfrastructureReason: the Cluster's infrastructure is not provisioned.
	WaitingForClusterInfrastructureReason = "WaitingForClusterInfrastructure"
	// WaitingForBootstrapDataReason: the Machine has no bootstrap data secret yet.
	WaitingForBootstrapDataReason = "WaitingForBootstrapData"
	// VirtualMachineNotRunningReason: the VirtualMachine is created but does not run yet.
	VirtualMachineNotRunningReason = "VirtualMachineNotRunning"
	// FailureDomainUnknownReason: the Machine's failure domain is not one of the Cluster's.
	FailureDomainUnknownReason = "FailureDomainUnknown"
	// VirtualMachineConflictReason: a VirtualMachine of the name exists and belongs to another.
	VirtualMachineConflictReason = "VirtualMachineConflict"
	// VirtualMachineDeletedReason: the VirtualMachine of a provisioned machine is gone, and its
	// guest with it; the provider does not re-create it (a MachineHealthCheck, or an admin who
	// deletes the Machine, replaces the machine).
	VirtualMachineDeletedReason = "VirtualMachineDeleted"
	// WaitingForVolumeDetachReason: deleting, the VirtualMachine still holds volumes.
	WaitingForVolumeDetachReason = "WaitingForVolumeDetach"
	// VolumeDetachTimedOutReason: deleting, the volumes did not detach within the timeout; the
	// VirtualMachine is powered off and deleted anyway (the host agent forces it off).
	VolumeDetachTimedOutReason = "VolumeDetachTimedOut"
	// DeletingReason: the VirtualMachine is being powered off and deleted.
	DeletingReason = "Deleting"
)

// APIEndpoint is where a guest cluster's API server is reached (Cluster API's APIEndpoint).
type APIEndpoint struct {
	// host is the DNS name or IP address of the API server.
	// +optional
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=512
	Host string `json:"host,omitempty"`

	// port is the TCP port of the API server.
	// +optional
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=65535
	Port int32 `json:"port,omitempty"`
}

// IsZero reports whether neither host nor port is set.
func (e APIEndpoint) IsZero() bool { return e.Host == "" && e.Port == 0 }

// IsValid reports whether both host and port are set.
func (e APIEndpoint) IsValid() bool { return e.Host != "" && e.Port > 0 }

// FailureDomain is a failure domain as Cluster API reads it from an InfraCluster: for pvbridge,
// a management host (a Node name).
type FailureDomain struct {
	// name is the failure domain: the management host's Node name.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=256
	Name string `json:"name"`

	// controlPlane is true when control plane machines may be placed there.
	// +optional
	ControlPlane *bool `json:"controlPlane,omitempty"`

	// attributes are free-form attributes of the failure domain.
	// +optional
	Attributes map[string]string `json:"attributes,omitempty"`
}

// MachineAddressType is the kind of a machine address (Cluster API's MachineAddressType).
// +kubebuilder:validation:Enum=Hostname;ExternalIP;InternalIP;ExternalDNS;InternalDNS
type MachineAddressType string

// Machine address types.
const (
	MachineHostName    MachineAddressType = "Hostname"
	MachineExternalIP  MachineAddressType = "ExternalIP"
	MachineInternalIP  MachineAddressType = "InternalIP"
	MachineExternalDNS MachineAddressType = "ExternalDNS"
	MachineInternalDNS MachineAddressType = "InternalDNS"
)

// MachineAddress is an address of a machine (Cluster API's MachineAddress).
type MachineAddress struct {
	// type is the kind of address.
	// +required
	Type MachineAddressType `json:"type"`

	// address is the address.
	// +required
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=256
	Address string `json:"address"`
}
