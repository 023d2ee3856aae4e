package local

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"pvbridge.io/pkg/qsd"
	"pvbridge.io/vm-operator/internal/hypervisor"
)

// A disk attached with limits is throttled: the guest sees it through a qemu-storage-daemon of
// its own, because QEMU's block layer limits a disk's I/O and changes the limits live, while
// the host's cgroup v1 blkio throttling cannot limit the pods of a VM (it is not hierarchical):
//
//	host device → host_device node → throttle node (throttle group) → FUSE export, a file
//	→ loop device over that file → dev/vdX and sys/block/vdX of the VM
//
// The daemon runs with --daemonize in a session of its own, so it outlives the agent. Its files
// are in a directory of its own, daemonDir, named after the driver's root, the VM and the
// serial: a restarted agent finds the daemon there (the holder of the lock on its pid file),
// and the loop device by its backing file in sysfs. Neither is taken from the disk's record,
// which lives in the VM's directory: the driver acts on no host object that a file there names.

// exportFile, in a daemon's directory, is the regular file over which the daemon mounts its
// FUSE export: the disk.
const exportFile = "disk"

// Names inside the daemon.
const (
	throttleGroup = "limits"
	throttleNode  = "throttle"
)

// Bounds of Options.RunDir: the daemon's directory adds at most a serial, a dash and
// daemonHashLen hexadecimal digits.
const (
	daemonHashLen = 12
	maxRunDirLen  = qsd.MaxDirLen - len("/") - hypervisor.MaxSerialLength - len("-") - daemonHashLen
)

// daemonDir is the directory of a throttled disk's daemon.
type daemonDir = qsd.Dir

// daemonDir returns the directory of the daemon of the disk with serial in vm:
// <RunDir>/<serial>-<hash>, the hash being that of the driver's root and the VM, so that
// drivers on different roots can share a run directory (the lab's hosts on one machine).
func (d *Driver) daemonDir(vm hypervisor.VM, serial string) daemonDir {
	sum := sha256.Sum256([]byte(d.root + "\x00" + vmKey(vm)))
	return daemonDir(filepath.Join(d.runDir, serial+"-"+hex.EncodeToString(sum[:])[:daemonHashLen]))
}

// throttle brings up what the guest's view of the throttled disk rec rests on: its daemon,
// started with limits or set to them if it runs, and the loop device over its export, both
// grown to the host device's size. It returns rec with those limits and the loop device's
// number, stored.
func (d *Driver) throttle(ctx context.Context, r *os.Root, vm hypervisor.VM, rec record, limits hypervisor.Limits) (record, error) {
	dd := d.daemonDir(vm, rec.Serial)
	q, err := d.daemon(ctx, dd, rec.Device, limits)
	if err != nil {
		return record{}, err
	}
	defer q.Close()
	if err := setLimits(q, limits); err != nil {
		return record{}, err
	}
	loop, err := d.loopOver(dd.Path(exportFile))
	if err != nil {
		return record{}, err
	}
	if err := d.followSize(ctx, q, dd, rec, loop); err != nil {
		return record{}, err
	}
	t := throttle{
		IOPS: limits.IOPS, BytesPerSecond: limits.BytesPerSecond,
		LoopMajor: unix.Major(loop.dev), LoopMinor: unix.Minor(loop.dev),
	}
	if *rec.Throttle == t {
		return rec, nil
	}
	rec.Throttle = &t
	return rec, writeRecord(r, rec)
}

// daemon returns a connection to the daemon of dd, which it starts, with device and limits,
// if it does not run, after clearing away what a dead one left.
func (d *Driver) daemon(ctx context.Context, dd daemonDir, device string, limits hypervisor.Limits) (*qsd.Conn, error) {
	pid, err := qsd.Pid(dd)
	if err != nil {
		return nil, err
	}
	if pid == 0 {
		if err := d.stopThrottle(ctx, dd); err != nil {
			return nil, err
		}
		if err := startDaemon(ctx, dd, device, limits); err != nil {
			return nil, err
		}
		klog.FromContext(ctx).V(2).Info("Started qemu-storage-daemon", "dir", string(dd), "device", device)
	}
	return qsd.Dial(ctx, dd)
}

