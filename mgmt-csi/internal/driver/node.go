package driver

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"

	"pvbridge.io/mgmt-csi/internal/pmem"
	"pvbridge.io/pkg/csinode"
	"pvbridge.io/pkg/mounter"
)

// Devices finds the block device of a volume on this node.
type Devices interface {
	// Device returns the path of volume volumeID's block device, or an error wrapping
	// pmem.ErrNotFound when this node has no such volume. A replicated volume has one while
	// it is staged on the node.
	Device(ctx context.Context, volumeID string) (string, error)
	// Stage returns the device of volume volumeID, bringing up what it rests on: the target of
	// a replicated volume.
	Stage(ctx context.Context, volumeID string) (string, error)
	// Unstage takes down what Stage brought up, if anything.
	Unstage(ctx context.Context, volumeID string) error
}

// nodeServer is the CSI Node service of a host's node agent: it stages the host's PMEM volumes
// as filesystems or raw block devices and publishes them to pods (and, through the vm-operator
// host agent, to VMs).
//
// The device of a volume is always looked up locally by volume ID, never taken from the publish
// context: with attachRequired false, ordinary pods in the management cluster skip
// ControllerPublishVolume and their NodeStageVolume gets no publish context at all.
//
// Serialization, unstaging, unpublishing and the common bodies come from csinode.Base.
type nodeServer struct {
	csinode.Base

	nodeID string
	// maxVolumes is what NodeGetInfo reports as max_volumes_per_node; 0 means no limit.
	maxVolumes int64
	devices    Devices
}

var _ csi.NodeServer = (*nodeServer)(nil)

