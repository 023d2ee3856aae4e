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

// StorageClass, VolumeSnapshotClass and VolumeGroupSnapshotClass parameters of the guest. Every
// other parameter is refused, so that a typo is an error and not a silently ignored setting.
const (
	// ParamMgmtStorageClass names the management StorageClass of the management PVC.
	ParamMgmtStorageClass = names.MgmtStorageClassParam
	// ParamMgmtSnapshotClass names the management VolumeSnapshotClass of the management
	// VolumeSnapshot.
	ParamMgmtSnapshotClass = "mgmtSnapshotClass"
	// ParamMgmtAttributesClass, the only parameter of a guest VolumeAttributesClass, names the
	// management VolumeAttributesClass of the management PVC.
	ParamMgmtAttributesClass = names.MgmtVolumeAttributesClassParam
	// ParamMgmtGroupSnapshotClass names the management VolumeGroupSnapshotClass of the
	// management VolumeGroupSnapshot.
	ParamMgmtGroupSnapshotClass = names.MgmtVolumeGroupSnapshotClassParam

	// The keys csi-provisioner and csi-snapshotter add with --extra-create-metadata.
	paramPVCName        = "csi.storage.k8s.io/pvc/name"
	paramPVCNamespace   = "csi.storage.k8s.io/pvc/namespace"
	paramPVName         = "csi.storage.k8s.io/pv/name"
	paramSnapName       = "csi.storage.k8s.io/volumesnapshot/name"
	paramSnapNamespace  = "csi.storage.k8s.io/volumesnapshot/namespace"
	paramGroupName      = "csi.storage.k8s.io/volumegroupsnapshot/name"
	paramGroupNamespace = "csi.storage.k8s.io/volumegroupsnapshot/namespace"
	// Every other key of the prefix csi.storage.k8s.io/ (a content's name, the fstype) is
	// accepted and not kept.
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

// snapshotParams are the parameters of a CreateSnapshot or CreateVolumeGroupSnapshot call.
type snapshotParams struct {
	class         string
	guestSnapshot types.NamespacedName
}

// snapshotKeys are the parameters of a kind of snapshot: the key that names its management
// class and the keys csi-snapshotter adds with the guest object's name and namespace.
type snapshotKeys struct {
	class, classKind, name, namespace string
}

var (
	// volumeSnapshotKeys are CreateSnapshot's parameters.
	volumeSnapshotKeys = snapshotKeys{class: ParamMgmtSnapshotClass, classKind: "VolumeSnapshotClass", name: paramSnapName, namespace: paramSnapNamespace}
	// groupSnapshotKeys are CreateVolumeGroupSnapshot's.
	groupSnapshotKeys = snapshotKeys{class: ParamMgmtGroupSnapshotClass, classKind: "VolumeGroupSnapshotClass", name: paramGroupName, namespace: paramGroupNamespace}
)

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

// parseSnapshotParameters validates the parameters of CreateSnapshot (volumeSnapshotKeys) or
// CreateVolumeGroupSnapshot (groupSnapshotKeys). defaultClass applies when they name none.
func parseSnapshotParameters(params map[string]string, defaultClass string, keys snapshotKeys) (snapshotParams, error) {
	p := snapshotParams{class: defaultClass}
	for k, v := range params {
		switch k {
		case keys.class:
			p.class = v
		case keys.name:
			p.guestSnapshot.Name = v
		case keys.namespace:
			p.guestSnapshot.Namespace = v
		default:
			if !strings.HasPrefix(k, "csi.storage.k8s.io/") {
				return p, status.Errorf(codes.InvalidArgument, "parameter %q is not supported (only %s)", k, keys.class)
			}
		}
	}
	if p.class != "" {
		if msgs := validation.IsDNS1123Subdomain(p.class); len(msgs) > 0 {
			return p, status.Errorf(codes.InvalidArgument, "parameter %s %q is no %s name: %s", keys.class, p.class, keys.classKind, strings.Join(msgs, "; "))
		}
	}
	return p, nil
}

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

// mgmtName is the name of the management object for a CSI name: "<cluster UID>-<rest>", where
// rest is the CSI name without prefix ("pvc-", "snapshot-" or "groupsnapshot-", as the sidecars
// make them: the guest object's UID) when that gives a valid object name, and 40 hex digits of
// the name's SHA-256 otherwise (hashedName). The same name always gives the same object, which is
// what makes the Create calls idempotent; two names never give the same one.
func mgmtName(clusterUID, prefix, csiName string) string {
	rest, ok := strings.CutPrefix(csiName, prefix)
	name := clusterUID + "-" + rest
	if ok && rest != "" && len(validation.IsDNS1123Subdomain(name)) == 0 {
		return name
	}
	return hashedName(clusterUID, csiName)
}

// hashedName is "<cluster UID>-" and 40 hex digits of csiName's SHA-256.
func hashedName(clusterUID, csiName string) string {
	sum := sha256.Sum256([]byte(csiName))
	return clusterUID + "-" + hex.EncodeToString(sum[:20])
}

// groupSnapshotName is the management VolumeGroupSnapshot of a CSI group snapshot name:
// mgmtName's, whose rest must also be a label value (groupLabel), else hashedName's.
func groupSnapshotName(clusterUID, csiName string) string {
	name := mgmtName(clusterUID, groupSnapshotPrefix, csiName)
	if len(validation.IsValidLabelValue(strings.TrimPrefix(name, clusterUID+"-"))) > 0 {
		return hashedName(clusterUID, csiName)
	}
	return name
}

// groupLabel is the value of tenancy.VolumeGroupLabel on the member claims of the management
// VolumeGroupSnapshot name of cluster uid: its name without "<uid>-", the guest
// VolumeGroupSnapshot's UID.
func groupLabel(clusterUID, name string) string {
	return strings.TrimPrefix(name, clusterUID+"-")
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
