// Package mounter does the node side of CSI volumes for both pvbridge drivers, on top of
// k8s.io/mount-utils: stage a block device as a filesystem (formatting it only when it is
// blank), publish by bind mount (read-only included) or as a raw block device file, unmount and
// remove, report usage and health, and grow a filesystem after its device grew.
//
// Every operation is idempotent: repeating a call that succeeded succeeds again without
// changing anything, and a call that finds the path holding something else fails with
// ErrIncompatible instead of stacking a second mount. Callers serialize the operations on one
// volume; the package keeps no state of its own.
package mounter

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"
	mount "k8s.io/mount-utils"
	utilexec "k8s.io/utils/exec"
)

// Errors the operations return, wrapped with details. A driver maps them to gRPC codes.
var (
	// ErrNotFound: the device, or the path the call reads, does not exist.
	ErrNotFound = errors.New("not found")
	// ErrNotMounted: the path exists but is not the mount point the call needs (publishing a
	// filesystem volume that is not staged, growing a filesystem that is not mounted).
	ErrNotMounted = errors.New("not a mount point")
	// ErrIncompatible: the path is already a mount point, but of another device or filesystem,
	// or with another read-only mode than requested.
	ErrIncompatible = errors.New("already mounted differently")
	// ErrHasData: the device holds a filesystem other than the requested one, or data that is
	// not a filesystem. Such a device is never formatted.
	ErrHasData = errors.New("device holds data")
	// ErrUnsupported: a filesystem type this package does not format.
	ErrUnsupported = errors.New("unsupported")
)

// DefaultFilesystem is the filesystem Stage makes when the caller names none.
const DefaultFilesystem = "ext4"

// filesystems are the types Stage formats and mounts.
var filesystems = []string{"ext4", "xfs"}

// blankHeader is how many leading bytes must be zero, beyond blkid finding no signature, before
// a device counts as blank. blkid recognises filesystems, partition tables and volume-manager
// labels, but not a raw block volume's own data; 4 KiB is what `lvcreate --zero` and `wipefs`
// clear, so a freshly carved volume always passes.
const blankHeader = 4096

// maxStackedMounts bounds how many mounts Unmount takes off one path.
const maxStackedMounts = 8

// Mounter stages, publishes, unmounts, measures and grows volumes. It is safe for concurrent
// use on different paths.
type Mounter struct {
	mount  *mount.SafeFormatAndMount
	resize *mount.ResizeFs
	// sysfs is the root of sysfs, where device sizes, DAX support and presence are read.
	sysfs string
}

// New returns a Mounter that runs the host's mount, umount, blkid, mkfs, fsck, resize2fs and
// xfs_growfs. It never runs mounts through systemd-run: the filesystems it mounts need no
// user-space daemon that would have to outlive the driver.
func New() *Mounter {
	return NewWith(mount.NewWithoutSystemd(""), utilexec.New())
}

// NewWith returns a Mounter that mounts through m and runs tools through exec: for tests, or
// for a driver that needs another mount implementation.
func NewWith(m mount.Interface, exec utilexec.Interface) *Mounter {
	return &Mounter{
		mount:  mount.NewSafeFormatAndMount(m, exec),
		resize: mount.NewResizeFs(exec),
		sysfs:  "/sys",
	}
}

// ValidFilesystem reports whether Stage supports fsType; "" stands for DefaultFilesystem.
func ValidFilesystem(fsType string) bool {
	return fsType == "" || slices.Contains(filesystems, fsType)
}

