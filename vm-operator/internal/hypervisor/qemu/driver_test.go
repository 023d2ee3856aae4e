package qemu

// The tests in this file run a real qemu-system-x86_64 with no guest OS: native PCIe hot-plug
// completes an unplug at once when no guest drives the slot. Prerequisites: root (for loop
// devices) and QEMU (`make deps`). They start one QEMU at a time, under TCG unless the CPU has
// hardware virtualization.

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	. "github.com/onsi/gomega"

	"pvbridge.io/pkg/cgroups"
	"pvbridge.io/vm-operator/internal/hypervisor"
)

var testVM = hypervisor.VM{Namespace: "tenant-a", Name: "vm1", UID: "6c0c5b9e-2f59-4a51-9d67-4f7a53a1c0de"}

// newDriver returns a driver with a fresh run directory, closed when the test ends.
func newDriver(t *testing.T, opts Options) *Driver {
	t.Helper()
	if _, err := exec.LookPath("qemu-system-x86_64"); err != nil {
		t.Fatal("qemu-system-x86_64 is not installed: run `make deps` (hack/install-deps.sh installs Debian's qemu-system-x86)")
	}
	if opts.RunDir == "" {
		// Not t.TempDir(): its long names would push socket paths past their limit.
		dir, err := os.MkdirTemp("", "qemu-test-")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = os.RemoveAll(dir) })
		opts.RunDir = dir
	}
	d, err := New(opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Close() })
	return d
}

// startVM powers vm on and makes sure that its QEMU does not outlive the test.
func startVM(t *testing.T, d *Driver, vm hypervisor.VM) {
	t.Helper()
	start := time.Now()
	if err := d.PowerOn(t.Context(), vm); err != nil {
		t.Fatal(err)
	}
	t.Logf("PowerOn took %v", time.Since(start).Round(time.Millisecond))
	pid := readPid(filepath.Join(d.Dir(vm), pidFile))
	if pid <= 0 {
		t.Fatal("QEMU wrote no pid file")
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := d.PowerOff(ctx, vm); err != nil {
			t.Errorf("PowerOff: %v", err)
		}
		if !processGone(pid) {
			_ = syscall.Kill(pid, syscall.SIGKILL)
			t.Errorf("QEMU %d outlived PowerOff", pid)
		}
	})
}

// newLoop returns a loop device over a sparse 64 MiB file, detached when the test ends.
func newLoop(t *testing.T) (device, backingFile string) {
	t.Helper()
	img := filepath.Join(t.TempDir(), "disk.img")
	f, err := os.Create(img)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(64 << 20); err != nil {
		t.Fatal(err)
	}
	_ = f.Close()
	out, err := exec.Command("losetup", "--find", "--show", img).CombinedOutput()
	if err != nil {
		t.Fatalf("losetup (the tests need root): %v: %s", err, out)
	}
	dev := strings.TrimSpace(string(out))
	t.Cleanup(func() {
		if out, err := exec.Command("losetup", "--detach", dev).CombinedOutput(); err != nil {
			t.Errorf("losetup --detach %s: %v: %s", dev, err, out)
		}
	})
	return dev, img
}

