package driver

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"

	"github.com/container-storage-interface/spec/lib/go/csi"
	groupsnapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumegroupsnapshot/v1"
	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pvbridge.io/guest-csi/internal/request"
	"pvbridge.io/pkg/csiserver"
	"pvbridge.io/pkg/tenancy"
)

// groupControllerServer is the GroupController service. A guest group snapshot is a management
// VolumeGroupSnapshot of its member claims, which the management snapshot-controller and
// mgmt-csi take; each member becomes a management VolumeSnapshot, which restores like any other.
// The service shares the controller service's connection, cache and locks.
//
// A management VolumeGroupSnapshot selects its claims by label: tenancy.ClusterUIDLabel and
// tenancy.VolumeGroupLabel = request.GroupLabel. Before it is created, each member claim is labelled (a
// merge patch under the claim's resourceVersion); once it is ready, the labels are removed. A
// claim is in one group at a time: labelled for another group whose VolumeGroupSnapshot is still
// being taken, it makes the call Aborted (csi-snapshotter calls again); a label left by a group
// that is gone or ready is overwritten.
type groupControllerServer struct {
	csi.UnimplementedGroupControllerServer
	*controllerServer

	// labelling is held while a group labels its claims and creates its VolumeGroupSnapshot: a
	// group that finds a claim labelled for another then finds that group's VolumeGroupSnapshot
	// in the apiserver, or none because the other gave up.
	labelling sync.Mutex
}

var _ csi.GroupControllerServer = (*groupControllerServer)(nil)

func (s *groupControllerServer) GroupControllerGetCapabilities(context.Context, *csi.GroupControllerGetCapabilitiesRequest) (*csi.GroupControllerGetCapabilitiesResponse, error) {
	return csiserver.GroupControllerCapabilities(csi.GroupControllerServiceCapability_RPC_CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT), nil
}

// CreateVolumeGroupSnapshot gets or creates the management VolumeGroupSnapshot of a guest group
// snapshot and waits until it and every member snapshot are ready to use: csi-snapshotter keeps
// the members of its first successful answer, so no answer holds fewer.
func (s *groupControllerServer) CreateVolumeGroupSnapshot(ctx context.Context, req *csi.CreateVolumeGroupSnapshotRequest) (*csi.CreateVolumeGroupSnapshotResponse, error) {
	if err := validateCSIName(req.GetName()); err != nil {
		return nil, err
	}
	sources, err := groupSources(req.GetSourceVolumeIds())
	if err != nil {
		return nil, err
	}
	params, err := request.ParseSnapshotParameters(req.GetParameters(), "", request.GroupSnapshotKeys)
	if err != nil {
		return nil, err
	}
	c, err := s.cluster()
	if err != nil {
		return nil, err
	}
	name := request.GroupSnapshotName(c.UID, req.GetName())
	unlock, err := s.lock(name)
	if err != nil {
		return nil, err
	}
	defer unlock()
	ctx = klog.NewContext(ctx, klog.FromContext(ctx).WithValues("groupSnapshotID", name))
	what := fmt.Sprintf("management VolumeGroupSnapshot %s/%s", c.Namespace, name)

	vgs := &groupsnapshotv1.VolumeGroupSnapshot{}
	switch err := s.mgmt.Get(ctx, client.ObjectKey{Namespace: c.Namespace, Name: name}, vgs); {
	case apierrors.IsNotFound(err):
		if err := s.createGroup(ctx, c, name, req.GetName(), sources, params); err != nil {
			return nil, err
		}
	case err != nil:
		return nil, csiserver.APIError(err, "get %s", what)
	default:
		if err := s.sameGroup(ctx, c, vgs, sources); err != nil {
			return nil, err
		}
	}

	got := &groupsnapshotv1.VolumeGroupSnapshot{}
	if err := s.await(ctx, kindGroupSnapshot, name, got, func(found bool) (bool, error) {
		switch {
		case !found:
			return false, nil
		case got.DeletionTimestamp != nil:
			return false, status.Errorf(codes.Aborted, "%s is being deleted", what)
		}
		return groupReady(got), nil
	}); err != nil {
		return nil, withSnapshotError(err, what, got)
	}
	group, pending, err := s.csiGroupSnapshot(ctx, got, sources)
	if err != nil {
		return nil, err
	}
	if len(pending) > 0 {
		// snapshot-controller makes the members ready just after the group; they are not
		// watched (not labelled), so the sidecar's next call looks again.
		return nil, status.Errorf(codes.DeadlineExceeded, "%s is ready, but not yet the member snapshots of %s", what, strings.Join(pending, ", "))
	}
	s.releaseMembers(ctx, c, request.GroupLabel(c.UID, name))
	return &csi.CreateVolumeGroupSnapshotResponse{GroupSnapshot: group}, nil
}

