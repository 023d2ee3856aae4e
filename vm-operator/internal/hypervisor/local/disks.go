package local

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"

	"pvbridge.io/vm-operator/internal/hypervisor"
)

// Attach exposes disk.Device in the running VM as a virtio disk with disk.Serial. Repeating it
// completes an interrupted attach and refreshes the size. The same device under the same serial
// is the same disk whatever path names it (the record then keeps the latest path); ErrConflict
// when the serial is attached with another device, or the device under another serial.
//
// A disk attached with limits (disk.Limits set) is throttled: the guest sees it through a
// qemu-storage-daemon (see throttle.go), whose daemon and loop device a repeated Attach
// restarts or remakes if they are gone, and whose limits it sets to disk.Limits (nil: none).
// A disk attached without limits keeps its direct path for as long as it is attached, whatever
// the limits of a repeated Attach: the guest may hold it, and SetLimits says ErrNotLive.
func (d *Driver) Attach(ctx context.Context, vm hypervisor.VM, disk hypervisor.Disk) error {
	if err := validateSerial(disk.Serial); err != nil {
		return err
	}
	dev, err := blockDevice(disk.Device)
	if err != nil {
		return err
	}
	unlock, err := d.lock(ctx, vm)
	if err != nil {
		return err
	}
	defer unlock()
	r, err := d.openRunning(vm)
	if err != nil {
		return err
	}
	defer r.Close()

	wrap := func(err error) error { return fmt.Errorf("attach disk %s to %s: %w", disk.Serial, vmKey(vm), err) }
	// Whatever is in the temporary directory was left by an interrupted operation.
	if err := r.RemoveAll(tmpDir); err != nil {
		return wrap(err)
	}
	if err := r.Mkdir(tmpDir, 0o755); err != nil {
		return wrap(err)
	}
	rec, err := recordFor(r, disk, dev, d.slotsOf(vm))
	if err != nil {
		return wrap(err)
	}
	if rec.Throttle != nil {
		if rec, err = d.throttle(ctx, r, vm, rec, ptr.Deref(disk.Limits, hypervisor.Limits{})); err != nil {
			return wrap(err)
		}
	}
	sectors, err := d.sectors(rec.guestNumber())
	if err != nil {
		return wrap(err)
	}
	if err := plug(r, rec, sectors); err != nil {
		return wrap(err)
	}
	kv := []any{"vm", klog.KRef(vm.Namespace, vm.Name), "serial", rec.Serial, "device", rec.Device, "disk", rec.Name}
	if l := rec.limits(); l != nil {
		kv = append(kv, "limits", l.String(), "guestDevice", rec.guestNumber())
	}
	klog.FromContext(ctx).V(2).Info("Attached disk", kv...)
	return nil
}

// openRunning opens the directory of vm, completing its skeleton; ErrVMNotFound if the VM
// does not run.
func (d *Driver) openRunning(vm hypervisor.VM) (_ *os.Root, err error) {
	r, err := d.openVM(vm)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("%w: %s does not run", hypervisor.ErrVMNotFound, vmKey(vm))
	}
	if err != nil {
		return nil, fmt.Errorf("open VM %s: %w", vmKey(vm), err)
	}
	defer func() {
		if err != nil {
			_ = r.Close()
		}
	}()
	running, err := isRunning(r)
	if err != nil {
		return nil, fmt.Errorf("open VM %s: %w", vmKey(vm), err)
	}
	if !running {
		return nil, fmt.Errorf("%w: %s does not run", hypervisor.ErrVMNotFound, vmKey(vm))
	}
	if err := makeSkeleton(r); err != nil {
		return nil, fmt.Errorf("open VM %s: %w", vmKey(vm), err)
	}
	return r, nil
}