// Stage mounts the filesystem on device at path (created if missing) with the given mount
// options, first formatting the device as fsType ("" for DefaultFilesystem) if and only if it
// is blank, and grows the filesystem to fill a larger device (a restore or clone of a smaller
// volume) unless the mount is read-only: ext4 before it is mounted, xfs after. A device that
// holds another filesystem or unrecognised data is ErrHasData and is left untouched. If path
// is already a mount of device's fsType filesystem, Stage only grows an xfs filesystem that is
// smaller than its device; a mount of anything else there is ErrIncompatible. A device that
// does not exist is ErrNotFound.
func (m *Mounter) Stage(ctx context.Context, device, path, fsType string, options []string) error {
	logger := klog.FromContext(ctx).WithValues("device", device, "stagingPath", path)
	if fsType == "" {
		fsType = DefaultFilesystem
	}
	if !ValidFilesystem(fsType) {
		return fmt.Errorf("%w: filesystem %q, want one of %v", ErrUnsupported, fsType, filesystems)
	}
	dev, err := blockDevice(device)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(path, 0o750); err != nil {
		return fmt.Errorf("create staging path: %w", err)
	}
	mounted, err := m.isMountPoint(path)
	if err != nil {
		return err
	}
	if mounted {
		if err := m.checkStaged(path, dev, fsType); err != nil {
			return err
		}
		logger.V(4).Info("Already staged")
		return m.fill(ctx, device, path, fsType)
	}

	existing, err := m.mount.GetDiskFormat(device)
	if err != nil {
		return fmt.Errorf("detect the filesystem on %s: %w", device, err)
	}
	switch existing {
	case fsType:
		if fsType == "ext4" && !slices.Contains(options, "ro") {
			if err := m.fillUnmountedExt4(ctx, dev, device); err != nil {
				return err
			}
		}
	case "":
		if err := checkBlank(device); err != nil {
			return err
		}
		logger.Info("Formatting blank device", "fsType", fsType)
	default:
		return fmt.Errorf("%w: %s holds %s, not %s; it is not formatted over", ErrHasData, device, existing, fsType)
	}
	// A snapshot's restore or a clone is a copy of its source, UUID included, and XFS refuses
	// to mount a second filesystem of one UUID: the two could not be used on one node.
	if fsType == "xfs" && !slices.Contains(options, "nouuid") {
		options = append(slices.Clone(options), "nouuid")
	}
	// FormatAndMount formats only when blkid finds nothing, which was checked above, and runs
	// fsck before mounting an existing filesystem read-write. ext4 gets blocks of a page, as
	// DAX needs: mkfs.ext4 picks 1 KiB blocks below 512 MiB, and such a filesystem refuses
	// -o dax (EINVAL), found on emulated NVDIMMs.
	var formatOptions []string
	if fsType == "ext4" {
		formatOptions = []string{"-b", "4096"}
	}
	if err := m.mount.FormatAndMountSensitiveWithFormatOptions(device, path, fsType, options, nil, formatOptions); err != nil {
		return fmt.Errorf("format and mount %s at %s: %w", device, path, err)
	}
	logger.V(2).Info("Staged", "fsType", fsType, "options", options)
	return m.fill(ctx, device, path, fsType)
}

// fill grows the xfs filesystem of device, writably mounted at path, when the device is larger
// (xfs grows only mounted; ext4 grew before it was mounted). A read-only mount is left as it is.
func (m *Mounter) fill(ctx context.Context, device, path, fsType string) error {
	if fsType != "xfs" {
		return nil
	}
	if ro, err := isReadOnly(path); err != nil || ro {
		return err
	}
	// xfs_growfs says so and changes nothing when the filesystem fills its device.
	if err := m.grow(device, path); err != nil {
		return err
	}
	klog.FromContext(ctx).V(4).Info("Filesystem fills its device", "device", device, "stagingPath", path)
	return nil
}

// ext4Slack is how much of its device an ext4 filesystem may leave unused without being grown:
// mkfs and resize2fs leave a last block group out when it would not hold its own metadata
// (bitmaps and inode table: at most a few MiB).
const ext4Slack = 16 << 20

// fillUnmountedExt4 grows the ext4 filesystem of the unmounted device when the device is larger
// by more than ext4Slack: e2fsck -f first, as resize2fs requires, then resize2fs. Growing
// unmounted needs no CAP_SYS_RESOURCE, which growing a mounted ext4 does.
func (m *Mounter) fillUnmountedExt4(ctx context.Context, dev uint64, device string) error {
	deviceSize, err := m.deviceSize(dev)
	if err != nil {
		return fmt.Errorf("size of %s: %w", device, err)
	}
	fsSize, err := m.ext4Size(device)
	if err != nil {
		return err
	}
	if deviceSize-fsSize <= ext4Slack {
		return nil
	}
	out, err := m.mount.Exec.Command("e2fsck", "-f", "-p", device).CombinedOutput()
	var exit utilexec.ExitError
	if corrected := errors.As(err, &exit) && exit.ExitStatus() == 1; err != nil && !corrected {
		return fmt.Errorf("e2fsck -f %s: %w: %s", device, err, out)
	}
	if err := m.grow(device, ""); err != nil {
		return err
	}
	klog.FromContext(ctx).V(2).Info("Grew the filesystem to its device", "device", device, "from", fsSize, "to", deviceSize)
	return nil
}

