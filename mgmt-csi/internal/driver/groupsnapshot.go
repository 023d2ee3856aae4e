package driver

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/klog/v2"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pvbridge.io/mgmt-csi/internal/agent"
	"pvbridge.io/mgmt-csi/internal/ids"
	pmemv1 "pvbridge.io/pkg/apis/pmem/v1alpha1"
	"pvbridge.io/pkg/csiserver"
)

// groupControllerServer is the CSI GroupController service: a group snapshot is a set of
// PmemSnapshots that carry the group (spec.group, GroupLabel), which the node agent of their
// node cuts together while the writers of their volumes are held (agent.SnapshotReconciler).
// The members are ordinary snapshots from then on: restored, listed and deleted as any other.
type groupControllerServer struct {
	csi.UnimplementedGroupControllerServer
	*controllerServer
}

var _ csi.GroupControllerServer = (*groupControllerServer)(nil)

func (s *groupControllerServer) GroupControllerGetCapabilities(context.Context, *csi.GroupControllerGetCapabilitiesRequest) (*csi.GroupControllerGetCapabilitiesResponse, error) {
	return csiserver.GroupControllerCapabilities(csi.GroupControllerServiceCapability_RPC_CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT), nil
}

// CreateVolumeGroupSnapshot gets or creates the members of group snapshot name, one per source
// volume, and waits until the node agent has cut them. The volumes must be on one node (a
// replicated one: served by it, with a replica there, groupReplica): the writers are held per
// host; the new members must fit the namespace's snapshot quotas.
// Idempotent by name; a group that failed is removed whole, so that a retry cuts all of its
// members anew, but for one whose cut outlasted the hold (pmemv1.HoldExpiredReason).
func (s *groupControllerServer) CreateVolumeGroupSnapshot(ctx context.Context, req *csi.CreateVolumeGroupSnapshotRequest) (*csi.CreateVolumeGroupSnapshotResponse, error) {
	sources := req.GetSourceVolumeIds()
	switch {
	case req.GetName() == "":
		return nil, status.Error(codes.InvalidArgument, "name is required")
	case len(sources) == 0:
		return nil, status.Error(codes.InvalidArgument, "source_volume_ids is required")
	case len(sources) > maxGroupMembers:
		return nil, status.Errorf(codes.InvalidArgument, "a group snapshot has at most %d members, not %d", maxGroupMembers, len(sources))
	case slices.Contains(sources, ""):
		return nil, status.Error(codes.InvalidArgument, "source_volume_ids has an empty entry")
	case len(sorted(sources)) != len(slices.Compact(sorted(sources))):
		return nil, status.Error(codes.InvalidArgument, "source_volume_ids names a volume twice")
	}
	id := ids.For("groupsnapshot", req.GetName())
	if !s.locks.TryLock(id) {
		return nil, status.Errorf(codes.Aborted, "an operation on group snapshot %s is in progress", id)
	}
	defer s.locks.Unlock(id)

	members, err := s.groupMembers(ctx, id)
	if err != nil {
		return nil, err
	}
	for _, m := range members {
		if !slices.Contains(sources, m.Spec.SourceVolumeID) || int(m.Spec.Group.Size) != len(sources) {
			return nil, status.Errorf(codes.AlreadyExists, "group snapshot %s exists for other volumes (%d, among them %s)", id, m.Spec.Group.Size, m.Spec.SourceVolumeID)
		}
	}
	if len(members) < len(sources) {
		if err := s.snapshotRoom(ctx, req.GetParameters(), len(sources)-len(members)); err != nil {
			return nil, err
		}
		if members, err = s.createMembers(ctx, req.GetName(), id, sources); err != nil {
			return nil, err
		}
	}

	for _, snap := range members {
		failure, err := s.awaitSnapshot(ctx, snap)
		if err != nil {
			return nil, err
		}
		if failure != nil {
			// A group whose cut outlasted the hold keeps its failed members, so that a retry
			// answers the same at once instead of holding the writers again; any other failure
			// removes them, and a retry cuts the group anew.
			if c := conditionsOf(snap); c == nil || c.Reason != pmemv1.HoldExpiredReason {
				for _, m := range members {
					if err := s.deleteObject(ctx, m); err != nil {
						return nil, err
					}
				}
			}
			return nil, status.Errorf(status.Code(failure), "group snapshot %s: member %s of volume %s: %s", id, snap.Name, snap.Spec.SourceVolumeID, status.Convert(failure).Message())
		}
	}
	return &csi.CreateVolumeGroupSnapshotResponse{GroupSnapshot: csiGroupSnapshot(id, members)}, nil
}