// recordFor returns the record of disk, dev being the number of disk.Device: the existing one,
// updated to the path disk names, or a new one with the lowest free name, throttled if disk has
// limits. It stores what it returns; ErrConflict if the serial or the device is attached with
// another, ErrNoSlot when a new disk would be one more than slots. Every record counts,
// complete or not: each holds its device, as a disk in the middle of a hot-plug holds its slot.
func recordFor(r *os.Root, disk hypervisor.Disk, dev uint64, slots int) (record, error) {
	records, err := readRecords(r)
	if err != nil {
		return record{}, err
	}
	var existing *record
	for i, rec := range records {
		switch {
		case rec.Serial == disk.Serial && rec.dev() != dev:
			return record{}, fmt.Errorf("%w: the serial is attached as %s with device %s (%s), not %s (%d:%d)",
				hypervisor.ErrConflict, rec.Name, rec.Device, rec.number(), disk.Device, unix.Major(dev), unix.Minor(dev))
		case rec.Serial != disk.Serial && rec.dev() == dev:
			return record{}, fmt.Errorf("%w: device %s (%s) is attached as %s with serial %s",
				hypervisor.ErrConflict, disk.Device, rec.number(), rec.Name, rec.Serial)
		case rec.Serial == disk.Serial:
			existing = &records[i]
		}
	}
	var rec record
	switch {
	case existing != nil && existing.Device == disk.Device:
		return *existing, nil
	case existing != nil:
		rec = *existing
		rec.Device = disk.Device
	case len(records) >= slots:
		return record{}, fmt.Errorf("%w: all %d slots hold disks", hypervisor.ErrNoSlot, slots)
	default:
		name, err := lowestFreeName(r, records)
		if err != nil {
			return record{}, err
		}
		rec = newRecord(disk.Serial, name, disk.Device, dev)
		if l := disk.Limits; l != nil {
			rec.Throttle = &throttle{IOPS: l.IOPS, BytesPerSecond: l.BytesPerSecond}
		}
	}
	if err := writeRecord(r, rec); err != nil {
		return record{}, err
	}
	return rec, nil
}

// plug makes what the guest sees of rec, repairing what is missing or wrong: the device node,
// then the sys/block directory, whose serial makes the disk visible, then the by-id link. Both
// carry the number of the device the guest sees (guestDev).
func plug(r *os.Root, rec record, sectors uint64) error {
	if err := makeNode(r, rec); err != nil {
		return err
	}
	if err := makeSysDir(r, rec, sectors); err != nil {
		return err
	}
	return makeLink(r, rec)
}

// makeNode makes dev/vdX a block device node with the guest's number of rec, replacing anything
// else.
func makeNode(r *os.Root, rec record) error {
	fi, err := r.Lstat(rec.node())
	switch {
	case err == nil && isBlockDevice(fi, rec.guestDev()):
		return nil
	case err == nil:
		if err := r.Remove(rec.node()); err != nil {
			return fmt.Errorf("replace device node: %w", err)
		}
	case !errors.Is(err, fs.ErrNotExist):
		return fmt.Errorf("device node: %w", err)
	}
	dir, err := r.Open(devDir)
	if err != nil {
		return err
	}
	defer dir.Close()
	// Mknodat relative to a directory opened through the Root stays inside the VM. The kernel's
	// device numbers have 12+20 bits, which their 64-bit encoding keeps far below 2^63.
	if err := unix.Mknodat(int(dir.Fd()), rec.Name, unix.S_IFBLK|0o660, int(rec.guestDev())); err != nil { //nolint:gosec // see above
		return fmt.Errorf("mknod %s: %w", rec.node(), err)
	}
	return nil
}

// isBlockDevice reports whether fi is a block device node with number dev.
func isBlockDevice(fi fs.FileInfo, dev uint64) bool {
	st, ok := fi.Sys().(*syscall.Stat_t)
	return ok && fi.Mode().Type() == fs.ModeDevice && st.Rdev == dev
}

// makeSysDir makes sys/block/vdX of rec, or only refreshes its size when it is already right.
// The directory is built under the temporary directory and renamed into place, so that the
// guest never sees a serial without the rest.
func makeSysDir(r *os.Root, rec record, sectors uint64) error {
	if hasSysDir(r, rec) {
		return writeSize(r, rec, sectors)
	}
	tmp := filepath.Join(tmpDir, rec.Name)
	if err := r.RemoveAll(tmp); err != nil {
		return err
	}
	if err := r.MkdirAll(tmp, 0o755); err != nil {
		return err
	}
	files := []struct{ name, content string }{
		{"dev", rec.guestNumber()},
		{"size", strconv.FormatUint(sectors, 10)},
		{"serial", rec.Serial},
	}
	for _, f := range files {
		if err := r.WriteFile(filepath.Join(tmp, f.name), []byte(f.content+"\n"), 0o444); err != nil {
			return err
		}
	}
	if err := r.RemoveAll(rec.sysDir()); err != nil {
		return err
	}
	return r.Rename(tmp, rec.sysDir())
}