// ext4Size is the size of the ext4 filesystem on device, from its superblock (dumpe2fs -h).
func (m *Mounter) ext4Size(device string) (int64, error) {
	out, err := m.mount.Exec.Command("dumpe2fs", "-h", device).CombinedOutput()
	if err != nil {
		return 0, fmt.Errorf("dumpe2fs -h %s: %w: %s", device, err, out)
	}
	var blocks, blockSize int64
	for line := range strings.Lines(string(out)) {
		key, value, _ := strings.Cut(line, ":")
		switch key {
		case "Block count":
			blocks, err = strconv.ParseInt(strings.TrimSpace(value), 10, 64)
		case "Block size":
			blockSize, err = strconv.ParseInt(strings.TrimSpace(value), 10, 64)
		}
		if err != nil {
			return 0, fmt.Errorf("dumpe2fs -h %s: %q: %w", device, line, err)
		}
	}
	if blocks == 0 || blockSize == 0 {
		return 0, fmt.Errorf("dumpe2fs -h %s: no block count or size in %q", device, out)
	}
	return blocks * blockSize, nil
}

// checkStaged accepts the mount at path if it is dev's filesystem of type fsType.
func (m *Mounter) checkStaged(path string, dev uint64, fsType string) error {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return fmt.Errorf("stat %s: %w", path, err)
	}
	if st.Dev != dev {
		return fmt.Errorf("%w: %s is a mount of device %s, not %s", ErrIncompatible, path, devNumber(st.Dev), devNumber(dev))
	}
	mp, err := m.mountPoint(path)
	if err != nil {
		return err
	}
	if mp.Type != fsType {
		return fmt.Errorf("%w: %s is mounted as %s, not %s", ErrIncompatible, path, mp.Type, fsType)
	}
	return nil
}

// Publish bind-mounts the staged filesystem at source onto target (created if missing),
// read-only if readOnly, with the given extra mount options. source must be a mount point
// (ErrNotMounted otherwise: the volume is not staged). If target already is a bind mount of
// source with the same read-only mode, Publish succeeds without doing anything; any other mount
// there is ErrIncompatible.
func (m *Mounter) Publish(ctx context.Context, source, target string, readOnly bool, options []string) error {
	logger := klog.FromContext(ctx).WithValues("stagingPath", source, "targetPath", target)
	staged, err := m.isMountPoint(source)
	if err != nil {
		return err
	}
	if !staged {
		return fmt.Errorf("%w: %s, the volume is not staged", ErrNotMounted, source)
	}
	var src unix.Stat_t
	if err := unix.Stat(source, &src); err != nil {
		return fmt.Errorf("stat %s: %w", source, err)
	}
	if err := os.MkdirAll(target, 0o750); err != nil {
		return fmt.Errorf("create target path: %w", err)
	}
	published, err := m.checkPublished(target, readOnly, func(st *unix.Stat_t) bool {
		return st.Dev == src.Dev && st.Ino == src.Ino
	})
	if err != nil || published {
		if published {
			logger.V(4).Info("Already published")
		}
		return err
	}
	if err := m.bind(source, target, readOnly, options); err != nil {
		return err
	}
	logger.V(2).Info("Published", "readOnly", readOnly)
	return nil
}

