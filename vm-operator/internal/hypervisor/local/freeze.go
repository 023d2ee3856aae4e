package local

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"slices"
	"strings"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"pvbridge.io/vm-operator/internal/hypervisor"
)

// frozenFile lists the guest filesystems that Freeze froze, so that Thaw lets them go also
// after the agent restarted.
const frozenFile = stateDir + "/frozen"

// The filesystem freeze ioctls of linux/fs.h, _IOWR('X', 119, int) and _IOWR('X', 120, int),
// which golang.org/x/sys/unix does not define.
const (
	ioctlFIFREEZE = 0xc0045877
	ioctlFITHAW   = 0xc0045878
)

// frozenFS is an entry of frozenFile: the serial of the disk whose filesystem is frozen, and
// the mount point through which it was. A filesystem freezes as a whole, through any of its
// mounts.
type frozenFS struct {
	Serial     string `json:"serial"`
	MountPoint string `json:"mountPoint"`
}

// Freeze holds the writes of the guest to the disks with serials by freezing the filesystem
// the guest mounted from each (FIFREEZE, as qemu-guest-agent's guest-fsfreeze-freeze does
// inside a real VM): the kernel writes the filesystem's dirty data and journal to the device
// and flushes it, then blocks every new write to the filesystem until FITHAW. The local VM's
// guest has no CPU of its own to pause, and its mounts are in the host's mount table: the
// filesystem is the only place its writes can be held.
//
// The filesystems are recorded in .hypervisor/frozen before they are frozen, so that a Thaw,
// also by a restarted agent, lets every one go. A disk the guest does not use (no mount, no
// holder) has nothing to hold, nor has a serial that is not attached. A disk the guest uses
// otherwise cannot be held: its node bind-mounted (a raw block volume, written around any
// filesystem), a device stacked on it, a filesystem frozen by someone else, or an exclusive
// claim the mount table does not show (a mount in another mount namespace). Freeze then
// thaws what it froze and returns an error naming the disk and why.
//
// Freezing a frozen disk again is success. Unlike QEMU's pause, the guest's processes run
// on: those that write to a frozen filesystem block in the kernel until Thaw.
func (d *Driver) Freeze(ctx context.Context, vm hypervisor.VM, serials []string) error {
	for _, s := range serials {
		if err := validateSerial(s); err != nil {
			return err
		}
	}
	unlock, err := d.lock(ctx, vm)
	if err != nil {
		return err
	}
	defer unlock()
	r, err := d.openVM(vm)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("freeze disks of %s: %w", vmKey(vm), err)
	}
	defer r.Close()
	frozen, err := readFrozen(r)
	if err != nil {
		return fmt.Errorf("freeze disks of %s: %w", vmKey(vm), err)
	}
	// fail lets go of everything this VM has frozen: Freeze holds nothing when it fails.
	fail := func(err error) error {
		if terr := d.thawAll(ctx, r, vm, frozen); terr != nil {
			err = errors.Join(err, fmt.Errorf("thaw again: %w", terr))
		}
		return fmt.Errorf("freeze disks of %s: %w", vmKey(vm), err)
	}

	// Every disk is checked before the first freeze, so that a refusal usually freezes nothing.
	var targets []frozenFS
	for _, serial := range slices.Compact(slices.Sorted(slices.Values(serials))) {
		rec, found, err := readRecord(r, serial)
		if err != nil {
			return fail(err)
		}
		if !found {
			continue
		}
		mp, err := d.freezeTarget(r, rec, frozen)
		if err != nil {
			return fail(fmt.Errorf("disk %s: %w", serial, err))
		}
		if mp != "" {
			targets = append(targets, frozenFS{Serial: serial, MountPoint: mp})
		}
	}
	for _, t := range targets {
		// One entry per disk: its filesystem freezes as a whole, through any of its mounts.
		i := slices.IndexFunc(frozen, func(f frozenFS) bool { return f.Serial == t.Serial })
		ours := i >= 0
		if !ours || frozen[i] != t {
			frozen = append(slices.DeleteFunc(frozen, func(f frozenFS) bool { return f.Serial == t.Serial }), t)
			if err := writeFrozen(r, frozen); err != nil {
				return fail(err)
			}
		}
		rec, _, err := readRecord(r, t.Serial)
		if err != nil {
			return fail(err)
		}
		err = ioctlOnMount(t.MountPoint, rec.guestDev(), ioctlFIFREEZE)
		switch {
		case errors.Is(err, unix.EBUSY) && !ours:
			// Frozen by someone else, who may thaw it at any time; and it is not ours to thaw.
			frozen = slices.DeleteFunc(frozen, func(f frozenFS) bool { return f == t })
			if werr := writeFrozen(r, frozen); werr != nil {
				err = errors.Join(err, werr)
			}
			return fail(fmt.Errorf("disk %s: its filesystem at %s is frozen by someone else (fsfreeze?): %w", t.Serial, t.MountPoint, err))
		case errors.Is(err, unix.EBUSY):
			// Frozen by an earlier Freeze.
		case err != nil:
			return fail(fmt.Errorf("disk %s: freeze its filesystem at %s: %w", t.Serial, t.MountPoint, err))
		}
	}
	klog.FromContext(ctx).V(2).Info("Froze the guest's filesystems", "vm", klog.KRef(vm.Namespace, vm.Name), "serials", serials, "frozen", frozen)
	return nil
}