// startDaemon starts the daemon of dd over device, with limits, exporting it as FUSE.
func startDaemon(ctx context.Context, dd daemonDir, device string, limits hypervisor.Limits) error {
	if err := os.MkdirAll(string(dd), 0o700); err != nil {
		return fmt.Errorf("create the daemon's directory: %w", err)
	}
	f, err := os.OpenFile(dd.Path(exportFile), os.O_CREATE|os.O_WRONLY, 0o600)
	if err != nil {
		return fmt.Errorf("create the daemon's export file: %w", err)
	}
	_ = f.Close()
	group, err := json.Marshal(map[string]any{"qom-type": "throttle-group", "id": throttleGroup, "limits": qmpLimits(limits)})
	if err != nil {
		return err
	}
	return qsd.Start(ctx, dd,
		"--object", string(group),
		// Direct I/O: what the guest wrote is on the device, not in the daemon's page cache,
		// when the host reads the device (a snapshot).
		"--blockdev", "driver=host_device,node-name=device,cache.direct=on,filename="+qsd.OptValue(device),
		"--blockdev", "driver=throttle,node-name="+throttleNode+",throttle-group="+throttleGroup+",file=device",
		"--export", "type=fuse,id=export,node-name="+throttleNode+",writable=on,mountpoint="+qsd.OptValue(dd.Path(exportFile)),
	)
}

// qmpLimits are limits as a throttle group's limits property takes them.
func qmpLimits(l hypervisor.Limits) map[string]int64 {
	return map[string]int64{"iops-total": l.IOPS, "bps-total": l.BytesPerSecond}
}

// setLimits sets the limits of the daemon's throttle group, which apply to the requests that
// follow.
func setLimits(q *qsd.Conn, l hypervisor.Limits) error {
	return q.Execute("qom-set", map[string]any{"path": "/objects/" + throttleGroup, "property": "limits", "value": qmpLimits(l)}, nil)
}

// stopThrottle releases whatever is left of what a throttled disk holds on the host, in this
// order: the loop devices over the daemon's export (the kernel detaches one that is still open
// when its last user closes it), the daemon, which unmounts its export as it exits, the
// export's mount that a killed daemon left, and the directory.
func (d *Driver) stopThrottle(ctx context.Context, dd daemonDir) error {
	if err := d.detachLoops(dd.Path(exportFile)); err != nil {
		return err
	}
	if err := qsd.Stop(ctx, dd); err != nil {
		return err
	}
	if err := qsd.UnmountAll(dd.Path(exportFile)); err != nil {
		return err
	}
	if err := os.RemoveAll(string(dd)); err != nil {
		return fmt.Errorf("remove the daemon's directory: %w", err)
	}
	return nil
}

// loopDevice is a loop device: its name in /dev and its number.
type loopDevice struct {
	name string
	dev  uint64
}

// loopOver returns the loop device over file, attaching one if there is none.
func (d *Driver) loopOver(file string) (loopDevice, error) {
	loops, err := d.loopsOver(file)
	if err != nil {
		return loopDevice{}, err
	}
	if len(loops) > 0 {
		return loops[0], nil
	}
	return attachLoop(file)
}

// loopsOver lists the loop devices whose backing file is file, from sysfs.
func (d *Driver) loopsOver(file string) ([]loopDevice, error) {
	backing, err := filepath.Glob(filepath.Join(d.sysfs, "block", "loop*", "loop", "backing_file"))
	if err != nil {
		return nil, err
	}
	var loops []loopDevice
	for _, b := range backing {
		data, err := os.ReadFile(b)
		if err != nil || strings.TrimSuffix(string(data), "\n") != file {
			continue // detached meanwhile, or over another file
		}
		dir := filepath.Dir(filepath.Dir(b))
		dev, err := readDev(filepath.Join(dir, "dev"))
		if err != nil {
			return nil, err
		}
		loops = append(loops, loopDevice{name: filepath.Base(dir), dev: dev})
	}
	return loops, nil
}

// readDev reads a sysfs dev file, "major:minor" and a newline.
func readDev(name string) (uint64, error) {
	data, err := os.ReadFile(name)
	if err != nil {
		return 0, err
	}
	major, minor, ok := strings.Cut(strings.TrimSpace(string(data)), ":")
	ma, errMajor := strconv.ParseUint(major, 10, 32)
	mi, errMinor := strconv.ParseUint(minor, 10, 32)
	if !ok || errMajor != nil || errMinor != nil {
		return 0, fmt.Errorf("parse %s: %q is not major:minor", name, data)
	}
	return unix.Mkdev(uint32(ma), uint32(mi)), nil
}

