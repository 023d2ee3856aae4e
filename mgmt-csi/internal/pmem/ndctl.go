package pmem

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"k8s.io/klog/v2"

	pmemv1 "pvbridge.io/pkg/apis/pmem/v1alpha1"
)

// DefaultNdctlAlignment is the allocation granularity of the ndctl back end unless configured.
const DefaultNdctlAlignment = 1 << 30

// On-device naming of the ndctl back end: one fsdax namespace per volume and per snapshot,
// found by its name (a label of at most 63 characters):
//
//	<volume ID>              a volume
//	snap:<snapshot ID>       a snapshot, for IDs of at most 58 characters
//	snap#<40 hex digits>     a snapshot with a longer ID: the start of the ID's SHA-256
//
// No volume ID contains ':' or '#', so names never collide. Namespaces cannot be renamed, so
// completeness is written inside them, bound to the namespace's random UUID so that data left
// on the media by an earlier namespace never passes for it:
//
//   - a volume being filled (zeroed, or copied from its source) starts with the block
//     "pvbridge.io/pmem incomplete <uuid>"; its first block is written last, by the copy or
//     the zeroing. A volume still starting with it is left over from a crash and filled again.
//   - a snapshot ends with a 4 KiB JSON trailer (its ID, source volume, size, creation time
//     and the UUID), written after its data: a snapshot without a valid trailer is incomplete.
//
// The regions used are pvbridge's: every namespace in them named by a DNS label is a volume.
const (
	nsSnapshotPrefix     = "snap:"
	nsSnapshotHashPrefix = "snap#"
	nsNameMax            = 63
	recordSize           = 4096
	incompleteMagic      = "pvbridge.io/pmem incomplete "
	trailerMagic         = "pvbridge.io/pmem snapshot"
	// nsOverhead bounds what an fsdax namespace keeps for itself besides its page map (64
	// bytes per 4 KiB page, --map=dev): the info block and the padding to 2 MiB.
	nsOverhead = 16 << 20
)

// ndctlMu serializes the ndctl commands of the process and each check-then-act (find a region
// with room, then create-namespace): libndctl is not safe for concurrent use (pmem/ndctl#96).
var ndctlMu sync.Mutex

// NdctlOptions configure the ndctl back end.
type NdctlOptions struct {
	// Regions are the PMEM regions to use, e.g. "region0"; empty means every pmem region.
	Regions []string
	// Alignment is the allocation granularity; 0 means 1 GiB.
	Alignment int64
	// Runner runs ndctl; nil means ExecRunner.
	Runner Runner
	// BlockIO zeroes and copies data and keeps the records; nil means DeviceIO.
	BlockIO BlockIO
}

// Ndctl makes one fsdax namespace per volume (pmem-csi's direct mode). Namespaces are
// contiguous, so free space fragments: the largest volume is bounded by the largest free
// extent of a region. A namespace holds its page map, so a volume's namespace is larger than
// the volume, by a little more than 1/64 rounded up to the alignment.
type Ndctl struct {
	regions   []string
	alignment int64
	run       Runner
	io        BlockIO
	keys      keyLocks
}

var _ Backend = (*Ndctl)(nil)

// NewNdctl opens the ndctl back end.
func NewNdctl(opts NdctlOptions) (*Ndctl, error) {
	if opts.Alignment == 0 {
		opts.Alignment = DefaultNdctlAlignment
	}
	if opts.Alignment < nsOverhead || opts.Alignment&(opts.Alignment-1) != 0 {
		return nil, fmt.Errorf("ndctl back end: alignment %d is not a power of two of at least 16 MiB", opts.Alignment)
	}
	n := &Ndctl{regions: slices.Clone(opts.Regions), alignment: opts.Alignment, run: opts.Runner, io: opts.BlockIO}
	if n.run == nil {
		n.run = ExecRunner{}
	}
	if n.io == nil {
		n.io = DeviceIO{}
	}
	return n, nil
}

// Mode implements Backend.
func (n *Ndctl) Mode() pmemv1.Mode { return pmemv1.ModeNdctl }

type regionRow struct {
	Dev                string `json:"dev"`
	Size               int64  `json:"size"`
	AvailableSize      int64  `json:"available_size"`
	MaxAvailableExtent int64  `json:"max_available_extent"`
	Type               string `json:"type"`
	State              string `json:"state"`
}