// execute runs a QMP command on vm through the driver's connection (QEMU serves one QMP
// client at a time).
func execute(t *testing.T, d *Driver, vm hypervisor.VM, command string, args, result any) error {
	t.Helper()
	v, err := d.state(vm)
	if err != nil {
		t.Fatal(err)
	}
	mon, err := v.monitor(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	return mon.Execute(t.Context(), command, args, result)
}

// peripherals lists the ids of vm's devices.
func peripherals(t *testing.T, d *Driver, vm hypervisor.VM) []string {
	t.Helper()
	var props []qomProperty
	if err := execute(t, d, vm, "qom-list", map[string]string{"path": "/machine/peripheral"}, &props); err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, p := range props {
		if strings.HasPrefix(p.Type, "child<") {
			ids = append(ids, p.Name)
		}
	}
	return ids
}

func hasNode(t *testing.T, d *Driver, vm hypervisor.VM, node string) bool {
	t.Helper()
	v, _ := d.state(vm)
	mon, err := v.monitor(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	ok, err := nodeExists(t.Context(), mon, node)
	if err != nil {
		t.Fatal(err)
	}
	return ok
}

func TestPowerOnAndOff(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	d := newDriver(t, Options{})

	g.Expect(d.Running(ctx, testVM)).To(BeFalse())
	startVM(t, d, testVM)
	g.Expect(d.Running(ctx, testVM)).To(BeTrue())
	pid := readPid(filepath.Join(d.Dir(testVM), pidFile))

	g.Expect(d.PowerOn(ctx, testVM)).To(Succeed(), "powering on a running VM does nothing")
	g.Expect(readPid(filepath.Join(d.Dir(testVM), pidFile))).To(Equal(pid))
	g.Expect(d.Running(ctx, hypervisor.VM{Namespace: "tenant-a", Name: "vm2"})).To(BeFalse(), "another VM does not run")

	var uuid struct {
		UUID string `json:"UUID"`
	}
	g.Expect(execute(t, d, testVM, "query-uuid", nil, &uuid)).To(Succeed())
	g.Expect(uuid.UUID).To(Equal(testVM.UID), "the guest sees the VM's UID as its system UUID")

	start := time.Now()
	g.Expect(d.PowerOff(ctx, testVM)).To(Succeed())
	t.Logf("PowerOff took %v", time.Since(start).Round(time.Millisecond))
	g.Expect(processGone(pid)).To(BeTrue())
	g.Expect(d.Running(ctx, testVM)).To(BeFalse())
	g.Expect(d.PowerOff(ctx, testVM)).To(Succeed(), "powering off a VM that is off does nothing")
}

func TestPowerOffAfterGracePeriod(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	// No guest answers the ACPI power button: PowerOff stops QEMU once the grace period ends.
	d := newDriver(t, Options{ShutdownGracePeriod: 300 * time.Millisecond})
	startVM(t, d, testVM)

	start := time.Now()
	g.Expect(d.PowerOff(ctx, testVM)).To(Succeed())
	g.Expect(time.Since(start)).To(BeNumerically(">=", 300*time.Millisecond))
	g.Expect(d.Running(ctx, testVM)).To(BeFalse())
}

func TestForceOffDoesNotWaitForTheGuest(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	// In ACPI hot-plug mode no guest ejects the disk: it stays held, as with a guest that
	// refuses the unplug; and no guest answers the power button within the long grace.
	d := newDriver(t, Options{
		ShutdownGracePeriod: time.Hour, UnplugTimeout: 300 * time.Millisecond,
		ExtraArgs: []string{"-global", "ICH9-LPC.acpi-pci-hotplug-with-bridge-support=on"},
	})
	loop, _ := newLoop(t)
	startVM(t, d, testVM)
	disk := hypervisor.Disk{Serial: "pvc-a", Device: loop}
	g.Expect(d.Attach(ctx, testVM, disk)).To(Succeed())
	g.Expect(d.Detach(ctx, testVM, disk.Serial)).To(MatchError(hypervisor.ErrBusy))

	g.Expect(d.ForceOff(ctx, testVM)).To(Succeed())
	g.Expect(d.Running(ctx, testVM)).To(BeFalse())
	g.Expect(d.Detach(ctx, testVM, disk.Serial)).To(Succeed(), "the disk went with the VM")
	g.Expect(d.ForceOff(ctx, testVM)).To(Succeed(), "forcing off a VM that is off does nothing")
}

func TestPowerOnReportsQEMUErrors(t *testing.T) {
	g := NewWithT(t)
	d := newDriver(t, Options{ExtraArgs: []string{"-no-such-option"}})
	err := d.PowerOn(t.Context(), testVM)
	g.Expect(err).To(MatchError(ContainSubstring("invalid option")), "QEMU's own message")
	g.Expect(d.Running(t.Context(), testVM)).To(BeFalse())
}

func TestAttachAndDetach(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	d := newDriver(t, Options{})
	loop, _ := newLoop(t)
	startVM(t, d, testVM)
	disk := hypervisor.Disk{Serial: "PVB0123456789ABCDEFG", Device: loop} // the full 20 characters

	start := time.Now()
	g.Expect(d.Attach(ctx, testVM, disk)).To(Succeed())
	t.Logf("Attach took %v", time.Since(start).Round(time.Millisecond))
	g.Expect(d.Disks(ctx, testVM)).To(Equal([]hypervisor.Disk{disk}))
	var serial string
	g.Expect(execute(t, d, testVM, "qom-get",
		map[string]string{"path": "/machine/peripheral/pvb-disk-" + disk.Serial, "property": "serial"}, &serial)).To(Succeed())
	g.Expect(serial).To(Equal(disk.Serial))

	start = time.Now()
	g.Expect(d.Detach(ctx, testVM, disk.Serial)).To(Succeed())
	t.Logf("Detach took %v", time.Since(start).Round(time.Millisecond))
	g.Expect(d.Disks(ctx, testVM)).To(BeEmpty())
	g.Expect(peripherals(t, d, testVM)).NotTo(ContainElement(HavePrefix(devicePrefix)))
	g.Expect(hasNode(t, d, testVM, nodePrefix+disk.Serial)).To(BeFalse(), "QEMU let go of the loop device")

	g.Expect(d.Detach(ctx, testVM, disk.Serial)).To(Succeed(), "detaching a detached disk is success")
	g.Expect(d.Attach(ctx, testVM, disk)).To(Succeed(), "a detached disk can be attached again")
	g.Expect(d.Disks(ctx, testVM)).To(Equal([]hypervisor.Disk{disk}))
}

func TestLimitsAreSetAtAttachAndChangedLive(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	d := newDriver(t, Options{})
	loop, _ := newLoop(t)
	startVM(t, d, testVM)
	limits := hypervisor.Limits{IOPS: 200, BytesPerSecond: 4 << 20}
	disk := hypervisor.Disk{Serial: "PVB-LIMITS", Device: loop, Limits: &limits}

	g.Expect(d.Attach(ctx, testVM, disk)).To(Succeed())
	g.Expect(d.Disks(ctx, testVM)).To(Equal([]hypervisor.Disk{disk}), "QEMU reports the limits it enforces")
	g.Expect(d.Attach(ctx, testVM, disk)).To(Succeed(), "attaching again is success")

	faster := hypervisor.Limits{BytesPerSecond: 64 << 20}
	g.Expect(d.SetLimits(ctx, testVM, disk.Serial, faster)).To(Succeed())
	g.Expect(d.SetLimits(ctx, testVM, disk.Serial, faster)).To(Succeed(), "setting the limits a disk has is success")
	g.Expect(d.Disks(ctx, testVM)).To(Equal([]hypervisor.Disk{{Serial: disk.Serial, Device: loop, Limits: &faster}}))

	g.Expect(d.SetLimits(ctx, testVM, disk.Serial, hypervisor.Limits{})).To(Succeed(), "zero lifts the limits")
	g.Expect(d.Disks(ctx, testVM)).To(Equal([]hypervisor.Disk{{Serial: disk.Serial, Device: loop}}))

	g.Expect(d.SetLimits(ctx, testVM, "PVB-OTHER", faster)).To(MatchError(ContainSubstring(`no disk with serial "PVB-OTHER"`)))
	g.Expect(d.Detach(ctx, testVM, disk.Serial)).To(Succeed())
	g.Expect(d.SetLimits(ctx, hypervisor.VM{Namespace: "ns", Name: "off"}, disk.Serial, faster)).To(MatchError(hypervisor.ErrVMNotFound))
}

func TestAttachIsIdempotentAndRefusesConflicts(t *testing.T) {
	d := newDriver(t, Options{})
	loopA, _ := newLoop(t)
	loopB, _ := newLoop(t)
	link := filepath.Join(t.TempDir(), "by-id")
	if err := os.Symlink(loopA, link); err != nil {
		t.Fatal(err)
	}
	loopC, _ := newLoop(t)
	startVM(t, d, testVM)
	attached := hypervisor.Disk{Serial: "pvc-a", Device: loopA}
	if err := d.Attach(t.Context(), testVM, attached); err != nil {
		t.Fatal(err)
	}
	// A disk that someone else hot-plugged.
	if err := execute(t, d, testVM, "blockdev-add", map[string]string{"driver": "host_device", "node-name": "other", "filename": loopC}, nil); err != nil {
		t.Fatal(err)
	}
	if err := execute(t, d, testVM, "device_add", map[string]string{
		"driver": "virtio-blk-pci", "id": "other", "drive": "other", "serial": "pvc-c", "bus": portID(1),
	}, nil); err != nil {
		t.Fatal(err)
	}

	tests := []struct {
		name    string
		disk    hypervisor.Disk
		wantErr error  // for sentinel errors
		wantMsg string // for validation errors
	}{{
		name: "the same serial and device is success",
		disk: attached,
	}, {
		name: "the same device by another path is success",
		disk: hypervisor.Disk{Serial: "pvc-a", Device: link},
	}, {
		name:    "the serial with another device conflicts",
		disk:    hypervisor.Disk{Serial: "pvc-a", Device: loopB},
		wantErr: hypervisor.ErrConflict,
	}, {
		name:    "the device under another serial conflicts",
		disk:    hypervisor.Disk{Serial: "pvc-b", Device: loopA},
		wantErr: hypervisor.ErrConflict,
	}, {
		name:    "a disk this driver did not add conflicts",
		disk:    hypervisor.Disk{Serial: "pvc-c", Device: loopC},
		wantErr: hypervisor.ErrConflict,
	}, {
		name:    "a serial longer than virtio's 20 characters is refused",
		disk:    hypervisor.Disk{Serial: strings.Repeat("s", 21), Device: loopB},
		wantMsg: "want 1 to 20 characters",
	}, {
		name:    "a relative device path is refused",
		disk:    hypervisor.Disk{Serial: "pvc-b", Device: "loop9"},
		wantMsg: "want an absolute path",
	}, {
		name:    "a device QEMU cannot open is refused",
		disk:    hypervisor.Disk{Serial: "pvc-b", Device: "/dev/no-such-device"},
		wantMsg: "No such file or directory",
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			err := d.Attach(t.Context(), testVM, tt.disk)
			switch {
			case tt.wantErr != nil:
				g.Expect(err).To(MatchError(tt.wantErr))
			case tt.wantMsg != "":
				g.Expect(err).To(MatchError(ContainSubstring(tt.wantMsg)))
			default:
				g.Expect(err).NotTo(HaveOccurred())
			}
			g.Expect(d.Disks(t.Context(), testVM)).To(Equal([]hypervisor.Disk{attached}), "nothing changed, and only the driver's disks are listed")
			g.Expect(hasNode(t, d, testVM, nodePrefix+"pvc-b")).To(BeFalse(), "no block node left behind")
		})
	}
}

func TestVMThatDoesNotRun(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	d := newDriver(t, Options{})
	loop, _ := newLoop(t)

	g.Expect(d.Attach(ctx, testVM, hypervisor.Disk{Serial: "pvc-a", Device: loop})).To(MatchError(hypervisor.ErrVMNotFound))
	g.Expect(d.Detach(ctx, testVM, "pvc-a")).To(Succeed(), "a VM that does not run holds no disk")
	g.Expect(d.Disks(ctx, testVM)).To(BeEmpty())
	g.Expect(d.Slots(ctx, testVM)).To(BeZero())
}

func TestSlotsAreThePortsTheVMWasStartedWith(t *testing.T) {
	tests := []struct {
		name  string
		opts  Options
		slots int // the VM's own number
		want  int
	}{
		{name: "the driver's default", opts: Options{}, want: 16},
		{name: "the driver's configured ports", opts: Options{HotplugPorts: 3}, want: 3},
		{name: "the VM's own number wins", opts: Options{HotplugPorts: 3}, slots: 9, want: 9},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			d := newDriver(t, tt.opts)
			vm := testVM
			vm.Slots = tt.slots
			startVM(t, d, vm)
			g.Expect(d.Slots(t.Context(), vm)).To(Equal(tt.want))
			vm.Slots = tt.want + 1
			g.Expect(d.Slots(t.Context(), vm)).To(Equal(tt.want), "a running VM keeps the ports it was started with")
		})
	}
}

