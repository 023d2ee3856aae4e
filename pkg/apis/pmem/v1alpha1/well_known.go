package v1alpha1

// Labels and annotations of PmemVolumes, PmemSnapshots and PmemReplicas, set by mgmt-csi's
// controller and read by its own watches, administrators' tools and the benchmarks.
const (
	// NodeLabel carries spec.node on PmemVolumes, PmemSnapshots and PmemReplicas.
	NodeLabel = "pmem.pvbridge.io/node"
	// VolumeLabel carries spec.volumeID on PmemReplicas.
	VolumeLabel = "pmem.pvbridge.io/volume"
	// GroupLabel carries spec.group.id on the PmemSnapshots of a group snapshot.
	GroupLabel = "pmem.pvbridge.io/group-snapshot"
	// NameAnnotation records the CSI name a PmemVolume or PmemSnapshot was created for (for a
	// volume csi-provisioner provisions, the name of its PV).
	NameAnnotation = "pmem.pvbridge.io/csi-name"
	// ReplacesAnnotation, on a PmemReplica made to replace another (faulted, or on a drained
	// node), names that one.
	ReplacesAnnotation = "pmem.pvbridge.io/replaces"
)