// groupSources validates source_volume_ids: at least one, none empty, none twice. It returns
// them sorted.
func groupSources(ids []string) ([]string, error) {
	if len(ids) == 0 {
		return nil, status.Error(codes.InvalidArgument, "source_volume_ids are required")
	}
	sorted := slices.Sorted(slices.Values(ids))
	for i, id := range sorted {
		switch {
		case id == "":
			return nil, status.Error(codes.InvalidArgument, "source_volume_ids holds an empty volume ID")
		case i > 0 && sorted[i-1] == id:
			return nil, status.Errorf(codes.InvalidArgument, "source_volume_ids holds volume %s twice", id)
		}
	}
	return sorted, nil
}

// createGroup labels the member claims and creates the management VolumeGroupSnapshot that
// selects them.
func (s *groupControllerServer) createGroup(ctx context.Context, c tenancy.Cluster, name, csiName string, sources []string, params request.SnapshotParams) error {
	s.labelling.Lock()
	defer s.labelling.Unlock()
	group := request.GroupLabel(c.UID, name)
	if err := s.labelMembers(ctx, c, group, sources); err != nil {
		return err
	}
	vgs := &groupsnapshotv1.VolumeGroupSnapshot{
		ObjectMeta: mgmtObjectMeta(c, name, csiName),
		Spec: groupsnapshotv1.VolumeGroupSnapshotSpec{Source: groupsnapshotv1.VolumeGroupSnapshotSource{
			Selector: &metav1.LabelSelector{MatchLabels: map[string]string{tenancy.ClusterUIDLabel: c.UID, tenancy.VolumeGroupLabel: group}},
		}},
	}
	if params.Class != "" {
		vgs.Spec.VolumeGroupSnapshotClassName = ptr.To(params.Class)
	}
	if v := guestObject(params.GuestSnapshot); v != "" {
		vgs.Annotations[tenancy.GuestSnapshotAnnotation] = v
	}
	if err := s.mgmt.Create(ctx, vgs); err != nil {
		return csiserver.APIError(err, "create management VolumeGroupSnapshot %s/%s", c.Namespace, name)
	}
	klog.FromContext(ctx).V(2).Info("Created management VolumeGroupSnapshot", "sources", sources)
	return nil
}

// labelMembers labels the member claims with group, after taking the label from claims that
// carry it but are not members (an earlier call's). A member must be a claim the cluster owns:
// a guest may label only its own claims (the admission policy), so a VolumeGroupSnapshot of a
// shared claim could never select it. Each claim is written under the resourceVersion its
// decision was made on, also when it carries the label already (the cache may be behind a
// change of its label): a conflict reads it again.
func (s *groupControllerServer) labelMembers(ctx context.Context, c tenancy.Cluster, group string, sources []string) error {
	if err := s.unlabel(ctx, c, group, sources); err != nil {
		return err
	}
	for _, id := range sources {
		obj, access, err := s.accessible(ctx, c, kindPVC, id)
		if err != nil {
			return err
		}
		if access != tenancy.Owned {
			return status.Errorf(codes.FailedPrecondition,
				"management PVC %s/%s is shared with cluster %s, not owned by it: a group snapshot holds only volumes the cluster owns", c.Namespace, id, c.Name)
		}
		pvc := obj.(*corev1.PersistentVolumeClaim)
		if err := s.tryUpdate(ctx, pvc, func() (bool, error) {
			if other := pvc.Labels[tenancy.VolumeGroupLabel]; other != "" && other != group {
				if err := s.notInProgress(ctx, c, other, id); err != nil {
					return false, err
				}
			}
			metav1.SetMetaDataLabel(&pvc.ObjectMeta, tenancy.VolumeGroupLabel, group)
			return true, nil
		}); err != nil {
			if _, refused := status.FromError(err); refused {
				return err
			}
			return csiserver.APIError(err, "label management PVC %s/%s for its group snapshot", c.Namespace, id)
		}
	}
	klog.FromContext(ctx).V(2).Info("Labelled the member claims", "label", tenancy.VolumeGroupLabel+"="+group)
	return nil
}

// notInProgress fails with Aborted while claim id carries the label of group other whose
// management VolumeGroupSnapshot is being taken; the label of a group that is gone or ready is
// stale.
func (s *groupControllerServer) notInProgress(ctx context.Context, c tenancy.Cluster, other, id string) error {
	obj, err := s.lookup(ctx, c, kindGroupSnapshot, c.UID+"-"+other)
	switch {
	case status.Code(err) == codes.NotFound:
		return nil
	case err != nil:
		return err
	case groupReady(obj.(*groupsnapshotv1.VolumeGroupSnapshot)):
		return nil
	}
	return status.Errorf(codes.Aborted, "management PVC %s/%s is a member of VolumeGroupSnapshot %s/%s, which is being taken: a volume is in one group snapshot at a time",
		c.Namespace, id, c.Namespace, obj.GetName())
}