func TestARestartedVMHasTheSlotsItWasStartedWith(t *testing.T) {
	g := NewWithT(t)
	d := newDriver(t, Options{HotplugPorts: 2})
	vm := testVM
	startVM(t, d, vm)
	g.Expect(d.Slots(t.Context(), vm)).To(Equal(2))
	g.Expect(d.PowerOff(t.Context(), vm)).To(Succeed())
	g.Expect(d.Slots(t.Context(), vm)).To(BeZero(), "a VM that does not run has no slots")
	vm.Slots = 5
	startVM(t, d, vm)
	g.Expect(d.Slots(t.Context(), vm)).To(Equal(5))
}

func TestAttachUsesFreePortsOnly(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	d := newDriver(t, Options{HotplugPorts: 2})
	loop1, _ := newLoop(t)
	loop2, _ := newLoop(t)
	loop3, _ := newLoop(t)
	startVM(t, d, testVM)
	disk1 := hypervisor.Disk{Serial: "pvc-1", Device: loop1}
	disk2 := hypervisor.Disk{Serial: "pvc-2", Device: loop2}
	disk3 := hypervisor.Disk{Serial: "pvc-3", Device: loop3}

	g.Expect(d.Attach(ctx, testVM, disk1)).To(Succeed())
	g.Expect(d.Attach(ctx, testVM, disk2)).To(Succeed())
	g.Expect(d.Attach(ctx, testVM, disk3)).To(MatchError(hypervisor.ErrNoSlot))
	g.Expect(d.Attach(ctx, testVM, disk3)).To(MatchError(ContainSubstring("all 2 hot-plug ports hold a device")))
	g.Expect(hasNode(t, d, testVM, nodePrefix+"pvc-3")).To(BeFalse())

	g.Expect(d.Detach(ctx, testVM, disk1.Serial)).To(Succeed())
	g.Expect(d.Attach(ctx, testVM, disk3)).To(Succeed(), "the freed port is used again")
	g.Expect(d.Disks(ctx, testVM)).To(Equal([]hypervisor.Disk{disk2, disk3}))
}