// newNodeServer returns the Node service of node nodeID, which finds volumes' devices through
// devices and mounts them with m. maxVolumes limits the volumes the scheduler places on the
// node (0: no limit).
func newNodeServer(nodeID string, maxVolumes int64, devices Devices, m *mounter.Mounter) *nodeServer {
	// Unstaging takes down what staging brought up: a replicated volume's target.
	return &nodeServer{Base: csinode.Base{Mounter: m, Codes: driverCodes, Unstaged: devices.Unstage}, nodeID: nodeID, maxVolumes: maxVolumes, devices: devices}
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

func (n *nodeServer) NodeGetInfo(context.Context, *csi.NodeGetInfoRequest) (*csi.NodeGetInfoResponse, error) {
	return &csi.NodeGetInfoResponse{
		NodeId:             n.nodeID,
		MaxVolumesPerNode:  n.maxVolumes,
		AccessibleTopology: &csi.Topology{Segments: map[string]string{TopologyKey: n.nodeID}},
	}, nil
}

// NodeStageVolume makes a mount volume's filesystem available at the staging path, formatting
// the device only when it is blank, and mounting with -o dax when the device supports DAX. A
// block volume needs no staging: the call only checks that its device is there.
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
	ctx, unlock, err := n.Lock(ctx, req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	defer unlock()

	device, err := n.devices.Stage(ctx, req.GetVolumeId())
	if err != nil {
		return nil, n.StatusError(fmt.Errorf("find the device of volume %s: %w", req.GetVolumeId(), err))
	}
	if capability.GetBlock() != nil {
		if _, err := n.Mounter.DeviceSize(device); err != nil {
			return nil, n.StatusError(err)
		}
		return &csi.NodeStageVolumeResponse{}, nil
	}

	dax, err := n.Mounter.SupportsDAX(device)
	if err != nil {
		return nil, n.StatusError(err)
	}
	mnt := capability.GetMount()
	if err := n.Mounter.Stage(ctx, device, req.GetStagingTargetPath(), mnt.GetFsType(), stageOptions(mnt.GetMountFlags(), dax)); err != nil {
		return nil, n.StatusError(err)
	}
	return &csi.NodeStageVolumeResponse{}, nil
}

// stageOptions are the mount options of a staged filesystem: the capability's mount flags,
// and dax where the device supports it, so that the filesystem maps PMEM into applications'
// address spaces without the page cache.
func stageOptions(flags []string, dax bool) []string {
	opts := slices.Clone(flags)
	if dax && !slices.ContainsFunc(opts, func(o string) bool { return o == "dax" || strings.HasPrefix(o, "dax=") }) {
		opts = append(opts, "dax")
	}
	return opts
}

// NodePublishVolume bind-mounts a staged filesystem at the target path, or the device of a
// block volume onto a file at the target path; read-only when the request or the access mode
// says so. A mount volume that is not staged is FailedPrecondition.
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
	ctx, unlock, err := n.Lock(ctx, req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	defer unlock()

	device, err := n.device(ctx, req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	if err := n.Publish(ctx, req, device); err != nil {
		return nil, err
	}
	return &csi.NodePublishVolumeResponse{}, nil
}

// NodeGetVolumeStats reports a filesystem's bytes and inodes, or a block device's size. A path
// that does not exist or holds another volume is NotFound; a volume that is not healthy (see
// NodeGetVolumeHealth) has no usage to report and is FailedPrecondition.
func (n *nodeServer) NodeGetVolumeStats(ctx context.Context, req *csi.NodeGetVolumeStatsRequest) (*csi.NodeGetVolumeStatsResponse, error) {
	switch {
	case req.GetVolumeId() == "":
		return nil, status.Error(codes.InvalidArgument, "volume_id is required")
	case req.GetVolumePath() == "":
		return nil, status.Error(codes.InvalidArgument, "volume_path is required")
	}
	ctx = klog.NewContext(ctx, klog.FromContext(ctx).WithValues("volumeID", req.GetVolumeId()))
	device, err := n.deviceIfAny(ctx, req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	return n.Stats(ctx, req.GetVolumeId(), req.GetVolumePath(), device)
}

// NodeGetVolumeHealth reports a volume as INACCESSIBLE when its device is gone or its publish
// path is no mount of it. CSI 1.13 replaced NodeGetVolumeStats' volume condition with this call,
// which kubelet's CSIVolumeHealth feature makes for every volume in use. Without a publish
// path the staging path is checked, but "not mounted" is not reported there: a block volume
// has nothing mounted at its staging path. A volume that is neither on this node nor at its
// paths is NotFound.
func (n *nodeServer) NodeGetVolumeHealth(ctx context.Context, req *csi.NodeGetVolumeHealthRequest) (*csi.NodeGetVolumeHealthResponse, error) {
	if req.GetVolumeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "volume_id is required")
	}
	ctx = klog.NewContext(ctx, klog.FromContext(ctx).WithValues("volumeID", req.GetVolumeId()))
	device, err := n.deviceIfAny(ctx, req.GetVolumeId())
	if err != nil {
		return nil, err
	}

	health := &csi.VolumeHealth{VolumeId: req.GetVolumeId()}
	report := func(reason, message string) {
		for _, e := range health.HealthStatuses {
			if e.Reason == reason {
				return // one entry per (status, reason)
			}
		}
		health.HealthStatuses = append(health.HealthStatuses, &csi.VolumeHealth_VolumeHealthEntry{
			Status: csi.VolumeHealthErrorType_INACCESSIBLE, Reason: reason, Message: message,
		})
	}
	if device == "" {
		report(mounter.ReasonDeviceGone, fmt.Sprintf("volume %s has no device on node %s", req.GetVolumeId(), n.nodeID))
	}
	path, published := req.GetVolumePublishPath(), true
	if path == "" {
		path, published = req.GetStagingTargetPath(), false
	}
	if path != "" {
		stats, err := n.Mounter.Stats(ctx, path, device)
		switch {
		case errors.Is(err, mounter.ErrNotFound):
			if device == "" {
				return nil, status.Errorf(codes.NotFound, "volume %s is neither on node %s nor at %s", req.GetVolumeId(), n.nodeID, path)
			}
			report(mounter.ReasonNotMounted, err.Error())
		case err != nil:
			return nil, n.StatusError(err)
		case stats.Condition == nil:
		case stats.Condition.Reason == mounter.ReasonNotMounted && !published:
		default:
			report(stats.Condition.Reason, stats.Condition.Message)
		}
	} else if device == "" {
		return nil, status.Errorf(codes.NotFound, "volume %s is not on node %s", req.GetVolumeId(), n.nodeID)
	}
	return &csi.NodeGetVolumeHealthResponse{VolumeHealth: health}, nil
}

// NodeExpandVolume grows the filesystem at the volume path to fill its device, which the
// controller grew; for a block volume there is nothing to grow. It reports the device's size.
func (n *nodeServer) NodeExpandVolume(ctx context.Context, req *csi.NodeExpandVolumeRequest) (*csi.NodeExpandVolumeResponse, error) {
	return n.Expand(ctx, req, validateNodeCapability, func(ctx context.Context) (string, error) {
		return n.device(ctx, req.GetVolumeId())
	})
}

// validateNodeCapability validates the one capability of a node RPC.
func validateNodeCapability(c *csi.VolumeCapability) error {
	if c == nil {
		return status.Error(codes.InvalidArgument, "volume_capability is required")
	}
	return validateCapabilities([]*csi.VolumeCapability{c})
}

// deviceIfAny looks up the volume's device on this node, "" if it has no such volume.
func (n *nodeServer) deviceIfAny(ctx context.Context, volumeID string) (string, error) {
	device, err := n.devices.Device(ctx, volumeID)
	if errors.Is(err, pmem.ErrNotFound) {
		return "", nil
	}
	if err != nil {
		return "", n.StatusError(fmt.Errorf("find the device of volume %s: %w", volumeID, err))
	}
	return device, nil
}

// device looks up the volume's device on this node: NotFound if it has no such volume.
func (n *nodeServer) device(ctx context.Context, volumeID string) (string, error) {
	device, err := n.devices.Device(ctx, volumeID)
	if err != nil {
		return "", n.StatusError(fmt.Errorf("find the device of volume %s: %w", volumeID, err))
	}
	klog.FromContext(ctx).V(4).Info("Found device", "device", device)
	return device, nil
}
