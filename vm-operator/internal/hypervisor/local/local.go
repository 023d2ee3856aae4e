// Package local is the lab's hypervisor: a virtual machine is a directory on this machine, and
// hot-plugging a disk exposes the host block device inside that directory the way a Linux guest
// sees a virtio disk. The guest-csi node plugin of the VM runs on this machine with the VM
// directory as its root and finds the disk by serial exactly as it would inside a real VM; the
// device node carries the host device's number, so the plugin formats and mounts it for real.
//
// The VM directory <root>/<namespace>/<name> holds:
//
//	sys/block/vdX/serial             the serial and a newline, as the kernel writes it
//	sys/block/vdX/size               the size in 512-byte sectors, refreshed by Attach and Disks
//	sys/block/vdX/dev                "major:minor" of the host device, and a newline
//	dev/vdX                          a block device node with the host device's number
//	dev/disk/by-id/virtio-<serial>   a symbolic link to ../../vdX
//	.hypervisor/running              the power-state marker; it holds the VM's UID
//	var/lib/cloud/seed/nocloud/      user-data and meta-data of a VM started with bootstrap
//	                                 data (mode 0600), where cloud-init's NoCloud looks
//	.hypervisor/disks/<serial>.json  the record of a disk: its name vdX, host device and number,
//	                                 and for a throttled disk its limits and loop device
//	.hypervisor/frozen               the guest filesystems Freeze froze (freeze.go), for Thaw
//	.hypervisor/tmp/                 files being written, renamed into place when complete
//
// A disk attached with I/O limits is throttled (throttle.go): the guest sees it through a
// qemu-storage-daemon of its own, a loop device over the daemon's FUSE export, whose number
// dev/vdX and sys/block/vdX/dev then carry. The daemon's files are in
// <RunDir>/<serial>-<hash of the root and the VM>/:
//
//	qmp.sock   its QMP socket, over which SetLimits changes the limits live
//	qsd.pid    its pid file, which it keeps locked while it runs
//	disk       the regular file over which it mounts its FUSE export: the throttled disk
//
// The daemon needs /dev/fuse, and the loop devices /dev/loop-control and /dev/loopN.
//
// Disk names are allocated lowest-free first (vda … vdz, vdaa …) as the kernel does. The UID is
// recorded for people reading the directory; the VM is its namespace and name.
//
// The namespace must be a DNS label, the name a DNS subdomain and the serial 1 to 20 characters
// of [A-Za-z0-9_-], and every access to a VM goes through an os.Root on its directory: neither
// an argument nor a symbolic link planted in the directory leads the driver outside it.
//
// The directory is the only state, so a restarted driver reads it back. Every write is
// atomic against a crash of the process (a file or a sys/block directory is built under
// .hypervisor/tmp and renamed into place), and the steps are ordered so that a crash leaves
// nothing unaccounted for: Attach writes the record first, then the device node, then the
// sys/block directory (whose serial is what makes the disk visible), then the by-id link;
// Detach removes them in the opposite order and the record last. A throttled disk's daemon and
// loop device come after the record and before the device node (the record then gets the loop
// device's number), and go after the sys/block directory and before the record. A disk with a
// record is attached as far as PowerOff is concerned, complete or not: repeating Attach
// completes it (restarting a daemon that died, reusing one that runs), and Detach removes it.
//
// Writes are not synced to stable storage: the loop devices of the lab do not survive a reboot
// of the machine either.
package local

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sync"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"pvbridge.io/vm-operator/internal/hypervisor"
)

// Options configure a Driver.
type Options struct {
	// Root is the directory that holds one directory per VM, <Root>/<namespace>/<name>. It is
	// required, must be absolute, and must be on a filesystem that allows device nodes (not
	// mounted nodev). It is created if missing.
	Root string
	// Sysfs is where the host's sysfs is mounted, read for device sizes and holders.
	// Default /sys.
	Sysfs string
	// Slots is how many disks a VM holds at once when its VirtualMachine does not say
	// (hypervisor.VM.Slots). Default hypervisor.MaxSlots.
	Slots int
	// RunDir holds a directory per disk attached with limits, with the QMP socket, pid file
	// and FUSE export of the disk's qemu-storage-daemon. It must be absolute and at most 64
	// bytes long, so that the sockets' paths stay within the 107 bytes of a unix socket
	// address, and must not change across restarts of the agent, which finds the daemons
	// there. A tmpfs suits: the daemons do not survive a reboot. It is created when first
	// needed. Default /run/pvbridge/local.
	RunDir string
}

// Driver is the local hypervisor. It is safe for concurrent use; the operations on one VM are
// serialized, those on different VMs run in parallel. Only one Driver may act on a root at a
// time (one agent per host): two would not serialize against each other.
type Driver struct {
	root   string
	sysfs  string
	slots  int
	runDir string
	locks  vmLocks
}