type namespaceRow struct {
	Dev  string `json:"dev"`
	Mode string `json:"mode"`
	// Size is the usable size of the block device.
	Size     int64  `json:"size"`
	UUID     string `json:"uuid"`
	Blockdev string `json:"blockdev"`
	Name     string `json:"name"`
}

func (ns namespaceRow) device() string { return "/dev/" + ns.Blockdev }

// region is the region of ns: namespace0.1 is in region0.
func (ns namespaceRow) region() string {
	id, _, _ := strings.Cut(strings.TrimPrefix(ns.Dev, "namespace"), ".")
	return "region" + id
}

// parseList parses what ndctl list prints: nothing when nothing matches, an array, or, in
// human mode, one object alone.
func parseList[T any](out []byte) ([]T, error) {
	out = bytes.TrimSpace(out)
	switch {
	case len(out) == 0:
		return nil, nil
	case out[0] == '{':
		var one T
		if err := json.Unmarshal(out, &one); err != nil {
			return nil, err
		}
		return []T{one}, nil
	}
	var all []T
	err := json.Unmarshal(out, &all)
	return all, err
}

func (n *Ndctl) use(region string) bool {
	return len(n.regions) == 0 || slices.Contains(n.regions, region)
}

func (n *Ndctl) regionsLocked(ctx context.Context) ([]regionRow, error) {
	out, err := n.run.Run(ctx, "ndctl", "list", "-R")
	if err != nil {
		return nil, err
	}
	all, err := parseList[regionRow](out)
	if err != nil {
		return nil, fmt.Errorf("parse ndctl list -R: %w", err)
	}
	var regions []regionRow
	for _, r := range all {
		if r.Type == "pmem" && r.State != "disabled" && n.use(r.Dev) {
			regions = append(regions, r)
		}
	}
	return regions, nil
}

// namespacesLocked lists the fsdax namespaces of our regions that have a name.
func (n *Ndctl) namespacesLocked(ctx context.Context) ([]namespaceRow, error) {
	out, err := n.run.Run(ctx, "ndctl", "list", "-N")
	if err != nil {
		return nil, err
	}
	all, err := parseList[namespaceRow](out)
	if err != nil {
		return nil, fmt.Errorf("parse ndctl list -N: %w", err)
	}
	var nss []namespaceRow
	for _, ns := range all {
		if ns.Name != "" && ns.Mode == "fsdax" && ns.Blockdev != "" && n.use(ns.region()) {
			nss = append(nss, ns)
		}
	}
	return nss, nil
}

func findNamespace(nss []namespaceRow, name string) (namespaceRow, bool) {
	i := slices.IndexFunc(nss, func(ns namespaceRow) bool { return ns.Name == name })
	if i < 0 {
		return namespaceRow{}, false
	}
	return nss[i], true
}

// snapshotNamespaceName is the name of the namespace of snapshot id.
func snapshotNamespaceName(id string) string {
	if len(nsSnapshotPrefix)+len(id) <= nsNameMax {
		return nsSnapshotPrefix + id
	}
	sum := sha256.Sum256([]byte(id))
	return nsSnapshotHashPrefix + hex.EncodeToString(sum[:20])
}

func isSnapshotNamespace(name string) bool {
	return strings.HasPrefix(name, nsSnapshotPrefix) || strings.HasPrefix(name, nsSnapshotHashPrefix)
}

// rawSize is the size of a namespace whose usable size is at least usable bytes.
func rawSize(usable, alignment int64) int64 {
	need := usable + nsOverhead
	return AlignUp((need*64+62)/63, alignment)
}

// usableSize is the largest aligned size rawSize fits into raw bytes, 0 if none.
func usableSize(raw, alignment int64) int64 {
	return max(AlignDown(raw*63/64-nsOverhead, alignment), 0)
}

// pickRegion chooses the region for a namespace of raw bytes: the one whose largest free
// extent fits it most tightly. ErrNoSpace if none fits.
func pickRegion(regions []regionRow, raw int64) (string, error) {
	best, largest := -1, int64(0)
	for i, r := range regions {
		largest = max(largest, r.MaxAvailableExtent)
		if r.MaxAvailableExtent >= raw && (best < 0 || r.MaxAvailableExtent < regions[best].MaxAvailableExtent) {
			best = i
		}
	}
	if best < 0 {
		return "", fmt.Errorf("%w: a namespace of %d bytes asked, the largest free extent of a region is %d", ErrNoSpace, raw, largest)
	}
	return regions[best].Dev, nil
}

