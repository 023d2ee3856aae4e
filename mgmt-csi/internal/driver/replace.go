package driver

import (
	"context"
	"errors"
	"fmt"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/klog/v2"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"

	"pvbridge.io/mgmt-csi/internal/agent"
	"pvbridge.io/mgmt-csi/internal/ids"
	pmemv1 "pvbridge.io/pkg/apis/pmem/v1alpha1"
	"pvbridge.io/pkg/hostloss"
)

// Repair keeps the replicas of the replicated volume vol whole and off drained nodes; the
// replicated-volume reconciler calls it (replicated.Repairer) for every Ready volume.
//
//   - A faulted replica is replaced: a new replica (spec.rebuild: the node that serves the
//     volume copies it in, Rebuilder) on a node that holds no other live replica of it and is
//     neither lost nor drained; then the faulted one is deleted.
//   - A live replica on a drained node (vmv1.DrainTaint) gets its replacement the same way; once
//     that one has the data, the node that serves the volume takes the drained one out of its
//     target and reports it Retired (Rebuilder), or, when no node serves the volume, it is
//     deleted at once.
//   - A retired replica is deleted.
//
// A deleted replica's agent frees its PMEM; on a lost node, whose agent never will, its
// finalizer is removed. A replacement's name derives from the UID of the replica it replaces,
// so that a retry finds it, and no name is ever used twice: a target that had a replica of a
// name must never take another for it (its `rebuilt` file would say done).
func (s *controllerServer) Repair(ctx context.Context, vol *pmemv1.PmemVolume) error {
	list := &pmemv1.PmemReplicaList{}
	if err := s.apiReader.List(ctx, list, client.MatchingLabels{pmemv1.VolumeLabel: vol.Name}); err != nil {
		return fmt.Errorf("list the PmemReplicas of volume %s: %w", vol.Name, err)
	}
	r := repair{s: s, vol: vol, byName: map[string]*pmemv1.PmemReplica{}}
	for i := range list.Items {
		rep := &list.Items[i]
		r.byName[rep.Name] = rep
		if rep.Live() {
			r.taken = append(r.taken, rep.Spec.Node)
		}
	}
	var errs []error
	for i := range list.Items {
		errs = append(errs, r.one(ctx, &list.Items[i]))
	}
	return errors.Join(errs...)
}

// repair is one pass of Repair over a volume's replicas.
type repair struct {
	s      *controllerServer
	vol    *pmemv1.PmemVolume
	byName map[string]*pmemv1.PmemReplica
	taken  []string // the nodes of the live replicas, and of the replacements made
}

// one repairs replica rep.
func (r *repair) one(ctx context.Context, rep *pmemv1.PmemReplica) error {
	if !rep.DeletionTimestamp.IsZero() {
		return r.releaseLost(ctx, rep)
	}
	switch {
	case rep.Faulted():
		if _, err := r.replacement(ctx, rep); err != nil {
			return err
		}
		return r.delete(ctx, rep, "faulted")
	case rep.Retired():
		return r.delete(ctx, rep, "retired")
	case !rep.HasData():
		return nil
	}
	state, err := hostloss.StateOf(ctx, r.s.reader, r.s.apiReader, rep.Spec.Node)
	if err != nil || state != hostloss.Drained {
		return err // a live replica of a lost node: the next stage faults it
	}
	repl, err := r.replacement(ctx, rep)
	if err != nil {
		return fmt.Errorf("move replica %s off drained node %s: %w", rep.Name, rep.Spec.Node, err)
	}
	if repl != nil && repl.HasData() && r.vol.Status.Target == "" {
		return r.delete(ctx, rep, "drained") // in no target
	}
	return nil
}

// replacement returns the replica that replaces rep, creating it first on a node that holds no
// live replica of the volume and is neither lost nor drained; nil when just created.
func (r *repair) replacement(ctx context.Context, rep *pmemv1.PmemReplica) (*pmemv1.PmemReplica, error) {
	name := ids.For("replica", r.vol.Name+"-for-"+string(rep.UID))
	if repl, ok := r.byName[name]; ok {
		return repl, nil
	}
	nodes, err := r.s.chooseReplicaNodes(ctx, r.vol, 1, r.taken, nil, 0)
	if err != nil {
		return nil, err
	}
	repl := newReplica(r.vol, name, nodes[0], true)
	repl.Annotations = map[string]string{pmemv1.ReplacesAnnotation: rep.Name}
	if err := r.s.client.Create(ctx, repl); err != nil && !apierrors.IsAlreadyExists(err) {
		return nil, fmt.Errorf("create PmemReplica %s: %w", name, err)
	}
	r.taken = append(r.taken, nodes[0])
	klog.FromContext(ctx).Info("Placed a replica to replace another", "volumeID", r.vol.Name, "replica", name, "node", nodes[0], "replaces", rep.Name)
	return nil, nil
}

// delete deletes replica rep, which is why, and releases it if its node is lost.
func (r *repair) delete(ctx context.Context, rep *pmemv1.PmemReplica, why string) error {
	if err := r.s.client.Delete(ctx, rep); client.IgnoreNotFound(err) != nil {
		return fmt.Errorf("delete %s PmemReplica %s: %w", why, rep.Name, err)
	}
	klog.FromContext(ctx).Info("Deleted a replica", "volumeID", r.vol.Name, "replica", rep.Name, "node", rep.Spec.Node, "why", why)
	return r.releaseLost(ctx, rep)
}

// releaseLost removes the agent's finalizer of replica rep, being deleted, if its node is lost.
func (r *repair) releaseLost(ctx context.Context, rep *pmemv1.PmemReplica) error {
	if !controllerutil.ContainsFinalizer(rep, agent.Finalizer) {
		return nil
	}
	lost, err := hostloss.Lost(ctx, r.s.reader, r.s.apiReader, rep.Spec.Node)
	if err != nil || !lost {
		return err
	}
	patch := client.MergeFrom(rep.DeepCopy())
	controllerutil.RemoveFinalizer(rep, agent.Finalizer)
	if err := r.s.client.Patch(ctx, rep, patch); client.IgnoreNotFound(err) != nil {
		return fmt.Errorf("release PmemReplica %s of lost node %s: %w", rep.Name, rep.Spec.Node, err)
	}
	return nil
}