// PublishBlock bind-mounts the block device onto the file target (created, with its parent
// directory, if missing), read-only if readOnly. If target already is that device with the
// same read-only mode, PublishBlock succeeds without doing anything; anything else mounted
// there is ErrIncompatible. A device that does not exist is ErrNotFound.
//
// Read-only applies to the mount: the kernel does not refuse writes through a device node on a
// read-only mount, so it is the container runtime, told by kubelet, that gives a container
// read-only access to the device.
func (m *Mounter) PublishBlock(ctx context.Context, device, target string, readOnly bool) error {
	logger := klog.FromContext(ctx).WithValues("device", device, "targetPath", target)
	dev, err := blockDevice(device)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(target), 0o750); err != nil {
		return fmt.Errorf("create the directory of the target path: %w", err)
	}
	// Create the file only when it is missing: opening a published target would open the
	// device itself.
	if _, err := os.Lstat(target); errors.Is(err, fs.ErrNotExist) {
		f, err := os.OpenFile(target, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
		if err != nil {
			return fmt.Errorf("create target file: %w", err)
		}
		_ = f.Close()
	} else if err != nil {
		return fmt.Errorf("check target file: %w", err)
	}
	published, err := m.checkPublished(target, readOnly, func(st *unix.Stat_t) bool {
		return st.Mode&unix.S_IFMT == unix.S_IFBLK && st.Rdev == dev
	})
	if err != nil || published {
		if published {
			logger.V(4).Info("Already published")
		}
		return err
	}
	if err := m.bind(device, target, readOnly, nil); err != nil {
		return err
	}
	logger.V(2).Info("Published block device", "readOnly", readOnly)
	return nil
}

// checkPublished reports whether target is already a mount that same accepts, with the
// requested read-only mode; another mount there is ErrIncompatible.
func (m *Mounter) checkPublished(target string, readOnly bool, same func(*unix.Stat_t) bool) (bool, error) {
	mounted, err := m.isMountPoint(target)
	if err != nil || !mounted {
		return false, err
	}
	var st unix.Stat_t
	if err := unix.Stat(target, &st); err != nil {
		return false, fmt.Errorf("stat %s: %w", target, err)
	}
	if !same(&st) {
		return false, fmt.Errorf("%w: %s is a mount of something else", ErrIncompatible, target)
	}
	ro, err := isReadOnly(target)
	if err != nil {
		return false, err
	}
	if ro != readOnly {
		return false, fmt.Errorf("%w: %s is mounted with read-only %t, requested %t", ErrIncompatible, target, ro, readOnly)
	}
	return true, nil
}

// bind bind-mounts source onto target. mount-utils makes a read-only bind mount in two steps
// (bind, then remount read-only); if the second fails, the first is undone, so that a failed
// call never leaves a writable mount behind.
func (m *Mounter) bind(source, target string, readOnly bool, options []string) error {
	opts := append([]string{"bind"}, options...)
	if readOnly {
		opts = append(opts, "ro")
	}
	if err := m.mount.Mount(source, target, "", opts); err != nil {
		err = fmt.Errorf("bind-mount %s at %s: %w", source, target, err)
		if mounted, mErr := m.isMountPoint(target); mErr == nil && mounted {
			if uErr := m.mount.Unmount(target); uErr != nil {
				return errors.Join(err, fmt.Errorf("undo the bind mount: %w", uErr))
			}
		}
		return err
	}
	return nil
}

// Unmount unmounts path, as often as mounts are stacked on it, and removes it (a directory or
// a raw block device file). A path that does not exist is success.
func (m *Mounter) Unmount(ctx context.Context, path string) error {
	if _, err := os.Lstat(path); errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	for range maxStackedMounts {
		// CleanupMountPoint unmounts once and removes the path if it is no mount point then.
		// The extensive check detects bind mounts, which share their parent's device.
		err := mount.CleanupMountPoint(path, m.mount, true)
		if err == nil {
			klog.FromContext(ctx).V(2).Info("Unmounted and removed", "path", path)
			return nil
		}
		if mounted, mErr := m.isMountPoint(path); mErr != nil || !mounted {
			return fmt.Errorf("unmount %s: %w", path, err)
		}
		// Another mount was beneath the one just removed.
	}
	return fmt.Errorf("unmount %s: still a mount point after %d unmounts", path, maxStackedMounts)
}

// Stats is what NodeGetVolumeStats and NodeGetVolumeHealth report.
type Stats struct {
	// Block is true when the path is a raw block device; only TotalBytes is set then.
	Block bool
	// TotalBytes is the size of the filesystem or device.
	TotalBytes int64
	// AvailableBytes is the space an unprivileged user can still allocate.
	AvailableBytes int64
	// UsedBytes is the space in use.
	UsedBytes int64
	// TotalInodes, FreeInodes and UsedInodes count the filesystem's inodes.
	TotalInodes, FreeInodes, UsedInodes int64
	// Condition says what is wrong with a volume that is not healthy; no sizes are set then.
	// Nil for a healthy volume.
	Condition *Condition
}

