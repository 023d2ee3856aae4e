package driver

import (
	"context"
	"errors"
	"fmt"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/klog/v2"

	"pvbridge.io/guest-csi/internal/request"
	"pvbridge.io/guest-csi/internal/topology"
	"pvbridge.io/pkg/csinode"
	"pvbridge.io/pkg/mounter"
)

// TopologyKey is the topology segment of a guest node and of a guest volume: the management
// host whose PMEM holds the volume and which runs the node's VirtualMachine.
const TopologyKey = topology.Key

// ErrHostUnknown is what a Host returns while it does not know the node's host yet.
var ErrHostUnknown = topology.ErrHostUnknown

// VM is what the node plugin knows of its VirtualMachine: its host and its hot-plug slots.
type VM = topology.VM

// Host tells the node plugin which management host runs its VirtualMachine, and how many volumes
// the VM can hold. Guest nodes hold no management credentials: the guest-csi controller labels
// each guest Node with its host and annotates it with the VM's slots, and a Host reads them from
// the plugin's own Node.
type Host interface {
	// VMOf returns what is known of the VM, or an error wrapping ErrHostUnknown while its host
	// is not known.
	VMOf(ctx context.Context) (VM, error)
	// WaitForHost returns once the host is known, or with ctx's error when ctx ends first.
	WaitForHost(ctx context.Context) error
}

// nodeServer is the CSI Node service of a guest node: it finds the disk that the controller
// attached to the node's VirtualMachine by its serial, from the publish context, stages it as a
// filesystem or leaves it a raw block device, and publishes it to pods.
//
// The disk is found by its serial on every call that has a publish context (stage, publish);
// the calls that have none (stats, expand) find it by the device number behind the path they
// are given. Device names (vdb, vdc) are never remembered: they change across reboots and
// hot-plugs.
//
// Serialization, unstaging, unpublishing and the common bodies come from csinode.Base.
type nodeServer struct {
	csinode.Base

	nodeID string
	host   Host
	disks  disks
}

var _ csi.NodeServer = (*nodeServer)(nil)

// newNodeServer returns the Node service of node nodeID, whose host comes from host, which
// finds disks under the device root and mounts them with m.
func newNodeServer(nodeID string, host Host, deviceRoot string, m *mounter.Mounter) *nodeServer {
	return &nodeServer{Base: csinode.Base{Mounter: m, Codes: driverCodes}, nodeID: nodeID, host: host, disks: disks{root: deviceRoot}}
}

func (n *nodeServer) NodeGetCapabilities(context.Context, *csi.NodeGetCapabilitiesRequest) (*csi.NodeGetCapabilitiesResponse, error) {
	return csinode.Capabilities(
		csi.NodeServiceCapability_RPC_STAGE_UNSTAGE_VOLUME,
		csi.NodeServiceCapability_RPC_GET_VOLUME_STATS,
		csi.NodeServiceCapability_RPC_GET_VOLUME_HEALTH,
		csi.NodeServiceCapability_RPC_EXPAND_VOLUME,
		csi.NodeServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER,
	), nil
}

// NodeGetInfo reports the VM as the node, its host as the node's topology and its hot-plug
// slots as max_volumes_per_node (none while the VM has not reported them). Kubelet asks again
// every nodeAllocatableUpdatePeriodSeconds of the CSIDriver, and after an attach refused with
// ResourceExhausted, and writes the number into the CSINode's allocatable count, which the
// scheduler places volumes by. While the host is not known (the controller has not labelled the
// Node yet) it answers Unavailable, and kubelet retries the plugin registration.
func (n *nodeServer) NodeGetInfo(ctx context.Context, _ *csi.NodeGetInfoRequest) (*csi.NodeGetInfoResponse, error) {
	if n.host == nil {
		return nil, status.Errorf(codes.Unavailable, "node %s: %v: no source of the host is configured", n.nodeID, ErrHostUnknown)
	}
	vm, err := n.host.VMOf(ctx)
	host := vm.Host
	if err == nil && host == "" {
		err = ErrHostUnknown
	}
	if err != nil {
		if !errors.Is(err, ErrHostUnknown) {
			return nil, status.Errorf(codes.Unavailable, "find the host of node %s: %v", n.nodeID, err)
		}
		return nil, n.StatusError(fmt.Errorf("node %s: %w", n.nodeID, err))
	}
	if msgs := validation.IsValidLabelValue(host); len(msgs) > 0 {
		return nil, status.Errorf(codes.Internal, "the host %q of node %s is no topology value: %v", host, n.nodeID, msgs)
	}
	return &csi.NodeGetInfoResponse{
		NodeId:             n.nodeID,
		MaxVolumesPerNode:  vm.MaxVolumes,
		AccessibleTopology: &csi.Topology{Segments: map[string]string{TopologyKey: host}},
	}, nil
}

