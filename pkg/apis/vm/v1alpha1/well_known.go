package v1alpha1

import corev1 "k8s.io/api/core/v1"

// Labels, annotations and finalizers that tie VirtualMachines to the objects around them. They
// are read by several parts (the vm-operator controller and host agent, administrators' tools),
// so they are part of the API.
const (
	// HostLabel, set to "true" on a Node, makes the Node a candidate host for VirtualMachines
	// that do not name one in spec.host.
	HostLabel = "vm.pvbridge.io/host"

	// VMNamespaceLabel and VMNameLabel, on a management VolumeAttachment, name the
	// VirtualMachine whose volume it attaches. A name longer than a label value (63 characters)
	// is shortened to its first 22 characters, "-" and 40 hex digits of its SHA-256.
	VMNamespaceLabel = "vm.pvbridge.io/vm-namespace"
	// VMNameLabel: see VMNamespaceLabel.
	VMNameLabel = "vm.pvbridge.io/vm-name"

	// VolumeAnnotation, on a management VolumeAttachment, is the name of the volume
	// (spec.volumes[].name) it attaches.
	VolumeAnnotation = "vm.pvbridge.io/volume"

	// VolumesFinalizer keeps a deleted VirtualMachine until status.volumes is empty (every disk
	// unplugged and unstaged by the host agent) and its VolumeAttachments are gone.
	VolumesFinalizer = "vm.pvbridge.io/volumes"

	// DrainTaint, a taint of a management host's Node (any value and effect; NoSchedule keeps
	// new pods off too), drains the host before its maintenance: it takes no new VirtualMachine
	// and no new replica of a replicated volume, and each replica it holds moves to another
	// host (a new replica there is rebuilt, then the host's is taken out of the volume's target
	// and deleted) where one can take it. Removing the taint brings the host back.
	DrainTaint = "pvbridge.io/drain"
)

// NoFreeSlotError is the phrase a status.volumes entry's error contains when the hypervisor
// refused the hot-plug because every slot of the VirtualMachine holds a disk
// (status.maxVolumes): a guest answers such an attach with ResourceExhausted, which makes its
// kubelet read the node's volume limit again.
const NoFreeSlotError = "no free hot-plug slot"

// LimitsAtNextAttach is the error of a status.volumes entry whose disk keeps the I/O limits it
// was attached with because its hypervisor cannot change them live (the local hypervisor's
// disk attached without a class): the limits of VolumeAttributesClass class apply when the
// volume is next attached. A guest takes the class as accepted, as a cloud takes a volume
// modification that is still optimizing; the entry and an Event say what holds meanwhile.
func LimitsAtNextAttach(class string) string {
	return "the I/O limits of VolumeAttributesClass " + class + " apply when the volume is next attached"
}

// HostLost tells whether a management host is declared lost, for good: its Node carries
// Kubernetes' non-graceful shutdown taint (node.kubernetes.io/out-of-service, which an admin or
// a fencing agent sets once the machine is off; a deleted Node is lost too). A lost host's agents
// never act again, so what waited for them (the unplugging of its VMs' volumes) is released
// without them. NotReady alone is not lost: a partitioned host may still run its VMs.
func HostLost(node *corev1.Node) bool {
	for _, t := range node.Spec.Taints {
		if t.Key == corev1.TaintNodeOutOfService {
			return true
		}
	}
	return false
}

// HostDraining tells whether a management host is being drained (DrainTaint).
func HostDraining(node *corev1.Node) bool {
	for _, t := range node.Spec.Taints {
		if t.Key == DrainTaint {
			return true
		}
	}
	return false
}

// HostTakesNewVMs tells whether a Node can take new VirtualMachines: a host (HostLabel), Ready,
// not cordoned, not being deleted, not lost and not drained. vm-operator places VMs only there,
// and the infrastructure provider offers only those hosts as failure domains.
func HostTakesNewVMs(node *corev1.Node) bool {
	if node.Labels[HostLabel] != "true" || node.Spec.Unschedulable || !node.DeletionTimestamp.IsZero() || HostLost(node) || HostDraining(node) {
		return false
	}
	return NodeReady(node)
}

// NodeReady reports whether a Node's Ready condition is True.
func NodeReady(node *corev1.Node) bool {
	for _, c := range node.Status.Conditions {
		if c.Type == corev1.NodeReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}
