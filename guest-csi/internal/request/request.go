// Package request interprets what a tenant controls in guest-csi's CSI requests: the parameters
// of its StorageClasses, VolumeSnapshotClasses, VolumeGroupSnapshotClasses and
// VolumeAttributesClasses, the management names of the objects the sidecars name for it, the
// volume handles of its static PVs, and the disk serial a publish context carries. It imports
// nothing heavier than apimachinery's validation and gRPC's status codes: a fuzz test
// instruments every package its binary holds, and these parsers are fuzzed (make fuzz).
package request

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/validation"

	"pvbridge.io/pkg/names"
)

// StorageClass, VolumeSnapshotClass and VolumeGroupSnapshotClass parameters of the guest. Every
// other parameter is refused, so that a typo is an error and not a silently ignored setting.
const (
	// ParamMgmtStorageClass names the management StorageClass of the management PVC.
	ParamMgmtStorageClass = names.MgmtStorageClassParam
	// ParamReplicated "true" says that the management class keeps a volume on several hosts:
	// the guest volume then has no host topology (any VM may use it); "false" or absent, it is
	// used only on the VMs of the host it was made on.
	ParamReplicated = names.ReplicatedParam
	// ParamMgmtSnapshotClass names the management VolumeSnapshotClass of the management
	// VolumeSnapshot.
	ParamMgmtSnapshotClass = "mgmtSnapshotClass"
	// ParamMgmtAttributesClass, the only parameter of a guest VolumeAttributesClass, names the
	// management VolumeAttributesClass of the management PVC.
	ParamMgmtAttributesClass = names.MgmtVolumeAttributesClassParam
	// ParamMgmtGroupSnapshotClass names the management VolumeGroupSnapshotClass of the
	// management VolumeGroupSnapshot.
	ParamMgmtGroupSnapshotClass = names.MgmtVolumeGroupSnapshotClassParam

	// ParamPVCName and the others below are the keys csi-provisioner and csi-snapshotter add
	// with --extra-create-metadata.
	ParamPVCName        = "csi.storage.k8s.io/pvc/name"
	ParamPVCNamespace   = "csi.storage.k8s.io/pvc/namespace"
	ParamPVName         = "csi.storage.k8s.io/pv/name"
	ParamSnapName       = "csi.storage.k8s.io/volumesnapshot/name"
	ParamSnapNamespace  = "csi.storage.k8s.io/volumesnapshot/namespace"
	ParamGroupName      = "csi.storage.k8s.io/volumegroupsnapshot/name"
	ParamGroupNamespace = "csi.storage.k8s.io/volumegroupsnapshot/namespace"
	// Every other key of the prefix csi.storage.k8s.io/ (a content's name, the fstype) is
	// accepted and not kept.
)

// VolumeParams are the parameters of a CreateVolume call.
type VolumeParams struct {
	// Class is the management StorageClass, "" for the management cluster's default.
	Class string
	// AttributesClass is the management VolumeAttributesClass, "" for none.
	// GuestPVC and GuestPV are the guest objects csi-provisioner names (--extra-create-metadata).
	AttributesClass string
	GuestPVC        types.NamespacedName
	GuestPV         string
	// Replicated is ParamReplicated.
	Replicated bool
}

// SnapshotParams are the parameters of a CreateSnapshot or CreateVolumeGroupSnapshot call.
type SnapshotParams struct {
	// Class is the management snapshot class; GuestSnapshot the guest object csi-snapshotter
	// names (--extra-create-metadata).
	Class         string
	GuestSnapshot types.NamespacedName
}

// SnapshotKeys are the parameters of a kind of snapshot: the key that names its management
// class and the keys csi-snapshotter adds with the guest object's name and namespace.
type SnapshotKeys struct {
	class, classKind, name, namespace string
}

var (
	// VolumeSnapshotKeys are CreateSnapshot's parameters.
	VolumeSnapshotKeys = SnapshotKeys{class: ParamMgmtSnapshotClass, classKind: "VolumeSnapshotClass", name: ParamSnapName, namespace: ParamSnapNamespace}
	// GroupSnapshotKeys are CreateVolumeGroupSnapshot's.
	GroupSnapshotKeys = SnapshotKeys{class: ParamMgmtGroupSnapshotClass, classKind: "VolumeGroupSnapshotClass", name: ParamGroupName, namespace: ParamGroupNamespace}
)

// ParseVolumeParameters validates CreateVolume's parameters (and GetCapacity's: the same
// StorageClass's). defaultClass applies when the class names none.
func ParseVolumeParameters(params map[string]string, defaultClass string) (VolumeParams, error) {
	p := VolumeParams{Class: defaultClass}
	for k, v := range params {
		switch k {
		case ParamMgmtStorageClass:
			p.Class = v
		case ParamPVCName:
			p.GuestPVC.Name = v
		case ParamPVCNamespace:
			p.GuestPVC.Namespace = v
		case ParamPVName:
			p.GuestPV = v
		case ParamReplicated:
			switch v {
			case "true":
				p.Replicated = true
			case "false":
			default:
				return p, status.Errorf(codes.InvalidArgument, "parameter %s %q is neither \"true\" nor \"false\"", ParamReplicated, v)
			}
		default:
			if !strings.HasPrefix(k, "csi.storage.k8s.io/") {
				return p, status.Errorf(codes.InvalidArgument, "parameter %q is not supported (only %s and %s)", k, ParamMgmtStorageClass, ParamReplicated)
			}
		}
	}
	if p.Class != "" {
		if msgs := validation.IsDNS1123Subdomain(p.Class); len(msgs) > 0 {
			return p, status.Errorf(codes.InvalidArgument, "parameter %s %q is no StorageClass name: %s", ParamMgmtStorageClass, p.Class, strings.Join(msgs, "; "))
		}
	}
	return p, nil
}

