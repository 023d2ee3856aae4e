package driver

import (
	"context"
	"errors"
	"fmt"
	"slices"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/klog/v2"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"

	"pvbridge.io/mgmt-csi/internal/agent"
	"pvbridge.io/mgmt-csi/internal/ids"
	pmemv1 "pvbridge.io/pkg/apis/pmem/v1alpha1"
	"pvbridge.io/pkg/hostloss"
)

// ReplaceFaulted gives the replicated volume vol a new replica (spec.rebuild: the node that
// serves the volume copies it in, Rebuilder) for each faulted one, on a node that holds no
// other live replica of it and is not lost, then deletes the faulted one, whose PMEM its
// agent frees (or, on a lost node, whose agent never will, its finalizer is removed). The new
// replica's name derives from the faulted one's UID, so that a retry finds it, and no name is
// ever used twice: a target that had a replica of that name must never take another for it.
// The replicated-volume reconciler calls it (replicated.Replacer).
func (s *controllerServer) ReplaceFaulted(ctx context.Context, vol *pmemv1.PmemVolume) error {
	list := &pmemv1.PmemReplicaList{}
	if err := s.apiReader.List(ctx, list, client.MatchingLabels{pmemv1.VolumeLabel: vol.Name}); err != nil {
		return fmt.Errorf("list the PmemReplicas of volume %s: %w", vol.Name, err)
	}
	var taken, names []string
	for _, r := range list.Items {
		names = append(names, r.Name)
		if !r.Faulted() && r.DeletionTimestamp.IsZero() {
			taken = append(taken, r.Spec.Node)
		}
	}
	var errs []error
	for i := range list.Items {
		f := &list.Items[i]
		if !f.Faulted() {
			continue
		}
		if f.DeletionTimestamp.IsZero() {
			name := ids.For("replica", vol.Name+"-for-"+string(f.UID))
			if !slices.Contains(names, name) {
				node, err := s.replacementNode(ctx, vol, taken)
				if err != nil {
					errs = append(errs, err)
					continue
				}
				if err := s.client.Create(ctx, newReplica(vol, name, node, true)); err != nil && !apierrors.IsAlreadyExists(err) {
					errs = append(errs, fmt.Errorf("create PmemReplica %s: %w", name, err))
					continue
				}
				taken = append(taken, node)
				klog.FromContext(ctx).Info("Placed a replica to replace a faulted one", "volumeID", vol.Name, "replica", name, "node", node, "faulted", f.Name)
			}
			if err := s.client.Delete(ctx, f); client.IgnoreNotFound(err) != nil {
				errs = append(errs, fmt.Errorf("delete faulted PmemReplica %s: %w", f.Name, err))
				continue
			}
		}
		lost, err := hostloss.Lost(ctx, s.apiReader, s.apiReader, f.Spec.Node)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if lost && controllerutil.ContainsFinalizer(f, agent.Finalizer) {
			patch := client.MergeFrom(f.DeepCopy())
			controllerutil.RemoveFinalizer(f, agent.Finalizer)
			if err := s.client.Patch(ctx, f, patch); client.IgnoreNotFound(err) != nil {
				errs = append(errs, fmt.Errorf("release faulted PmemReplica %s of lost node %s: %w", f.Name, f.Spec.Node, err))
			}
		}
	}
	return errors.Join(errs...)
}

// replacementNode chooses a node for a new replica of vol, none of taken and none lost.
func (s *controllerServer) replacementNode(ctx context.Context, vol *pmemv1.PmemVolume, taken []string) (string, error) {
	taken = slices.Clone(taken)
	for {
		nodes, err := s.chooseReplicaNodes(ctx, vol, 1, taken, nil, 0)
		if err != nil {
			return "", err
		}
		lost, err := hostloss.Lost(ctx, s.apiReader, s.apiReader, nodes[0])
		if err != nil || !lost {
			return nodes[0], err
		}
		taken = append(taken, nodes[0])
	}
}
