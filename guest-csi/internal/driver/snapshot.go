package driver

import (
	"context"
	"slices"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pvbridge.io/pkg/csiserver"
	"pvbridge.io/pkg/tenancy"
)

// snapshotGroup is the API group of VolumeSnapshots.
const snapshotGroup = "snapshot.storage.k8s.io"

// CreateSnapshot gets or creates the management VolumeSnapshot of a guest snapshot and waits
// until it is ready to use.
func (s *controllerServer) CreateSnapshot(ctx context.Context, req *csi.CreateSnapshotRequest) (*csi.CreateSnapshotResponse, error) {
	if err := validateCSIName(req.GetName()); err != nil {
		return nil, err
	}
	if req.GetSourceVolumeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "source_volume_id is required")
	}
	params, err := parseSnapshotParameters(req.GetParameters(), s.cfg.snapshotClass)
	if err != nil {
		return nil, err
	}
	c, err := s.cluster()
	if err != nil {
		return nil, err
	}
	name := mgmtName(c.UID, "snapshot-", req.GetName())
	unlock, err := s.lock(name)
	if err != nil {
		return nil, err
	}
	defer unlock()
	source := req.GetSourceVolumeId()

	snap := &snapshotv1.VolumeSnapshot{}
	switch err := s.mgmt.Get(ctx, client.ObjectKey{Namespace: c.Namespace, Name: name}, snap); {
	case apierrors.IsNotFound(err):
		if _, _, err := s.accessible(ctx, c, kindPVC, source); err != nil {
			return nil, err
		}
		snap = &snapshotv1.VolumeSnapshot{
			ObjectMeta: metav1.ObjectMeta{
				Namespace:   c.Namespace,
				Name:        name,
				Labels:      c.Labels(),
				Annotations: map[string]string{tenancy.CSINameAnnotation: req.GetName()},
			},
			Spec: snapshotv1.VolumeSnapshotSpec{Source: snapshotv1.VolumeSnapshotSource{PersistentVolumeClaimName: ptr.To(source)}},
		}
		if params.class != "" {
			snap.Spec.VolumeSnapshotClassName = ptr.To(params.class)
		}
		if v := guestObject(params.guestSnapshot); v != "" {
			snap.Annotations[tenancy.GuestSnapshotAnnotation] = v
		}
		if err := s.mgmt.Create(ctx, snap); err != nil {
			return nil, csiserver.APIError(err, "create management VolumeSnapshot %s/%s", c.Namespace, name)
		}
		klog.FromContext(ctx).V(2).Info("Created management VolumeSnapshot", "snapshotID", name, "source", source)
	case err != nil:
		return nil, csiserver.APIError(err, "get management VolumeSnapshot %s/%s", c.Namespace, name)
	case ptr.Deref(snap.Spec.Source.PersistentVolumeClaimName, "") != source:
		return nil, status.Errorf(codes.AlreadyExists, "management VolumeSnapshot %s/%s exists for volume %s", c.Namespace, name, ptr.Deref(snap.Spec.Source.PersistentVolumeClaimName, ""))
	}

	got := &snapshotv1.VolumeSnapshot{}
	if err := s.await(ctx, kindSnapshot, name, got, func(found bool) (bool, error) {
		switch {
		case !found:
			return false, nil
		case got.DeletionTimestamp != nil:
			return false, status.Errorf(codes.Aborted, "management VolumeSnapshot %s/%s is being deleted", c.Namespace, name)
		}
		return ready(got), nil
	}); err != nil {
		if got.Status != nil && got.Status.Error != nil && got.Status.Error.Message != nil && status.Code(err) == codes.DeadlineExceeded {
			return nil, status.Errorf(codes.DeadlineExceeded, "management VolumeSnapshot %s/%s is not ready yet: %s", c.Namespace, name, *got.Status.Error.Message)
		}
		return nil, err
	}
	return &csi.CreateSnapshotResponse{Snapshot: csiSnapshot(got)}, nil
}

