package pmem

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"pvbridge.io/mgmt-csi/internal/loop"
	pmemv1 "pvbridge.io/pkg/apis/pmem/v1alpha1"
)

// DefaultFileAlignment is the allocation granularity of the file back end unless configured.
const DefaultFileAlignment = 1 << 20

// On-device layout of the file back end, under its directory:
//
//	volumes/<volume ID>.img        a volume, a sparse file bound to a loop device
//	snapshots/<snapshot ID>.img    a snapshot's data
//	snapshots/<snapshot ID>.json   its source volume, size and creation time
//	*/.<name>.partial              a file being written; renamed into place when complete
//
// IDs are DNS labels, so no ID starts with "." and a temporary never looks like a volume.
const (
	volumesDir    = "volumes"
	snapshotsDir  = "snapshots"
	imageSuffix   = ".img"
	metaSuffix    = ".json"
	partialSuffix = ".partial"
)

// FileOptions configure the file back end.
type FileOptions struct {
	// Dir is an existing directory on the PMEM filesystem (in production a DAX-mounted fsdax
	// namespace). It must be reachable under the same path in every run of the agent: the
	// kernel names a loop device's backing file by the path it was opened with.
	Dir string
	// Capacity is the number of bytes the back end hands out; 0 means the size of the
	// filesystem holding Dir.
	Capacity int64
	// Alignment is the allocation granularity, a multiple of 4096; 0 means 1 MiB.
	Alignment int64
}

// File keeps volumes in sparse files exposed as loop devices. Sparse files are thick in its
// accounting: a volume takes its full size from Capacity when it is made, so the filesystem is
// never overcommitted by this back end (other users of the filesystem are not accounted).
type File struct {
	volumes, snapshots string
	total, alignment   int64

	keys keyLocks

	// mu guards the directories, the loop devices and reserved: every file made, renamed or
	// removed, every loop device bound or unbound and every capacity sum happens under it.
	// Copies of data run without it, holding the keys of their volumes and snapshots.
	mu sync.Mutex
	// reserved is the space promised to copies in progress, by temporary file. A restart
	// loses it together with the temporaries, which NewFile removes.
	reserved map[string]int64
	// bound is the loop device each volume file was last found bound to, by path: a hint,
	// checked against that device's backing file before use. With it, finding a volume's
	// device reads one sysfs file instead of every loop device's (at a thousand volumes,
	// every node call read a thousand files under mu).
	bound map[string]string
}

var _ Backend = (*File)(nil)

// snapshotMeta is the sidecar of a snapshot, snapshots/<id>.json.
type snapshotMeta struct {
	SourceVolumeID string `json:"sourceVolumeID"`
	Size           int64  `json:"size"`
	// CreationTime is in Unix nanoseconds.
	CreationTime int64 `json:"creationTime"`
}

// NewFile opens the file back end on opts.Dir, making its subdirectories and removing what an
// interrupted operation left behind. Loop devices are bound lazily, by GetVolume and
// ListVolumes after a reboot.
func NewFile(opts FileOptions) (*File, error) {
	if opts.Dir == "" {
		return nil, errors.New("file back end: no directory")
	}
	dir, err := filepath.Abs(opts.Dir)
	if err == nil {
		dir, err = filepath.EvalSymlinks(dir)
	}
	if err != nil {
		return nil, fmt.Errorf("file back end: %w", err)
	}
	if opts.Alignment == 0 {
		opts.Alignment = DefaultFileAlignment
	}
	if opts.Alignment < 0 || opts.Alignment%4096 != 0 {
		return nil, fmt.Errorf("file back end: alignment %d is not a positive multiple of 4096", opts.Alignment)
	}
	if opts.Capacity < 0 {
		return nil, fmt.Errorf("file back end: negative capacity %d", opts.Capacity)
	}
	if opts.Capacity == 0 {
		var st unix.Statfs_t
		if err := unix.Statfs(dir, &st); err != nil {
			return nil, fmt.Errorf("file back end: size of %s: %w", dir, err)
		}
		opts.Capacity = int64(st.Blocks) * st.Bsize //nolint:gosec // a filesystem's size fits in int64
	}
	f := &File{
		volumes:   filepath.Join(dir, volumesDir),
		snapshots: filepath.Join(dir, snapshotsDir),
		total:     AlignDown(opts.Capacity, opts.Alignment),
		alignment: opts.Alignment,
		reserved:  map[string]int64{},
		bound:     map[string]string{},
	}
	for _, d := range []string{f.volumes, f.snapshots} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, fmt.Errorf("file back end: %w", err)
		}
	}
	if err := f.removeLeftovers(); err != nil {
		return nil, fmt.Errorf("file back end: %w", err)
	}
	return f, nil
}

