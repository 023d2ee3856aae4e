// Package fake is an in-memory pmem.Backend for the unit tests of the controller and the node
// agent: configurable capacity and alignment, volumes that can be marked in use, and errors
// injected per method. Its volumes have device paths but no devices.
package fake

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"pvbridge.io/mgmt-csi/internal/pmem"
	pmemv1 "pvbridge.io/pkg/apis/pmem/v1alpha1"
)

// Method names a Backend method, for InjectError and Calls.
type Method string

// The methods of pmem.Backend.
const (
	Capacity       Method = "Capacity"
	CreateVolume   Method = "CreateVolume"
	GetVolume      Method = "GetVolume"
	ListVolumes    Method = "ListVolumes"
	ExpandVolume   Method = "ExpandVolume"
	DeleteVolume   Method = "DeleteVolume"
	CreateSnapshot Method = "CreateSnapshot"
	ListSnapshots  Method = "ListSnapshots"
	DeleteSnapshot Method = "DeleteSnapshot"
)

// Options configure a Fake.
type Options struct {
	// Mode is what Mode reports; empty means file.
	Mode pmemv1.Mode
	// Capacity is the PMEM managed in bytes; 0 means 1 TiB.
	Capacity int64
	// Alignment is the allocation granularity; 0 means 1 MiB.
	Alignment int64
}

// Fake is an in-memory pmem.Backend that follows the contract of the real ones: sizes rounded
// up to the alignment, thick accounting of volumes and snapshots, ErrNoSpace, ErrNotFound,
// ErrInvalid and ErrInUse as documented, idempotent methods. Safe for concurrent use.
type Fake struct {
	mode             pmemv1.Mode
	total, alignment int64

	mu        sync.Mutex
	volumes   map[string]pmem.Volume
	snapshots map[string]pmem.Snapshot
	inUse     map[string]bool
	errs      map[Method]error
	calls     map[Method]int
	devices   int
}

var _ pmem.Backend = (*Fake)(nil)

// New makes an empty Fake.
func New(opts Options) *Fake {
	if opts.Mode == "" {
		opts.Mode = pmemv1.ModeFile
	}
	if opts.Capacity == 0 {
		opts.Capacity = 1 << 40
	}
	if opts.Alignment == 0 {
		opts.Alignment = 1 << 20
	}
	return &Fake{
		mode:      opts.Mode,
		total:     pmem.AlignDown(opts.Capacity, opts.Alignment),
		alignment: opts.Alignment,
		volumes:   map[string]pmem.Volume{},
		snapshots: map[string]pmem.Snapshot{},
		inUse:     map[string]bool{},
		errs:      map[Method]error{},
		calls:     map[Method]int{},
	}
}

// InjectError makes every later call of m fail with err, until InjectError(m, nil).
func (f *Fake) InjectError(m Method, err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err == nil {
		delete(f.errs, m)
		return
	}
	f.errs[m] = err
}

// SetInUse marks volume id as mounted (DeleteVolume is ErrInUse) or not.
func (f *Fake) SetInUse(id string, inUse bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.inUse[id] = inUse
}

// Calls is how often m was called, failed calls included.
func (f *Fake) Calls(m Method) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.calls[m]
}

// call counts a call of m and returns its injected error. f.mu must be held.
func (f *Fake) call(m Method) error {
	f.calls[m]++
	if err := f.errs[m]; err != nil {
		return fmt.Errorf("fake %s: %w", m, err)
	}
	return nil
}

func (f *Fake) freeLocked() int64 {
	used := int64(0)
	for _, v := range f.volumes {
		used += pmem.AlignUp(v.Size, f.alignment)
	}
	for _, s := range f.snapshots {
		used += pmem.AlignUp(s.Size, f.alignment)
	}
	return max(f.total-used, 0)
}

// Mode implements pmem.Backend.
func (f *Fake) Mode() pmemv1.Mode { return f.mode }

// Capacity implements pmem.Backend.
func (f *Fake) Capacity(context.Context) (pmem.Capacity, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call(Capacity); err != nil {
		return pmem.Capacity{}, err
	}
	free := f.freeLocked()
	return pmem.Capacity{Total: f.total, Free: free, LargestAllocatable: pmem.AlignDown(free, f.alignment), Alignment: f.alignment}, nil
}

