// Package qemu is the hypervisor.Driver for QEMU: each VM is a qemu-system-x86_64 process that
// the driver starts, and disks are hot-plugged into it over QMP as virtio-blk-pci devices.
//
// A VM lives in its own directory, <RunDir>/<namespace>_<name>/, which holds QEMU's QMP socket
// (qmp.sock), pid file (qemu.pid), output (qemu.log) and serial console (serial.sock, with a
// copy of all output in serial.log). The driver keeps no state of its own: whether a VM runs and
// which disks it holds are always read from QEMU through that socket, so a restarted agent
// converges. QEMU runs in its own session and outlives the agent.
//
// Hot-plug uses native PCIe hot-plug on pre-created pcie-root-ports (one per disk the VM may
// hold at once), because then an unplug completes at once when no guest OS drives the slot; a
// Linux guest releases a disk about 6 s after the unplug request (pciehp's attention-button
// delay). See reference/qemu-hotplug.md for the measurements behind these choices.
package qemu

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"pvbridge.io/vm-operator/internal/hypervisor"
)

// Name is the driver's name.
const Name = "qemu"

// Files in a VM's directory.
const (
	qmpSocket    = "qmp.sock"
	pidFile      = "qemu.pid"
	logFile      = "qemu.log"
	serialSocket = "serial.sock"
	// guestAgentSocket is QEMU's end of the guest agent's virtio-serial port.
	guestAgentSocket = "qga.sock"
	serialLog        = "serial.log"
	// seedDir holds the VM's NoCloud seed (user-data, meta-data), which QEMU's vvfat driver
	// shows the guest as a read-only FAT disk labelled CIDATA, where cloud-init looks.
	seedDir = "seed"
	// seedID is the QOM id and node name of that disk; Disks does not list it (not devicePrefix).
	seedID = "pvb-seed"
	// bootDisk is the VM's copy-on-write overlay of its image, its boot disk, with QOM id
	// and node name bootID.
	bootDisk = "disk.qcow2"
	bootID   = "pvb-boot"
	// nicID is the QOM id of the VM's NIC and of its network backend.
	nicID = "pvb-nic0"
)

// maxSocketPath is the longest path a unix socket can have on Linux (sun_path less its NUL).
const maxSocketPath = 107

// Options configure the driver. The zero value of a field picks its default.
type Options struct {
	// RunDir holds one directory per VM (required; at most 60 characters, so that socket
	// paths stay within the unix socket limit).
	RunDir string
	// Binary is the QEMU system emulator; default qemu-system-x86_64, looked up in PATH.
	Binary string
	// Accel is "kvm" or "tcg"; default kvm only if the CPU has hardware virtualization (vmx or
	// svm in /proc/cpuinfo) and /dev/kvm exists. /dev/kvm alone is not enough: a software
	// backend (kvm_pvm) cannot run Linux guests at a useful speed.
	Accel string
	// MemoryMiB is the memory of a VM whose hypervisor.VM does not say; default 256.
	MemoryMiB int
	// CPUs is the number of vCPUs of a VM whose hypervisor.VM does not say; default 1.
	CPUs int
	// HotplugPorts is the number of pcie-root-ports created at power-on when the VM does not
	// ask for a number (hypervisor.VM.Slots): the most disks a VM can hold at once. Default 16,
	// at most 64.
	HotplugPorts int
	// Kernel, Initrd and Append boot a Linux kernel directly (-kernel, -initrd, -append).
	// Without Kernel the firmware boots whatever ExtraArgs provide.
	Kernel, Initrd, Append string
	// Image, when set, is the boot disk of every VM: a qcow2 image (hack/build-node-image.sh
	// builds pvbridge's node image) that the driver never writes. A VM boots from an overlay of
	// its own, disk.qcow2 in its directory, made with qemu-img at its first power-on and kept
	// while the VM exists (a restarted VM keeps what its guest wrote).
	Image string
	// ImageDir is the host's image store: one directory per image, named as VirtualMachine
	// spec.image names it, holding disk.qcow2 and, for a direct kernel boot, vmlinuz with
	// initrd.img and cmdline (hack/build-node-image.sh makes one). A VM that names an image
	// boots it instead of Image, Kernel, Initrd and Append; one whose image is not there is not
	// started (hypervisor.ErrImageNotFound).
	ImageDir string
	// Network gives each VM a virtio NIC, its MAC derived from its UID: "user" on QEMU's
	// user-mode network, where the guest reaches the host's 127.0.0.1 at 10.0.2.2 and nothing
	// reaches the guest; "bridge:<name>" on the host's Linux bridge <name> through a tap device of
	// its own (pvb + 12 hex digits of its UID's hash), where the guest is a machine of the
	// bridge's network, addressed as that network addresses its machines (DHCP). "" gives none.
	Network string
	// NetNS, when set, is the network namespace QEMU runs in (and its tap is made in), a
	// /proc/<pid>/ns/net or /run/netns/<name> file: /proc/1/ns/net, the host's, for an agent in a
	// pod of its own network (with the host's PID namespace), whose network would go with the
	// pod and leave the VMs without one. Empty: the agent's.
	NetNS string
	// ExtraArgs are appended to QEMU's command line, e.g. a network device of another kind.
	ExtraArgs []string
	// UnplugTimeout is how long Detach waits for the guest to release a disk before it returns
	// ErrBusy (the caller's context may cut it shorter). Default 10s: a Linux guest takes about
	// 6.2 s under native PCIe hot-plug.
	UnplugTimeout time.Duration
	// ShutdownGracePeriod is how long PowerOff lets the guest shut down after pressing the ACPI
	// power button; then, or at once when zero (the default), QEMU is stopped.
	ShutdownGracePeriod time.Duration
	// CgroupParent, when set, puts each VM's QEMU in a cgroup of its own,
	// <CgroupParent>/<namespace>_<name>, in every hierarchy of the cgroup filesystem at
	// CgroupRoot (default /sys/fs/cgroup), and removes it when the VM stops. Then the VM's
	// memory is not charged to the agent's container, and a container runtime that kills every
	// process of the agent's container (its cgroup) does not kill the VMs: the agent's pod must
	// share the host's PID namespace too, whose end would kill them otherwise. Empty: QEMU
	// stays in the agent's cgroup.
	CgroupParent, CgroupRoot string
	// StopTimeout bounds how long PowerOff waits for QEMU to exit after `quit` before it kills
	// the process; default 10s.
	StopTimeout time.Duration
}