// Capacity implements Backend. The largest allocatable size is the largest volume the largest
// free extent of a region holds.
func (n *Ndctl) Capacity(ctx context.Context) (Capacity, error) {
	ndctlMu.Lock()
	regions, err := n.regionsLocked(ctx)
	ndctlMu.Unlock()
	if err != nil {
		return Capacity{}, err
	}
	c := Capacity{Alignment: n.alignment}
	for _, r := range regions {
		c.Total += r.Size
		c.Free += r.AvailableSize
		c.LargestAllocatable = max(c.LargestAllocatable, usableSize(AlignDown(r.MaxAvailableExtent, n.alignment), n.alignment))
	}
	return c, nil
}

// createLocked makes a namespace named name with a usable size of at least usable bytes.
func (n *Ndctl) createLocked(ctx context.Context, name string, usable int64) (namespaceRow, error) {
	regions, err := n.regionsLocked(ctx)
	if err != nil {
		return namespaceRow{}, err
	}
	raw := rawSize(usable, n.alignment)
	region, err := pickRegion(regions, raw)
	if err != nil {
		return namespaceRow{}, err
	}
	out, err := n.run.Run(ctx, "ndctl", "create-namespace", "--mode", "fsdax", "--map", "dev",
		"--region", region, "--size", strconv.FormatInt(raw, 10), "--name", name)
	if err != nil {
		if stderrContains(err, "No space left", "insufficient capacity") {
			return namespaceRow{}, fmt.Errorf("%w: %w", ErrNoSpace, err)
		}
		return namespaceRow{}, err
	}
	// create-namespace prints sizes for humans; list the new namespace for exact ones.
	var created struct {
		Dev string `json:"dev"`
	}
	if err := json.Unmarshal(bytes.TrimSpace(out), &created); err != nil || created.Dev == "" {
		return namespaceRow{}, fmt.Errorf("parse ndctl create-namespace: %q: %w", out, err)
	}
	out, err = n.run.Run(ctx, "ndctl", "list", "-N", "-n", created.Dev)
	if err != nil {
		return namespaceRow{}, err
	}
	nss, err := parseList[namespaceRow](out)
	if err != nil || len(nss) != 1 || nss[0].Blockdev == "" {
		return namespaceRow{}, fmt.Errorf("parse ndctl list -N -n %s: %q: %w", created.Dev, out, err)
	}
	ns := nss[0]
	if ns.Size < usable {
		err := fmt.Errorf("namespace %s holds %d bytes, less than the %d asked", ns.Dev, ns.Size, usable)
		return namespaceRow{}, errors.Join(err, n.destroyLocked(ctx, ns))
	}
	klog.FromContext(ctx).V(4).Info("Created namespace", "namespace", ns.Dev, "name", name, "region", region, "size", raw)
	return ns, nil
}

func (n *Ndctl) destroyLocked(ctx context.Context, ns namespaceRow) error {
	if _, err := n.run.Run(ctx, "ndctl", "destroy-namespace", "--force", ns.Dev); err != nil {
		if stderrContains(err, "Device or resource busy") {
			return fmt.Errorf("%w: %s (%s): %w", ErrInUse, ns.Dev, ns.device(), err)
		}
		return err
	}
	return nil
}

// destroyDetached destroys ns in cleanup after a failure, even when ctx has ended.
func (n *Ndctl) destroyDetached(ctx context.Context, ns namespaceRow) {
	ndctlMu.Lock()
	defer ndctlMu.Unlock()
	if err := n.destroyLocked(context.WithoutCancel(ctx), ns); err != nil {
		klog.FromContext(ctx).Error(err, "Cannot destroy incomplete namespace", "namespace", ns.Dev)
	}
}

func incompleteRecord(ns namespaceRow) []byte {
	p := make([]byte, recordSize)
	copy(p, incompleteMagic+ns.UUID+"\n")
	return p
}

// complete tells whether volume namespace ns holds all its data.
func (n *Ndctl) complete(ctx context.Context, ns namespaceRow) (bool, error) {
	p := make([]byte, recordSize)
	if err := n.io.ReadAt(ctx, ns.device(), p, 0); err != nil {
		return false, err
	}
	return !bytes.Equal(p, incompleteRecord(ns)), nil
}

