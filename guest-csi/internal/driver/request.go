package driver

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"slices"
	"strings"
	"unicode/utf8"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/validation"

	"pvbridge.io/pkg/names"
	"pvbridge.io/pkg/tenancy"
)

// StorageClass and VolumeSnapshotClass parameters of the guest. Every other parameter is
// refused, so that a typo is an error and not a silently ignored setting.
const (
	// ParamMgmtStorageClass names the management StorageClass of the management PVC.
	ParamMgmtStorageClass = names.MgmtStorageClassParam
	// ParamMgmtSnapshotClass names the management VolumeSnapshotClass of the management
	// VolumeSnapshot.
	ParamMgmtSnapshotClass = "mgmtSnapshotClass"
	// ParamMgmtAttributesClass, the only parameter of a guest VolumeAttributesClass, names the
	// management VolumeAttributesClass of the management PVC.
	ParamMgmtAttributesClass = names.MgmtVolumeAttributesClassParam

	// The keys csi-provisioner and csi-snapshotter add with --extra-create-metadata.
	paramPVCName       = "csi.storage.k8s.io/pvc/name"
	paramPVCNamespace  = "csi.storage.k8s.io/pvc/namespace"
	paramPVName        = "csi.storage.k8s.io/pv/name"
	paramSnapName      = "csi.storage.k8s.io/volumesnapshot/name"
	paramSnapNamespace = "csi.storage.k8s.io/volumesnapshot/namespace"
	paramSnapContent   = "csi.storage.k8s.io/volumesnapshotcontent/name"
)

// volumeParams are the parameters of a CreateVolume call.
type volumeParams struct {
	// class is the management StorageClass, "" for the management cluster's default.
	class string
	// attributesClass is the management VolumeAttributesClass, "" for none.
	attributesClass string
	guestPVC        types.NamespacedName
	guestPV         string
}

// snapshotParams are the parameters of a CreateSnapshot call.
type snapshotParams struct {
	class         string
	guestSnapshot types.NamespacedName
}

// parseVolumeParameters validates CreateVolume's parameters (and GetCapacity's: the same
// StorageClass's). defaultClass applies when the class names none.
func parseVolumeParameters(params map[string]string, defaultClass string) (volumeParams, error) {
	p := volumeParams{class: defaultClass}
	for k, v := range params {
		switch k {
		case ParamMgmtStorageClass:
			p.class = v
		case paramPVCName:
			p.guestPVC.Name = v
		case paramPVCNamespace:
			p.guestPVC.Namespace = v
		case paramPVName:
			p.guestPV = v
		default:
			if !strings.HasPrefix(k, "csi.storage.k8s.io/") {
				return p, status.Errorf(codes.InvalidArgument, "parameter %q is not supported (only %s)", k, ParamMgmtStorageClass)
			}
		}
	}
	if p.class != "" {
		if msgs := validation.IsDNS1123Subdomain(p.class); len(msgs) > 0 {
			return p, status.Errorf(codes.InvalidArgument, "parameter %s %q is no StorageClass name: %s", ParamMgmtStorageClass, p.class, strings.Join(msgs, "; "))
		}
	}
	return p, nil
}

// parseMutableParameters validates the parameters of a guest VolumeAttributesClass (CreateVolume's
// and ControllerModifyVolume's mutable_parameters) and returns the management class they name:
// "" when there are none.
func parseMutableParameters(params map[string]string) (string, error) {
	class := ""
	for k, v := range params {
		if k != ParamMgmtAttributesClass {
			return "", status.Errorf(codes.InvalidArgument, "mutable parameter %q is not supported (only %s)", k, ParamMgmtAttributesClass)
		}
		class = v
	}
	if len(params) > 0 {
		if msgs := validation.IsDNS1123Subdomain(class); len(msgs) > 0 {
			return "", status.Errorf(codes.InvalidArgument, "mutable parameter %s %q is no VolumeAttributesClass name: %s", ParamMgmtAttributesClass, class, strings.Join(msgs, "; "))
		}
	}
	return class, nil
}

// parseSnapshotParameters validates CreateSnapshot's parameters.
func parseSnapshotParameters(params map[string]string, defaultClass string) (snapshotParams, error) {
	p := snapshotParams{class: defaultClass}
	for k, v := range params {
		switch k {
		case ParamMgmtSnapshotClass:
			p.class = v
		case paramSnapName:
			p.guestSnapshot.Name = v
		case paramSnapNamespace:
			p.guestSnapshot.Namespace = v
		case paramSnapContent:
		default:
			if !strings.HasPrefix(k, "csi.storage.k8s.io/") {
				return p, status.Errorf(codes.InvalidArgument, "parameter %q is not supported (only %s)", k, ParamMgmtSnapshotClass)
			}
		}
	}
	if p.class != "" {
		if msgs := validation.IsDNS1123Subdomain(p.class); len(msgs) > 0 {
			return p, status.Errorf(codes.InvalidArgument, "parameter %s %q is no VolumeSnapshotClass name: %s", ParamMgmtSnapshotClass, p.class, strings.Join(msgs, "; "))
		}
	}
	return p, nil
}

// validateCSIName checks the name of a CreateVolume or CreateSnapshot: it is kept in the
// management object's annotation pvbridge.io/csi-name, whose length the admission policy bounds.
func validateCSIName(name string) error {
	switch n := utf8.RuneCountInString(name); {
	case n == 0:
		return status.Error(codes.InvalidArgument, "name is required")
	case n > tenancy.MaxAnnotationLength:
		return status.Errorf(codes.InvalidArgument, "name is %d characters long, more than the %d pvbridge keeps", n, tenancy.MaxAnnotationLength)
	}
	return nil
}

// mgmtName is the name of the management object for a CSI name: "<cluster UID>-<rest>", where
// rest is the CSI name without prefix ("pvc-" or "snapshot-", as the sidecars make them: the
// guest object's UID) when that gives a valid object name, and 40 hex digits of the name's
// SHA-256 otherwise. The same name always gives the same object, which is what makes
// CreateVolume and CreateSnapshot idempotent; two names never give the same one.
func mgmtName(clusterUID, prefix, csiName string) string {
	rest, ok := strings.CutPrefix(csiName, prefix)
	name := clusterUID + "-" + rest
	if ok && rest != "" && len(validation.IsDNS1123Subdomain(name)) == 0 {
		return name
	}
	sum := sha256.Sum256([]byte(csiName))
	return clusterUID + "-" + hex.EncodeToString(sum[:20])
}

// validHandle reports whether a volume or snapshot ID can name a management object: IDs are
// object names in the guest's namespace, never paths or names elsewhere.
func validHandle(id string) bool {
	return len(validation.IsDNS1123Subdomain(id)) == 0
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