// maxGroupMembers bounds a group as PmemSnapshotGroup.size does.
const maxGroupMembers = 1024

// createMembers gets or creates the PmemSnapshot of every source volume of group id, named
// after the group's CSI name and the volume, and returns them in source order.
func (s *groupControllerServer) createMembers(ctx context.Context, name, id string, sources []string) ([]*pmemv1.PmemSnapshot, error) {
	vols := make([]*pmemv1.PmemVolume, len(sources))
	cutOn := make([]string, len(sources))    // the node each member is cut on
	replicas := make([]string, len(sources)) // the replica it is cut from, of a replicated volume
	nodes := map[string][]string{}
	for i, src := range sources {
		vols[i] = &pmemv1.PmemVolume{}
		if err := s.getOrNotFound(ctx, src, vols[i], "volume"); err != nil {
			return nil, err
		}
		cutOn[i] = vols[i].Spec.Node
		if vols[i].Spec.Replicas > 1 {
			r, err := s.groupReplica(ctx, vols[i])
			if err != nil {
				return nil, err
			}
			cutOn[i], replicas[i] = r.Spec.Node, r.Name
		}
		nodes[cutOn[i]] = append(nodes[cutOn[i]], src)
	}
	if len(nodes) > 1 {
		var where []string
		for _, node := range slices.Sorted(maps.Keys(nodes)) {
			where = append(where, fmt.Sprintf("%s on %s", strings.Join(nodes[node], ", "), node))
		}
		return nil, status.Errorf(codes.FailedPrecondition,
			"the volumes of group snapshot %s are on %d nodes (%s): a group's writers are held per host, so its volumes must be on one", id, len(nodes), strings.Join(where, "; "))
	}

	size := int32(min(len(sources), maxGroupMembers))
	members := make([]*pmemv1.PmemSnapshot, len(sources))
	for i, vol := range vols {
		snapID := ids.For("snapshot", name+"/"+vol.Name)
		snap := &pmemv1.PmemSnapshot{
			ObjectMeta: metav1.ObjectMeta{
				Name:        snapID,
				Labels:      map[string]string{pmemv1.NodeLabel: cutOn[i], pmemv1.GroupLabel: id},
				Annotations: map[string]string{pmemv1.NameAnnotation: name},
				Finalizers:  []string{agent.Finalizer},
			},
			Spec: pmemv1.PmemSnapshotSpec{
				Node: cutOn[i], SnapshotID: snapID, SourceVolumeID: vol.Name, SourceReplica: replicas[i],
				Group: &pmemv1.PmemSnapshotGroup{ID: id, Size: size},
			},
		}
		err := s.client.Create(ctx, snap)
		if apierrors.IsAlreadyExists(err) {
			// Created by an earlier call that stopped half way: the name is the group's and the
			// volume's, so it is this member.
			err = s.apiReader.Get(ctx, client.ObjectKey{Name: snapID}, snap)
		}
		if err != nil {
			return nil, csiserver.APIError(err, "create PmemSnapshot %s of group snapshot %s", snapID, id)
		}
		members[i] = snap
	}
	klog.FromContext(ctx).V(2).Info("Created group snapshot", "groupSnapshotID", id, "sourceVolumeIDs", sources, "node", cutOn[0])
	return members, nil
}

// groupReplica chooses the replica of the replicated volume vol that its member of a group
// snapshot is cut from. A volume that a node serves is cut on that node, where its writers are
// held: from its replica there, which has every write the target acknowledged (the quorum
// acknowledges a write once every replica has it). A volume no node serves has no writers,
// and is cut from a replica as a snapshot of its own is (sourceReplica).
func (s *controllerServer) groupReplica(ctx context.Context, vol *pmemv1.PmemVolume) (*pmemv1.PmemReplica, error) {
	if vol.Status.Target == "" {
		return s.sourceReplica(ctx, vol)
	}
	replicas, err := s.replicasOf(ctx, vol.Name)
	if err != nil {
		return nil, err
	}
	for i := range replicas {
		if r := &replicas[i]; r.Spec.Node == vol.Status.Target && withData(r) {
			return r, nil
		}
	}
	return nil, status.Errorf(codes.FailedPrecondition,
		"volume %s is served by node %s, which holds none of its replicas with its data: a group snapshot is cut where its writers are held, from a replica there", vol.Name, vol.Status.Target)
}