// removeLeftovers removes temporaries and the sidecars of snapshots whose data never got in
// place: both are what a crash in the middle of an operation leaves.
func (f *File) removeLeftovers() error {
	for _, d := range []string{f.volumes, f.snapshots} {
		entries, err := os.ReadDir(d)
		if err != nil {
			return err
		}
		for _, e := range entries {
			name := e.Name()
			leftover := strings.HasPrefix(name, ".")
			if id, ok := strings.CutSuffix(name, metaSuffix); ok && d == f.snapshots {
				_, err := os.Stat(filepath.Join(d, id+imageSuffix))
				leftover = errors.Is(err, fs.ErrNotExist)
			}
			if leftover {
				if err := os.Remove(filepath.Join(d, name)); err != nil && !errors.Is(err, fs.ErrNotExist) {
					return err
				}
			}
		}
	}
	return nil
}

// Mode implements Backend.
func (f *File) Mode() pmemv1.Mode { return pmemv1.ModeFile }

// Capacity implements Backend.
func (f *File) Capacity(_ context.Context) (Capacity, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	free, err := f.freeLocked()
	if err != nil {
		return Capacity{}, err
	}
	return Capacity{
		Total:              f.total,
		Free:               free,
		LargestAllocatable: AlignDown(free, f.alignment),
		Alignment:          f.alignment,
	}, nil
}

// freeLocked is Total less what volumes, snapshots and copies in progress take.
func (f *File) freeLocked() (int64, error) {
	used := int64(0)
	for _, d := range []string{f.volumes, f.snapshots} {
		ids, err := imageIDs(d)
		if err != nil {
			return 0, err
		}
		for _, id := range ids {
			st, err := os.Stat(filepath.Join(d, id+imageSuffix))
			if err != nil {
				return 0, err
			}
			used += AlignUp(st.Size(), f.alignment)
		}
	}
	for _, n := range f.reserved {
		used += n
	}
	return max(f.total-used, 0), nil
}

// imageIDs lists the IDs of the images in d, sorted.
func imageIDs(d string) ([]string, error) {
	entries, err := os.ReadDir(d)
	if err != nil {
		return nil, err
	}
	var ids []string
	for _, e := range entries {
		id, ok := strings.CutSuffix(e.Name(), imageSuffix)
		if ok && ValidateID(id) == nil {
			ids = append(ids, id)
		}
	}
	return ids, nil
}

func (f *File) volumePath(id string) string   { return filepath.Join(f.volumes, id+imageSuffix) }
func (f *File) snapshotPath(id string) string { return filepath.Join(f.snapshots, id+imageSuffix) }
func (f *File) metaPath(id string) string     { return filepath.Join(f.snapshots, id+metaSuffix) }

func partialPath(path string) string {
	return filepath.Join(filepath.Dir(path), "."+filepath.Base(path)+partialSuffix)
}

// CreateVolume implements Backend.
func (f *File) CreateVolume(ctx context.Context, id string, size int64, src *Source) (Volume, error) {
	if err := ValidateID(id); err != nil {
		return Volume{}, err
	}
	if err := validateSource(src); err != nil {
		return Volume{}, err
	}
	unlock, err := f.keys.lock(ctx, volumeKey(id), sourceKey(src))
	if err != nil {
		return Volume{}, err
	}
	defer unlock()

	f.mu.Lock()
	if _, err := os.Stat(f.volumePath(id)); err == nil {
		defer f.mu.Unlock()
		return f.volumeLocked(ctx, id)
	}
	srcPath, srcSize, err := f.sourceLocked(src)
	if err == nil {
		size, err = sizeFor(size, srcSize, f.alignment)
	}
	var tmp *os.File
	if err == nil {
		tmp, err = f.reserveLocked(ctx, f.volumePath(id), size)
	}
	f.mu.Unlock()
	if err != nil {
		return Volume{}, fmt.Errorf("create volume %s: %w", id, err)
	}

	method := ""
	if src != nil {
		method, err = f.copyInto(ctx, tmp, srcPath, srcSize)
	}
	if err == nil {
		err = tmp.Truncate(size)
	}
	vol, err := f.commit(ctx, tmp, f.volumePath(id), err, func() (Volume, error) {
		// A file just renamed into place has no loop device: no need to look for one.
		return f.attachLocked(ctx, id, nil)
	})
	if err != nil {
		return Volume{}, fmt.Errorf("create volume %s: %w", id, err)
	}
	klog.FromContext(ctx).V(2).Info("Created volume", "volumeID", id, "size", vol.Size, "device", vol.Device, "copy", method)
	return vol, nil
}

