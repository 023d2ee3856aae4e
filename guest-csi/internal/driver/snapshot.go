package driver

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	groupsnapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumegroupsnapshot/v1"
	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pvbridge.io/guest-csi/internal/request"
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
	params, err := request.ParseSnapshotParameters(req.GetParameters(), s.cfg.snapshotClass, request.VolumeSnapshotKeys)
	if err != nil {
		return nil, err
	}
	c, err := s.cluster()
	if err != nil {
		return nil, err
	}
	name := request.MgmtName(c.UID, "snapshot-", req.GetName())
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
			ObjectMeta: mgmtObjectMeta(c, name, req.GetName()),
			Spec:       snapshotv1.VolumeSnapshotSpec{Source: snapshotv1.VolumeSnapshotSource{PersistentVolumeClaimName: ptr.To(source)}},
		}
		if params.Class != "" {
			snap.Spec.VolumeSnapshotClassName = ptr.To(params.Class)
		}
		if v := guestObject(params.GuestSnapshot); v != "" {
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
		return nil, withSnapshotError(err, fmt.Sprintf("management VolumeSnapshot %s/%s", c.Namespace, name), got)
	}
	return &csi.CreateSnapshotResponse{Snapshot: csiSnapshot(got)}, nil
}

// withSnapshotError is err, a wait for a management VolumeSnapshot or VolumeGroupSnapshot (obj,
// what) that ran out, with the error snapshot-controller records in obj's status, if any: the
// guest sees why it waits.
func withSnapshotError(err error, what string, obj client.Object) error {
	var failure *snapshotv1.VolumeSnapshotError
	switch o := obj.(type) {
	case *snapshotv1.VolumeSnapshot:
		if o.Status != nil {
			failure = o.Status.Error
		}
	case *groupsnapshotv1.VolumeGroupSnapshot:
		if o.Status != nil {
			failure = o.Status.Error
		}
	}
	if failure == nil || failure.Message == nil || status.Code(err) != codes.DeadlineExceeded {
		return err
	}
	return status.Errorf(codes.DeadlineExceeded, "%s is not ready yet: %s", what, *failure.Message)
}

// DeleteSnapshot deletes the management VolumeSnapshot of a snapshot the cluster created and
// waits until it is gone; one shared with it, or a member of one of its group snapshots, is
// released, a foreign one refused.
func (s *controllerServer) DeleteSnapshot(ctx context.Context, req *csi.DeleteSnapshotRequest) (*csi.DeleteSnapshotResponse, error) {
	if req.GetSnapshotId() == "" {
		return nil, status.Error(codes.InvalidArgument, "snapshot_id is required")
	}
	if err := s.deleteOwned(ctx, kindSnapshot, req.GetSnapshotId(), true); err != nil {
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

// csiSnapshot describes a VolumeSnapshot.
func csiSnapshot(snap *snapshotv1.VolumeSnapshot) *csi.Snapshot {
	out := &csi.Snapshot{
		SnapshotId:     snap.Name,
		SourceVolumeId: ptr.Deref(snap.Spec.Source.PersistentVolumeClaimName, ""),
		ReadyToUse:     ready(snap),
	}
	if snap.Status == nil {
		return out
	}
	if snap.Status.RestoreSize != nil {
		out.SizeBytes = snap.Status.RestoreSize.Value()
	}
	if snap.Status.CreationTime != nil {
		out.CreationTime = timestamppb.New(snap.Status.CreationTime.Time)
	}
	return out
}