// freezeTarget returns the mount point through which to freeze the guest's filesystem on the
// disk of rec (the one frozen already, if it is), "" when the guest does not use the disk,
// or an error saying why its writes cannot be held.
func (d *Driver) freezeTarget(r *os.Root, rec record, frozen []frozenFS) (string, error) {
	if rec.guestDev() == 0 {
		return "", nil // a throttled disk whose loop device was never made: the guest has no node
	}
	mounts, binds, err := mountsOf(r, rec)
	if err != nil {
		return "", err
	}
	if len(binds) > 0 {
		return "", fmt.Errorf("its device node is bind-mounted at %s (a raw block volume): writes to a raw device cannot be held", strings.Join(binds, ", "))
	}
	holders, err := d.holders(rec)
	if err != nil {
		return "", err
	}
	if len(holders) > 0 {
		return "", fmt.Errorf("held by %s (a device stacked on it): its writes cannot be held", strings.Join(holders, ", "))
	}
	if len(mounts) == 0 {
		if claimed(r, rec) {
			return "", errors.New("claimed exclusively, but not mounted in this mount namespace (mounted in another one?): its writes cannot be held")
		}
		return "", nil
	}
	for _, f := range frozen {
		if f.Serial == rec.Serial && slices.Contains(mounts, f.MountPoint) {
			return f.MountPoint, nil
		}
	}
	return mounts[0], nil
}

// Thaw lets go of every filesystem of the VM's disks that Freeze froze (FITHAW), as
// .hypervisor/frozen lists them. A filesystem that is not frozen, a VM that froze nothing or
// that does not exist, is success.
func (d *Driver) Thaw(ctx context.Context, vm hypervisor.VM) error {
	unlock, err := d.lock(ctx, vm)
	if err != nil {
		return err
	}
	defer unlock()
	r, err := d.openVM(vm)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("thaw disks of %s: %w", vmKey(vm), err)
	}
	defer r.Close()
	if err := d.thawFrozen(ctx, r, vm); err != nil {
		return fmt.Errorf("thaw disks of %s: %w", vmKey(vm), err)
	}
	return nil
}

// thawFrozen thaws what .hypervisor/frozen of the VM whose directory is r lists.
func (d *Driver) thawFrozen(ctx context.Context, r *os.Root, vm hypervisor.VM) error {
	frozen, err := readFrozen(r)
	if err != nil || len(frozen) == 0 {
		return err
	}
	return d.thawAll(ctx, r, vm, frozen)
}