// sameGroup checks that an existing management VolumeGroupSnapshot is the one a repeated call
// asks for: the cluster's, selecting its group's label and, until it is ready, of the claims that
// carry that label (once it is ready, its member snapshots tell: csiGroupSnapshot).
func (s *groupControllerServer) sameGroup(ctx context.Context, c tenancy.Cluster, vgs *groupsnapshotv1.VolumeGroupSnapshot, sources []string) error {
	what := fmt.Sprintf("management VolumeGroupSnapshot %s/%s", vgs.Namespace, vgs.Name)
	group := request.GroupLabel(c.UID, vgs.Name)
	switch {
	case tenancy.AccessOf(vgs, c) != tenancy.Owned:
		return status.Errorf(codes.AlreadyExists, "%s exists and was not created for cluster %s", what, c.Name)
	case vgs.Spec.Source.Selector == nil || vgs.Spec.Source.Selector.MatchLabels[tenancy.VolumeGroupLabel] != group:
		return status.Errorf(codes.AlreadyExists, "%s exists and selects other claims", what)
	case vgs.DeletionTimestamp != nil || groupReady(vgs):
		return nil
	}
	claims, err := s.labelled(ctx, c, group)
	if err != nil {
		return err
	}
	if members := claimNames(claims); !slices.Equal(members, sources) {
		return status.Errorf(codes.AlreadyExists, "%s exists for volumes %s", what, strings.Join(members, ", "))
	}
	return nil
}

// labelled lists, from the apiserver, the cluster's claims that carry the label of group.
func (s *groupControllerServer) labelled(ctx context.Context, c tenancy.Cluster, group string) ([]corev1.PersistentVolumeClaim, error) {
	list := &corev1.PersistentVolumeClaimList{}
	if err := s.mgmt.Live().List(ctx, list, client.InNamespace(c.Namespace),
		client.MatchingLabels{tenancy.ClusterUIDLabel: c.UID, tenancy.VolumeGroupLabel: group}); err != nil {
		return nil, csiserver.APIError(err, "list the management PVCs labelled %s=%s", tenancy.VolumeGroupLabel, group)
	}
	return list.Items, nil
}

// claimNames are the sorted names of claims.
func claimNames(claims []corev1.PersistentVolumeClaim) []string {
	names := make([]string, 0, len(claims))
	for i := range claims {
		names = append(names, claims[i].Name)
	}
	slices.Sort(names)
	return names
}

// unlabel takes the label of group from the cluster's claims that carry it, but those of keep.
func (s *groupControllerServer) unlabel(ctx context.Context, c tenancy.Cluster, group string, keep []string) error {
	claims, err := s.labelled(ctx, c, group)
	if err != nil {
		return err
	}
	for i := range claims {
		pvc := &claims[i]
		if slices.Contains(keep, pvc.Name) {
			continue
		}
		if err := s.update(ctx, pvc, func() bool {
			if pvc.Labels[tenancy.VolumeGroupLabel] != group {
				return false
			}
			delete(pvc.Labels, tenancy.VolumeGroupLabel)
			return true
		}); err != nil {
			return csiserver.APIError(err, "remove label %s from management PVC %s/%s", tenancy.VolumeGroupLabel, c.Namespace, pvc.Name)
		}
	}
	return nil
}

// releaseMembers takes the label of group from its claims once its VolumeGroupSnapshot is ready
// or deleted: the group has chosen its members. Best effort: a label left behind is stale, and
// the next call of the group tries again.
func (s *groupControllerServer) releaseMembers(ctx context.Context, c tenancy.Cluster, group string) {
	if err := s.unlabel(ctx, c, group, nil); err != nil {
		klog.FromContext(ctx).Info("Could not remove the group label from the member claims; they keep a stale label", "err", err.Error())
	}
}