// sourceLocked finds the file and size of src; "" and 0 without one.
func (f *File) sourceLocked(src *Source) (string, int64, error) {
	var path string
	switch {
	case src == nil:
		return "", 0, nil
	case src.SnapshotID != "":
		path = f.snapshotPath(src.SnapshotID)
	default:
		path = f.volumePath(src.VolumeID)
	}
	st, err := os.Stat(path)
	if errors.Is(err, fs.ErrNotExist) {
		return "", 0, fmt.Errorf("%w: source %s", ErrNotFound, strings.TrimSuffix(filepath.Base(path), imageSuffix))
	}
	if err != nil {
		return "", 0, err
	}
	return path, st.Size(), nil
}

// reserveLocked checks that size bytes are free, reserves them and opens an empty temporary
// for the file to be made at path.
func (f *File) reserveLocked(ctx context.Context, path string, size int64) (*os.File, error) {
	free, err := f.freeLocked()
	if err != nil {
		return nil, err
	}
	if size > free {
		return nil, fmt.Errorf("%w: %d bytes asked, %d free", ErrNoSpace, size, AlignDown(free, f.alignment))
	}
	tmpPath := partialPath(path)
	if err := os.Remove(tmpPath); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, err
	}
	tmp, err := os.OpenFile(tmpPath, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return nil, err
	}
	f.reserved[tmpPath] = size
	klog.FromContext(ctx).V(4).Info("Reserved space", "path", path, "size", size)
	return tmp, nil
}

// copyInto fills tmp from the file at srcPath. A source volume's loop device is flushed first,
// so that writes still in its page cache are copied too.
func (f *File) copyInto(ctx context.Context, tmp *os.File, srcPath string, srcSize int64) (string, error) {
	if filepath.Dir(srcPath) == f.volumes {
		f.mu.Lock()
		attached, err := loop.Attachments()
		f.mu.Unlock()
		if err != nil {
			return "", err
		}
		for _, dev := range attached[srcPath] {
			if err := loop.Flush(dev); err != nil {
				return "", fmt.Errorf("flush source: %w", err)
			}
		}
	}
	src, err := os.Open(srcPath)
	if err != nil {
		return "", err
	}
	defer src.Close()
	return cloneFile(ctx, tmp, src, srcSize)
}

// commit finishes a temporary: after err == nil, it flushes it, renames it to path and runs
// done under mu; otherwise, or if that fails, it removes it. The reservation ends either way.
func (f *File) commit(ctx context.Context, tmp *os.File, path string, err error, done func() (Volume, error)) (Volume, error) {
	if err == nil {
		err = tmp.Sync()
	}
	if closeErr := tmp.Close(); err == nil {
		err = closeErr
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.reserved, tmp.Name())
	if err == nil {
		err = renameDurably(tmp.Name(), path)
	}
	if err != nil {
		_ = os.Remove(tmp.Name())
		return Volume{}, err
	}
	if done == nil {
		return Volume{}, nil
	}
	vol, err := done()
	if err != nil {
		klog.FromContext(ctx).Error(err, "Volume made but not bound to a loop device", "path", path)
	}
	return vol, err
}

