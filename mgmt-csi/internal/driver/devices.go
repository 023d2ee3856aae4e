package driver

import (
	"context"
	"errors"
	"fmt"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/klog/v2"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pvbridge.io/mgmt-csi/internal/pmem"
	"pvbridge.io/mgmt-csi/internal/replication"
	pmemv1 "pvbridge.io/pkg/apis/pmem/v1alpha1"
	"pvbridge.io/pkg/hostloss"
)

// errReplicaNotReady: a replicated volume is staged only once every replica is ready, so that
// no replica misses a write (the CO retries the stage).
var errReplicaNotReady = errors.New("not every replica is ready")

// errNoReplica: every replica of a volume is faulted; its data is lost.
var errNoReplica = errors.New("no replica to serve")

// errServedElsewhere: another node serves the replicated volume.
var errServedElsewhere = errors.New("in use on another node")

// VolumeDevices finds the devices of volumes on this node: a volume in the node's PMEM back
// end, or the target of a replicated volume.
type VolumeDevices struct {
	Backend pmem.Backend
	// Node is this node's name.
	Node string
	// Reader reads PmemVolumes, PmemReplicas and Nodes from the apiserver: a replicated volume
	// has no node, so the agent's cache of its own node's objects does not hold it. Writer
	// records which node serves a replicated volume.
	Reader client.Reader
	Writer client.Client
	// Targets runs the targets of replicated volumes; nil on a node that cannot reach replica
	// servers (no keys).
	Targets *replication.Targets
}

var _ Devices = VolumeDevices{}

// Device returns the device of the back end's volume, which GetVolume makes sure is usable, or
// the device of the running target of a replicated volume.
func (d VolumeDevices) Device(ctx context.Context, volumeID string) (string, error) {
	vol, err := d.Backend.GetVolume(ctx, volumeID)
	if !errors.Is(err, pmem.ErrNotFound) || d.Targets == nil {
		return vol.Device, err
	}
	device, terr := d.Targets.Device(volumeID)
	if terr != nil || device == "" {
		return "", errors.Join(err, terr)
	}
	return device, nil
}

// Stage returns the device of the back end's volume, or brings up the target of a replicated
// volume over its replicas and returns its device. One node at a time serves a replicated
// volume: the one its status names as target, which Stage claims first (see claim). Every
// replica must be ready at the volume's size, or faulted: a target that went on without a replica that is still
// being made would leave it behind the others, while a faulted replica is never served again
// (the volume runs degraded without it).
func (d VolumeDevices) Stage(ctx context.Context, volumeID string) (string, error) {
	dev, err := d.Backend.GetVolume(ctx, volumeID)
	if !errors.Is(err, pmem.ErrNotFound) {
		return dev.Device, err
	}
	vol, replicas, err := d.replicas(ctx, volumeID)
	if err != nil {
		return "", err
	}
	if err := d.claim(ctx, vol); err != nil {
		return "", err
	}
	device, err := d.Targets.Open(ctx, volumeID, replicas)
	if err != nil {
		// Another node may serve it meanwhile.
		return "", errors.Join(err, d.release(ctx, volumeID))
	}
	return device, nil
}

// claim makes this node the target of the replicated volume vol, unless another node is and
// still may write: a node that is not lost. The apiserver arbitrates (an update conditional on
// the volume's resource version), so two nodes never both serve the volume, even for
// consumers that no VolumeAttachment orders (a management pod: mgmt-csi needs no attach).
func (d VolumeDevices) claim(ctx context.Context, vol *pmemv1.PmemVolume) error {
	switch owner := vol.Status.Target; owner {
	case d.Node:
		return nil
	case "":
	default:
		lost, err := d.nodeLost(ctx, owner)
		if err != nil {
			return err
		}
		if !lost {
			return fmt.Errorf("volume %s: %w: node %s serves it (until it unstages the volume, or is declared lost)", vol.Name, errServedElsewhere, owner)
		}
		klog.FromContext(ctx).Info("Taking over a replicated volume from a lost node", "node", owner)
	}
	return d.setTarget(ctx, vol, d.Node)
}

// nodeLost tells whether node is lost for good (hostloss.Lost): its agent never acts again.
func (d VolumeDevices) nodeLost(ctx context.Context, name string) (bool, error) {
	return hostloss.Lost(ctx, d.Reader, d.Reader, name)
}

// faultReplica marks the replica of that name Faulted, for good: its volume's target on this
// node took it out of its quorum.
func (d VolumeDevices) faultReplica(ctx context.Context, name, why string) error {
	r := &pmemv1.PmemReplica{}
	if err := d.Reader.Get(ctx, client.ObjectKey{Name: name}, r); err != nil {
		return client.IgnoreNotFound(err)
	}
	return d.fault(ctx, r, why)
}

// fault marks replica r Faulted, for good, saying why.
func (d VolumeDevices) fault(ctx context.Context, r *pmemv1.PmemReplica, why string) error {
	patch := client.MergeFrom(r.DeepCopy())
	meta.SetStatusCondition(&r.Status.Conditions, metav1.Condition{
		Type: pmemv1.ReadyCondition, Status: metav1.ConditionFalse, Reason: pmemv1.FaultedReason, Message: why, ObservedGeneration: r.Generation,
	})
	if err := d.Writer.Status().Patch(ctx, r, patch); err != nil {
		return fmt.Errorf("fault replica %s: %w", r.Name, err)
	}
	klog.FromContext(ctx).Info("Faulted replica", "replica", r.Name, "node", r.Spec.Node, "reason", why)
	return nil
}

