package v1alpha1

// ReadyCondition is the condition type every kind of this API reports: a PmemVolume or
// PmemSnapshot is Ready when its data exists on the node, a PmemNode when its back end serves.
const ReadyCondition = "Ready"

// DegradedCondition is a replicated PmemVolume's: True while one of its replicas is faulted and
// the volume runs on the others.
const DegradedCondition = "Degraded"

// Reasons of the Degraded condition.
const (
	// AllReplicasReason (False): every replica serves.
	AllReplicasReason = "AllReplicas"
	// ReplicaFaultedReason (True): a replica is faulted; the message names it and why. Also the
	// reason of the volume's Warning Event.
	ReplicaFaultedReason = "ReplicaFaulted"
	// ReplicasMissingReason (True): fewer replicas than spec.replicas have the volume's data,
	// none faulted: a replica is being rebuilt, or one was deleted.
	ReplicasMissingReason = "ReplicasMissing"
)

// InSyncCondition is a rebuilt PmemReplica's (spec.rebuild): True once it has the volume's
// data, from when on it is a replica as those made with the volume are.
const InSyncCondition = "InSync"

// Reasons of the InSync condition.
const (
	// RebuildingReason (False): the replica waits for, or is in, its copy.
	RebuildingReason = "Rebuilding"
	// RebuiltReason (True): the node that serves the volume copied it into the replica.
	RebuiltReason = "Rebuilt"
)

// Reasons of the Ready condition.
const (
	// PendingReason (False): the node agent has not realized the object yet.
	PendingReason = "Pending"
	// CreatedReason (True): the volume or snapshot exists on the node.
	CreatedReason = "Created"
	// ResizingReason (False): the volume is growing to spec.size.
	ResizingReason = "Resizing"
	// InsufficientCapacityReason (False): the node has not enough free PMEM. The controller
	// deletes the object and answers ResourceExhausted, so that nothing is left behind.
	InsufficientCapacityReason = "InsufficientCapacity"
	// SourceNotFoundReason (False): the snapshot or volume named in spec.source does not exist
	// on the node.
	SourceNotFoundReason = "SourceNotFound"
	// InUseReason (False, on a PmemVolume being deleted): the device is open or mounted on the
	// node, so its data cannot be removed yet. DeleteVolume answers FailedPrecondition.
	InUseReason = "InUse"
	// HoldExpiredReason (False, on the members of a group snapshot): cutting the members took
	// longer than the host's longest hold of their writers (a back end that copies each member
	// in full). What was cut is removed, and the group is not tried again, since each try would
	// hold the writers again: CreateVolumeGroupSnapshot answers ResourceExhausted until the
	// group is deleted.
	HoldExpiredReason = "HoldExpired"
	// FaultedReason (False, on a PmemReplica): the replica may have missed writes (its node's
	// replica server lost its export, as a restart does), so it is never served again: the
	// volume's targets go on with its other replicas until it is replaced.
	FaultedReason = "Faulted"
	// RetiredReason (False, on a PmemReplica): the replica's node is drained and another
	// replica took its place: the node that serves the volume took it out of its target, and
	// the controller deletes it. It is never served again either, but the volume lost nothing.
	RetiredReason = "Retired"
	// FailedReason (False): the back end failed; the message says how.
	FailedReason = "Failed"
	// BackendReadyReason (True on a PmemNode): the back end is initialized and reports capacity.
	BackendReadyReason = "BackendReady"
	// BackendUnavailableReason (False on a PmemNode): the back end cannot be used, for example
	// because the PMEM region or the tools are missing.
	BackendUnavailableReason = "BackendUnavailable"
)
