// Package csinode holds what the CSI Node services of pvbridge's two drivers share. They differ
// only in how they find a volume's device (mgmt-csi by volume ID in the host's PMEM, guest-csi
// by the disk serial in the VM) and in their topology; the rest is here: per-volume
// serialization, unstaging and unpublishing (which need no device), publishing, stats and
// filesystem growth on a device the driver found, and the mapping of errors to gRPC codes.
package csinode

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"
	"k8s.io/mount-utils"

	"pvbridge.io/pkg/keylock"
	"pvbridge.io/pkg/mounter"
)

// Base is embedded by a driver's Node service. It serves NodeUnstageVolume and
// NodeUnpublishVolume itself and offers the other RPCs' common bodies.
//
// Operations on one volume are serialized: a call that finds another one in progress for the
// same volume ID answers Aborted at once, and the CO retries. Stats take no lock, so that
// kubelet's periodic stats never make a mount or unmount fail.
type Base struct {
	csi.UnimplementedNodeServer

	Mounter *mounter.Mounter
	Locks   keylock.Locks
	// Codes maps the driver's own sentinel errors to gRPC codes, before the common ones.
	Codes []ErrorCode
	// Unstaged, when set, takes down what the driver's stage brought up besides the mount; it
	// is called under the volume's lock once the staging path is unmounted.
	Unstaged func(ctx context.Context, volumeID string) error
}

// Capabilities is a NodeGetCapabilities answer listing types.
func Capabilities(types ...csi.NodeServiceCapability_RPC_Type) *csi.NodeGetCapabilitiesResponse {
	resp := &csi.NodeGetCapabilitiesResponse{}
	for _, t := range types {
		resp.Capabilities = append(resp.Capabilities, &csi.NodeServiceCapability{
			Type: &csi.NodeServiceCapability_Rpc{Rpc: &csi.NodeServiceCapability_RPC{Type: t}},
		})
	}
	return resp
}

// Lock takes the volume's lock, or fails with Aborted while another operation on it is in
// progress. It returns ctx with a logger that names the volume.
func (b *Base) Lock(ctx context.Context, volumeID string) (context.Context, func(), error) {
	if !b.Locks.TryLock(volumeID) {
		return ctx, nil, status.Errorf(codes.Aborted, "an operation on volume %s is in progress", volumeID)
	}
	ctx = klog.NewContext(ctx, klog.FromContext(ctx).WithValues("volumeID", volumeID))
	return ctx, func() { b.Locks.Unlock(volumeID) }, nil
}

// NodeUnstageVolume unmounts and removes the staging path, then calls Unstaged. It needs no
// device, so it succeeds for a volume that is gone or detached already.
func (b *Base) NodeUnstageVolume(ctx context.Context, req *csi.NodeUnstageVolumeRequest) (*csi.NodeUnstageVolumeResponse, error) {
	switch {
	case req.GetVolumeId() == "":
		return nil, status.Error(codes.InvalidArgument, "volume_id is required")
	case req.GetStagingTargetPath() == "":
		return nil, status.Error(codes.InvalidArgument, "staging_target_path is required")
	}
	if err := b.unmount(ctx, req.GetVolumeId(), req.GetStagingTargetPath(), b.Unstaged); err != nil {
		return nil, err
	}
	return &csi.NodeUnstageVolumeResponse{}, nil
}

// NodeUnpublishVolume unmounts and removes the target path, a directory or a block device
// file. It needs no device, so it succeeds for a volume that is gone or detached already.
func (b *Base) NodeUnpublishVolume(ctx context.Context, req *csi.NodeUnpublishVolumeRequest) (*csi.NodeUnpublishVolumeResponse, error) {
	switch {
	case req.GetVolumeId() == "":
		return nil, status.Error(codes.InvalidArgument, "volume_id is required")
	case req.GetTargetPath() == "":
		return nil, status.Error(codes.InvalidArgument, "target_path is required")
	}
	if err := b.unmount(ctx, req.GetVolumeId(), req.GetTargetPath(), nil); err != nil {
		return nil, err
	}
	return &csi.NodeUnpublishVolumeResponse{}, nil
}