func TestAttachRemovesTheNodeWhenTheDeviceFails(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	// Every virtio-blk device fails to realize: device_add fails after blockdev-add succeeded.
	d := newDriver(t, Options{ExtraArgs: []string{"-global", "virtio-blk-pci.num-queues=0"}})
	loop, _ := newLoop(t)
	startVM(t, d, testVM)

	err := d.Attach(ctx, testVM, hypervisor.Disk{Serial: "pvc-a", Device: loop})
	g.Expect(err).To(MatchError(ContainSubstring("device_add")))
	g.Expect(hasNode(t, d, testVM, nodePrefix+"pvc-a")).To(BeFalse())
	g.Expect(d.Disks(ctx, testVM)).To(BeEmpty())
}

func TestConvergesFromHalfDoneOperations(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	d := newDriver(t, Options{})
	loopA, _ := newLoop(t)
	loopB, _ := newLoop(t)
	startVM(t, d, testVM)

	// An Attach that stopped after blockdev-add, then was asked again with another device.
	g.Expect(execute(t, d, testVM, "blockdev-add", map[string]string{
		"driver": "host_device", "node-name": nodePrefix + "pvc-a", "filename": loopB,
	}, nil)).To(Succeed())
	disk := hypervisor.Disk{Serial: "pvc-a", Device: loopA}
	g.Expect(d.Attach(ctx, testVM, disk)).To(Succeed())
	g.Expect(d.Disks(ctx, testVM)).To(Equal([]hypervisor.Disk{disk}))

	// A Detach that stopped after the device was deleted, before blockdev-del.
	sub := func() *Subscription {
		v, _ := d.state(testVM)
		mon, err := v.monitor(ctx)
		g.Expect(err).NotTo(HaveOccurred())
		return mon.Subscribe()
	}()
	defer sub.Close()
	g.Expect(execute(t, d, testVM, "device_del", map[string]string{"id": devicePrefix + "pvc-a"}, nil)).To(Succeed())
	g.Expect(d.waitDeleted(ctx, devicePrefix+"pvc-a", sub)).To(Succeed())
	g.Expect(d.Disks(ctx, testVM)).To(BeEmpty())
	g.Expect(hasNode(t, d, testVM, nodePrefix+"pvc-a")).To(BeTrue())

	g.Expect(d.Detach(ctx, testVM, "pvc-a")).To(Succeed())
	g.Expect(hasNode(t, d, testVM, nodePrefix+"pvc-a")).To(BeFalse())
}