var _ hypervisor.Driver = (*Driver)(nil)

// New validates opts and returns a Driver for the VMs under opts.Root.
func New(opts Options) (*Driver, error) {
	if !filepath.IsAbs(opts.Root) {
		return nil, fmt.Errorf("root %q must be an absolute path", opts.Root)
	}
	if opts.Sysfs == "" {
		opts.Sysfs = "/sys"
	}
	if opts.Slots == 0 {
		opts.Slots = hypervisor.MaxSlots
	}
	if opts.Slots < 0 || opts.Slots > hypervisor.MaxSlots {
		return nil, fmt.Errorf("slots %d: want 1 to %d", opts.Slots, hypervisor.MaxSlots)
	}
	if opts.RunDir == "" {
		opts.RunDir = "/run/pvbridge/local"
	}
	if !filepath.IsAbs(opts.RunDir) || len(filepath.Clean(opts.RunDir)) > maxRunDirLen {
		return nil, fmt.Errorf("run directory %q must be an absolute path of at most %d bytes", opts.RunDir, maxRunDirLen)
	}
	if err := os.MkdirAll(opts.Root, 0o755); err != nil {
		return nil, fmt.Errorf("create root: %w", err)
	}
	var st unix.Statfs_t
	if err := unix.Statfs(opts.Root, &st); err != nil {
		return nil, fmt.Errorf("statfs %s: %w", opts.Root, err)
	}
	if st.Flags&unix.ST_NODEV != 0 {
		return nil, fmt.Errorf("root %s is on a filesystem mounted nodev: guests could not open their disks", opts.Root)
	}
	return &Driver{root: filepath.Clean(opts.Root), sysfs: opts.Sysfs, slots: opts.Slots, runDir: filepath.Clean(opts.RunDir)}, nil
}

// Addresses implements hypervisor.Driver: a local VM has no NIC of its own (the lab's VMs get
// their network from whoever made their namespace).
func (d *Driver) Addresses(context.Context, hypervisor.VM) ([]string, error) { return nil, nil }

// Slots reports the VM's slots, vm.Slots or the driver's default, while it runs; 0 otherwise.
// The local driver has no hardware to count: the number is configuration, enforced by Attach.
func (d *Driver) Slots(ctx context.Context, vm hypervisor.VM) (int, error) {
	running, err := d.Running(ctx, vm)
	if err != nil || !running {
		return 0, err
	}
	return d.slotsOf(vm), nil
}

// slotsOf is how many disks vm holds at most.
func (d *Driver) slotsOf(vm hypervisor.VM) int {
	if vm.Slots > 0 {
		return min(vm.Slots, hypervisor.MaxSlots)
	}
	return d.slots
}

// Name returns "local".
func (d *Driver) Name() string { return "local" }

// PowerOn creates the VM directory with its device tree and marks the VM running.
func (d *Driver) PowerOn(ctx context.Context, vm hypervisor.VM) error {
	unlock, err := d.lock(ctx, vm)
	if err != nil {
		return err
	}
	defer unlock()
	r, err := d.createVM(vm)
	if err != nil {
		return fmt.Errorf("power on %s: %w", vmKey(vm), err)
	}
	defer r.Close()
	if uid, err := r.ReadFile(runningFile); err == nil && string(uid) == vm.UID+"\n" {
		return nil
	}
	// The seed before the power-state marker: a VM marked running has its bootstrap data.
	if vm.Bootstrap != nil {
		if err := writeSeed(r, vm.Bootstrap); err != nil {
			return fmt.Errorf("power on %s: bootstrap data: %w", vmKey(vm), err)
		}
	}
	if err := writeFile(r, runningFile, []byte(vm.UID+"\n")); err != nil {
		return fmt.Errorf("power on %s: %w", vmKey(vm), err)
	}
	klog.FromContext(ctx).V(2).Info("Powered on VM", "vm", klog.KRef(vm.Namespace, vm.Name), "uid", vm.UID)
	return nil
}

// Delete implements hypervisor.Driver: ForceOff; the VM's directory stays, as after a
// power-off.
func (d *Driver) Delete(ctx context.Context, vm hypervisor.VM) error {
	return d.ForceOff(ctx, vm)
}

// PowerOff marks the VM stopped. The guest of a local VM keeps what it mounted whatever its
// power state, so dropping its disks silently would report them detached while the guest still
// holds them: with disks attached (complete or not) PowerOff returns ErrBusy naming them, and
// the caller detaches them first.
func (d *Driver) PowerOff(ctx context.Context, vm hypervisor.VM) error {
	return d.powerOff(ctx, vm, false)
}