// snapshotTrailer is the last 4 KiB of a snapshot namespace, zero-padded JSON.
type snapshotTrailer struct {
	Magic          string `json:"magic"`
	UUID           string `json:"uuid"`
	ID             string `json:"id"`
	SourceVolumeID string `json:"sourceVolumeID"`
	Size           int64  `json:"size"`
	CreationTime   int64  `json:"creationTime"`
}

// readTrailer returns the snapshot in namespace ns; ok false while it is incomplete.
func (n *Ndctl) readTrailer(ctx context.Context, ns namespaceRow) (Snapshot, bool, error) {
	p := make([]byte, recordSize)
	if err := n.io.ReadAt(ctx, ns.device(), p, ns.Size-recordSize); err != nil {
		return Snapshot{}, false, err
	}
	var tr snapshotTrailer
	if json.Unmarshal(bytes.TrimRight(p, "\x00"), &tr) != nil || tr.Magic != trailerMagic || tr.UUID != ns.UUID ||
		snapshotNamespaceName(tr.ID) != ns.Name {
		return Snapshot{}, false, nil
	}
	return Snapshot{ID: tr.ID, SourceVolumeID: tr.SourceVolumeID, Size: tr.Size, CreationTime: tr.CreationTime}, true, nil
}

// CreateVolume implements Backend. A new volume is zeroed, then filled from its source.
func (n *Ndctl) CreateVolume(ctx context.Context, id string, size int64, src *Source) (Volume, error) {
	if err := ValidateID(id); err != nil {
		return Volume{}, err
	}
	if err := validateSource(src); err != nil {
		return Volume{}, err
	}
	unlock, err := n.keys.lock(ctx, volumeKey(id), sourceKey(src))
	if err != nil {
		return Volume{}, err
	}
	defer unlock()

	ndctlMu.Lock()
	ns, srcNS, srcSize, existing, err := n.prepareVolumeLocked(ctx, id, size, src)
	ndctlMu.Unlock()
	if err != nil {
		return Volume{}, fmt.Errorf("create volume %s: %w", id, err)
	}
	vol := Volume{ID: id, Size: ns.Size, Device: ns.device()}
	if existing {
		return vol, nil
	}
	// The first block goes last: until then the volume starts with the incomplete record.
	dev := ns.device()
	err = func() error {
		if src == nil {
			if err := n.io.Zero(ctx, dev, recordSize, ns.Size-recordSize); err != nil {
				return err
			}
			return n.io.Zero(ctx, dev, 0, recordSize)
		}
		if err := n.io.Copy(ctx, dev, srcNS.device(), recordSize, srcSize-recordSize); err != nil {
			return err
		}
		if ns.Size > srcSize {
			if err := n.io.Zero(ctx, dev, srcSize, ns.Size-srcSize); err != nil {
				return err
			}
		}
		return n.io.Copy(ctx, dev, srcNS.device(), 0, recordSize)
	}()
	if err != nil {
		n.destroyDetached(ctx, ns)
		return Volume{}, fmt.Errorf("create volume %s: %w", id, err)
	}
	klog.FromContext(ctx).V(2).Info("Created volume", "volumeID", id, "size", vol.Size, "device", vol.Device, "namespace", ns.Dev)
	return vol, nil
}

// prepareVolumeLocked returns the namespace of volume id: an existing, complete one, or one to
// fill (new, or left incomplete by a crash), then marked incomplete, with the namespace and
// size of the data of src.
func (n *Ndctl) prepareVolumeLocked(ctx context.Context, id string, size int64, src *Source) (ns, srcNS namespaceRow, srcSize int64, existing bool, err error) {
	nss, err := n.namespacesLocked(ctx)
	if err != nil {
		return
	}
	ns, found := findNamespace(nss, id)
	if found {
		complete, err := n.complete(ctx, ns)
		if err != nil || complete {
			return ns, srcNS, 0, complete, err
		}
		klog.FromContext(ctx).Info("Filling a volume a crash left incomplete", "volumeID", id, "namespace", ns.Dev)
	}
	if srcNS, srcSize, err = n.sourceLocked(ctx, nss, src); err != nil {
		return
	}
	if size, err = sizeFor(size, srcSize, n.alignment); err != nil {
		return
	}
	if !found {
		if ns, err = n.createLocked(ctx, id, size); err != nil {
			return
		}
		if err = n.io.WriteAt(ctx, ns.device(), incompleteRecord(ns), 0); err != nil {
			return ns, srcNS, 0, false, errors.Join(err, n.destroyLocked(ctx, ns))
		}
	}
	return ns, srcNS, srcSize, false, nil
}

