package driver

import (
	"fmt"
	"slices"
	"unicode/utf8"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/apimachinery/pkg/types"

	"pvbridge.io/pkg/tenancy"
)

// validateCSIName checks the name of a CreateVolume, CreateSnapshot or CreateVolumeGroupSnapshot:
// it is kept in the management object's annotation pvbridge.io/csi-name, whose length the
// admission policy bounds.
func validateCSIName(name string) error {
	switch n := utf8.RuneCountInString(name); {
	case n == 0:
		return status.Error(codes.InvalidArgument, "name is required")
	case n > tenancy.MaxAnnotationLength:
		return status.Errorf(codes.InvalidArgument, "name is %d characters long, more than the %d pvbridge keeps", n, tenancy.MaxAnnotationLength)
	}
	return nil
}

// validateCapabilities validates the capabilities of a controller RPC: those the Node service
// accepts (validateNodeCapability).
func validateCapabilities(caps []*csi.VolumeCapability) error {
	if len(caps) == 0 {
		return status.Error(codes.InvalidArgument, "volume_capabilities are required")
	}
	for _, c := range caps {
		if err := validateNodeCapability(c); err != nil {
			return err
		}
	}
	return nil
}

// isBlock reports whether a capability asks for a raw block volume.
func isBlock(caps ...*csi.VolumeCapability) bool {
	return slices.ContainsFunc(caps, func(c *csi.VolumeCapability) bool { return c.GetBlock() != nil })
}

// topologyHost returns the host a new volume should live on: the first host of the preferred
// topologies, else of the requisite ones; "" when the request has none. csi-provisioner with
// --strict-topology passes only the host of the node the guest scheduler selected.
func topologyHost(req *csi.TopologyRequirement) string {
	for _, t := range append(slices.Clone(req.GetPreferred()), req.GetRequisite()...) {
		if h := t.GetSegments()[TopologyKey]; h != "" {
			return h
		}
	}
	return ""
}

// guestObject formats a guest object's key for an annotation, "" if it is not known.
func guestObject(key types.NamespacedName) string {
	if key.Name == "" {
		return ""
	}
	return fmt.Sprintf("%s/%s", key.Namespace, key.Name)
}
