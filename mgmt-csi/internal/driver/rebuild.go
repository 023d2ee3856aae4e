package driver

import (
	"context"
	"errors"
	"fmt"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/klog/v2"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pvbridge.io/mgmt-csi/internal/replication"
	pmemv1 "pvbridge.io/pkg/apis/pmem/v1alpha1"
	"pvbridge.io/pkg/hostloss"
	"pvbridge.io/pkg/keylock"
)

// rebuildInterval is how often the node looks for replicas to rebuild into the volumes it serves.
const rebuildInterval = 10 * time.Second

// Rebuilder runs on each node agent with replication: it copies every rebuilt replica
// (spec.rebuild) of a volume this node serves into the volume's target once the replica's node
// exports it (Ready), then reports it InSync. Until then no target reads from it (Stage leaves
// it out). A volume that no node serves is served, for its rebuild, by the node of the replica
// (idle). The copy goes over NBD even into a replica of this node, through its own replica
// server. Then it retires the replicas of drained nodes that others replaced (retire).
type Rebuilder struct {
	Devices VolumeDevices
	// Locks are the node service's volume locks: an idle volume served for its rebuild is
	// locked as a stage locks it.
	Locks *keylock.Locks
	// Interval is how often it looks; zero: rebuildInterval.
	Interval time.Duration
}

// Start rebuilds until ctx ends: a controller-runtime Runnable of the node agent.
func (b Rebuilder) Start(ctx context.Context) error {
	interval := b.Interval
	if interval <= 0 {
		interval = rebuildInterval
	}
	tick := time.NewTicker(interval)
	defer tick.Stop()
	for {
		if err := b.pass(ctx); err != nil && ctx.Err() == nil {
			klog.FromContext(ctx).Error(err, "Rebuilding replicas")
		}
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		}
	}
}

// pass rebuilds, one after another, the replicas that wait for it in the volumes served here,
// then those of this node whose volume no node serves (idle).
func (b Rebuilder) pass(ctx context.Context) error {
	ids, err := b.Devices.Targets.Running()
	if err != nil {
		return err
	}
	states := nodeStates{reader: b.Devices.Reader, m: map[string]hostloss.State{}}
	var errs []error
	for _, id := range ids {
		errs = append(errs, b.serve(ctx, id, states))
	}
	return errors.Join(append(errs, b.idle(ctx, states))...)
}

// nodeStates reads each node's hostloss.State once in a pass.
type nodeStates struct {
	reader client.Reader
	m      map[string]hostloss.State
}

func (n nodeStates) of(ctx context.Context, node string) (hostloss.State, error) {
	if st, ok := n.m[node]; ok {
		return st, nil
	}
	st, err := hostloss.StateOf(ctx, n.reader, n.reader, node)
	if err == nil {
		n.m[node] = st
	}
	return st, err
}

// serve rebuilds the replicas that wait for it in volume id, whose target runs here, then
// retires those of drained nodes.
func (b Rebuilder) serve(ctx context.Context, id string, states nodeStates) error {
	list := &pmemv1.PmemReplicaList{}
	if err := b.Devices.Reader.List(ctx, list, client.MatchingLabels{pmemv1.VolumeLabel: id}); err != nil {
		return fmt.Errorf("list the PmemReplicas of volume %s: %w", id, err)
	}
	var errs []error
	for i := range list.Items {
		r := &list.Items[i]
		if !awaitsRebuild(r) {
			continue
		}
		log := klog.FromContext(ctx).WithValues("volumeID", id, "replica", r.Name, "node", r.Spec.Node)
		start := time.Now()
		err := b.Devices.Targets.Rebuild(klog.NewContext(ctx, log), id, replication.Replica{Name: r.Name, Address: r.Status.Address})
		if errors.Is(err, replication.ErrNotServed) {
			return nil // unstaged meanwhile
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("rebuild replica %s of volume %s: %w", r.Name, id, err))
			continue
		}
		if err := b.inSync(ctx, r); err != nil {
			errs = append(errs, err)
			continue
		}
		log.Info("Replica in sync", "took", time.Since(start).Round(time.Millisecond))
	}
	return errors.Join(append(errs, b.retire(ctx, id, list.Items, states))...)
}

// idle rebuilds each replica of this node that waits for a rebuild while no node serves its
// volume (a drain or a repair of a volume no pod uses): this node serves the volume for the
// copy, claimed as a stage claims it, so that no other node serves it meanwhile (a stage there
// answers FailedPrecondition and kubelet retries), then lets it go. A stage of the volume on
// this node waits on the volume's lock (Aborted).
func (b Rebuilder) idle(ctx context.Context, states nodeStates) error {
	list := &pmemv1.PmemReplicaList{}
	if err := b.Devices.Reader.List(ctx, list, client.MatchingLabels{pmemv1.NodeLabel: b.Devices.Node}); err != nil {
		return fmt.Errorf("list the PmemReplicas of node %s: %w", b.Devices.Node, err)
	}
	var errs []error
	for i := range list.Items {
		r := &list.Items[i]
		if awaitsRebuild(r) {
			errs = append(errs, b.serveIdle(ctx, r.Spec.VolumeID, states))
		}
	}
	return errors.Join(errs...)
}