// unmount unmounts and removes path, then calls after (when set), under the volume's lock.
func (b *Base) unmount(ctx context.Context, volumeID, path string, after func(context.Context, string) error) error {
	ctx, unlock, err := b.Lock(ctx, volumeID)
	if err != nil {
		return err
	}
	defer unlock()
	if err := b.Mounter.Unmount(ctx, path); err != nil {
		return b.StatusError(err)
	}
	if after != nil {
		return b.StatusError(after(ctx, volumeID))
	}
	return nil
}

// Publish bind-mounts a staged filesystem at the request's target path, or device, for a
// block volume, onto a file at the target path; read-only when the request or the access mode
// says so. A SINGLE_NODE_SINGLE_WRITER volume is published once: FailedPrecondition while
// device is published at another target. The caller validated the request, holds the volume's
// lock and found device for a block or single-writer volume.
func (b *Base) Publish(ctx context.Context, req *csi.NodePublishVolumeRequest, device string) error {
	capability := req.GetVolumeCapability()
	if capability.GetAccessMode().GetMode() == csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER {
		if err := b.notPublishedElsewhere(device, req.GetStagingTargetPath(), req.GetTargetPath()); err != nil {
			return err
		}
	}
	readOnly := req.GetReadonly() ||
		capability.GetAccessMode().GetMode() == csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY
	var err error
	if capability.GetBlock() != nil {
		err = b.Mounter.PublishBlock(ctx, device, req.GetTargetPath(), readOnly)
	} else {
		err = b.Mounter.Publish(ctx, req.GetStagingTargetPath(), req.GetTargetPath(), readOnly, capability.GetMount().GetMountFlags())
	}
	return b.StatusError(err)
}

// notPublishedElsewhere fails with FailedPrecondition when device is published at a path
// other than target: a SINGLE_NODE_SINGLE_WRITER volume is published once. A publication is a
// mount of the device's filesystem other than at the staging path, or a bind mount of the
// device node itself (a block volume), which the mount table lists under the filesystem that
// holds the node, with the node's name as its root.
func (b *Base) notPublishedElsewhere(device, staging, target string) error {
	var dev unix.Stat_t
	if err := unix.Stat(device, &dev); err != nil {
		return b.StatusError(fmt.Errorf("stat %s: %w", device, err))
	}
	node, err := filepath.EvalSymlinks(device)
	if err != nil {
		return b.StatusError(fmt.Errorf("resolve %s: %w", device, err))
	}
	mps, err := mount.ParseMountInfo(mounter.MountInfo)
	if err != nil {
		return b.StatusError(fmt.Errorf("read the mount table: %w", err))
	}
	staging, target = resolvePath(staging), resolvePath(target)
	for _, mp := range mps {
		mp.MountPoint = mounter.UnescapeMountPath(mp.MountPoint)
		if mp.MountPoint == staging || mp.MountPoint == target {
			continue
		}
		published := mp.Major == int(unix.Major(dev.Rdev)) && mp.Minor == int(unix.Minor(dev.Rdev))
		if !published && mp.Root != "/" && filepath.Base(mp.Root) == filepath.Base(node) {
			var st unix.Stat_t
			published = unix.Stat(mp.MountPoint, &st) == nil && st.Mode&unix.S_IFMT == unix.S_IFBLK && st.Rdev == dev.Rdev
		}
		if published {
			return status.Errorf(codes.FailedPrecondition, "the volume is published at %s already, and its access mode SINGLE_NODE_SINGLE_WRITER allows one publication", mp.MountPoint)
		}
	}
	return nil
}

// resolvePath resolves the symbolic links in path as the mount table shows it (a target path
// may not exist yet: then those of its directory).
func resolvePath(path string) string {
	if p, err := filepath.EvalSymlinks(path); err == nil {
		return p
	}
	if dir, err := filepath.EvalSymlinks(filepath.Dir(path)); err == nil {
		return filepath.Join(dir, filepath.Base(path))
	}
	return filepath.Clean(path)
}