// sourceLocked finds the namespace of src and the size of its data.
func (n *Ndctl) sourceLocked(ctx context.Context, nss []namespaceRow, src *Source) (namespaceRow, int64, error) {
	switch {
	case src == nil:
		return namespaceRow{}, 0, nil
	case src.SnapshotID != "":
		ns, ok := findNamespace(nss, snapshotNamespaceName(src.SnapshotID))
		if ok {
			snap, complete, err := n.readTrailer(ctx, ns)
			if err != nil || complete {
				return ns, snap.Size, err
			}
		}
		return namespaceRow{}, 0, fmt.Errorf("%w: source snapshot %s", ErrNotFound, src.SnapshotID)
	default:
		ns, ok := findNamespace(nss, src.VolumeID)
		if ok {
			complete, err := n.complete(ctx, ns)
			if err != nil || complete {
				return ns, ns.Size, err
			}
		}
		return namespaceRow{}, 0, fmt.Errorf("%w: source volume %s", ErrNotFound, src.VolumeID)
	}
}

// GetVolume implements Backend.
func (n *Ndctl) GetVolume(ctx context.Context, id string) (Volume, error) {
	if err := ValidateID(id); err != nil {
		return Volume{}, err
	}
	ndctlMu.Lock()
	nss, err := n.namespacesLocked(ctx)
	ndctlMu.Unlock()
	if err != nil {
		return Volume{}, err
	}
	return n.volume(ctx, nss, id)
}

// volume returns volume id from nss; ErrNotFound unless it is there and complete.
func (n *Ndctl) volume(ctx context.Context, nss []namespaceRow, id string) (Volume, error) {
	ns, ok := findNamespace(nss, id)
	if ok {
		complete, err := n.complete(ctx, ns)
		if err != nil {
			return Volume{}, err
		}
		if complete {
			return Volume{ID: id, Size: ns.Size, Device: ns.device()}, nil
		}
	}
	return Volume{}, fmt.Errorf("%w: volume %s", ErrNotFound, id)
}

// ListVolumes implements Backend.
func (n *Ndctl) ListVolumes(ctx context.Context) ([]Volume, error) {
	ndctlMu.Lock()
	nss, err := n.namespacesLocked(ctx)
	ndctlMu.Unlock()
	if err != nil {
		return nil, err
	}
	var vols []Volume
	for _, ns := range nss {
		if ValidateID(ns.Name) != nil {
			continue // a snapshot, or not ours
		}
		vol, err := n.volume(ctx, nss, ns.Name)
		if errors.Is(err, ErrNotFound) {
			continue
		}
		if err != nil {
			return nil, err
		}
		vols = append(vols, vol)
	}
	return vols, nil
}

// ExpandVolume implements Backend. Namespaces cannot grow: the kernel resizes only a disabled
// namespace without a page map, ndctl offers no resize, and a new namespace plus a copy would
// need the volume offline. A volume already large enough is returned as it is.
func (n *Ndctl) ExpandVolume(ctx context.Context, id string, size int64) (Volume, error) {
	vol, err := n.GetVolume(ctx, id)
	if err != nil {
		return Volume{}, err
	}
	if size <= vol.Size {
		return vol, nil
	}
	return Volume{}, fmt.Errorf("%w: volume %s: an fsdax namespace cannot grow (from %d to %d bytes) in ndctl mode",
		ErrInvalid, id, vol.Size, size)
}

// DeleteVolume implements Backend. ErrInUse while its device is mounted or held (ndctl
// refuses to disable a namespace whose block device it cannot open exclusively).
func (n *Ndctl) DeleteVolume(ctx context.Context, id string) error {
	if err := ValidateID(id); err != nil {
		return err
	}
	return n.destroy(ctx, volumeKey(id), id, "volume "+id)
}

func (n *Ndctl) destroy(ctx context.Context, key, name, what string) error {
	unlock, err := n.keys.lock(ctx, key)
	if err != nil {
		return err
	}
	defer unlock()
	ndctlMu.Lock()
	defer ndctlMu.Unlock()
	nss, err := n.namespacesLocked(ctx)
	if err != nil {
		return err
	}
	ns, ok := findNamespace(nss, name)
	if !ok {
		return nil
	}
	if err := n.destroyLocked(ctx, ns); err != nil {
		return fmt.Errorf("delete %s: %w", what, err)
	}
	klog.FromContext(ctx).V(2).Info("Destroyed namespace", "namespace", ns.Dev, "name", name)
	return nil
}