// hasSysDir reports whether sys/block/vdX of rec has its serial and the guest's number.
func hasSysDir(r *os.Root, rec record) bool {
	serial, errSerial := r.ReadFile(filepath.Join(rec.sysDir(), "serial"))
	number, errNumber := r.ReadFile(filepath.Join(rec.sysDir(), "dev"))
	return errSerial == nil && errNumber == nil && string(serial) == rec.Serial+"\n" && string(number) == rec.guestNumber()+"\n"
}

// writeSize updates the size in sys/block/vdX if it changed.
func writeSize(r *os.Root, rec record, sectors uint64) error {
	name := filepath.Join(rec.sysDir(), "size")
	content := strconv.FormatUint(sectors, 10) + "\n"
	if old, err := r.ReadFile(name); err == nil && string(old) == content {
		return nil
	}
	return writeFile(r, name, []byte(content))
}

// makeLink points dev/disk/by-id/virtio-<serial> at the node of rec, atomically.
func makeLink(r *os.Root, rec record) error {
	if hasLink(r, rec) {
		return nil
	}
	tmp := filepath.Join(tmpDir, filepath.Base(rec.link()))
	if err := removeIfExists(r, tmp); err != nil {
		return err
	}
	if err := r.Symlink(linkTarget(rec), tmp); err != nil {
		return err
	}
	return r.Rename(tmp, rec.link())
}

// linkTarget is where the by-id link of rec points: its node, relative to dev/disk/by-id.
func linkTarget(rec record) string { return "../../" + rec.Name }

// hasLink reports whether the by-id link of rec points at its node.
func hasLink(r *os.Root, rec record) bool {
	cur, err := r.Readlink(rec.link())
	return err == nil && cur == linkTarget(rec)
}

// sectors returns the current size of the device with number ("major:minor") in 512-byte
// sectors, from sysfs.
func (d *Driver) sectors(number string) (uint64, error) {
	data, err := os.ReadFile(filepath.Join(d.sysfs, "dev", "block", number, "size"))
	if err != nil {
		return 0, fmt.Errorf("read size of device %s: %w", number, err)
	}
	n, err := strconv.ParseUint(strings.TrimSpace(string(data)), 10, 64)
	if err != nil {
		return 0, fmt.Errorf("parse size of device %s: %w", number, err)
	}
	return n, nil
}

// Detach removes the disk with serial from the VM once nothing holds the device the guest sees
// (for a throttled disk, the loop device over its daemon's export): ErrBusy, naming the
// holders, while it is mounted (anywhere, through any path), its node in the VM is bind-mounted
// (a raw block volume published by the guest), a kernel device is stacked on it, or something
// claims it exclusively (a mount in another mount namespace). A disk that is not attached, or a
// VM that does not exist, is success. A throttled disk's loop device and daemon go before its
// record, so that a Detach interrupted anywhere is completed by the next.
//
// The check and the removal are not atomic against a guest that mounts the disk in between; the
// guest-csi node plugin does not, since kubelet unstages a volume before it is unpublished.
func (d *Driver) Detach(ctx context.Context, vm hypervisor.VM, serial string) error {
	if err := validateSerial(serial); err != nil {
		return err
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
		return fmt.Errorf("detach disk %s from %s: %w", serial, vmKey(vm), err)
	}
	defer r.Close()
	rec, found, err := readRecord(r, serial)
	if err != nil {
		return fmt.Errorf("detach disk %s from %s: %w", serial, vmKey(vm), err)
	}
	if !found {
		return nil
	}
	users, err := d.users(r, rec)
	if err != nil {
		return fmt.Errorf("detach disk %s from %s: %w", serial, vmKey(vm), err)
	}
	if len(users) > 0 {
		return fmt.Errorf("detach disk %s from %s: %w: %s", serial, vmKey(vm), hypervisor.ErrBusy, strings.Join(users, ", "))
	}
	if err := d.unplug(ctx, r, vm, rec); err != nil {
		return fmt.Errorf("detach disk %s from %s: %w", serial, vmKey(vm), err)
	}
	klog.FromContext(ctx).V(2).Info("Detached disk", "vm", klog.KRef(vm.Namespace, vm.Name),
		"serial", rec.Serial, "device", rec.Device, "disk", rec.Name)
	return nil
}