// CreateVolume implements pmem.Backend.
func (f *Fake) CreateVolume(_ context.Context, id string, size int64, src *pmem.Source) (pmem.Volume, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call(CreateVolume); err != nil {
		return pmem.Volume{}, err
	}
	if err := pmem.ValidateID(id); err != nil {
		return pmem.Volume{}, err
	}
	if v, ok := f.volumes[id]; ok {
		return v, nil
	}
	srcSize := int64(0)
	switch {
	case src != nil && src.SnapshotID != "" && src.VolumeID != "":
		return pmem.Volume{}, fmt.Errorf("%w: a source is a snapshot or a volume, not both", pmem.ErrInvalid)
	case src != nil && src.SnapshotID != "":
		s, ok := f.snapshots[src.SnapshotID]
		if !ok {
			return pmem.Volume{}, fmt.Errorf("%w: source snapshot %s", pmem.ErrNotFound, src.SnapshotID)
		}
		srcSize = s.Size
	case src != nil && src.VolumeID != "":
		v, ok := f.volumes[src.VolumeID]
		if !ok {
			return pmem.Volume{}, fmt.Errorf("%w: source volume %s", pmem.ErrNotFound, src.VolumeID)
		}
		srcSize = v.Size
	}
	switch {
	case size < 0:
		return pmem.Volume{}, fmt.Errorf("%w: negative size %d", pmem.ErrInvalid, size)
	case size == 0:
		size = max(srcSize, f.alignment)
	case size < srcSize:
		return pmem.Volume{}, fmt.Errorf("%w: size %d is smaller than its source (%d bytes)", pmem.ErrInvalid, size, srcSize)
	}
	size = pmem.AlignUp(size, f.alignment)
	if free := f.freeLocked(); size > free {
		return pmem.Volume{}, fmt.Errorf("create volume %s: %w: %d bytes asked, %d free", id, pmem.ErrNoSpace, size, free)
	}
	f.devices++
	v := pmem.Volume{ID: id, Size: size, Device: fmt.Sprintf("/dev/fake%d", f.devices)}
	f.volumes[id] = v
	return v, nil
}

// GetVolume implements pmem.Backend.
func (f *Fake) GetVolume(_ context.Context, id string) (pmem.Volume, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call(GetVolume); err != nil {
		return pmem.Volume{}, err
	}
	v, ok := f.volumes[id]
	if !ok {
		return pmem.Volume{}, fmt.Errorf("%w: volume %s", pmem.ErrNotFound, id)
	}
	return v, nil
}

// ListVolumes implements pmem.Backend, sorted by ID.
func (f *Fake) ListVolumes(context.Context) ([]pmem.Volume, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call(ListVolumes); err != nil {
		return nil, err
	}
	return slices.SortedFunc(maps.Values(f.volumes), func(a, b pmem.Volume) int { return strings.Compare(a.ID, b.ID) }), nil
}

// ExpandVolume implements pmem.Backend.
func (f *Fake) ExpandVolume(_ context.Context, id string, size int64) (pmem.Volume, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call(ExpandVolume); err != nil {
		return pmem.Volume{}, err
	}
	v, ok := f.volumes[id]
	if !ok {
		return pmem.Volume{}, fmt.Errorf("%w: volume %s", pmem.ErrNotFound, id)
	}
	size = pmem.AlignUp(size, f.alignment)
	if size <= v.Size {
		return v, nil
	}
	if free := f.freeLocked(); size-v.Size > free {
		return pmem.Volume{}, fmt.Errorf("expand volume %s: %w: %d more bytes asked, %d free", id, pmem.ErrNoSpace, size-v.Size, free)
	}
	v.Size = size
	f.volumes[id] = v
	return v, nil
}

// DeleteVolume implements pmem.Backend.
func (f *Fake) DeleteVolume(_ context.Context, id string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call(DeleteVolume); err != nil {
		return err
	}
	if _, ok := f.volumes[id]; ok && f.inUse[id] {
		return fmt.Errorf("delete volume %s: %w", id, pmem.ErrInUse)
	}
	delete(f.volumes, id)
	return nil
}

// CreateSnapshot implements pmem.Backend.
func (f *Fake) CreateSnapshot(_ context.Context, id, volumeID string) (pmem.Snapshot, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call(CreateSnapshot); err != nil {
		return pmem.Snapshot{}, err
	}
	if err := pmem.ValidateID(id); err != nil {
		return pmem.Snapshot{}, err
	}
	if s, ok := f.snapshots[id]; ok {
		if s.SourceVolumeID != volumeID {
			return pmem.Snapshot{}, fmt.Errorf("%w: snapshot %s exists, of volume %s", pmem.ErrInvalid, id, s.SourceVolumeID)
		}
		return s, nil
	}
	v, ok := f.volumes[volumeID]
	if !ok {
		return pmem.Snapshot{}, fmt.Errorf("%w: volume %s", pmem.ErrNotFound, volumeID)
	}
	if free := f.freeLocked(); v.Size > free {
		return pmem.Snapshot{}, fmt.Errorf("create snapshot %s: %w: %d bytes asked, %d free", id, pmem.ErrNoSpace, v.Size, free)
	}
	s := pmem.Snapshot{ID: id, SourceVolumeID: volumeID, Size: v.Size, CreationTime: time.Now().UnixNano()}
	f.snapshots[id] = s
	return s, nil
}

// ListSnapshots implements pmem.Backend, sorted by ID.
func (f *Fake) ListSnapshots(context.Context) ([]pmem.Snapshot, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call(ListSnapshots); err != nil {
		return nil, err
	}
	return slices.SortedFunc(maps.Values(f.snapshots), func(a, b pmem.Snapshot) int { return strings.Compare(a.ID, b.ID) }), nil
}

// DeleteSnapshot implements pmem.Backend.
func (f *Fake) DeleteSnapshot(_ context.Context, id string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.call(DeleteSnapshot); err != nil {
		return err
	}
	delete(f.snapshots, id)
	return nil
}