// ForceOff stops the VM as pulling its power would: the guest's mounts of its disks (which in
// the lab live in the host's mount table) are detached lazily, as a dead guest's would vanish,
// then the disks are unplugged (a throttled disk's daemon stopped) and the VM marked stopped. A
// device that something stacked on it still holds (a device-mapper or loop device of the
// guest) cannot be dropped: ErrBusy.
func (d *Driver) ForceOff(ctx context.Context, vm hypervisor.VM) error {
	return d.powerOff(ctx, vm, true)
}

func (d *Driver) powerOff(ctx context.Context, vm hypervisor.VM, force bool) error {
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
		return fmt.Errorf("power off %s: %w", vmKey(vm), err)
	}
	defer r.Close()
	records, err := readRecords(r)
	if err != nil {
		return fmt.Errorf("power off %s: %w", vmKey(vm), err)
	}
	if len(records) > 0 && !force {
		serials := make([]string, len(records))
		for i, rec := range records {
			serials[i] = rec.Serial
		}
		return fmt.Errorf("power off %s: %w: disks %q are attached; detach them first", vmKey(vm), hypervisor.ErrBusy, serials)
	}
	// A filesystem frozen by Freeze and then lazily unmounted would stay frozen with no mount
	// to thaw it through: thaw first.
	if err := d.thawFrozen(ctx, r, vm); err != nil {
		return fmt.Errorf("force off %s: %w", vmKey(vm), err)
	}
	for _, rec := range records {
		if err := d.pullDisk(ctx, r, vm, rec); err != nil {
			return fmt.Errorf("force off %s: disk %s: %w", vmKey(vm), rec.Serial, err)
		}
	}
	if err := removeIfExists(r, runningFile); err != nil {
		return fmt.Errorf("power off %s: %w", vmKey(vm), err)
	}
	klog.FromContext(ctx).V(2).Info("Powered off VM", "vm", klog.KRef(vm.Namespace, vm.Name), "forced", force, "disksPulled", len(records))
	return nil
}

// Running reports whether the VM's power-state marker exists.
func (d *Driver) Running(_ context.Context, vm hypervisor.VM) (bool, error) {
	if err := validateVM(vm); err != nil {
		return false, err
	}
	r, err := d.openVM(vm)
	if errors.Is(err, fs.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("read power state of %s: %w", vmKey(vm), err)
	}
	defer r.Close()
	return isRunning(r)
}

// isRunning reports whether the VM whose directory is r runs.
func isRunning(r *os.Root) (bool, error) {
	_, err := r.Stat(runningFile)
	if errors.Is(err, fs.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("read power state: %w", err)
	}
	return true, nil
}

// openVM opens the directory of vm, which must exist. Every access to the VM goes through the
// returned Root, so that nothing in the directory (a symbolic link a guest planted) can make the
// driver act outside it.
func (d *Driver) openVM(vm hypervisor.VM) (*os.Root, error) {
	top, err := os.OpenRoot(d.root)
	if err != nil {
		return nil, err
	}
	defer top.Close()
	return top.OpenRoot(filepath.Join(vm.Namespace, vm.Name))
}

// createVM opens the directory of vm, creating it and its skeleton as needed.
func (d *Driver) createVM(vm hypervisor.VM) (*os.Root, error) {
	top, err := os.OpenRoot(d.root)
	if err != nil {
		return nil, err
	}
	defer top.Close()
	dir := filepath.Join(vm.Namespace, vm.Name)
	if err := top.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	r, err := top.OpenRoot(dir)
	if err != nil {
		return nil, err
	}
	if err := makeSkeleton(r); err != nil {
		_ = r.Close()
		return nil, err
	}
	return r, nil
}

// lock validates vm and takes its lock, waiting at most until ctx is done.
func (d *Driver) lock(ctx context.Context, vm hypervisor.VM) (unlock func(), err error) {
	if err := validateVM(vm); err != nil {
		return nil, err
	}
	return d.locks.lock(ctx, vmKey(vm))
}

// vmKey names vm in locks and messages.
func vmKey(vm hypervisor.VM) string { return vm.Namespace + "/" + vm.Name }

// vmLocks serializes the operations on each VM. A waiter gives up when its context is done.
// Locks are never freed: there is one per VM this agent ever handled, a few bytes each.
type vmLocks struct {
	mu    sync.Mutex
	locks map[string]chan struct{}
}

func (l *vmLocks) lock(ctx context.Context, key string) (unlock func(), err error) {
	l.mu.Lock()
	if l.locks == nil {
		l.locks = make(map[string]chan struct{})
	}
	ch, ok := l.locks[key]
	if !ok {
		ch = make(chan struct{}, 1)
		l.locks[key] = ch
	}
	l.mu.Unlock()
	select {
	case ch <- struct{}{}:
		return func() { <-ch }, nil
	case <-ctx.Done():
		return nil, fmt.Errorf("wait for another operation on VM %s: %w", key, context.Cause(ctx))
	}
}