// renameDurably renames oldPath to newPath and flushes the directory, so the new name
// survives a crash.
func renameDurably(oldPath, newPath string) error {
	if err := os.Rename(oldPath, newPath); err != nil {
		return err
	}
	return syncDir(filepath.Dir(newPath))
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

// volumeLocked returns volume id, bound to a loop device.
func (f *File) volumeLocked(ctx context.Context, id string) (Volume, error) {
	path := f.volumePath(id)
	if dev, ok := f.bound[path]; ok && loop.Backing(dev) == path {
		st, err := os.Stat(path)
		if err != nil {
			return Volume{}, err
		}
		return Volume{ID: id, Size: st.Size(), Device: dev}, nil
	}
	attached, err := loop.Attachments()
	if err != nil {
		return Volume{}, err
	}
	return f.attachLocked(ctx, id, attached)
}

// attachLocked returns volume id, binding it to a loop device unless attached has one.
func (f *File) attachLocked(ctx context.Context, id string, attached map[string][]string) (Volume, error) {
	path := f.volumePath(id)
	st, err := os.Stat(path)
	if errors.Is(err, fs.ErrNotExist) {
		return Volume{}, fmt.Errorf("%w: volume %s", ErrNotFound, id)
	}
	if err != nil {
		return Volume{}, err
	}
	vol := Volume{ID: id, Size: st.Size()}
	if devs := attached[path]; len(devs) > 0 {
		vol.Device = devs[0]
		f.bound[path] = vol.Device
		return vol, nil
	}
	if vol.Device, err = loop.Attach(path); err != nil {
		return Volume{}, err
	}
	f.bound[path] = vol.Device
	klog.FromContext(ctx).V(2).Info("Bound volume to loop device", "volumeID", id, "device", vol.Device)
	return vol, nil
}

// GetVolume implements Backend.
func (f *File) GetVolume(ctx context.Context, id string) (Volume, error) {
	if err := ValidateID(id); err != nil {
		return Volume{}, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.volumeLocked(ctx, id)
}

// ListVolumes implements Backend. Volumes without a loop device (after a reboot) get one.
func (f *File) ListVolumes(ctx context.Context) ([]Volume, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	ids, err := imageIDs(f.volumes)
	if err != nil {
		return nil, err
	}
	attached, err := loop.Attachments()
	if err != nil {
		return nil, err
	}
	vols := make([]Volume, 0, len(ids))
	for _, id := range ids {
		vol, err := f.attachLocked(ctx, id, attached)
		if errors.Is(err, ErrNotFound) {
			continue // deleted since the directory was read
		}
		if err != nil {
			return nil, err
		}
		vols = append(vols, vol)
	}
	return vols, nil
}

// ExpandVolume implements Backend. The loop device takes the new size at once.
func (f *File) ExpandVolume(ctx context.Context, id string, size int64) (Volume, error) {
	if err := ValidateID(id); err != nil {
		return Volume{}, err
	}
	unlock, err := f.keys.lock(ctx, volumeKey(id))
	if err != nil {
		return Volume{}, err
	}
	defer unlock()
	f.mu.Lock()
	defer f.mu.Unlock()
	vol, err := f.volumeLocked(ctx, id)
	if err != nil {
		return Volume{}, err
	}
	size = AlignUp(size, f.alignment)
	if size <= vol.Size {
		return vol, nil
	}
	free, err := f.freeLocked()
	if err != nil {
		return Volume{}, err
	}
	if size-vol.Size > free {
		return Volume{}, fmt.Errorf("expand volume %s to %d bytes: %w: %d more bytes asked, %d free",
			id, size, ErrNoSpace, size-vol.Size, AlignDown(free, f.alignment))
	}
	if err := os.Truncate(f.volumePath(id), size); err != nil {
		return Volume{}, fmt.Errorf("expand volume %s: %w", id, err)
	}
	if err := loop.Resize(vol.Device); err != nil {
		return Volume{}, fmt.Errorf("expand volume %s: %w", id, err)
	}
	klog.FromContext(ctx).V(2).Info("Expanded volume", "volumeID", id, "size", size, "device", vol.Device)
	vol.Size = size
	return vol, nil
}

// DeleteVolume implements Backend. ErrInUse while its loop device is mounted or open.
func (f *File) DeleteVolume(ctx context.Context, id string) error {
	if err := ValidateID(id); err != nil {
		return err
	}
	unlock, err := f.keys.lock(ctx, volumeKey(id))
	if err != nil {
		return err
	}
	defer unlock()
	f.mu.Lock()
	defer f.mu.Unlock()
	path := f.volumePath(id)
	attached, err := loop.Attachments()
	if err != nil {
		return err
	}
	for _, dev := range attached[path] {
		if err := loop.Detach(ctx, dev); err != nil {
			return fmt.Errorf("delete volume %s: %w", id, err)
		}
	}
	delete(f.bound, path)
	if err := removeDurably(path); err != nil {
		return fmt.Errorf("delete volume %s: %w", id, err)
	}
	klog.FromContext(ctx).V(2).Info("Deleted volume", "volumeID", id)
	return nil
}

// removeDurably removes path, if it exists, and flushes its directory.
func removeDurably(path string) error {
	err := os.Remove(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	return syncDir(filepath.Dir(path))
}

// CreateSnapshot implements Backend. The snapshot is a reflink or sparse copy of the volume,
// independent of it from then on.
func (f *File) CreateSnapshot(ctx context.Context, id, volumeID string) (Snapshot, error) {
	if err := ValidateID(id); err != nil {
		return Snapshot{}, err
	}
	if err := ValidateID(volumeID); err != nil {
		return Snapshot{}, err
	}
	unlock, err := f.keys.lock(ctx, snapshotKey(id), volumeKey(volumeID))
	if err != nil {
		return Snapshot{}, err
	}
	defer unlock()

	f.mu.Lock()
	if snap, err := f.snapshotLocked(id); err == nil {
		f.mu.Unlock()
		if snap.SourceVolumeID != volumeID {
			return Snapshot{}, fmt.Errorf("%w: snapshot %s exists, of volume %s", ErrInvalid, id, snap.SourceVolumeID)
		}
		return snap, nil
	} else if !errors.Is(err, ErrNotFound) {
		f.mu.Unlock()
		return Snapshot{}, err
	}
	srcPath, srcSize, err := f.sourceLocked(&Source{VolumeID: volumeID})
	var tmp *os.File
	if err == nil {
		tmp, err = f.reserveLocked(ctx, f.snapshotPath(id), AlignUp(srcSize, f.alignment))
	}
	f.mu.Unlock()
	if err != nil {
		return Snapshot{}, fmt.Errorf("create snapshot %s: %w", id, err)
	}

	method, err := f.copyInto(ctx, tmp, srcPath, srcSize)
	if err == nil {
		err = tmp.Truncate(srcSize)
	}
	snap := Snapshot{ID: id, SourceVolumeID: volumeID, Size: srcSize, CreationTime: time.Now().UnixNano()}
	if err == nil {
		// The sidecar goes in place first: a sidecar without data is a leftover, data without
		// a sidecar cannot happen.
		err = writeFileDurably(f.metaPath(id), snapshotMeta{
			SourceVolumeID: snap.SourceVolumeID, Size: snap.Size, CreationTime: snap.CreationTime,
		})
	}
	if _, err := f.commit(ctx, tmp, f.snapshotPath(id), err, nil); err != nil {
		f.mu.Lock()
		_ = os.Remove(f.metaPath(id))
		f.mu.Unlock()
		return Snapshot{}, fmt.Errorf("create snapshot %s: %w", id, err)
	}
	klog.FromContext(ctx).V(2).Info("Created snapshot", "snapshotID", id, "volumeID", volumeID, "size", srcSize, "copy", method)
	return snap, nil
}

// writeFileDurably writes v as JSON to path through a temporary, so that path holds either
// nothing or all of it.
func writeFileDurably(path string, v any) error {
	data, err := json.Marshal(v)
	if err != nil {
		return err
	}
	tmp := partialPath(path)
	if err := os.WriteFile(tmp, data, 0o600); err != nil {
		return err
	}
	if err := syncFile(tmp); err != nil {
		return err
	}
	return renameDurably(tmp, path)
}

func syncFile(path string) error {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	return f.Sync()
}

// snapshotLocked reads snapshot id.
func (f *File) snapshotLocked(id string) (Snapshot, error) {
	if _, err := os.Stat(f.snapshotPath(id)); errors.Is(err, fs.ErrNotExist) {
		return Snapshot{}, fmt.Errorf("%w: snapshot %s", ErrNotFound, id)
	} else if err != nil {
		return Snapshot{}, err
	}
	data, err := os.ReadFile(f.metaPath(id))
	if err != nil {
		return Snapshot{}, fmt.Errorf("snapshot %s: %w", id, err)
	}
	var meta snapshotMeta
	if err := json.Unmarshal(data, &meta); err != nil {
		return Snapshot{}, fmt.Errorf("snapshot %s: %s: %w", id, f.metaPath(id), err)
	}
	return Snapshot{ID: id, SourceVolumeID: meta.SourceVolumeID, Size: meta.Size, CreationTime: meta.CreationTime}, nil
}

// ListSnapshots implements Backend.
func (f *File) ListSnapshots(_ context.Context) ([]Snapshot, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	ids, err := imageIDs(f.snapshots)
	if err != nil {
		return nil, err
	}
	snaps := make([]Snapshot, 0, len(ids))
	for _, id := range ids {
		snap, err := f.snapshotLocked(id)
		if err != nil {
			return nil, err
		}
		snaps = append(snaps, snap)
	}
	return snaps, nil
}

// DeleteSnapshot implements Backend.
func (f *File) DeleteSnapshot(ctx context.Context, id string) error {
	if err := ValidateID(id); err != nil {
		return err
	}
	unlock, err := f.keys.lock(ctx, snapshotKey(id))
	if err != nil {
		return err
	}
	defer unlock()
	f.mu.Lock()
	defer f.mu.Unlock()
	// Data first: a sidecar left alone is removed as a leftover by NewFile.
	if err := removeDurably(f.snapshotPath(id)); err != nil {
		return fmt.Errorf("delete snapshot %s: %w", id, err)
	}
	if err := removeDurably(f.metaPath(id)); err != nil {
		return fmt.Errorf("delete snapshot %s: %w", id, err)
	}
	klog.FromContext(ctx).V(2).Info("Deleted snapshot", "snapshotID", id)
	return nil
}