// NodeStageVolume finds the volume's disk by the serial in the publish context and, for a mount
// volume, makes its filesystem available at the staging path, formatting the disk only when it
// is blank. A block volume needs no staging: the call only checks that the disk is there. A
// disk that is not attached yet is NotFound, and kubelet retries.
func (n *nodeServer) NodeStageVolume(ctx context.Context, req *csi.NodeStageVolumeRequest) (*csi.NodeStageVolumeResponse, error) {
	switch {
	case req.GetVolumeId() == "":
		return nil, status.Error(codes.InvalidArgument, "volume_id is required")
	case req.GetStagingTargetPath() == "":
		return nil, status.Error(codes.InvalidArgument, "staging_target_path is required")
	}
	capability := req.GetVolumeCapability()
	if err := validateNodeCapability(capability); err != nil {
		return nil, err
	}
	serial, err := request.SerialFrom(req.GetPublishContext())
	if err != nil {
		return nil, n.StatusError(err)
	}
	ctx, unlock, err := n.Lock(ctx, req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	defer unlock()

	device, err := n.device(ctx, serial)
	if err != nil {
		return nil, err
	}
	if capability.GetBlock() != nil {
		if _, err := n.Mounter.DeviceSize(device); err != nil {
			return nil, n.StatusError(err)
		}
		return &csi.NodeStageVolumeResponse{}, nil
	}
	mnt := capability.GetMount()
	if err := n.Mounter.Stage(ctx, device, req.GetStagingTargetPath(), mnt.GetFsType(), mnt.GetMountFlags()); err != nil {
		return nil, n.StatusError(err)
	}
	return &csi.NodeStageVolumeResponse{}, nil
}

// NodePublishVolume bind-mounts a staged filesystem at the target path, or the disk of a block
// volume (found by its serial) onto a file at the target path; read-only when the request or
// the access mode says so. A mount volume that is not staged is FailedPrecondition.
func (n *nodeServer) NodePublishVolume(ctx context.Context, req *csi.NodePublishVolumeRequest) (*csi.NodePublishVolumeResponse, error) {
	switch {
	case req.GetVolumeId() == "":
		return nil, status.Error(codes.InvalidArgument, "volume_id is required")
	case req.GetStagingTargetPath() == "":
		return nil, status.Error(codes.InvalidArgument, "staging_target_path is required: the driver stages volumes")
	case req.GetTargetPath() == "":
		return nil, status.Error(codes.InvalidArgument, "target_path is required")
	}
	capability := req.GetVolumeCapability()
	if err := validateNodeCapability(capability); err != nil {
		return nil, err
	}
	// A mount volume publishes its staged filesystem: its disk is needed only to check that a
	// single-writer volume is not published elsewhere.
	needsDevice := capability.GetBlock() != nil ||
		capability.GetAccessMode().GetMode() == csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER
	var serial string
	if needsDevice {
		var err error
		if serial, err = request.SerialFrom(req.GetPublishContext()); err != nil {
			return nil, n.StatusError(err)
		}
	}
	ctx, unlock, err := n.Lock(ctx, req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	defer unlock()

	var device string
	if needsDevice {
		if device, err = n.device(ctx, serial); err != nil {
			return nil, err
		}
	}
	if err := n.Publish(ctx, req, device); err != nil {
		return nil, err
	}
	return &csi.NodePublishVolumeResponse{}, nil
}

// NodeGetVolumeStats reports a filesystem's bytes and inodes, or a block device's size. A path
// that does not exist is NotFound; a volume that is not healthy (not mounted, its disk
// detached) has no usage to report and is FailedPrecondition.
func (n *nodeServer) NodeGetVolumeStats(ctx context.Context, req *csi.NodeGetVolumeStatsRequest) (*csi.NodeGetVolumeStatsResponse, error) {
	switch {
	case req.GetVolumeId() == "":
		return nil, status.Error(codes.InvalidArgument, "volume_id is required")
	case req.GetVolumePath() == "":
		return nil, status.Error(codes.InvalidArgument, "volume_path is required")
	}
	ctx = klog.NewContext(ctx, klog.FromContext(ctx).WithValues("volumeID", req.GetVolumeId()))
	device, err := n.deviceAt(req.GetVolumePath())
	if err != nil {
		return nil, n.StatusError(err)
	}
	return n.Stats(ctx, req.GetVolumeId(), req.GetVolumePath(), device)
}

// NodeGetVolumeHealth reports a volume INACCESSIBLE, with the mounter's reason, when the disk
// behind its publish path (or, without one, its staging path) left the VM or has no capacity
// left (DeviceGone: the management side lost its backing device), when its filesystem fails
// (MountCorrupted, IOError), or when the publish path is no mount (NotMounted; a block volume
// has nothing mounted at its staging path, so that is not reported there). Kubelet's
// CSIVolumeHealth feature asks it for every volume a pod uses and writes the answer into the
// pod's status.volumeHealth. The node knows its disks by the serials of publish contexts and the
// paths it is given: without a path it knows nothing adverse, and says so with no entries. A
// path that does not exist is NotFound.
func (n *nodeServer) NodeGetVolumeHealth(ctx context.Context, req *csi.NodeGetVolumeHealthRequest) (*csi.NodeGetVolumeHealthResponse, error) {
	if req.GetVolumeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "volume_id is required")
	}
	ctx = klog.NewContext(ctx, klog.FromContext(ctx).WithValues("volumeID", req.GetVolumeId()))
	health := &csi.VolumeHealth{VolumeId: req.GetVolumeId()}
	path, published := req.GetVolumePublishPath(), true
	if path == "" {
		path, published = req.GetStagingTargetPath(), false
	}
	if path == "" {
		return &csi.NodeGetVolumeHealthResponse{VolumeHealth: health}, nil
	}
	device, err := n.deviceAt(path)
	if err != nil {
		return nil, n.StatusError(err)
	}
	stats, err := n.Mounter.Stats(ctx, path, device)
	switch {
	case err != nil:
		return nil, n.StatusError(err)
	case stats.Condition == nil:
	case stats.Condition.Reason == mounter.ReasonNotMounted && !published:
	default:
		health.HealthStatuses = []*csi.VolumeHealth_VolumeHealthEntry{{
			Status: csi.VolumeHealthErrorType_INACCESSIBLE, Reason: stats.Condition.Reason,
			Message: fmt.Sprintf("volume %s on node %s: %s", req.GetVolumeId(), n.nodeID, stats.Condition.Message),
		}}
	}
	return &csi.NodeGetVolumeHealthResponse{VolumeHealth: health}, nil
}

