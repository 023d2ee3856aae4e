// Package pmem carves volumes and snapshots out of a host's persistent memory. One interface,
// Backend, has three implementations, chosen per node:
//
//   - file: sparse files on a filesystem (in production a DAX-mounted fsdax namespace), each
//     volume exposed as a loop device;
//   - lvm: a volume group per PMEM region and a logical volume per volume (pmem-csi's LVM mode);
//   - ndctl: one fsdax namespace per volume (pmem-csi's direct mode).
//
// A back end keeps its state on the device itself (file names, LV tags, namespace names carry
// the volume and snapshot IDs), so a restarted agent finds every volume again and never creates
// one twice. Every method is idempotent.
package pmem

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"k8s.io/apimachinery/pkg/util/validation"

	"pvbridge.io/mgmt-csi/internal/loop"
	pmemv1 "pvbridge.io/pkg/apis/pmem/v1alpha1"
)

// Errors a Backend returns, wrapped with details. The CSI layer maps them to gRPC codes.
var (
	// ErrNotFound: no volume or snapshot with that ID.
	ErrNotFound = errors.New("not found")
	// ErrNoSpace: not enough free PMEM, or no free extent large enough.
	ErrNoSpace = errors.New("insufficient PMEM capacity")
	// ErrInUse: the volume is opened or mounted and cannot be removed.
	ErrInUse = loop.ErrInUse
	// ErrInvalid: the request cannot be satisfied as asked (an ID the back end cannot store,
	// a shrink, a source of another size than allowed).
	ErrInvalid = errors.New("invalid request")
)

// Volume is a volume as it exists on the node.
type Volume struct {
	// ID is the CSI volume ID.
	ID string
	// Size is the usable size of the device in bytes, at least the size asked for. The file and
	// lvm back ends allocate exactly this, a multiple of the alignment; an ndctl namespace also
	// holds its page metadata, so its Size is what remains of a multiple of the alignment.
	Size int64
	// Device is the block device path, e.g. /dev/loop3, /dev/pmem0.1, /dev/<vg>/<lv>.
	Device string
}

// Snapshot is a snapshot as it exists on the node.
type Snapshot struct {
	// ID is the CSI snapshot ID.
	ID string
	// SourceVolumeID is the volume it was taken from.
	SourceVolumeID string
	// Size is the size of the source volume when it was taken.
	Size int64
	// CreationTime is when it was cut, in Unix nanoseconds, as recorded on the device.
	CreationTime int64
}

// Capacity is the state of the node's PMEM.
type Capacity struct {
	// Total is the PMEM the back end manages, in bytes.
	Total int64
	// Free is the PMEM not allocated to volumes or snapshots.
	Free int64
	// LargestAllocatable is the size of the largest volume Create can make now (≤ Free).
	LargestAllocatable int64
	// Alignment is the allocation granularity; sizes are rounded up to it.
	Alignment int64
}

// Source is where a new volume's data comes from: at most one of SnapshotID and VolumeID.
type Source struct {
	SnapshotID string
	VolumeID   string
}

// Backend manages the PMEM of one node. Implementations are safe for concurrent use.
type Backend interface {
	// Mode names the back end.
	Mode() pmemv1.Mode
	// Capacity reports total, free and largest allocatable space.
	Capacity(ctx context.Context) (Capacity, error)

	// CreateVolume makes volume id of at least size bytes (rounded up to the alignment), filled
	// from src when it is set, and returns it with its device. Size 0 means the size of the
	// source, or one alignment without one; a size smaller than the source is ErrInvalid. A new
	// volume never shows data of an earlier one: it reads as zeroes past what src fills. If the volume exists it is
	// returned as it is (callers compare sizes). ErrNoSpace when it does not fit; ErrNotFound
	// when src does not exist. A crash part-way leaves no volume that GetVolume or ListVolumes
	// would report as complete.
	CreateVolume(ctx context.Context, id string, size int64, src *Source) (Volume, error)
	// GetVolume returns volume id, ErrNotFound if there is none. It makes sure the volume has a
	// usable device (the file back end re-attaches its loop device after a reboot).
	GetVolume(ctx context.Context, id string) (Volume, error)
	// ListVolumes returns every volume of this back end.
	ListVolumes(ctx context.Context) ([]Volume, error)
	// ExpandVolume grows volume id to at least size bytes; a volume already that large is
	// returned unchanged. ErrNoSpace, ErrNotFound.
	ExpandVolume(ctx context.Context, id string, size int64) (Volume, error)
	// DeleteVolume removes volume id and frees its space; nil if it does not exist. ErrInUse
	// while it is opened or mounted.
	DeleteVolume(ctx context.Context, id string) error

	// CreateSnapshot cuts snapshot id of volume volumeID; an existing snapshot id of the same
	// volume is returned as it is, one of another volume is ErrInvalid. ErrNotFound,
	// ErrNoSpace.
	CreateSnapshot(ctx context.Context, id, volumeID string) (Snapshot, error)
	// ListSnapshots returns every snapshot of this back end.
	ListSnapshots(ctx context.Context) ([]Snapshot, error)
	// DeleteSnapshot removes snapshot id; nil if it does not exist.
	DeleteSnapshot(ctx context.Context, id string) error
}

// AlignUp rounds size up to a multiple of alignment (alignment > 0).
func AlignUp(size, alignment int64) int64 {
	if r := size % alignment; r != 0 {
		return size + alignment - r
	}
	return size
}

// AlignDown rounds size down to a multiple of alignment (alignment > 0).
func AlignDown(size, alignment int64) int64 {
	return size - size%alignment
}

// ValidateID checks that id can name a volume or snapshot: a lowercase DNS label of at most 63
// characters, which every back end can store. The error wraps ErrInvalid.
func ValidateID(id string) error {
	if errs := validation.IsDNS1123Label(id); len(errs) > 0 {
		return fmt.Errorf("%w: ID %q: %s", ErrInvalid, id, strings.Join(errs, "; "))
	}
	return nil
}

// validateSource checks that src names at most one source, by a valid ID.
func validateSource(src *Source) error {
	switch {
	case src == nil:
		return nil
	case src.SnapshotID != "" && src.VolumeID != "":
		return fmt.Errorf("%w: a source is a snapshot or a volume, not both", ErrInvalid)
	case src.SnapshotID != "":
		return ValidateID(src.SnapshotID)
	case src.VolumeID != "":
		return ValidateID(src.VolumeID)
	}
	return nil
}

// sizeFor is the size of a new volume asked to be size bytes, filled from a source of
// sourceSize bytes (0 without a source): at least the source, one alignment at the least,
// rounded up to the alignment. Smaller than the source is ErrInvalid.
func sizeFor(size, sourceSize, alignment int64) (int64, error) {
	switch {
	case size < 0:
		return 0, fmt.Errorf("%w: negative size %d", ErrInvalid, size)
	case size == 0:
		size = max(sourceSize, alignment)
	case size < sourceSize:
		return 0, fmt.Errorf("%w: size %d is smaller than its source (%d bytes)", ErrInvalid, size, sourceSize)
	}
	return AlignUp(size, alignment), nil
}