// attachLoop attaches a new loop device to file. Not with direct I/O: the loop device would then
// send the daemon concurrent writes, and QEMU 7.2's FUSE export corrupts data when a write
// arrives while another waits in the throttle node (both use one request buffer; QEMU fixed it
// in 2025, "fuse: Copy write buffer content before polling"). Without it, the loop device
// writes synchronously, which the kernel serializes on the FUSE file (the export does not allow
// parallel direct writes); and the export opens the file with direct_io, so that no page cache
// under the loop device's own serves reads that the daemon would not count.
func attachLoop(file string) (loopDevice, error) {
	back, err := os.OpenFile(file, os.O_RDWR, 0)
	if err != nil {
		return loopDevice{}, fmt.Errorf("open the daemon's export: %w", err)
	}
	defer back.Close()
	ctl, err := os.OpenFile("/dev/loop-control", os.O_RDWR, 0)
	if err != nil {
		return loopDevice{}, err
	}
	defer ctl.Close()
	// Another process may configure the free device first: LOOP_CONFIGURE then fails with
	// EBUSY, and the next free one is tried.
	for range 10 {
		n, err := unix.IoctlRetInt(int(ctl.Fd()), unix.LOOP_CTL_GET_FREE)
		if err != nil {
			return loopDevice{}, fmt.Errorf("find a free loop device: %w", err)
		}
		loop, err := configureLoop("/dev/loop"+strconv.Itoa(n), back)
		if !errors.Is(err, unix.EBUSY) {
			return loop, err
		}
	}
	return loopDevice{}, errors.New("find a free loop device: others took every one found")
}

// configureLoop makes the loop device at path a loop over back.
func configureLoop(path string, back *os.File) (loopDevice, error) {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return loopDevice{}, err
	}
	defer f.Close()
	cfg := unix.LoopConfig{Fd: uint32(back.Fd())} //nolint:gosec // a descriptor fits
	copy(cfg.Info.File_name[:], back.Name())
	if err := unix.IoctlLoopConfigure(int(f.Fd()), &cfg); err != nil {
		return loopDevice{}, fmt.Errorf("attach %s to the daemon's export: %w", path, err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return loopDevice{}, err
	}
	return loopDevice{name: filepath.Base(path), dev: st.Rdev}, nil
}

// detachLoops detaches the loop devices over file. The kernel detaches one that is open at
// once when this was its last user, else when its last user closes it.
func (d *Driver) detachLoops(file string) error {
	loops, err := d.loopsOver(file)
	if err != nil {
		return err
	}
	for _, l := range loops {
		if err := detachLoop(l); err != nil {
			return err
		}
	}
	return nil
}

func detachLoop(l loopDevice) error {
	f, err := os.OpenFile("/dev/"+l.name, os.O_RDWR, 0)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	defer f.Close()
	if err := unix.IoctlSetInt(int(f.Fd()), unix.LOOP_CLR_FD, 0); err != nil && !errors.Is(err, unix.ENXIO) {
		return fmt.Errorf("detach %s: %w", f.Name(), err)
	}
	return nil
}

// throttled returns the loop device of the throttled disk rec and whether the guest can use
// the disk: its daemon runs, and the loop device that the guest's node carries is over the
// daemon's export.
func (d *Driver) throttled(vm hypervisor.VM, rec record) (loopDevice, bool, error) {
	dd := d.daemonDir(vm, rec.Serial)
	pid, err := qsd.Pid(dd)
	if err != nil || pid == 0 {
		return loopDevice{}, false, err
	}
	sys := filepath.Join(d.sysfs, "dev", "block", rec.guestNumber())
	backing, err := os.ReadFile(filepath.Join(sys, "loop", "backing_file"))
	if err != nil || strings.TrimSuffix(string(backing), "\n") != dd.Path(exportFile) {
		return loopDevice{}, false, nil
	}
	target, err := os.Readlink(sys)
	if err != nil {
		return loopDevice{}, false, nil
	}
	return loopDevice{name: filepath.Base(target), dev: rec.guestDev()}, true, nil
}

