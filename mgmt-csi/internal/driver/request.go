package driver

import (
	"maps"
	"slices"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"pvbridge.io/pkg/qos"
)

// supportedFsTypes are the filesystems NodeStageVolume makes; "" means ext4.
var supportedFsTypes = []string{"", "ext4", "xfs"}

// validateCapabilities accepts block and mount volumes with a single-node access mode: a PMEM
// volume lives in one host.
func validateCapabilities(caps []*csi.VolumeCapability) error {
	if len(caps) == 0 {
		return status.Error(codes.InvalidArgument, "volume_capabilities are required")
	}
	for _, c := range caps {
		switch c.GetAccessMode().GetMode() {
		case csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER,
			csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY,
			csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER,
			csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER:
		case csi.VolumeCapability_AccessMode_UNKNOWN:
			return status.Error(codes.InvalidArgument, "volume_capability.access_mode is required")
		default:
			return status.Errorf(codes.InvalidArgument, "access mode %s is not supported: a PMEM volume lives in one node", c.GetAccessMode().GetMode())
		}
		switch {
		case c.GetBlock() != nil:
		case c.GetMount() != nil:
			if !slices.Contains(supportedFsTypes, c.GetMount().GetFsType()) {
				return status.Errorf(codes.InvalidArgument, "fs_type %q is not supported (ext4, xfs)", c.GetMount().GetFsType())
			}
		default:
			return status.Error(codes.InvalidArgument, "volume_capability.access_type must be block or mount")
		}
	}
	return nil
}

// validateParameters refuses StorageClass parameters this driver does not know, so that a typo
// is an error and not a silently ignored setting. Keys csi-provisioner adds itself
// (csi.storage.k8s.io/*) are allowed.
func validateParameters(params map[string]string) error {
	for k := range params {
		if k != replicasParameter && !strings.HasPrefix(k, "csi.storage.k8s.io/") {
			return status.Errorf(codes.InvalidArgument, "parameter %q is not supported", k)
		}
	}
	return nil
}

// topologyNodes lists the nodes of the preferred, then the requisite topologies, without
// repeats.
func topologyNodes(req *csi.TopologyRequirement) []string {
	var nodes []string
	for _, t := range append(slices.Clone(req.GetPreferred()), req.GetRequisite()...) {
		if n, ok := t.GetSegments()[TopologyKey]; ok && !slices.Contains(nodes, n) {
			nodes = append(nodes, n)
		}
	}
	return nodes
}

// topologyAllows reports whether node satisfies the requirements (no requirement allows all).
func topologyAllows(req *csi.TopologyRequirement, node string) bool {
	nodes := topologyNodes(req)
	return len(nodes) == 0 || slices.Contains(nodes, node)
}

// validateMutableParameters checks a VolumeAttributesClass's parameters: the I/O limits a
// hypervisor enforces on the volume's disk (pkg/qos), besides the claim's metadata that
// csi-resizer adds with --extra-modify-metadata (csi.storage.k8s.io/...).
func validateMutableParameters(params map[string]string) error {
	limits := maps.Clone(params)
	maps.DeleteFunc(limits, func(k, _ string) bool { return strings.HasPrefix(k, sidecarParameterPrefix) })
	if _, err := qos.Parse(limits); err != nil {
		return status.Errorf(codes.InvalidArgument, "mutable parameters: %v", err)
	}
	return nil
}