// Driver is the QEMU hypervisor driver. It is safe for concurrent use.
type Driver struct {
	opts    Options
	meminfo string // /proc/meminfo, where checkMemory reads MemAvailable

	mu  sync.Mutex // guards vms
	vms map[string]*vmState
}

var _ hypervisor.Driver = (*Driver)(nil)

// vmState is what the driver keeps about a VM between calls: locks, an open QMP connection and,
// if this driver started QEMU, the child process to reap. None of it is the VM's state.
type vmState struct {
	name string // namespace/name, for messages
	dir  string

	// mu serializes changes: power-on and power-off, and the device changes of Attach (which
	// picks a free port) and Detach. Detach does not hold it while it waits for the guest.
	mu sync.Mutex

	monMu sync.Mutex // guards mon, proc, ports and portsOf
	mon   *Monitor
	proc  *process
	// ports is how many hot-plug ports the QEMU behind the monitor portsOf was started with:
	// fixed for the life of a process, so read once per connection.
	ports   int
	portsOf *Monitor
	// cgroupPid is the QEMU that joinCgroup moved into the VM's cgroup; guarded by mu.
	cgroupPid int
}

// New returns a driver configured by opts.
func New(opts Options) (*Driver, error) {
	if opts.RunDir == "" {
		return nil, errors.New("qemu: RunDir is required")
	}
	runDir, err := filepath.Abs(opts.RunDir)
	if err != nil {
		return nil, fmt.Errorf("qemu: RunDir: %w", err)
	}
	if len(runDir) > 60 {
		return nil, fmt.Errorf("qemu: RunDir %s is longer than 60 characters: its sockets would exceed the unix socket path limit", runDir)
	}
	opts.RunDir = runDir
	if opts.Binary == "" {
		opts.Binary = "qemu-system-x86_64"
	}
	for name, path := range map[string]*string{"Image": &opts.Image, "ImageDir": &opts.ImageDir} {
		if *path != "" {
			if *path, err = filepath.Abs(*path); err != nil {
				return nil, fmt.Errorf("qemu: %s: %w", name, err)
			}
		}
	}
	if br := bridgeOf(opts.Network); opts.Network != "" && opts.Network != "user" && (br == "" || len(br) > 15) {
		return nil, fmt.Errorf("qemu: Network %q: want user, bridge:<name of at most 15 characters> or none", opts.Network)
	}
	switch opts.Accel {
	case "":
		opts.Accel = detectAccel()
	case "kvm", "tcg":
	default:
		return nil, fmt.Errorf("qemu: Accel %q: want kvm or tcg", opts.Accel)
	}
	if opts.MemoryMiB == 0 {
		opts.MemoryMiB = 256
	}
	if opts.CPUs == 0 {
		opts.CPUs = 1
	}
	if opts.HotplugPorts == 0 {
		opts.HotplugPorts = 16
	}
	if opts.HotplugPorts < 0 || opts.HotplugPorts > 64 {
		return nil, fmt.Errorf("qemu: HotplugPorts %d: want 1 to 64", opts.HotplugPorts)
	}
	if opts.MemoryMiB < 0 || opts.CPUs < 0 {
		return nil, errors.New("qemu: MemoryMiB and CPUs must not be negative")
	}
	if opts.UnplugTimeout == 0 {
		opts.UnplugTimeout = 10 * time.Second
	}
	if opts.StopTimeout == 0 {
		opts.StopTimeout = 10 * time.Second
	}
	if opts.CgroupRoot == "" {
		opts.CgroupRoot = "/sys/fs/cgroup"
	}
	if opts.CgroupParent != "" && (filepath.IsAbs(opts.CgroupParent) || !filepath.IsLocal(opts.CgroupParent)) {
		return nil, fmt.Errorf("qemu: CgroupParent %q: want a path relative to the cgroup root", opts.CgroupParent)
	}
	return &Driver{opts: opts, meminfo: "/proc/meminfo", vms: map[string]*vmState{}}, nil
}