// Condition is what is wrong with a volume.
type Condition struct {
	// Reason is one CamelCase word for machines: one of the Reason constants.
	Reason string
	// Message says what is wrong, for people.
	Message string
}

// Reasons of a Condition.
const (
	// ReasonNotMounted: the path is not a mount point.
	ReasonNotMounted = "NotMounted"
	// ReasonDeviceGone: the volume's device was removed, or detached and has no capacity.
	ReasonDeviceGone = "DeviceGone"
	// ReasonMountCorrupted: the mount point cannot be reached (ESTALE, ENOTCONN, EIO, ...).
	ReasonMountCorrupted = "MountCorrupted"
	// ReasonIOError: the filesystem fails with I/O errors.
	ReasonIOError = "IOError"
)

// Stats measures the volume of device at path: a filesystem mount point (staging or bind
// mount) or a raw block device file. A path that does not exist, or holds another device than
// device, is ErrNotFound: the volume is not there. A path that is no mount point, or whose
// device is gone ("" when the caller could not find it, removed, or detached and of size
// zero), is reported in Condition rather than as an error.
func (m *Mounter) Stats(ctx context.Context, path, device string) (Stats, error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return Stats{}, fmt.Errorf("%w: %s", ErrNotFound, path)
		}
		if mount.IsCorruptedMnt(err) {
			return abnormal(ctx, path, ReasonMountCorrupted, fmt.Sprintf("the mount at %s is corrupted: %v", path, err)), nil
		}
		return Stats{}, fmt.Errorf("stat %s: %w", path, err)
	}
	mounted, err := m.isMountPoint(path)
	if err != nil {
		return Stats{}, err
	}
	if !mounted {
		return abnormal(ctx, path, ReasonNotMounted, path+" is not a mount point"), nil
	}
	if device == "" {
		return abnormal(ctx, path, ReasonDeviceGone, "the volume's device is gone"), nil
	}
	dev, err := blockDevice(device)
	if errors.Is(err, ErrNotFound) {
		return abnormal(ctx, path, ReasonDeviceGone, fmt.Sprintf("device %s is gone", device)), nil
	}
	if err != nil {
		return Stats{}, err
	}
	if !holds(&st, dev) {
		return Stats{}, fmt.Errorf("%w: %s holds another device than %s", ErrNotFound, path, device)
	}
	size, err := m.deviceSize(dev)
	if err != nil {
		return abnormal(ctx, path, ReasonDeviceGone, fmt.Sprintf("device %s is gone: %v", device, err)), nil
	}
	if size == 0 {
		return abnormal(ctx, path, ReasonDeviceGone, fmt.Sprintf("device %s has no capacity: detached or removed", device)), nil
	}
	if st.Mode&unix.S_IFMT == unix.S_IFBLK {
		return Stats{Block: true, TotalBytes: size}, nil
	}

	var sfs unix.Statfs_t
	if err := unix.Statfs(path, &sfs); err != nil {
		if errors.Is(err, unix.EIO) {
			return abnormal(ctx, path, ReasonIOError, fmt.Sprintf("the filesystem at %s fails with I/O errors", path)), nil
		}
		return Stats{}, fmt.Errorf("statfs %s: %w", path, err)
	}
	bsize := uint64(max(sfs.Bsize, 0))
	return Stats{
		TotalBytes:     clamp(sfs.Blocks * bsize),
		AvailableBytes: clamp(sfs.Bavail * bsize),
		UsedBytes:      clamp((sfs.Blocks - sfs.Bfree) * bsize),
		TotalInodes:    clamp(sfs.Files),
		FreeInodes:     clamp(sfs.Ffree),
		UsedInodes:     clamp(sfs.Files - sfs.Ffree),
	}, nil
}

// holds reports whether the file st describes is block device dev (a raw block publish) or in
// a filesystem on dev (a staging or bind mount).
func holds(st *unix.Stat_t, dev uint64) bool {
	if st.Mode&unix.S_IFMT == unix.S_IFBLK {
		return st.Rdev == dev
	}
	return st.Dev == dev
}