// release gives up this node's claim on the replicated volume volumeID, if it has it.
func (d VolumeDevices) release(ctx context.Context, volumeID string) error {
	vol := &pmemv1.PmemVolume{}
	if err := d.Reader.Get(ctx, client.ObjectKey{Name: volumeID}, vol); err != nil {
		return client.IgnoreNotFound(err)
	}
	if vol.Status.Target != d.Node {
		return nil
	}
	return d.setTarget(ctx, vol, "")
}

// setTarget writes node as vol's target, if vol is still the version read.
func (d VolumeDevices) setTarget(ctx context.Context, vol *pmemv1.PmemVolume, node string) error {
	patch := client.MergeFromWithOptions(vol.DeepCopy(), client.MergeFromWithOptimisticLock{})
	vol.Status.Target = node
	if err := d.Writer.Status().Patch(ctx, vol, patch); err != nil {
		if apierrors.IsConflict(err) {
			return fmt.Errorf("volume %s: %w: it changed meanwhile", vol.Name, errReplicaNotReady)
		}
		return fmt.Errorf("record node %q as the target of volume %s: %w", node, vol.Name, err)
	}
	return nil
}

// replicas returns the replicated volume volumeID and what a target of it writes to;
// pmem.ErrNotFound when the volume is no replicated one.
func (d VolumeDevices) replicas(ctx context.Context, volumeID string) (*pmemv1.PmemVolume, []replication.Replica, error) {
	notHere := fmt.Errorf("volume %s: %w on node %s", volumeID, pmem.ErrNotFound, d.Node)
	vol := &pmemv1.PmemVolume{}
	if err := d.Reader.Get(ctx, client.ObjectKey{Name: volumeID}, vol); apierrors.IsNotFound(err) {
		return nil, nil, notHere
	} else if err != nil {
		return nil, nil, fmt.Errorf("get PmemVolume %s: %w", volumeID, err)
	}
	if vol.Spec.Replicas <= 1 {
		return nil, nil, notHere
	}
	if d.Targets == nil {
		return nil, nil, fmt.Errorf("volume %s is replicated, and node %s has no keys to its replica servers: %w", volumeID, d.Node, pmem.ErrInvalid)
	}
	list := &pmemv1.PmemReplicaList{}
	if err := d.Reader.List(ctx, list, client.MatchingLabels{pmemv1.VolumeLabel: volumeID}); err != nil {
		return nil, nil, fmt.Errorf("list the PmemReplicas of volume %s: %w", volumeID, err)
	}
	// Fewer than spec.replicas: still being made (a replacement is made before the faulted
	// replica it replaces is deleted, so a volume being repaired has them all).
	if len(list.Items) < int(vol.Spec.Replicas) {
		return nil, nil, fmt.Errorf("volume %s: %w: %d of %d exist", volumeID, errReplicaNotReady, len(list.Items), vol.Spec.Replicas)
	}
	replicas := make([]replication.Replica, 0, len(list.Items))
	for _, r := range list.Items {
		if r.Faulted() || r.Retired() {
			continue
		}
		if r.Spec.Node != d.Node {
			lost, err := d.nodeLost(ctx, r.Spec.Node)
			if err != nil {
				return nil, nil, err
			}
			if lost {
				// Its agent, gone with its node, cannot say so itself.
				if err := d.fault(ctx, &r, fmt.Sprintf("node %s is lost", r.Spec.Node)); err != nil {
					return nil, nil, err
				}
				continue
			}
		}
		if !r.HasData() {
			continue // empty, or partly copied: the serving node's Rebuilder brings it in
		}
		ready := meta.FindStatusCondition(r.Status.Conditions, pmemv1.ReadyCondition)
		if r.DeletionTimestamp != nil || ready == nil || ready.Status != metav1.ConditionTrue || ready.ObservedGeneration < r.Generation {
			return nil, nil, fmt.Errorf("volume %s: %w: replica %s on node %s is not", volumeID, errReplicaNotReady, r.Name, r.Spec.Node)
		}
		if r.Spec.Size.Cmp(vol.Spec.Size) < 0 {
			// The controller grows the volume (expandReplicated), then its replicas.
			return nil, nil, fmt.Errorf("volume %s: %w: replica %s on node %s has not grown to the volume's size yet", volumeID, errReplicaNotReady, r.Name, r.Spec.Node)
		}
		rep := replication.Replica{Name: r.Name, Address: r.Status.Address}
		if r.Spec.Node == d.Node {
			// The local replica is written directly, from the back end's own view of it.
			local, err := d.Backend.GetVolume(ctx, r.Name)
			if err != nil {
				return nil, nil, fmt.Errorf("replica %s of volume %s: %w", r.Name, volumeID, err)
			}
			rep.Device = local.Device
		}
		replicas = append(replicas, rep)
	}
	if len(replicas) == 0 {
		return nil, nil, fmt.Errorf("volume %s: every replica is faulted: %w", volumeID, errNoReplica)
	}
	return vol, replicas, nil
}

// Unstage takes down the target of a replicated volume, if it runs here, and gives up this
// node's claim on it.
func (d VolumeDevices) Unstage(ctx context.Context, volumeID string) error {
	if d.Targets == nil {
		return nil
	}
	if _, err := d.Backend.GetVolume(ctx, volumeID); !errors.Is(err, pmem.ErrNotFound) {
		return err // a volume of this node's PMEM: nothing to take down
	}
	if err := d.Targets.Close(ctx, volumeID); err != nil {
		return err
	}
	return d.release(ctx, volumeID)
}