func TestRestartedDriverSeesQEMUState(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	first := newDriver(t, Options{})
	loop1, _ := newLoop(t)
	loop2, _ := newLoop(t)
	startVM(t, first, testVM)
	disks := []hypervisor.Disk{{Serial: "pvc-1", Device: loop1}, {Serial: "pvc-2", Device: loop2}}
	for _, disk := range disks {
		g.Expect(first.Attach(ctx, testVM, disk)).To(Succeed())
	}
	pid := readPid(filepath.Join(first.Dir(testVM), pidFile))
	g.Expect(first.Close()).To(Succeed()) // the agent goes away; QEMU does not

	second := newDriver(t, Options{RunDir: first.opts.RunDir})
	g.Expect(second.Running(ctx, testVM)).To(BeTrue())
	g.Expect(second.Disks(ctx, testVM)).To(Equal(disks))
	g.Expect(second.Attach(ctx, testVM, disks[0])).To(Succeed())
	g.Expect(second.Detach(ctx, testVM, "pvc-1")).To(Succeed())
	g.Expect(second.Disks(ctx, testVM)).To(Equal(disks[1:]))

	// QEMU is not the child of this driver: PowerOff waits for the pid to go.
	g.Expect(second.PowerOff(ctx, testVM)).To(Succeed())
	g.Expect(processGone(pid)).To(BeTrue())
	g.Expect(first.Running(ctx, testVM)).To(BeFalse())
}