// unplug removes the guest's view of rec (the by-id link, the node, the sys/block directory),
// then what a throttled disk holds on the host (stopThrottle), then the record; each may
// already be gone.
func (d *Driver) unplug(ctx context.Context, r *os.Root, vm hypervisor.VM, rec record) error {
	for _, name := range []string{rec.link(), rec.node()} {
		if err := removeIfExists(r, name); err != nil {
			return err
		}
	}
	if err := r.RemoveAll(rec.sysDir()); err != nil {
		return err
	}
	if rec.Throttle != nil {
		if err := d.stopThrottle(ctx, d.daemonDir(vm, rec.Serial)); err != nil {
			return err
		}
	}
	return removeIfExists(r, rec.recFile())
}

// Disks lists the disks the guest sees, in the order of their names, each with Device as
// Attach was given it and its limits (nil for a disk attached without), and refreshes the size
// of each. A disk whose attach or detach was interrupted is not listed, as QEMU lists no device
// whose device_add did not happen: the guest does not see it, and a caller that took it for
// attached would report a disk the guest never finds; nor is a throttled disk whose daemon or
// loop device is gone, which the guest can no longer use. Attach completes or repairs it,
// Detach removes it; until then it holds its device (PowerOff refuses). A VM that is not
// running has no disks, since PowerOff refuses while it has some.
func (d *Driver) Disks(ctx context.Context, vm hypervisor.VM) ([]hypervisor.Disk, error) {
	unlock, err := d.lock(ctx, vm)
	if err != nil {
		return nil, err
	}
	defer unlock()
	r, err := d.openVM(vm)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("list disks of %s: %w", vmKey(vm), err)
	}
	defer r.Close()
	records, err := readRecords(r)
	if err != nil {
		return nil, fmt.Errorf("list disks of %s: %w", vmKey(vm), err)
	}
	var disks []hypervisor.Disk
	for _, rec := range records {
		if !plugged(r, rec) {
			continue
		}
		if rec.Throttle != nil {
			loop, ok, err := d.throttled(vm, rec)
			if err != nil {
				return nil, fmt.Errorf("list disks of %s: %w", vmKey(vm), err)
			}
			if !ok {
				continue
			}
			if err := d.followSize(ctx, nil, d.daemonDir(vm, rec.Serial), rec, loop); err != nil {
				return nil, fmt.Errorf("list disks of %s: disk %s: %w", vmKey(vm), rec.Serial, err)
			}
		}
		if err := d.refreshSize(r, rec); err != nil {
			return nil, fmt.Errorf("list disks of %s: %w", vmKey(vm), err)
		}
		disks = append(disks, hypervisor.Disk{Serial: rec.Serial, Device: rec.Device, Limits: rec.limits()})
	}
	return disks, nil
}

// plugged reports whether the guest's view of rec is complete, all that plug makes: the device
// node, the sys/block directory with the serial and the number, the by-id link.
func plugged(r *os.Root, rec record) bool {
	fi, err := r.Lstat(rec.node())
	return err == nil && isBlockDevice(fi, rec.guestDev()) && hasSysDir(r, rec) && hasLink(r, rec)
}

// refreshSize updates the size the guest sees of a disk to that of the device it sees. A device
// that no longer exists keeps its last size.
func (d *Driver) refreshSize(r *os.Root, rec record) error {
	sectors, err := d.sectors(rec.guestNumber())
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	return writeSize(r, rec, sectors)
}