// thawAll thaws the filesystems of frozen and removes .hypervisor/frozen, or, when some
// cannot be thawed, leaves those in it for the next Thaw.
func (d *Driver) thawAll(ctx context.Context, r *os.Root, vm hypervisor.VM, frozen []frozenFS) error {
	var left []frozenFS
	var errs []error
	for _, f := range frozen {
		if err := thaw(ctx, r, vm, f); err != nil {
			left = append(left, f)
			errs = append(errs, fmt.Errorf("disk %s: %w", f.Serial, err))
		}
	}
	if len(left) == 0 {
		errs = append(errs, removeIfExists(r, frozenFile))
	} else {
		errs = append(errs, writeFrozen(r, left))
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	if len(frozen) > 0 {
		klog.FromContext(ctx).V(2).Info("Thawed the guest's filesystems", "vm", klog.KRef(vm.Namespace, vm.Name), "thawed", frozen)
	}
	return nil
}

// thaw thaws the filesystem of f. The mount point the file names is used only if the mount
// table says that the disk's device is mounted there (the file is in the VM directory, where
// the guest could write); otherwise any other mount of the device's filesystem does. A disk
// that is gone, or whose filesystem is no longer mounted, leaves nothing to thaw.
func thaw(ctx context.Context, r *os.Root, vm hypervisor.VM, f frozenFS) error {
	rec, found, err := readRecord(r, f.Serial)
	if err != nil || !found || rec.guestDev() == 0 {
		return err
	}
	mounts, _, err := mountsOf(r, rec)
	if err != nil {
		return err
	}
	if len(mounts) == 0 {
		klog.FromContext(ctx).Info("A frozen filesystem is no longer mounted: it cannot be thawed", "vm", klog.KRef(vm.Namespace, vm.Name), "serial", f.Serial, "mountPoint", f.MountPoint)
		return nil
	}
	mp := mounts[0]
	if slices.Contains(mounts, f.MountPoint) {
		mp = f.MountPoint
	}
	if err := ioctlOnMount(mp, rec.guestDev(), ioctlFITHAW); err != nil && !errors.Is(err, unix.EINVAL) {
		return fmt.Errorf("thaw its filesystem at %s: %w", mp, err)
	}
	return nil
}

// ioctlOnMount issues FIFREEZE or FITHAW on the filesystem mounted at mountPoint, which may
// be a directory or a file (a bind mount of a file of the filesystem, as kubelet makes for a
// subPath), after checking that it is on the filesystem of device dev: a path can change
// between the read of the mount table and the open. It is looked at through an O_PATH
// descriptor first, so that nothing else (a device node) is ever opened.
func ioctlOnMount(mountPoint string, dev uint64, req uint) error {
	path, err := unix.Open(mountPoint, unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return &fs.PathError{Op: "open", Path: mountPoint, Err: err}
	}
	defer unix.Close(path)
	var st unix.Stat_t
	if err := unix.Fstat(path, &st); err != nil {
		return &fs.PathError{Op: "stat", Path: mountPoint, Err: err}
	}
	if t := st.Mode & unix.S_IFMT; t != unix.S_IFDIR && t != unix.S_IFREG {
		return fmt.Errorf("%s is neither a directory nor a regular file", mountPoint)
	}
	if st.Dev != dev {
		return fmt.Errorf("%s is no longer a mount of device %s", mountPoint, formatDev(dev))
	}
	f, err := os.OpenFile(fmt.Sprintf("/proc/self/fd/%d", path), os.O_RDONLY|unix.O_NONBLOCK, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	return unix.IoctlSetInt(int(f.Fd()), req, 0)
}

// readFrozen returns the entries of .hypervisor/frozen; none when it does not exist.
func readFrozen(r *os.Root) ([]frozenFS, error) {
	data, err := r.ReadFile(frozenFile)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read the frozen filesystems: %w", err)
	}
	var frozen []frozenFS
	if err := json.Unmarshal(data, &frozen); err != nil {
		return nil, fmt.Errorf("parse the frozen filesystems: %w", err)
	}
	return slices.DeleteFunc(frozen, func(f frozenFS) bool { return validateSerial(f.Serial) != nil }), nil
}

// writeFrozen replaces .hypervisor/frozen with frozen, atomically.
func writeFrozen(r *os.Root, frozen []frozenFS) error {
	data, err := json.Marshal(frozen)
	if err != nil {
		return err
	}
	if err := writeFile(r, frozenFile, append(data, '\n')); err != nil {
		return fmt.Errorf("record the frozen filesystems: %w", err)
	}
	return nil
}