// CreateSnapshot implements Backend: a namespace of its own holding a block copy of the
// volume and, at its end, the trailer.
func (n *Ndctl) CreateSnapshot(ctx context.Context, id, volumeID string) (Snapshot, error) {
	if err := ValidateID(id); err != nil {
		return Snapshot{}, err
	}
	if err := ValidateID(volumeID); err != nil {
		return Snapshot{}, err
	}
	unlock, err := n.keys.lock(ctx, snapshotKey(id), volumeKey(volumeID))
	if err != nil {
		return Snapshot{}, err
	}
	defer unlock()

	ndctlMu.Lock()
	ns, srcNS, snap, existing, err := n.prepareSnapshotLocked(ctx, id, volumeID)
	ndctlMu.Unlock()
	if err != nil {
		return Snapshot{}, fmt.Errorf("create snapshot %s: %w", id, err)
	}
	if existing {
		return snap, nil
	}
	snap.CreationTime = time.Now().UnixNano()
	err = n.io.Copy(ctx, ns.device(), srcNS.device(), 0, snap.Size)
	if err == nil {
		var tr []byte
		tr, err = json.Marshal(snapshotTrailer{
			Magic: trailerMagic, UUID: ns.UUID, ID: id, SourceVolumeID: volumeID, Size: snap.Size, CreationTime: snap.CreationTime,
		})
		if err == nil {
			p := make([]byte, recordSize)
			copy(p, tr)
			err = n.io.WriteAt(ctx, ns.device(), p, ns.Size-recordSize)
		}
	}
	if err != nil {
		n.destroyDetached(ctx, ns)
		return Snapshot{}, fmt.Errorf("create snapshot %s: %w", id, err)
	}
	klog.FromContext(ctx).V(2).Info("Created snapshot", "snapshotID", id, "volumeID", volumeID, "namespace", ns.Dev)
	return snap, nil
}

// prepareSnapshotLocked returns snapshot id if it exists (existing), or makes its namespace
// and returns it with the namespace of the volume.
func (n *Ndctl) prepareSnapshotLocked(ctx context.Context, id, volumeID string) (ns, srcNS namespaceRow, snap Snapshot, existing bool, err error) {
	nss, err := n.namespacesLocked(ctx)
	if err != nil {
		return
	}
	if ns, ok := findNamespace(nss, snapshotNamespaceName(id)); ok {
		snap, complete, err := n.readTrailer(ctx, ns)
		if err != nil {
			return ns, srcNS, snap, false, err
		}
		if complete {
			if snap.SourceVolumeID != volumeID {
				err = fmt.Errorf("%w: snapshot %s exists, of volume %s", ErrInvalid, id, snap.SourceVolumeID)
			}
			return ns, srcNS, snap, true, err
		}
		if err := n.destroyLocked(ctx, ns); err != nil {
			return ns, srcNS, snap, false, err
		}
	}
	srcNS, size, err := n.sourceLocked(ctx, nss, &Source{VolumeID: volumeID})
	if err != nil {
		return
	}
	ns, err = n.createLocked(ctx, snapshotNamespaceName(id), size+recordSize)
	return ns, srcNS, Snapshot{ID: id, SourceVolumeID: volumeID, Size: size}, false, err
}

// ListSnapshots implements Backend.
func (n *Ndctl) ListSnapshots(ctx context.Context) ([]Snapshot, error) {
	ndctlMu.Lock()
	nss, err := n.namespacesLocked(ctx)
	ndctlMu.Unlock()
	if err != nil {
		return nil, err
	}
	var snaps []Snapshot
	for _, ns := range nss {
		if !isSnapshotNamespace(ns.Name) {
			continue
		}
		snap, complete, err := n.readTrailer(ctx, ns)
		if err != nil {
			return nil, err
		}
		if complete {
			snaps = append(snaps, snap)
		}
	}
	return snaps, nil
}

// DeleteSnapshot implements Backend.
func (n *Ndctl) DeleteSnapshot(ctx context.Context, id string) error {
	if err := ValidateID(id); err != nil {
		return err
	}
	return n.destroy(ctx, snapshotKey(id), snapshotNamespaceName(id), "snapshot "+id)
}
