package pmem

import (
	"context"
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

// On-device naming of the lvm back end. Logical volumes are named by their IDs behind a
// prefix with a character no ID has ('.'), so a volume and a snapshot of the same ID never
// collide and no ID can hit LVM's reserved names ("snapshot*", "pvmove*", "*_tmeta"...):
//
//	vol.<volume ID>     tags pmem.pvbridge.io/volume
//	snap.<snapshot ID>  tags pmem.pvbridge.io/snapshot, pmem.pvbridge.io/source=<volume ID>,
//	                    pmem.pvbridge.io/created=<Unix nanoseconds>
//
// An LV is created with the tag pmem.pvbridge.io/incomplete, which goes once its data is in
// place (zeroes or a copy); an LV that still has it is left over from a crash and removed.
// An expansion tags pmem.pvbridge.io/zero-from=<old size> until the new space is zeroed.
// Only LVs with these tags are ours; others in the same volume groups are left alone.
const (
	lvVolumePrefix   = "vol."
	lvSnapshotPrefix = "snap."

	tagVolume     = "pmem.pvbridge.io/volume"
	tagSnapshot   = "pmem.pvbridge.io/snapshot"
	tagIncomplete = "pmem.pvbridge.io/incomplete"
	tagSource     = "pmem.pvbridge.io/source="
	tagCreated    = "pmem.pvbridge.io/created="
	tagZeroFrom   = "pmem.pvbridge.io/zero-from="
)

// lvmMu serializes every LVM command of the process, and with them each check-then-act
// (find a VG with room, then lvcreate). pmem-csi found LVM unreliable under concurrent
// commands. Copies and zeroing run without it.
var lvmMu sync.Mutex

// LVMOptions configure the lvm back end.
type LVMOptions struct {
	// VolumeGroups are the volume groups to carve from, one per PMEM region. They must exist.
	VolumeGroups []string
	// Runner runs the lvm commands; nil means ExecRunner.
	Runner Runner
	// BlockIO zeroes and copies data; nil means DeviceIO.
	BlockIO BlockIO
}

// LVM keeps each volume and snapshot in a logical volume of one of its volume groups. A
// logical volume never spans volume groups, that is PMEM regions.
type LVM struct {
	vgs       []string
	run       Runner
	io        BlockIO
	alignment int64
	keys      keyLocks
}

var _ Backend = (*LVM)(nil)

// NewLVM opens the lvm back end on opts.VolumeGroups, taking its alignment from their extent
// size, and removes the logical volumes an interrupted operation left behind.
func NewLVM(ctx context.Context, opts LVMOptions) (*LVM, error) {
	if len(opts.VolumeGroups) == 0 {
		return nil, errors.New("lvm back end: no volume groups")
	}
	l := &LVM{vgs: slices.Clone(opts.VolumeGroups), run: opts.Runner, io: opts.BlockIO}
	if l.run == nil {
		l.run = ExecRunner{}
	}
	if l.io == nil {
		l.io = DeviceIO{}
	}
	lvmMu.Lock()
	defer lvmMu.Unlock()
	vgs, err := l.vgsLocked(ctx)
	if err != nil {
		return nil, fmt.Errorf("lvm back end: %w", err)
	}
	for _, name := range l.vgs {
		i := slices.IndexFunc(vgs, func(vg vgRow) bool { return vg.Name == name })
		if i < 0 {
			return nil, fmt.Errorf("lvm back end: volume group %s not found", name)
		}
		l.alignment = max(l.alignment, int64(vgs[i].ExtentSize))
	}
	lvs, err := l.lvsLocked(ctx)
	if err != nil {
		return nil, fmt.Errorf("lvm back end: %w", err)
	}
	for _, lv := range lvs {
		if lv.has(tagIncomplete) {
			if err := l.removeLocked(ctx, lv); err != nil {
				klog.FromContext(ctx).Error(err, "Cannot remove incomplete logical volume", "lv", lv.fullName())
			}
		}
	}
	return l, nil
}

// Mode implements Backend.
func (l *LVM) Mode() pmemv1.Mode { return pmemv1.ModeLVM }

// lvmInt is a number in an lvm JSON report: a string with --reportformat json, a number with
// json_std.
type lvmInt int64

func (n *lvmInt) UnmarshalJSON(data []byte) error {
	s := strings.Trim(string(data), `"`)
	if s == "" {
		*n = 0
		return nil
	}
	v, err := strconv.ParseInt(s, 10, 64)
	*n = lvmInt(v)
	return err
}

type vgRow struct {
	Name       string `json:"vg_name"`
	Size       lvmInt `json:"vg_size"`
	Free       lvmInt `json:"vg_free"`
	ExtentSize lvmInt `json:"vg_extent_size"`
}

type lvRow struct {
	Name string `json:"lv_name"`
	VG   string `json:"vg_name"`
	Size lvmInt `json:"lv_size"`
	// Attr is lv_attr: its 5th character is 'a' when the LV is active, the 6th 'o' when open.
	Attr string `json:"lv_attr"`
	Tags string `json:"lv_tags"`
	Path string `json:"lv_path"`
}

func (lv lvRow) tags() []string {
	if lv.Tags == "" {
		return nil
	}
	return strings.Split(lv.Tags, ",")
}

func (lv lvRow) has(tag string) bool { return slices.Contains(lv.tags(), tag) }

// tagValue is the value of the first tag with prefix, "" without one.
func (lv lvRow) tagValue(prefix string) string {
	for _, t := range lv.tags() {
		if v, ok := strings.CutPrefix(t, prefix); ok {
			return v
		}
	}
	return ""
}

func (lv lvRow) fullName() string { return lv.VG + "/" + lv.Name }
func (lv lvRow) active() bool     { return len(lv.Attr) > 4 && lv.Attr[4] == 'a' }
func (lv lvRow) open() bool       { return len(lv.Attr) > 5 && lv.Attr[5] == 'o' }

func (lv lvRow) device() string {
	if lv.Path != "" {
		return lv.Path
	}
	return "/dev/" + lv.VG + "/" + lv.Name
}

var reportArgs = []string{"--reportformat", "json", "--units", "b", "--nosuffix"}

func (l *LVM) vgsLocked(ctx context.Context) ([]vgRow, error) {
	args := append(slices.Clone(reportArgs), "-o", "vg_name,vg_size,vg_free,vg_extent_size")
	out, err := l.run.Run(ctx, "vgs", append(args, l.vgs...)...)
	if err != nil {
		return nil, err
	}
	var report struct {
		Report []struct {
			VG []vgRow `json:"vg"`
		} `json:"report"`
	}
	if err := json.Unmarshal(out, &report); err != nil {
		return nil, fmt.Errorf("parse vgs: %w", err)
	}
	var vgs []vgRow
	for _, r := range report.Report {
		vgs = append(vgs, r.VG...)
	}
	return vgs, nil
}

// lvsLocked lists the LVs of our volume groups that carry our tags.
func (l *LVM) lvsLocked(ctx context.Context) ([]lvRow, error) {
	args := append(slices.Clone(reportArgs), "-o", "lv_name,vg_name,lv_size,lv_attr,lv_tags,lv_path")
	out, err := l.run.Run(ctx, "lvs", append(args, l.vgs...)...)
	if err != nil {
		return nil, err
	}
	var report struct {
		Report []struct {
			LV []lvRow `json:"lv"`
		} `json:"report"`
	}
	if err := json.Unmarshal(out, &report); err != nil {
		return nil, fmt.Errorf("parse lvs: %w", err)
	}
	var lvs []lvRow
	for _, r := range report.Report {
		for _, lv := range r.LV {
			if lv.has(tagVolume) || lv.has(tagSnapshot) {
				lvs = append(lvs, lv)
			}
		}
	}
	return lvs, nil
}

// findLV returns the LV named name among lvs; ok false if there is none.
func findLV(lvs []lvRow, name string) (lvRow, bool) {
	i := slices.IndexFunc(lvs, func(lv lvRow) bool { return lv.Name == name })
	if i < 0 {
		return lvRow{}, false
	}
	return lvs[i], true
}

// pickVG chooses the volume group for size bytes: the one with the least free space that
// fits, keeping the larger free spaces for larger volumes. ErrNoSpace if none fits.
func pickVG(vgs []vgRow, size int64) (string, error) {
	best, largest := -1, int64(0)
	for i, vg := range vgs {
		free := int64(vg.Free)
		largest = max(largest, free)
		if free >= size && (best < 0 || free < int64(vgs[best].Free)) {
			best = i
		}
	}
	if best < 0 {
		return "", fmt.Errorf("%w: %d bytes asked, the largest free space of a volume group is %d", ErrNoSpace, size, largest)
	}
	return vgs[best].Name, nil
}

func (l *LVM) removeLocked(ctx context.Context, lv lvRow) error {
	if _, err := l.run.Run(ctx, "lvremove", "-fy", lv.fullName()); err != nil {
		if stderrContains(err, "in use", "open logical volume") {
			return fmt.Errorf("%w: %s: %w", ErrInUse, lv.fullName(), err)
		}
		return err
	}
	return nil
}

// createLocked makes an LV of size bytes, tagged incomplete besides tags.
func (l *LVM) createLocked(ctx context.Context, name string, size int64, tags ...string) (lvRow, error) {
	vgs, err := l.vgsLocked(ctx)
	if err != nil {
		return lvRow{}, err
	}
	vg, err := pickVG(vgs, size)
	if err != nil {
		return lvRow{}, err
	}
	args := []string{"-Zn", "-L", strconv.FormatInt(size, 10) + "b", "-n", name}
	for _, t := range append(tags, tagIncomplete) {
		args = append(args, "--addtag", t)
	}
	if _, err := l.run.Run(ctx, "lvcreate", append(args, vg)...); err != nil {
		if stderrContains(err, "Insufficient free space") {
			return lvRow{}, fmt.Errorf("%w: %w", ErrNoSpace, err)
		}
		return lvRow{}, err
	}
	return lvRow{Name: name, VG: vg, Size: lvmInt(size), Path: "/dev/" + vg + "/" + name}, nil
}

// fill runs write on a new LV and then marks it complete; if write fails, it removes the LV.
func (l *LVM) fill(ctx context.Context, lv lvRow, write func() error) error {
	err := write()
	lvmMu.Lock()
	defer lvmMu.Unlock()
	if err == nil {
		_, err = l.run.Run(ctx, "lvchange", "--deltag", tagIncomplete, lv.fullName())
		if err == nil {
			return nil
		}
	}
	// Clean up even when ctx has ended: that is the usual reason for a failed copy.
	if rmErr := l.removeLocked(context.WithoutCancel(ctx), lv); rmErr != nil {
		klog.FromContext(ctx).Error(rmErr, "Cannot remove incomplete logical volume", "lv", lv.fullName())
	}
	return err
}

// Capacity implements Backend. The largest allocatable size is the largest free space of one
// volume group.
func (l *LVM) Capacity(ctx context.Context) (Capacity, error) {
	lvmMu.Lock()
	defer lvmMu.Unlock()
	vgs, err := l.vgsLocked(ctx)
	if err != nil {
		return Capacity{}, err
	}
	c := Capacity{Alignment: l.alignment}
	for _, vg := range vgs {
		c.Total += int64(vg.Size)
		c.Free += int64(vg.Free)
		c.LargestAllocatable = max(c.LargestAllocatable, AlignDown(int64(vg.Free), l.alignment))
	}
	return c, nil
}

// CreateVolume implements Backend. A new volume is zeroed, then filled from its source.
func (l *LVM) CreateVolume(ctx context.Context, id string, size int64, src *Source) (Volume, error) {
	if err := ValidateID(id); err != nil {
		return Volume{}, err
	}
	if err := validateSource(src); err != nil {
		return Volume{}, err
	}
	unlock, err := l.keys.lock(ctx, volumeKey(id), sourceKey(src))
	if err != nil {
		return Volume{}, err
	}
	defer unlock()

	lvmMu.Lock()
	lv, srcLV, existing, err := l.prepareVolumeLocked(ctx, id, size, src)
	lvmMu.Unlock()
	if err != nil {
		return Volume{}, fmt.Errorf("create volume %s: %w", id, err)
	}
	if existing {
		return l.volume(ctx, id, lv)
	}
	err = l.fill(ctx, lv, func() error {
		start := int64(0)
		if src != nil {
			start = int64(srcLV.Size)
			if err := l.io.Copy(ctx, lv.device(), srcLV.device(), 0, start); err != nil {
				return err
			}
		}
		if start == int64(lv.Size) {
			return nil
		}
		return l.io.Zero(ctx, lv.device(), start, int64(lv.Size)-start)
	})
	if err != nil {
		return Volume{}, fmt.Errorf("create volume %s: %w", id, err)
	}
	vol := Volume{ID: id, Size: int64(lv.Size), Device: lv.device()}
	klog.FromContext(ctx).V(2).Info("Created volume", "volumeID", id, "size", vol.Size, "device", vol.Device, "lv", lv.fullName())
	return vol, nil
}

// prepareVolumeLocked returns the complete LV of volume id if there is one (existing), or
// else makes a new, incomplete one and returns it with the LV of src.
func (l *LVM) prepareVolumeLocked(ctx context.Context, id string, size int64, src *Source) (lv, srcLV lvRow, existing bool, err error) {
	lvs, err := l.lvsLocked(ctx)
	if err != nil {
		return lvRow{}, lvRow{}, false, err
	}
	if lv, ok := findLV(lvs, lvVolumePrefix+id); ok {
		if !lv.has(tagIncomplete) {
			return lv, lvRow{}, true, nil
		}
		if err := l.removeLocked(ctx, lv); err != nil {
			return lvRow{}, lvRow{}, false, err
		}
	}
	if src != nil {
		name, what := lvVolumePrefix+src.VolumeID, "volume "+src.VolumeID
		if src.SnapshotID != "" {
			name, what = lvSnapshotPrefix+src.SnapshotID, "snapshot "+src.SnapshotID
		}
		var ok bool
		if srcLV, ok = findLV(lvs, name); !ok || srcLV.has(tagIncomplete) {
			return lvRow{}, lvRow{}, false, fmt.Errorf("%w: source %s", ErrNotFound, what)
		}
	}
	if size, err = sizeFor(size, int64(srcLV.Size), l.alignment); err != nil {
		return lvRow{}, lvRow{}, false, err
	}
	lv, err = l.createLocked(ctx, lvVolumePrefix+id, size, tagVolume)
	return lv, srcLV, false, err
}

// volume returns the Volume of lv, activating it if needed (after a reboot without
// autoactivation).
func (l *LVM) volume(ctx context.Context, id string, lv lvRow) (Volume, error) {
	if !lv.active() {
		lvmMu.Lock()
		_, err := l.run.Run(ctx, "lvchange", "-ay", lv.fullName())
		lvmMu.Unlock()
		if err != nil {
			return Volume{}, fmt.Errorf("activate volume %s: %w", id, err)
		}
	}
	return Volume{ID: id, Size: int64(lv.Size), Device: lv.device()}, nil
}

// GetVolume implements Backend.
func (l *LVM) GetVolume(ctx context.Context, id string) (Volume, error) {
	if err := ValidateID(id); err != nil {
		return Volume{}, err
	}
	lv, err := l.find(ctx, lvVolumePrefix+id, "volume "+id)
	if err != nil {
		return Volume{}, err
	}
	return l.volume(ctx, id, lv)
}

// find returns the complete LV named name.
func (l *LVM) find(ctx context.Context, name, what string) (lvRow, error) {
	lvmMu.Lock()
	lvs, err := l.lvsLocked(ctx)
	lvmMu.Unlock()
	if err != nil {
		return lvRow{}, err
	}
	lv, ok := findLV(lvs, name)
	if !ok || lv.has(tagIncomplete) {
		return lvRow{}, fmt.Errorf("%w: %s", ErrNotFound, what)
	}
	return lv, nil
}

// ListVolumes implements Backend.
func (l *LVM) ListVolumes(ctx context.Context) ([]Volume, error) {
	lvmMu.Lock()
	lvs, err := l.lvsLocked(ctx)
	lvmMu.Unlock()
	if err != nil {
		return nil, err
	}
	var vols []Volume
	for _, lv := range lvs {
		id, ok := strings.CutPrefix(lv.Name, lvVolumePrefix)
		if !ok || !lv.has(tagVolume) || lv.has(tagIncomplete) {
			continue
		}
		vol, err := l.volume(ctx, id, lv)
		if err != nil {
			return nil, err
		}
		vols = append(vols, vol)
	}
	return vols, nil
}

// ExpandVolume implements Backend: lvextend within the volume's volume group, then zeroes for
// the new space, which a crash in between leaves to the next ExpandVolume.
func (l *LVM) ExpandVolume(ctx context.Context, id string, size int64) (Volume, error) {
	if err := ValidateID(id); err != nil {
		return Volume{}, err
	}
	unlock, err := l.keys.lock(ctx, volumeKey(id))
	if err != nil {
		return Volume{}, err
	}
	defer unlock()
	lv, err := l.find(ctx, lvVolumePrefix+id, "volume "+id)
	if err != nil {
		return Volume{}, err
	}
	size = AlignUp(size, l.alignment)
	zeroTag := tagZeroFrom + strconv.FormatInt(int64(lv.Size), 10)
	if size > int64(lv.Size) {
		if lv, err = l.extend(ctx, lv, size, zeroTag); err != nil {
			return Volume{}, fmt.Errorf("expand volume %s: %w", id, err)
		}
	}
	if from := lv.tagValue(tagZeroFrom); from != "" {
		if err := l.zeroTail(ctx, lv, from); err != nil {
			return Volume{}, fmt.Errorf("expand volume %s: %w", id, err)
		}
	}
	klog.FromContext(ctx).V(2).Info("Expanded volume", "volumeID", id, "size", int64(lv.Size), "lv", lv.fullName())
	return l.volume(ctx, id, lv)
}

// extend grows lv to size bytes, tagging it with zeroTag first.
func (l *LVM) extend(ctx context.Context, lv lvRow, size int64, zeroTag string) (lvRow, error) {
	lvmMu.Lock()
	defer lvmMu.Unlock()
	vgs, err := l.vgsLocked(ctx)
	if err != nil {
		return lv, err
	}
	i := slices.IndexFunc(vgs, func(vg vgRow) bool { return vg.Name == lv.VG })
	if i < 0 {
		return lv, fmt.Errorf("volume group %s not found", lv.VG)
	}
	if more := size - int64(lv.Size); more > int64(vgs[i].Free) {
		return lv, fmt.Errorf("%w: %d more bytes asked, volume group %s has %d free", ErrNoSpace, more, lv.VG, int64(vgs[i].Free))
	}
	if lv.tagValue(tagZeroFrom) == "" {
		if _, err := l.run.Run(ctx, "lvchange", "--addtag", zeroTag, lv.fullName()); err != nil {
			return lv, err
		}
		lv.Tags = strings.Join(append(lv.tags(), zeroTag), ",")
	}
	if _, err := l.run.Run(ctx, "lvextend", "-L", strconv.FormatInt(size, 10)+"b", lv.fullName()); err != nil {
		if stderrContains(err, "Insufficient free space") {
			return lv, fmt.Errorf("%w: %w", ErrNoSpace, err)
		}
		return lv, err
	}
	lv.Size = lvmInt(size)
	return lv, nil
}

// zeroTail zeroes lv from the offset from to its end and drops the tag that asked for it.
func (l *LVM) zeroTail(ctx context.Context, lv lvRow, from string) error {
	offset, err := strconv.ParseInt(from, 10, 64)
	if err != nil {
		return fmt.Errorf("%s: bad tag %s%s", lv.fullName(), tagZeroFrom, from)
	}
	if err := l.io.Zero(ctx, lv.device(), offset, int64(lv.Size)-offset); err != nil {
		return err
	}
	lvmMu.Lock()
	defer lvmMu.Unlock()
	_, err = l.run.Run(ctx, "lvchange", "--deltag", tagZeroFrom+from, lv.fullName())
	return err
}

// DeleteVolume implements Backend. ErrInUse while the LV is open.
func (l *LVM) DeleteVolume(ctx context.Context, id string) error {
	if err := ValidateID(id); err != nil {
		return err
	}
	return l.remove(ctx, volumeKey(id), lvVolumePrefix+id, "volume "+id)
}

func (l *LVM) remove(ctx context.Context, key, name, what string) error {
	unlock, err := l.keys.lock(ctx, key)
	if err != nil {
		return err
	}
	defer unlock()
	lvmMu.Lock()
	defer lvmMu.Unlock()
	lvs, err := l.lvsLocked(ctx)
	if err != nil {
		return err
	}
	lv, ok := findLV(lvs, name)
	if !ok {
		return nil
	}
	if lv.open() {
		return fmt.Errorf("delete %s: %w: %s is open", what, ErrInUse, lv.fullName())
	}
	if err := l.removeLocked(ctx, lv); err != nil {
		return fmt.Errorf("delete %s: %w", what, err)
	}
	klog.FromContext(ctx).V(2).Info("Deleted logical volume", "lv", lv.fullName())
	return nil
}

// CreateSnapshot implements Backend. A snapshot is a full copy in an LV of its own, not an LVM
// (copy-on-write) snapshot: that would die with its origin, slow the origin's writes and be
// invalidated when its COW space runs out, and a CSI snapshot must outlive its volume.
func (l *LVM) CreateSnapshot(ctx context.Context, id, volumeID string) (Snapshot, error) {
	if err := ValidateID(id); err != nil {
		return Snapshot{}, err
	}
	if err := ValidateID(volumeID); err != nil {
		return Snapshot{}, err
	}
	unlock, err := l.keys.lock(ctx, snapshotKey(id), volumeKey(volumeID))
	if err != nil {
		return Snapshot{}, err
	}
	defer unlock()

	now := time.Now().UnixNano()
	lvmMu.Lock()
	lv, srcLV, existing, err := l.prepareSnapshotLocked(ctx, id, volumeID, now)
	lvmMu.Unlock()
	if err != nil {
		return Snapshot{}, fmt.Errorf("create snapshot %s: %w", id, err)
	}
	if existing {
		return snapshotOf(lv)
	}
	err = l.fill(ctx, lv, func() error {
		return l.io.Copy(ctx, lv.device(), srcLV.device(), 0, int64(srcLV.Size))
	})
	if err != nil {
		return Snapshot{}, fmt.Errorf("create snapshot %s: %w", id, err)
	}
	klog.FromContext(ctx).V(2).Info("Created snapshot", "snapshotID", id, "volumeID", volumeID, "lv", lv.fullName())
	return Snapshot{ID: id, SourceVolumeID: volumeID, Size: int64(srcLV.Size), CreationTime: now}, nil
}

// prepareSnapshotLocked returns the complete LV of snapshot id if there is one (existing), or
// makes a new, incomplete one and returns it with the LV of its volume.
func (l *LVM) prepareSnapshotLocked(ctx context.Context, id, volumeID string, now int64) (lv, srcLV lvRow, existing bool, err error) {
	lvs, err := l.lvsLocked(ctx)
	if err != nil {
		return lvRow{}, lvRow{}, false, err
	}
	if lv, ok := findLV(lvs, lvSnapshotPrefix+id); ok {
		if !lv.has(tagIncomplete) {
			if src := lv.tagValue(tagSource); src != volumeID {
				return lvRow{}, lvRow{}, false, fmt.Errorf("%w: snapshot %s exists, of volume %s", ErrInvalid, id, src)
			}
			return lv, lvRow{}, true, nil
		}
		if err := l.removeLocked(ctx, lv); err != nil {
			return lvRow{}, lvRow{}, false, err
		}
	}
	srcLV, ok := findLV(lvs, lvVolumePrefix+volumeID)
	if !ok || srcLV.has(tagIncomplete) {
		return lvRow{}, lvRow{}, false, fmt.Errorf("%w: volume %s", ErrNotFound, volumeID)
	}
	lv, err = l.createLocked(ctx, lvSnapshotPrefix+id, int64(srcLV.Size),
		tagSnapshot, tagSource+volumeID, tagCreated+strconv.FormatInt(now, 10))
	return lv, srcLV, false, err
}

func snapshotOf(lv lvRow) (Snapshot, error) {
	created, err := strconv.ParseInt(lv.tagValue(tagCreated), 10, 64)
	if err != nil {
		return Snapshot{}, fmt.Errorf("snapshot %s: bad tag %s: %w", lv.fullName(), tagCreated, err)
	}
	return Snapshot{
		ID:             strings.TrimPrefix(lv.Name, lvSnapshotPrefix),
		SourceVolumeID: lv.tagValue(tagSource),
		Size:           int64(lv.Size),
		CreationTime:   created,
	}, nil
}

// ListSnapshots implements Backend.
func (l *LVM) ListSnapshots(ctx context.Context) ([]Snapshot, error) {
	lvmMu.Lock()
	lvs, err := l.lvsLocked(ctx)
	lvmMu.Unlock()
	if err != nil {
		return nil, err
	}
	var snaps []Snapshot
	for _, lv := range lvs {
		if !strings.HasPrefix(lv.Name, lvSnapshotPrefix) || !lv.has(tagSnapshot) || lv.has(tagIncomplete) {
			continue
		}
		snap, err := snapshotOf(lv)
		if err != nil {
			return nil, err
		}
		snaps = append(snaps, snap)
	}
	return snaps, nil
}

// DeleteSnapshot implements Backend.
func (l *LVM) DeleteSnapshot(ctx context.Context, id string) error {
	if err := ValidateID(id); err != nil {
		return err
	}
	return l.remove(ctx, snapshotKey(id), lvSnapshotPrefix+id, "snapshot "+id)
}