// ParseMutableParameters validates the parameters of a guest VolumeAttributesClass (CreateVolume's
// and ControllerModifyVolume's mutable_parameters) and returns the management class they name:
// "" when there are none.
func ParseMutableParameters(params map[string]string) (string, error) {
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

// ParseSnapshotParameters validates the parameters of CreateSnapshot (VolumeSnapshotKeys) or
// CreateVolumeGroupSnapshot (GroupSnapshotKeys). defaultClass applies when they name none.
func ParseSnapshotParameters(params map[string]string, defaultClass string, keys SnapshotKeys) (SnapshotParams, error) {
	p := SnapshotParams{Class: defaultClass}
	for k, v := range params {
		switch k {
		case keys.class:
			p.Class = v
		case keys.name:
			p.GuestSnapshot.Name = v
		case keys.namespace:
			p.GuestSnapshot.Namespace = v
		default:
			if !strings.HasPrefix(k, "csi.storage.k8s.io/") {
				return p, status.Errorf(codes.InvalidArgument, "parameter %q is not supported (only %s)", k, keys.class)
			}
		}
	}
	if p.Class != "" {
		if msgs := validation.IsDNS1123Subdomain(p.Class); len(msgs) > 0 {
			return p, status.Errorf(codes.InvalidArgument, "parameter %s %q is no %s name: %s", keys.class, p.Class, keys.classKind, strings.Join(msgs, "; "))
		}
	}
	return p, nil
}

// MgmtName is the name of the management object for a CSI name: "<cluster UID>-<rest>", where
// rest is the CSI name without prefix ("pvc-", "snapshot-" or "groupsnapshot-", as the sidecars
// make them: the guest object's UID) when that gives a valid object name, and 40 hex digits of
// the name's SHA-256 otherwise (HashedName). The same name always gives the same object, which is
// what makes the Create calls idempotent; two names never give the same one.
func MgmtName(clusterUID, prefix, csiName string) string {
	rest, ok := strings.CutPrefix(csiName, prefix)
	name := clusterUID + "-" + rest
	if ok && rest != "" && len(validation.IsDNS1123Subdomain(name)) == 0 {
		return name
	}
	return HashedName(clusterUID, csiName)
}

// HashedName is "<cluster UID>-" and 40 hex digits of csiName's SHA-256.
func HashedName(clusterUID, csiName string) string {
	sum := sha256.Sum256([]byte(csiName))
	return clusterUID + "-" + hex.EncodeToString(sum[:20])
}

// GroupSnapshotPrefix starts the name csi-snapshotter gives a group snapshot:
// groupsnapshot-<UID of the guest VolumeGroupSnapshot>.
const GroupSnapshotPrefix = "groupsnapshot-"

// GroupSnapshotName is the management VolumeGroupSnapshot of a CSI group snapshot name:
// MgmtName's, whose rest must also be a label value (GroupLabel), else HashedName's.
func GroupSnapshotName(clusterUID, csiName string) string {
	name := MgmtName(clusterUID, GroupSnapshotPrefix, csiName)
	if len(validation.IsValidLabelValue(strings.TrimPrefix(name, clusterUID+"-"))) > 0 {
		return HashedName(clusterUID, csiName)
	}
	return name
}

// GroupLabel is the value of tenancy.VolumeGroupLabel on the member claims of the management
// VolumeGroupSnapshot name of cluster uid: its name without "<uid>-", the guest
// VolumeGroupSnapshot's UID.
func GroupLabel(clusterUID, name string) string {
	return strings.TrimPrefix(name, clusterUID+"-")
}

// ValidHandle reports whether a volume or snapshot ID can name a management object: IDs are
// object names in the guest's namespace, never paths or names elsewhere.
func ValidHandle(id string) bool {
	return len(validation.IsDNS1123Subdomain(id)) == 0
}

const (
	// PublishContextSerial is the publish context key under which ControllerPublishVolume hands
	// the node the serial of the disk it attached to the node's VirtualMachine.
	PublishContextSerial = "diskSerial"
	// MaxSerialLength is the longest serial virtio-blk passes to the guest.
	MaxSerialLength = 20
)

// ErrInvalidSerial is returned when the publish context carries no serial, or one that no disk
// can have.
var ErrInvalidSerial = errors.New("invalid disk serial")

// SerialFrom returns the disk serial of a publish context. The serial comes from the management
// cluster, not from the node, but it names files under the device root: only the characters a
// virtio serial made by pvbridge has are accepted, so that it can never name another path.
func SerialFrom(publishContext map[string]string) (string, error) {
	serial, ok := publishContext[PublishContextSerial]
	if !ok || serial == "" {
		return "", fmt.Errorf("%w: publish_context has no %s", ErrInvalidSerial, PublishContextSerial)
	}
	if len(serial) > MaxSerialLength {
		return "", fmt.Errorf("%w: publish_context %s %q is longer than %d characters", ErrInvalidSerial, PublishContextSerial, serial, MaxSerialLength)
	}
	for _, c := range []byte(serial) {
		if !isSerialChar(c) {
			return "", fmt.Errorf("%w: publish_context %s %q may only contain letters, digits, '_' and '-'", ErrInvalidSerial, PublishContextSerial, serial)
		}
	}
	return serial, nil
}

func isSerialChar(c byte) bool {
	return 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '_' || c == '-'
}