// DeleteSnapshot deletes the management VolumeSnapshot of a snapshot the cluster created; one
// shared with it is released, a foreign one refused.
func (s *controllerServer) DeleteSnapshot(ctx context.Context, req *csi.DeleteSnapshotRequest) (*csi.DeleteSnapshotResponse, error) {
	id := req.GetSnapshotId()
	if id == "" {
		return nil, status.Error(codes.InvalidArgument, "snapshot_id is required")
	}
	if !validHandle(id) {
		return &csi.DeleteSnapshotResponse{}, nil
	}
	c, err := s.cluster()
	if err != nil {
		return nil, err
	}
	unlock, err := s.lock(id)
	if err != nil {
		return nil, err
	}
	defer unlock()
	obj, access, err := s.accessible(ctx, c, kindSnapshot, id)
	switch {
	case status.Code(err) == codes.NotFound:
		return &csi.DeleteSnapshotResponse{}, nil
	case err != nil:
		return nil, err
	case access == tenancy.Shared:
		klog.FromContext(ctx).Info("Released a management VolumeSnapshot shared with the cluster; it is not deleted", "snapshotID", id)
		return &csi.DeleteSnapshotResponse{}, nil
	}
	if err := s.deleteIfOwned(ctx, obj); err != nil {
		return nil, err
	}
	if err := s.await(ctx, kindSnapshot, id, &snapshotv1.VolumeSnapshot{}, func(found bool) (bool, error) { return !found, nil }); err != nil {
		return nil, err
	}
	return &csi.DeleteSnapshotResponse{}, nil
}

// ListSnapshots lists the cluster's ready snapshots in name order. starting_token is the index
// of the first entry to return.
func (s *controllerServer) ListSnapshots(ctx context.Context, req *csi.ListSnapshotsRequest) (*csi.ListSnapshotsResponse, error) {
	list := &snapshotv1.VolumeSnapshotList{}
	if err := s.mgmt.List(ctx, list); err != nil {
		return nil, csiserver.APIError(err, "list the cluster's management VolumeSnapshots")
	}
	var entries []*csi.ListSnapshotsResponse_Entry
	for i := range list.Items {
		snap := &list.Items[i]
		if (req.GetSnapshotId() != "" && snap.Name != req.GetSnapshotId()) ||
			(req.GetSourceVolumeId() != "" && ptr.Deref(snap.Spec.Source.PersistentVolumeClaimName, "") != req.GetSourceVolumeId()) ||
			!ready(snap) {
			continue
		}
		entries = append(entries, &csi.ListSnapshotsResponse_Entry{Snapshot: csiSnapshot(snap)})
	}
	slices.SortFunc(entries, func(a, b *csi.ListSnapshotsResponse_Entry) int {
		return strings.Compare(a.GetSnapshot().GetSnapshotId(), b.GetSnapshot().GetSnapshotId())
	})
	page, next, err := csiserver.Page(entries, req.GetStartingToken(), req.GetMaxEntries())
	if err != nil {
		return nil, err
	}
	return &csi.ListSnapshotsResponse{Entries: page, NextToken: next}, nil
}

// ready reports whether a VolumeSnapshot is ready to use.
func ready(snap *snapshotv1.VolumeSnapshot) bool {
	return snap.Status != nil && ptr.Deref(snap.Status.ReadyToUse, false)
}

// csiSnapshot describes a ready VolumeSnapshot.
func csiSnapshot(snap *snapshotv1.VolumeSnapshot) *csi.Snapshot {
	out := &csi.Snapshot{
		SnapshotId:     snap.Name,
		SourceVolumeId: ptr.Deref(snap.Spec.Source.PersistentVolumeClaimName, ""),
		ReadyToUse:     true,
	}
	if snap.Status.RestoreSize != nil {
		out.SizeBytes = snap.Status.RestoreSize.Value()
	}
	if snap.Status.CreationTime != nil {
		out.CreationTime = timestamppb.New(snap.Status.CreationTime.Time)
	}
	return out
}