// With CgroupParent, QEMU runs in a cgroup of its own in every hierarchy, not the agent's: its
// memory is not the agent's, and whoever kills the agent's cgroup (a container runtime stopping
// the agent's container) does not kill it. A restarted agent moves a QEMU that its predecessor
// started but did not move; the cgroup goes with the VM.
func TestQEMURunsInACgroupOfItsOwn(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	const root = "/sys/fs/cgroup"
	parent := fmt.Sprintf("pvbridge-test-%d", os.Getpid())
	t.Cleanup(func() { _ = cgroups.Remove(root, parent) })
	first := newDriver(t, Options{CgroupParent: parent})
	startVM(t, first, testVM)
	pid := readPid(filepath.Join(first.Dir(testVM), pidFile))
	own := filepath.Join(parent, filepath.Base(first.Dir(testVM)))
	cgroupsOf := func() []string {
		data, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
		g.Expect(err).NotTo(HaveOccurred())
		var paths []string
		for _, line := range strings.Split(strings.TrimSpace(string(data)), "\n") {
			paths = append(paths, line[strings.LastIndex(line, ":")+1:])
		}
		return paths
	}
	g.Expect(cgroupsOf()).To(HaveEach("/"+own), "in its cgroup in every hierarchy")
	g.Expect(cgroups.Pids(root, own)).To(Equal([]int{pid}))

	// An agent that ended between QEMU's start and its move: QEMU is where the agent was.
	g.Expect(cgroups.Join(root, ".", pid)).To(Succeed())
	g.Expect(cgroupsOf()).To(HaveEach("/"))
	g.Expect(first.Close()).To(Succeed())
	second := newDriver(t, Options{RunDir: first.opts.RunDir, CgroupParent: parent})
	g.Expect(second.PowerOn(ctx, testVM)).To(Succeed())
	g.Expect(cgroupsOf()).To(HaveEach("/"+own), "the restarted agent moved it")

	g.Expect(second.PowerOff(ctx, testVM)).To(Succeed())
	g.Expect(processGone(pid)).To(BeTrue())
	hierarchies, err := cgroups.Hierarchies(root)
	g.Expect(err).NotTo(HaveOccurred())
	for _, h := range hierarchies {
		g.Expect(filepath.Join(h, own)).NotTo(BeADirectory(), "the VM's cgroup goes with it")
	}
}