// clamp converts a statfs count to the int64 CSI wants.
func clamp(v uint64) int64 {
	if v > math.MaxInt64 {
		return math.MaxInt64
	}
	return int64(v)
}

func abnormal(ctx context.Context, path, reason, msg string) Stats {
	klog.FromContext(ctx).V(2).Info("Volume is not healthy", "path", path, "reason", reason, "message", msg)
	return Stats{Condition: &Condition{Reason: reason, Message: msg}}
}

// Expand grows the filesystem of device mounted at path (the staging path or a bind mount of
// it) to fill the device, which has grown: resize2fs for ext4, xfs_growfs for xfs, both
// online. A filesystem that fills its device already is left as it is. The filesystem must
// have a writable mount somewhere (path may be a read-only bind mount of it). A path that does
// not exist, or holds another device, is ErrNotFound; one that is no mount point ErrNotMounted.
//
// Growing a mounted ext4 needs CAP_SYS_RESOURCE besides CAP_SYS_ADMIN.
func (m *Mounter) Expand(ctx context.Context, path, device string) error {
	dev, err := blockDevice(device)
	if err != nil {
		return err
	}
	mounted, err := m.isMountPoint(path)
	if err != nil {
		return err
	}
	if !mounted {
		return fmt.Errorf("%w: %s, nothing to grow", ErrNotMounted, path)
	}
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return fmt.Errorf("stat %s: %w", path, err)
	}
	if st.Mode&unix.S_IFMT == unix.S_IFBLK || !holds(&st, dev) {
		return fmt.Errorf("%w: %s holds no filesystem of %s", ErrNotFound, path, device)
	}
	// xfs_growfs works through a mount point and fails on a read-only one.
	writable, err := m.writableMount(path)
	if err != nil {
		return err
	}
	if err := m.grow(device, writable); err != nil {
		return err
	}
	klog.FromContext(ctx).V(2).Info("Filesystem fills its device", "device", device, "path", writable)
	return nil
}

// grow runs resize2fs or xfs_growfs on the filesystem of device, writably mounted at path (an
// ext4 may also be unmounted, path "").
func (m *Mounter) grow(device, path string) error {
	if _, err := m.resize.Resize(device, path); err != nil {
		if strings.Contains(err.Error(), "Permission denied to resize") {
			err = fmt.Errorf("%w (growing a mounted ext4 needs CAP_SYS_RESOURCE)", err)
		}
		return fmt.Errorf("grow the filesystem on %s: %w", device, err)
	}
	return nil
}

// writableMount returns path if it is a writable mount, or else another writable mount of the
// same device.
func (m *Mounter) writableMount(path string) (string, error) {
	ro, err := isReadOnly(path)
	if err != nil {
		return "", err
	}
	if !ro {
		return path, nil
	}
	device, _, err := mount.GetDeviceNameFromMount(m.mount, path)
	if err != nil {
		return "", fmt.Errorf("find the device mounted at %s: %w", path, err)
	}
	mps, err := m.mount.List()
	if err != nil {
		return "", fmt.Errorf("list mounts: %w", err)
	}
	for _, mp := range mps {
		if mp.Device == device && !slices.Contains(mp.Opts, "ro") {
			return mp.Path, nil
		}
	}
	return "", fmt.Errorf("%w: the filesystem at %s has no writable mount to grow it through", ErrNotMounted, path)
}

// DeviceSize returns the size of a block device in bytes (ErrNotFound if it does not exist).
func (m *Mounter) DeviceSize(device string) (int64, error) {
	dev, err := blockDevice(device)
	if err != nil {
		return 0, err
	}
	size, err := m.deviceSize(dev)
	if err != nil {
		return 0, fmt.Errorf("size of %s: %w", device, err)
	}
	return size, nil
}