// csiGroupSnapshot describes a management VolumeGroupSnapshot and its members: the
// VolumeSnapshots snapshot-controller made for it (their ownerReference), one per member claim.
// They carry no label of the cluster, so they are read from the apiserver. Given sources
// (CreateVolumeGroupSnapshot's), a member of another claim is AlreadyExists, and pending lists
// the sources without a ready member; without, the members are those that exist. The group is
// ready to use when the VolumeGroupSnapshot and every member are.
func (s *groupControllerServer) csiGroupSnapshot(ctx context.Context, vgs *groupsnapshotv1.VolumeGroupSnapshot, sources []string) (*csi.VolumeGroupSnapshot, []string, error) {
	what := fmt.Sprintf("management VolumeGroupSnapshot %s/%s", vgs.Namespace, vgs.Name)
	list := &snapshotv1.VolumeSnapshotList{}
	if err := s.mgmt.Live().List(ctx, list, client.InNamespace(vgs.Namespace)); err != nil {
		return nil, nil, csiserver.APIError(err, "list the member snapshots of %s", what)
	}
	members := map[string]*snapshotv1.VolumeSnapshot{}
	for i := range list.Items {
		snap := &list.Items[i]
		// A member without a claim is one whose volume snapshot-controller did not find: it
		// maps to no source, which stays pending.
		source := ptr.Deref(snap.Spec.Source.PersistentVolumeClaimName, "")
		if source != "" && slices.ContainsFunc(snap.OwnerReferences, func(ref metav1.OwnerReference) bool { return ref.UID == vgs.UID }) {
			members[source] = snap
		}
	}
	if sources == nil {
		sources = slices.Sorted(maps.Keys(members))
	}
	for source := range members {
		if !slices.Contains(sources, source) {
			return nil, nil, status.Errorf(codes.AlreadyExists, "%s exists for other volumes: it holds a snapshot of %q", what, source)
		}
	}
	group := &csi.VolumeGroupSnapshot{GroupSnapshotId: vgs.Name}
	if vgs.Status != nil && vgs.Status.CreationTime != nil {
		group.CreationTime = timestamppb.New(vgs.Status.CreationTime.Time)
	}
	var pending []string
	for _, source := range sources {
		member, ok := members[source]
		if !ok || !ready(member) {
			pending = append(pending, source)
		}
		if ok {
			snap := csiSnapshot(member)
			snap.GroupSnapshotId = vgs.Name
			group.Snapshots = append(group.Snapshots, snap)
		}
	}
	group.ReadyToUse = groupReady(vgs) && len(pending) == 0
	return group, pending, nil
}

// groupReady reports whether a VolumeGroupSnapshot is ready to use.
func groupReady(vgs *groupsnapshotv1.VolumeGroupSnapshot) bool {
	return vgs.Status != nil && ptr.Deref(vgs.Status.ReadyToUse, false)
}

// GetVolumeGroupSnapshot describes a management VolumeGroupSnapshot of the cluster (or shared
// with it) and its member snapshots. snapshot_ids, when given, must be members of a ready group.
func (s *groupControllerServer) GetVolumeGroupSnapshot(ctx context.Context, req *csi.GetVolumeGroupSnapshotRequest) (*csi.GetVolumeGroupSnapshotResponse, error) {
	id := req.GetGroupSnapshotId()
	if id == "" {
		return nil, status.Error(codes.InvalidArgument, "group_snapshot_id is required")
	}
	c, err := s.cluster()
	if err != nil {
		return nil, err
	}
	obj, _, err := s.accessible(ctx, c, kindGroupSnapshot, id)
	if err != nil {
		return nil, err
	}
	group, _, err := s.csiGroupSnapshot(ctx, obj.(*groupsnapshotv1.VolumeGroupSnapshot), nil)
	if err != nil {
		return nil, err
	}
	if group.GetReadyToUse() {
		for _, snap := range req.GetSnapshotIds() {
			if !slices.ContainsFunc(group.GetSnapshots(), func(m *csi.Snapshot) bool { return m.GetSnapshotId() == snap }) {
				return nil, status.Errorf(codes.InvalidArgument, "snapshot_ids name %s, which is no member snapshot of management VolumeGroupSnapshot %s/%s", snap, c.Namespace, id)
			}
		}
	}
	return &csi.GetVolumeGroupSnapshotResponse{GroupSnapshot: group}, nil
}

// DeleteVolumeGroupSnapshot deletes the management VolumeGroupSnapshot of a group snapshot the
// cluster created and returns: the deletion policy of its VolumeGroupSnapshotClass decides the
// fate of the members, which snapshot-controller deletes with it. One shared with the cluster is
// released, a foreign one refused. The label of a group deleted before it was ready is taken
// from its claims.
func (s *groupControllerServer) DeleteVolumeGroupSnapshot(ctx context.Context, req *csi.DeleteVolumeGroupSnapshotRequest) (*csi.DeleteVolumeGroupSnapshotResponse, error) {
	id := req.GetGroupSnapshotId()
	if id == "" {
		return nil, status.Error(codes.InvalidArgument, "group_snapshot_id is required")
	}
	if err := s.deleteOwned(ctx, kindGroupSnapshot, id, false); err != nil {
		return nil, err
	}
	if c, err := s.cluster(); err == nil && strings.HasPrefix(id, c.UID+"-") {
		s.releaseMembers(ctx, c, request.GroupLabel(c.UID, id))
	}
	return &csi.DeleteVolumeGroupSnapshotResponse{}, nil
}