func TestDetachIsBusyWhileTheGuestHoldsTheDisk(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	// In ACPI hot-plug mode QEMU waits for the guest OS to eject the device, and there is no
	// guest: the unplug stays pending, as with a guest that is slow or refuses.
	d := newDriver(t, Options{
		UnplugTimeout: 300 * time.Millisecond,
		ExtraArgs:     []string{"-global", "ICH9-LPC.acpi-pci-hotplug-with-bridge-support=on"},
	})
	loop, _ := newLoop(t)
	startVM(t, d, testVM)
	disk := hypervisor.Disk{Serial: "pvc-a", Device: loop}
	g.Expect(d.Attach(ctx, testVM, disk)).To(Succeed())

	start := time.Now()
	g.Expect(d.Detach(ctx, testVM, disk.Serial)).To(MatchError(hypervisor.ErrBusy))
	g.Expect(time.Since(start)).To(BeNumerically(">=", 300*time.Millisecond), "it waited for DEVICE_DELETED")
	g.Expect(d.Disks(ctx, testVM)).To(Equal([]hypervisor.Disk{disk}), "QEMU still holds the disk")
	g.Expect(hasNode(t, d, testVM, nodePrefix+"pvc-a")).To(BeTrue())

	// QEMU refuses a second device_del while the first is pending: that is no error.
	short, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancel()
	g.Expect(d.Detach(short, testVM, disk.Serial)).To(MatchError(hypervisor.ErrBusy), "bounded by the caller's context")

	g.Expect(d.PowerOff(ctx, testVM)).To(Succeed())
	g.Expect(d.Detach(ctx, testVM, disk.Serial)).To(Succeed(), "a stopped VM holds no disk")
}

func TestConcurrentAttachAndDetach(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	const n = 8
	d := newDriver(t, Options{HotplugPorts: n})
	var disks []hypervisor.Disk
	for i := range n {
		loop, _ := newLoop(t)
		disks = append(disks, hypervisor.Disk{Serial: fmt.Sprintf("pvc-%d", i), Device: loop})
	}
	disks[n-1].Serial = "disk #7" // not a QOM id: its names are hashed
	startVM(t, d, testVM)

	concurrently := func(op func(hypervisor.Disk) error) {
		t.Helper()
		errs := make(chan error, n)
		var wg sync.WaitGroup
		for _, disk := range disks {
			wg.Go(func() { errs <- op(disk) })
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			g.Expect(err).NotTo(HaveOccurred())
		}
	}

	start := time.Now()
	concurrently(func(disk hypervisor.Disk) error { return d.Attach(ctx, testVM, disk) })
	t.Logf("%d concurrent Attach calls took %v", n, time.Since(start).Round(time.Millisecond))
	g.Expect(d.Disks(ctx, testVM)).To(ConsistOf(disks))
	buses := map[string]bool{}
	for _, disk := range disks {
		id, _ := names(disk.Serial)
		var bus string
		g.Expect(execute(t, d, testVM, "qom-get", map[string]string{"path": peripheral + id, "property": "parent_bus"}, &bus)).To(Succeed())
		buses[bus] = true
	}
	g.Expect(buses).To(HaveLen(n), "each disk on a port of its own")

	start = time.Now()
	concurrently(func(disk hypervisor.Disk) error { return d.Detach(ctx, testVM, disk.Serial) })
	t.Logf("%d concurrent Detach calls took %v", n, time.Since(start).Round(time.Millisecond))
	g.Expect(d.Disks(ctx, testVM)).To(BeEmpty())
}