// followSize grows the loop device of the throttled disk rec to the size of its host device
// when that grew (its volume was expanded). QEMU's host_device node keeps the length it found
// when it opened the device, so the daemon's nodes are resized to the device's (block_resize,
// which a host device accepts up to its real size); then the kernel reads again the size of
// the FUSE file, which it caches, and the loop device's capacity is set from it. q is a
// connection to the daemon, or nil to make one if needed.
func (d *Driver) followSize(ctx context.Context, q *qsd.Conn, dd daemonDir, rec record, loop loopDevice) error {
	want, err := d.sectors(rec.number())
	if errors.Is(err, fs.ErrNotExist) {
		return nil // the device is gone: the guest keeps the last size
	}
	if err != nil {
		return err
	}
	have, err := d.sectors(formatDev(loop.dev))
	if err != nil || have >= want {
		return err
	}
	if q == nil {
		if q, err = qsd.Dial(ctx, dd); err != nil {
			return err
		}
		defer q.Close()
	}
	if err := q.Execute("block_resize", map[string]any{"node-name": throttleNode, "size": want * 512}, nil); err != nil {
		return err
	}
	var stx unix.Statx_t
	if err := unix.Statx(unix.AT_FDCWD, dd.Path(exportFile), unix.AT_STATX_FORCE_SYNC, unix.STATX_SIZE, &stx); err != nil {
		return fmt.Errorf("read the size of the daemon's export: %w", err)
	}
	f, err := os.Open("/dev/" + loop.name)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := unix.IoctlSetInt(int(f.Fd()), unix.LOOP_SET_CAPACITY, 0); err != nil {
		return fmt.Errorf("grow %s: %w", f.Name(), err)
	}
	klog.FromContext(ctx).V(2).Info("Grew throttled disk", "serial", rec.Serial, "guestDevice", loop.name, "sectors", want)
	return nil
}

// SetLimits changes the limits of a throttled disk live, with qom-set of its daemon's throttle
// group, then records them for Disks: the daemon first, so that Disks never reports limits
// that are not enforced. A disk attached without limits has no daemon: ErrNotLive. A disk
// whose daemon does not run is an error; Attach restarts the daemon.
func (d *Driver) SetLimits(ctx context.Context, vm hypervisor.VM, serial string, limits hypervisor.Limits) error {
	if err := validateSerial(serial); err != nil {
		return err
	}
	if limits.IOPS < 0 || limits.BytesPerSecond < 0 {
		return fmt.Errorf("%w: negative I/O limits (%d IOPS, %d bytes/s)", errInvalid, limits.IOPS, limits.BytesPerSecond)
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
	wrap := func(err error) error {
		return fmt.Errorf("set the I/O limits of disk %s of %s: %w", serial, vmKey(vm), err)
	}
	rec, found, err := readRecord(r, serial)
	switch {
	case err != nil:
		return wrap(err)
	case !found:
		return wrap(errors.New("no disk with that serial is attached"))
	case rec.Throttle == nil:
		return wrap(fmt.Errorf("%w: it was attached without limits, its device passed straight to the guest", hypervisor.ErrNotLive))
	}
	dd := d.daemonDir(vm, serial)
	switch pid, err := qsd.Pid(dd); {
	case err != nil:
		return wrap(err)
	case pid == 0:
		return wrap(errors.New("its qemu-storage-daemon does not run; attaching the disk again restarts it"))
	}
	q, err := qsd.Dial(ctx, dd)
	if err != nil {
		return wrap(err)
	}
	defer q.Close()
	if err := setLimits(q, limits); err != nil {
		return wrap(err)
	}
	if t := *rec.Throttle; t.IOPS != limits.IOPS || t.BytesPerSecond != limits.BytesPerSecond {
		t.IOPS, t.BytesPerSecond = limits.IOPS, limits.BytesPerSecond
		rec.Throttle = &t
		if err := writeRecord(r, rec); err != nil {
			return wrap(err)
		}
	}
	klog.FromContext(ctx).V(2).Info("Set disk I/O limits", "vm", klog.KRef(vm.Namespace, vm.Name), "serial", serial, "limits", limits.String())
	return nil
}