// Name implements hypervisor.Driver.
func (d *Driver) Name() string { return Name }

// Close closes the driver's QMP connections. The VMs keep running.
func (d *Driver) Close() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, v := range d.vms {
		v.monMu.Lock()
		if v.mon != nil {
			_ = v.mon.Close()
			v.mon = nil
		}
		v.monMu.Unlock()
	}
	return nil
}

// Dir is the directory of vm's QEMU files.
func (d *Driver) Dir(vm hypervisor.VM) string {
	return filepath.Join(d.opts.RunDir, dirName(d.opts.RunDir, vm))
}

// dirName is <namespace>_<name> ('_' occurs in neither), shortened with a hash when a socket
// path in it would be too long.
func dirName(runDir string, vm hypervisor.VM) string {
	base := vm.Namespace + "_" + vm.Name
	room := maxSocketPath - len(runDir) - len("/") - len("/"+serialSocket)
	if len(base) <= room {
		return base
	}
	sum := sha256.Sum256([]byte(vm.Namespace + "/" + vm.Name))
	suffix := "-" + hex.EncodeToString(sum[:6])
	return base[:room-len(suffix)] + suffix
}

// state returns what the driver keeps about vm.
func (d *Driver) state(vm hypervisor.VM) (*vmState, error) {
	for _, s := range []string{vm.Namespace, vm.Name} {
		if s == "" || s == "." || s == ".." || strings.ContainsAny(s, "/_\x00") {
			return nil, fmt.Errorf("qemu: invalid VM %s/%s", vm.Namespace, vm.Name)
		}
	}
	key := vm.Namespace + "/" + vm.Name
	d.mu.Lock()
	defer d.mu.Unlock()
	v, ok := d.vms[key]
	if !ok {
		v = &vmState{name: key, dir: d.Dir(vm)}
		d.vms[key] = v
	}
	return v, nil
}

func (v *vmState) path(file string) string { return filepath.Join(v.dir, file) }

// monitor returns an open QMP connection to vm's QEMU, or ErrVMNotFound if none serves its
// socket.
func (v *vmState) monitor(ctx context.Context) (*Monitor, error) {
	v.monMu.Lock()
	defer v.monMu.Unlock()
	if v.mon != nil {
		if v.mon.Err() == nil {
			return v.mon, nil
		}
		v.mon = nil
	}
	mon, err := Dial(ctx, v.path(qmpSocket))
	if err != nil {
		if isNotServing(err) {
			return nil, fmt.Errorf("%w: no QEMU serves VM %s", hypervisor.ErrVMNotFound, v.name)
		}
		return nil, fmt.Errorf("VM %s: %w", v.name, err)
	}
	v.mon = mon
	return mon, nil
}

// forget drops the connection and the process of a QEMU that exited.
func (v *vmState) forget() {
	v.monMu.Lock()
	defer v.monMu.Unlock()
	if v.mon != nil {
		_ = v.mon.Close()
		v.mon = nil
	}
	v.proc = nil
}