func TestPowerOnRefusesAVMLargerThanTheHostsAvailableMemory(t *testing.T) {
	g := NewWithT(t)
	d := newDriver(t, Options{MemoryMiB: 256})
	d.meminfo = filepath.Join(t.TempDir(), "meminfo")
	g.Expect(os.WriteFile(d.meminfo, []byte("MemTotal:        1048576 kB\nMemFree:            1000 kB\nMemAvailable:     204800 kB\n"), 0o600)).To(Succeed())

	err := d.PowerOn(t.Context(), testVM)
	g.Expect(err).To(MatchError(hypervisor.ErrInsufficientMemory))
	g.Expect(err).To(MatchError(ContainSubstring("VM tenant-a/vm1 boots with 256 MiB, the host has 200 MiB available")))
	g.Expect(d.Running(t.Context(), testVM)).To(BeFalse(), "not started, nor started smaller")

	small := testVM
	small.MemoryMiB = 128
	startVM(t, d, small)
	g.Expect(d.Running(t.Context(), small)).To(BeTrue(), "a VM that fits starts")
}

// A VM boots from an overlay of its image, one of the host's image store, with a NIC whose MAC
// follows its UID; Delete stops it and removes its files, overlay included, and never the image.
func TestAVMBootsAnOverlayOfItsImageAndDeleteRemovesIt(t *testing.T) {
	g := NewWithT(t)
	store := t.TempDir()
	g.Expect(os.Mkdir(filepath.Join(store, "node-v1"), 0o755)).To(Succeed())
	image := filepath.Join(store, "node-v1", imageDisk)
	out, err := exec.Command("qemu-img", "create", "-q", "-f", "qcow2", image, "64M").CombinedOutput()
	g.Expect(err).NotTo(HaveOccurred(), "qemu-img (hack/install-deps.sh installs qemu-utils): %s", out)
	imageBefore, err := os.ReadFile(image)
	g.Expect(err).NotTo(HaveOccurred())
	d := newDriver(t, Options{ImageDir: store, Network: "user"})
	vm := testVM
	vm.Image = "node-v2"
	g.Expect(d.PowerOn(t.Context(), vm)).To(MatchError(hypervisor.ErrImageNotFound), "an image the store does not have")
	g.Expect(d.Running(t.Context(), vm)).To(BeFalse(), "nor is it started with another")
	vm.Image = "node-v1"
	startVM(t, d, vm)

	overlay := filepath.Join(d.Dir(vm), bootDisk)
	out, err = exec.Command("qemu-img", "info", "--output=json", "-U", overlay).CombinedOutput()
	g.Expect(err).NotTo(HaveOccurred(), "%s", out)
	var info struct {
		Format  string `json:"format"`
		Backing string `json:"full-backing-filename"`
	}
	g.Expect(json.Unmarshal(out, &info)).To(Succeed())
	g.Expect(info).To(Equal(struct {
		Format  string `json:"format"`
		Backing string `json:"full-backing-filename"`
	}{"qcow2", image}))
	var mac string
	g.Expect(execute(t, d, vm, "qom-get", map[string]string{"path": peripheral + nicID, "property": "mac"}, &mac)).To(Succeed())
	g.Expect(mac).To(Equal(macFor(vm)))
	g.Expect(macFor(vm)).To(MatchRegexp(`^52:54:00(:[0-9a-f]{2}){3}$`))
	g.Expect(d.Disks(t.Context(), vm)).To(BeEmpty(), "the boot disk is not a hot-plugged one")

	g.Expect(d.Delete(t.Context(), vm)).To(Succeed())
	g.Expect(d.Running(t.Context(), vm)).To(BeFalse())
	g.Expect(d.Dir(vm)).NotTo(BeADirectory())
	g.Expect(os.ReadFile(image)).To(Equal(imageBefore), "the image is never written")
	g.Expect(d.Delete(t.Context(), vm)).To(Succeed(), "deleting what is gone is success")
}