// Stats reports a filesystem's bytes and inodes, or a block device's size, for the volume at
// path whose device is device ("" when the driver found none). A volume that is not healthy has
// no usage to report and is FailedPrecondition.
func (b *Base) Stats(ctx context.Context, volumeID, path, device string) (*csi.NodeGetVolumeStatsResponse, error) {
	stats, err := b.Mounter.Stats(ctx, path, device)
	if err != nil {
		return nil, b.StatusError(err)
	}
	switch {
	case stats.Condition != nil:
		return nil, status.Errorf(codes.FailedPrecondition, "volume %s at %s is not healthy: %s", volumeID, path, stats.Condition.Message)
	case stats.Block:
		return &csi.NodeGetVolumeStatsResponse{
			Usage: []*csi.VolumeUsage{{Unit: csi.VolumeUsage_BYTES, Total: stats.TotalBytes}},
		}, nil
	}
	return &csi.NodeGetVolumeStatsResponse{
		Usage: []*csi.VolumeUsage{
			{Unit: csi.VolumeUsage_BYTES, Total: stats.TotalBytes, Available: stats.AvailableBytes, Used: stats.UsedBytes},
			{Unit: csi.VolumeUsage_INODES, Total: stats.TotalInodes, Available: stats.FreeInodes, Used: stats.UsedInodes},
		},
	}, nil
}

// Expand serves NodeExpandVolume: it validates the request (the optional capability with
// validate), takes the volume's lock, finds the volume's device with device, and grows the
// filesystem at the volume path to fill it; a block volume has nothing to grow. It reports the
// device's size, and Aborted while the device is smaller than required (the controller grew
// the volume, the node has not seen it yet): work in progress, which kubelet retries. Not
// FailedPrecondition: kubelet reads that as a driver that cannot grow a volume in use, and
// leaves the filesystem as it is until the volume is next staged (a VM's disk grew 2 s after
// kubelet's first call, and the pod's filesystem never did).
func (b *Base) Expand(ctx context.Context, req *csi.NodeExpandVolumeRequest, validate func(*csi.VolumeCapability) error,
	findDevice func(context.Context) (string, error)) (*csi.NodeExpandVolumeResponse, error) {
	switch {
	case req.GetVolumeId() == "":
		return nil, status.Error(codes.InvalidArgument, "volume_id is required")
	case req.GetVolumePath() == "":
		return nil, status.Error(codes.InvalidArgument, "volume_path is required")
	case req.GetCapacityRange().GetRequiredBytes() < 0 || req.GetCapacityRange().GetLimitBytes() < 0:
		return nil, status.Error(codes.InvalidArgument, "capacity_range must not be negative")
	}
	if c := req.GetVolumeCapability(); c != nil {
		if err := validate(c); err != nil {
			return nil, err
		}
	}
	ctx, unlock, err := b.Lock(ctx, req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	defer unlock()
	device, err := findDevice(ctx)
	if err != nil {
		return nil, err
	}
	size, err := b.Mounter.DeviceSize(device)
	if err != nil {
		return nil, b.StatusError(err)
	}
	if required := req.GetCapacityRange().GetRequiredBytes(); size < required {
		return nil, status.Errorf(codes.Aborted, "the device of volume %s has %d bytes, fewer than the required %d: it has not grown yet", req.GetVolumeId(), size, required)
	}
	block, err := isBlockVolume(req.GetVolumeCapability(), req.GetVolumePath())
	if err != nil {
		return nil, b.StatusError(err)
	}
	if !block {
		if err := b.Mounter.Expand(ctx, req.GetVolumePath(), device); err != nil {
			return nil, b.StatusError(err)
		}
	}
	return &csi.NodeExpandVolumeResponse{CapacityBytes: size}, nil
}

// isBlockVolume tells a block volume from a mount volume by its capability, or, since
// NodeExpandVolume's capability is optional, by what is at the volume path.
func isBlockVolume(c *csi.VolumeCapability, path string) (bool, error) {
	switch {
	case c.GetBlock() != nil:
		return true, nil
	case c.GetMount() != nil:
		return false, nil
	}
	fi, err := os.Stat(path)
	if errors.Is(err, os.ErrNotExist) {
		return false, fmt.Errorf("%w: volume path %s", mounter.ErrNotFound, path)
	}
	if err != nil {
		return false, fmt.Errorf("stat volume path: %w", err)
	}
	return fi.Mode()&os.ModeDevice != 0 && fi.Mode()&os.ModeCharDevice == 0, nil
}