// SupportsDAX reports whether a block device supports direct access (DAX), so that a
// filesystem on it can be mounted with -o dax: /sys/block/<dev>/queue/dax, read from the whole
// disk for a partition.
func (m *Mounter) SupportsDAX(device string) (bool, error) {
	dev, err := blockDevice(device)
	if err != nil {
		return false, err
	}
	// /sys/dev/block/<major:minor> links into the device tree, where a partition is a
	// subdirectory of its disk.
	dir, err := filepath.EvalSymlinks(m.sysfsDir(dev))
	if err != nil {
		return false, fmt.Errorf("find %s in sysfs: %w", device, err)
	}
	if _, err := os.Stat(filepath.Join(dir, "partition")); err == nil {
		dir = filepath.Dir(dir)
	}
	b, err := os.ReadFile(filepath.Join(dir, "queue", "dax"))
	if errors.Is(err, fs.ErrNotExist) {
		// Older kernels have no such file for devices without DAX.
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("read DAX support of %s: %w", device, err)
	}
	return strings.TrimSpace(string(b)) == "1", nil
}

// isMountPoint reports whether path is a mount point, bind mounts included; ErrNotFound if path
// does not exist.
func (m *Mounter) isMountPoint(path string) (bool, error) {
	mounted, err := m.mount.IsMountPoint(path)
	if errors.Is(err, fs.ErrNotExist) {
		return false, fmt.Errorf("%w: %s", ErrNotFound, path)
	}
	if err != nil {
		return false, fmt.Errorf("check mount point %s: %w", path, err)
	}
	return mounted, nil
}

// mountPoint returns the topmost mount at path from the mount table.
func (m *Mounter) mountPoint(path string) (mount.MountPoint, error) {
	resolved, err := filepath.EvalSymlinks(path)
	if err != nil {
		return mount.MountPoint{}, fmt.Errorf("resolve %s: %w", path, err)
	}
	mps, err := m.mount.List()
	if err != nil {
		return mount.MountPoint{}, fmt.Errorf("list mounts: %w", err)
	}
	for i := len(mps) - 1; i >= 0; i-- {
		if mps[i].Path == resolved {
			return mps[i], nil
		}
	}
	return mount.MountPoint{}, fmt.Errorf("%w: %s is not in the mount table", ErrNotMounted, path)
}

// sysfsDir is the sysfs directory of block device dev.
func (m *Mounter) sysfsDir(dev uint64) string {
	return filepath.Join(m.sysfs, "dev", "block", devNumber(dev))
}

// deviceSize reads the size of block device dev from sysfs, which the kernel keeps current
// when the device grows.
func (m *Mounter) deviceSize(dev uint64) (int64, error) {
	b, err := os.ReadFile(filepath.Join(m.sysfsDir(dev), "size"))
	if err != nil {
		return 0, err
	}
	sectors, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	if err != nil {
		return 0, fmt.Errorf("parse the size of device %s: %w", devNumber(dev), err)
	}
	return sectors * 512, nil // sysfs counts 512-byte sectors whatever the device's block size
}

// blockDevice returns the device number of the block device at path.
func blockDevice(path string) (uint64, error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return 0, fmt.Errorf("%w: device %s", ErrNotFound, path)
		}
		return 0, fmt.Errorf("stat %s: %w", path, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFBLK {
		return 0, fmt.Errorf("%s is not a block device", path)
	}
	return st.Rdev, nil
}

// checkBlank returns ErrHasData unless the first blankHeader bytes of device are zero.
func checkBlank(device string) error {
	f, err := os.Open(device)
	if err != nil {
		return fmt.Errorf("open %s: %w", device, err)
	}
	defer func() { _ = f.Close() }()
	buf := make([]byte, blankHeader)
	n, err := io.ReadFull(f, buf)
	if err != nil && !errors.Is(err, io.ErrUnexpectedEOF) {
		return fmt.Errorf("read %s: %w", device, err)
	}
	for _, b := range buf[:n] {
		if b != 0 {
			return fmt.Errorf("%w: %s has no filesystem that blkid knows, but its first %d bytes are not zero; it is not formatted over", ErrHasData, device, blankHeader)
		}
	}
	return nil
}

// isReadOnly reports whether the mount at path is read-only.
func isReadOnly(path string) (bool, error) {
	var sfs unix.Statfs_t
	if err := unix.Statfs(path, &sfs); err != nil {
		return false, fmt.Errorf("statfs %s: %w", path, err)
	}
	return sfs.Flags&unix.ST_RDONLY != 0, nil
}

func devNumber(dev uint64) string {
	return fmt.Sprintf("%d:%d", unix.Major(dev), unix.Minor(dev))
}