// NodeExpandVolume grows the filesystem at the volume path to fill its disk, which the
// controller grew; for a block volume there is nothing to grow. It reports the disk's size, and
// FailedPrecondition while the guest has not seen the disk grow to the required size yet.
func (n *nodeServer) NodeExpandVolume(ctx context.Context, req *csi.NodeExpandVolumeRequest) (*csi.NodeExpandVolumeResponse, error) {
	return n.Expand(ctx, req, validateNodeCapability, func(context.Context) (string, error) {
		device, err := n.deviceAt(req.GetVolumePath())
		if err != nil {
			return "", n.StatusError(err)
		}
		if device == "" {
			return "", status.Errorf(codes.NotFound, "no disk attached to node %s is at %s", n.nodeID, req.GetVolumePath())
		}
		return device, nil
	})
}

// validateNodeCapability validates the one capability of a node RPC. A disk is attached to one
// VM, so only single-node access modes are possible: with the SINGLE_NODE_MULTI_WRITER
// capability, the CO asks SINGLE_NODE_SINGLE_WRITER for a ReadWriteOncePod volume (published
// once) and SINGLE_NODE_MULTI_WRITER for a ReadWriteOnce one.
func validateNodeCapability(c *csi.VolumeCapability) error {
	if c == nil {
		return status.Error(codes.InvalidArgument, "volume_capability is required")
	}
	switch c.GetAccessMode().GetMode() {
	case csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER,
		csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY,
		csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER,
		csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER:
	case csi.VolumeCapability_AccessMode_UNKNOWN:
		return status.Error(codes.InvalidArgument, "volume_capability.access_mode is required")
	default:
		return status.Errorf(codes.InvalidArgument, "volume_capability.access_mode %s is not supported: a disk is attached to one VM", c.GetAccessMode().GetMode())
	}
	switch {
	case c.GetBlock() != nil:
	case c.GetMount() != nil:
		if !mounter.ValidFilesystem(c.GetMount().GetFsType()) {
			return status.Errorf(codes.InvalidArgument, "volume_capability.mount.fs_type %q is not supported (ext4, xfs)", c.GetMount().GetFsType())
		}
	default:
		return status.Error(codes.InvalidArgument, "volume_capability.access_type must be block or mount")
	}
	return nil
}

// device finds the disk with serial: NotFound while it is not attached.
func (n *nodeServer) device(ctx context.Context, serial string) (string, error) {
	device, err := n.disks.bySerial(serial)
	if err != nil {
		return "", n.StatusError(fmt.Errorf("find the disk of node %s: %w", n.nodeID, err))
	}
	klog.FromContext(ctx).V(4).Info("Found disk", "diskSerial", serial, "device", device)
	return device, nil
}

// deviceAt returns the disk behind path: the device a published block file is, or the one
// whose filesystem is mounted there; "" when no attached disk is (the disk was detached, or
// path is no mount, or a corrupted one, which the mounter then reports). A path that does not
// exist wraps mounter.ErrNotFound.
func (n *nodeServer) deviceAt(path string) (string, error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return "", fmt.Errorf("%w: %s", mounter.ErrNotFound, path)
		}
		return "", nil
	}
	dev := st.Dev
	if st.Mode&unix.S_IFMT == unix.S_IFBLK {
		dev = st.Rdev
	}
	return n.disks.byNumber(dev)
}
