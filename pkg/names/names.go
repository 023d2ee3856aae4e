// Package names holds the names that tie pvbridge's parts together: the CSI drivers and their
// topology keys, which guest-csi, mgmt-csi, vm-operator, the manifests and the tests must spell
// alike.
package names

const (
	// GuestDriver is the CSI driver of guest clusters (guest-csi).
	GuestDriver = "guest.csi.pvbridge.io"
	// GuestTopologyKey is its topology key: the management host of a guest node's VirtualMachine.
	GuestTopologyKey = "topology.guest.csi.pvbridge.io/host"
	// PmemDriver is the management cluster's CSI driver of PMEM volumes (mgmt-csi), the attacher
	// of every VolumeAttachment vm-operator makes.
	PmemDriver = "pmem.csi.pvbridge.io"
	// PmemTopologyKey is its topology key: the host whose PMEM holds a volume. The management
	// CSIStorageCapacity objects are per host.
	PmemTopologyKey = "pmem.csi.pvbridge.io/node"

	// MgmtStorageClassParam is the guest StorageClass parameter that names the management
	// StorageClass of a guest volume's management PVC.
	MgmtStorageClassParam = "mgmtStorageClass"

	// MgmtVolumeAttributesClassParam is the guest VolumeAttributesClass parameter that names
	// the management VolumeAttributesClass of a guest volume's management PVC.
	MgmtVolumeAttributesClassParam = "mgmtVolumeAttributesClass"

	// MgmtVolumeGroupSnapshotClassParam is the guest VolumeGroupSnapshotClass parameter that
	// names the management VolumeGroupSnapshotClass of a guest group snapshot's management
	// VolumeGroupSnapshot.
	MgmtVolumeGroupSnapshotClassParam = "mgmtVolumeGroupSnapshotClass"

	// ReplicasParam is the management StorageClass parameter of the number of copies of a PMEM
	// volume, each on another host (mgmt-csi).
	ReplicasParam = "replicas"
	// ReplicatedParam "true" on a guest StorageClass says that its management class keeps
	// replicas on several hosts: its guest volumes have no host topology, so that a pod can move
	// to a VM of any host. The tenants controller sets it on the classes it installs.
	ReplicatedParam = "replicated"
)