// GetVolumeGroupSnapshot describes the members of a group snapshot.
func (s *groupControllerServer) GetVolumeGroupSnapshot(ctx context.Context, req *csi.GetVolumeGroupSnapshotRequest) (*csi.GetVolumeGroupSnapshotResponse, error) {
	id := req.GetGroupSnapshotId()
	if id == "" {
		return nil, status.Error(codes.InvalidArgument, "group_snapshot_id is required")
	}
	members, err := s.groupMembers(ctx, id)
	if err != nil {
		return nil, err
	}
	if len(members) == 0 {
		return nil, status.Errorf(codes.NotFound, "group snapshot %s does not exist", id)
	}
	if want := req.GetSnapshotIds(); len(want) > 0 {
		if have := memberIDs(members); !slices.Equal(have, sorted(want)) {
			return nil, status.Errorf(codes.InvalidArgument, "group snapshot %s has snapshots %s, not %s", id, strings.Join(have, ", "), strings.Join(sorted(want), ", "))
		}
	}
	return &csi.GetVolumeGroupSnapshotResponse{GroupSnapshot: csiGroupSnapshot(id, members)}, nil
}

// DeleteVolumeGroupSnapshot deletes the members of a group snapshot (those it lists and those
// the group still has) and waits until they are gone. A missing group is success.
func (s *groupControllerServer) DeleteVolumeGroupSnapshot(ctx context.Context, req *csi.DeleteVolumeGroupSnapshotRequest) (*csi.DeleteVolumeGroupSnapshotResponse, error) {
	id := req.GetGroupSnapshotId()
	if id == "" {
		return nil, status.Error(codes.InvalidArgument, "group_snapshot_id is required")
	}
	if !s.locks.TryLock(id) {
		return nil, status.Errorf(codes.Aborted, "an operation on group snapshot %s is in progress", id)
	}
	defer s.locks.Unlock(id)
	members, err := s.groupMembers(ctx, id)
	if err != nil {
		return nil, err
	}
	ids := memberIDs(members)
	for _, snapID := range req.GetSnapshotIds() {
		if !slices.Contains(ids, snapID) {
			ids = append(ids, snapID)
		}
	}
	for _, snapID := range ids {
		if !s.locks.TryLock(snapID) {
			return nil, status.Errorf(codes.Aborted, "an operation on snapshot %s is in progress", snapID)
		}
		defer s.locks.Unlock(snapID)
	}
	// All at once, then wait for each: the node agent removes them in parallel.
	for _, m := range members {
		if err := s.deleteObject(ctx, m); err != nil {
			return nil, err
		}
	}
	for _, snapID := range ids {
		if err := s.deleteAndWait(ctx, kindSnapshot, snapID, &pmemv1.PmemSnapshot{}); err != nil {
			return nil, err
		}
	}
	return &csi.DeleteVolumeGroupSnapshotResponse{}, nil
}

// groupMembers lists the PmemSnapshots of group id from the cache, in name order.
func (s *controllerServer) groupMembers(ctx context.Context, id string) ([]*pmemv1.PmemSnapshot, error) {
	list := &pmemv1.PmemSnapshotList{}
	if err := s.reader.List(ctx, list, client.MatchingLabels{pmemv1.GroupLabel: id}); err != nil {
		return nil, csiserver.APIError(err, "list the PmemSnapshots of group snapshot %s", id)
	}
	members := make([]*pmemv1.PmemSnapshot, 0, len(list.Items))
	for i := range list.Items {
		if g := list.Items[i].Spec.Group; g != nil && g.ID == id {
			members = append(members, &list.Items[i])
		}
	}
	slices.SortFunc(members, func(a, b *pmemv1.PmemSnapshot) int { return strings.Compare(a.Name, b.Name) })
	return members, nil
}

func csiGroupSnapshot(id string, members []*pmemv1.PmemSnapshot) *csi.VolumeGroupSnapshot {
	group := &csi.VolumeGroupSnapshot{GroupSnapshotId: id, ReadyToUse: true}
	for _, m := range members {
		snap := csiSnapshot(m)
		snap.GroupSnapshotId = id
		group.Snapshots = append(group.Snapshots, snap)
		group.ReadyToUse = group.ReadyToUse && snap.GetReadyToUse()
		if t := snap.GetCreationTime(); t != nil && (group.CreationTime == nil || t.AsTime().Before(group.CreationTime.AsTime())) {
			group.CreationTime = snap.GetCreationTime()
		}
	}
	return group
}

func memberIDs(members []*pmemv1.PmemSnapshot) []string {
	var out []string
	for _, m := range members {
		out = append(out, m.Name)
	}
	return sorted(out)
}

func sorted(s []string) []string { return slices.Sorted(slices.Values(s)) }