// Running implements hypervisor.Driver: a VM runs while its QEMU process answers QMP, whatever
// the guest does (a QEMU process holds its disks also while paused or before the guest boots).
func (d *Driver) Running(ctx context.Context, vm hypervisor.VM) (bool, error) {
	v, err := d.state(vm)
	if err != nil {
		return false, err
	}
	// A cached connection may belong to a QEMU that exited since: then ask once more, to tell
	// a restart from an exit.
	for attempt := 0; ; attempt++ {
		mon, err := v.monitor(ctx)
		if errors.Is(err, hypervisor.ErrVMNotFound) {
			return false, nil
		}
		if err != nil {
			return false, err
		}
		err = mon.Execute(ctx, "query-status", nil, nil)
		if err == nil {
			return true, nil
		}
		if !errors.Is(err, ErrMonitorClosed) || attempt > 0 {
			return false, fmt.Errorf("VM %s: %w", v.name, err)
		}
	}
}

// PowerOn implements hypervisor.Driver: it starts QEMU unless a QEMU serves the VM's socket.
// It returns once QMP answers; the guest boots on its own.
func (d *Driver) PowerOn(ctx context.Context, vm hypervisor.VM) error {
	v, err := d.state(vm)
	if err != nil {
		return err
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	_, err = v.monitor(ctx)
	if err == nil {
		return d.joinCgroup(v, readPid(v.path(pidFile)))
	}
	if !errors.Is(err, hypervisor.ErrVMNotFound) {
		return err // we cannot tell
	}
	return d.start(ctx, v, vm)
}

// PowerOff implements hypervisor.Driver: after ShutdownGracePeriod (if any) it stops QEMU with
// `quit`, and kills it if it has not exited within StopTimeout. It returns once the process is
// gone, so that no disk is held any more.
func (d *Driver) PowerOff(ctx context.Context, vm hypervisor.VM) error {
	return d.powerOff(ctx, vm, d.opts.ShutdownGracePeriod)
}

// Delete implements hypervisor.Driver: ForceOff, then the VM's directory goes, with its boot
// disk overlay, its logs and its console log. A VM of the name that was powered on since (a new
// one) keeps them.
func (d *Driver) Delete(ctx context.Context, vm hypervisor.VM) error {
	if err := d.powerOff(ctx, vm, 0); err != nil {
		return err
	}
	v, err := d.state(vm)
	if err != nil {
		return err
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	switch _, err := v.monitor(ctx); {
	case err == nil:
		return nil
	case !errors.Is(err, hypervisor.ErrVMNotFound):
		return err
	}
	// A QEMU that ended on its own (its guest powered off) left its cgroup.
	if err := d.removeCgroup(ctx, v); err != nil {
		return err
	}
	if err := os.RemoveAll(v.dir); err != nil {
		return fmt.Errorf("VM %s: remove its files: %w", v.name, err)
	}
	return nil
}

// lockRunning locks vm's state and connects to its monitor, for a call that has nothing to do
// when QEMU does not run: mon is nil then, and nothing is locked. Otherwise unlock unlocks.
func (d *Driver) lockRunning(ctx context.Context, vm hypervisor.VM) (v *vmState, mon *Monitor, unlock func(), err error) {
	if v, err = d.state(vm); err != nil {
		return nil, nil, nil, err
	}
	v.mu.Lock()
	mon, err = v.monitor(ctx)
	if err != nil {
		v.mu.Unlock()
		if errors.Is(err, hypervisor.ErrVMNotFound) {
			err = nil
		}
		return nil, nil, nil, err
	}
	return v, mon, v.mu.Unlock, nil
}

// ForceOff quits QEMU at once, without asking the guest to shut down: every disk goes with the
// process.
func (d *Driver) ForceOff(ctx context.Context, vm hypervisor.VM) error {
	return d.powerOff(ctx, vm, 0)
}

// powerOff asks the guest to power down and gives it grace (none: 0) before it quits QEMU.
func (d *Driver) powerOff(ctx context.Context, vm hypervisor.VM, grace time.Duration) error {
	v, mon, unlock, err := d.lockRunning(ctx, vm)
	if err != nil || mon == nil {
		return err
	}
	defer unlock()
	pid := readPid(v.path(pidFile))

	if grace > 0 {
		if err := mon.Execute(ctx, "system_powerdown", nil, nil); err == nil {
			t := time.NewTimer(grace)
			select {
			case <-mon.Done(): // the guest powered off
			case <-t.C:
			case <-ctx.Done():
			}
			t.Stop()
		}
	}
	if err := mon.Execute(ctx, "quit", nil, nil); err != nil && !errors.Is(err, ErrMonitorClosed) {
		return fmt.Errorf("VM %s: %w", v.name, err)
	}
	if err := d.waitStopped(ctx, v, mon, pid); err != nil {
		return fmt.Errorf("VM %s: %w", v.name, err)
	}
	v.forget()
	// QEMU does not remove a socket it was handed; a stale one only refuses connections, but
	// clean up anyway.
	_ = os.Remove(v.path(qmpSocket))
	return d.removeCgroup(ctx, v)
}