// serveIdle serves volume id for its rebuild, unless a node serves it.
func (b Rebuilder) serveIdle(ctx context.Context, id string, states nodeStates) error {
	vol := &pmemv1.PmemVolume{}
	if err := b.Devices.Reader.Get(ctx, client.ObjectKey{Name: id}, vol); err != nil {
		return client.IgnoreNotFound(err)
	}
	if vol.Status.Target != "" || !b.Locks.TryLock(id) {
		return nil // served, or being staged here
	}
	defer b.Locks.Unlock(id)
	if dev, err := b.Devices.Targets.Device(id); err != nil || dev != "" {
		return err // staged here meanwhile: the next pass serves it
	}
	if _, err := b.Devices.Stage(ctx, id); err != nil {
		if errors.Is(err, errServedElsewhere) || errors.Is(err, errReplicaNotReady) {
			return nil
		}
		return fmt.Errorf("serve volume %s for its rebuild: %w", id, err)
	}
	klog.FromContext(ctx).Info("Serving a volume that no node serves, for its rebuild", "volumeID", id)
	return errors.Join(b.serve(ctx, id, states), b.Devices.Unstage(ctx, id))
}

// retire takes each replica of a drained node out of the target of volume id once the volume
// has as many replicas with its data elsewhere (on nodes neither drained nor lost) as it
// wants, and reports it Retired, for the controller to delete (Repair). replicas are the
// volume's, as serve left them (a rebuilt one reported in sync).
func (b Rebuilder) retire(ctx context.Context, id string, replicas []pmemv1.PmemReplica, states nodeStates) error {
	var drained []*pmemv1.PmemReplica
	elsewhere := 0
	for i := range replicas {
		r := &replicas[i]
		if !r.Live() || !r.HasData() {
			continue
		}
		state, err := states.of(ctx, r.Spec.Node)
		if err != nil {
			return err
		}
		switch state {
		case hostloss.Drained:
			drained = append(drained, r)
		case hostloss.Available:
			elsewhere++
		}
	}
	if len(drained) == 0 {
		return nil
	}
	vol := &pmemv1.PmemVolume{}
	if err := b.Devices.Reader.Get(ctx, client.ObjectKey{Name: id}, vol); err != nil {
		return client.IgnoreNotFound(err)
	}
	if elsewhere < int(vol.Spec.Replicas) {
		return nil // no replica is retired before the volume has its replicas elsewhere
	}
	for _, r := range drained {
		if err := b.Devices.Targets.Retire(ctx, id, r.Name); errors.Is(err, replication.ErrNotServed) {
			return nil // unstaged meanwhile
		} else if err != nil {
			return err
		}
		if err := b.report(ctx, r, metav1.Condition{
			Type: pmemv1.ReadyCondition, Status: metav1.ConditionFalse, Reason: pmemv1.RetiredReason,
			Message: fmt.Sprintf("node %s is drained, and the volume has its %d replicas elsewhere: node %s took this one out of its target", r.Spec.Node, vol.Spec.Replicas, b.Devices.Node),
		}); err != nil {
			return err
		}
		klog.FromContext(ctx).Info("Retired a replica of a drained node", "volumeID", id, "replica", r.Name, "node", r.Spec.Node)
	}
	return nil
}

// awaitsRebuild tells whether r is a rebuilt replica, exported and not faulted, whose copy has
// not been reported done.
func awaitsRebuild(r *pmemv1.PmemReplica) bool {
	ready := meta.FindStatusCondition(r.Status.Conditions, pmemv1.ReadyCondition)
	return !r.HasData() && r.DeletionTimestamp.IsZero() && r.Status.Address != "" &&
		ready != nil && ready.Status == metav1.ConditionTrue && ready.ObservedGeneration >= r.Generation
}

// inSync reports replica r in sync.
func (b Rebuilder) inSync(ctx context.Context, r *pmemv1.PmemReplica) error {
	return b.report(ctx, r, metav1.Condition{
		Type: pmemv1.InSyncCondition, Status: metav1.ConditionTrue, Reason: pmemv1.RebuiltReason,
		Message: "copied from node " + b.Devices.Node,
	})
}

// report sets cond on replica r (updated in place), unless its status changed since it was
// read (its agent may have faulted it meanwhile): the next pass looks again.
func (b Rebuilder) report(ctx context.Context, r *pmemv1.PmemReplica, cond metav1.Condition) error {
	patch := client.MergeFromWithOptions(r.DeepCopy(), client.MergeFromWithOptimisticLock{})
	cond.ObservedGeneration = r.Generation
	meta.SetStatusCondition(&r.Status.Conditions, cond)
	if err := b.Devices.Writer.Status().Patch(ctx, r, patch); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("report replica %s %s: %w", r.Name, cond.Reason, err)
	}
	return nil
}
