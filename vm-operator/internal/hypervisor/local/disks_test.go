package local

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"golang.org/x/sys/unix"

	"pvbridge.io/vm-operator/internal/hypervisor"
)

func TestAttachExposesTheDeviceInTheVM(t *testing.T) {
	g := NewWithT(t)
	e := newEnv(t)
	vm := e.runningVM(t, "node-1")
	device, _ := e.loop(t, 64*mib)
	vmDir := e.vmDir(vm)

	g.Expect(e.d.Attach(t.Context(), vm, hypervisor.Disk{Serial: "pvb-0123456789abcdef", Device: device})).To(Succeed())

	expectDisk(g, vmDir, "vda", "pvb-0123456789abcdef", device)
	g.Expect(guestDisks(t, vmDir)).To(Equal(map[string]string{"pvb-0123456789abcdef": "vda"}))
	g.Expect(e.d.Disks(t.Context(), vm)).To(Equal([]hypervisor.Disk{{Serial: "pvb-0123456789abcdef", Device: device}}))

	// The guest formats and mounts the disk by its serial; the data lands on the host device.
	byID := filepath.Join(vmDir, "dev/disk/by-id/virtio-pvb-0123456789abcdef")
	run(t, "mkfs.ext4", "-q", byID)
	guestMnt, hostMnt := e.path("guest"), e.path("host")
	g.Expect(os.Mkdir(guestMnt, 0o755)).To(Succeed())
	g.Expect(os.Mkdir(hostMnt, 0o755)).To(Succeed())
	run(t, "mount", byID, guestMnt)
	g.Expect(os.WriteFile(filepath.Join(guestMnt, "hello"), []byte("from the guest"), 0o644)).To(Succeed())
	run(t, "umount", guestMnt)
	run(t, "mount", "-o", "ro", device, hostMnt)
	defer run(t, "umount", hostMnt)
	g.Expect(os.ReadFile(filepath.Join(hostMnt, "hello"))).To(BeEquivalentTo("from the guest"))
}

func TestAttachIsIdempotent(t *testing.T) {
	tests := []struct {
		name string
		// again repeats the attach of serial with device, as the test's driver d, and returns
		// the Device that Disks reports afterwards.
		again func(t *testing.T, e *env, d *Driver, vm hypervisor.VM, serial, device string) string
	}{
		{
			name: "same serial and device",
			again: func(t *testing.T, _ *env, d *Driver, vm hypervisor.VM, serial, device string) string {
				NewWithT(t).Expect(d.Attach(t.Context(), vm, hypervisor.Disk{Serial: serial, Device: device})).To(Succeed())
				return device
			},
		},
		{
			name: "same device through another path, which Disks then reports",
			again: func(t *testing.T, e *env, d *Driver, vm hypervisor.VM, serial, device string) string {
				g := NewWithT(t)
				link := e.path("published")
				g.Expect(os.Symlink(device, link)).To(Succeed())
				g.Expect(d.Attach(t.Context(), vm, hypervisor.Disk{Serial: serial, Device: link})).To(Succeed())
				return link
			},
		},
		{
			name: "after a restart of the agent",
			again: func(t *testing.T, e *env, _ *Driver, vm hypervisor.VM, serial, device string) string {
				d := e.driver(t, Options{})
				NewWithT(t).Expect(d.Attach(t.Context(), vm, hypervisor.Disk{Serial: serial, Device: device})).To(Succeed())
				return device
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			e := newEnv(t)
			vm := e.runningVM(t, "node-1")
			device, _ := e.loop(t, 16*mib)
			g.Expect(e.d.Attach(t.Context(), vm, hypervisor.Disk{Serial: "disk-1", Device: device})).To(Succeed())

			reported := tt.again(t, e, e.d, vm, "disk-1", device)

			expectDisk(g, e.vmDir(vm), "vda", "disk-1", device)
			g.Expect(e.d.Disks(t.Context(), vm)).To(Equal([]hypervisor.Disk{{Serial: "disk-1", Device: reported}}))
			g.Expect(guestDisks(t, e.vmDir(vm))).To(HaveLen(1))
		})
	}
}

func TestAttachConflicts(t *testing.T) {
	tests := []struct {
		name string
		// disk returns the conflicting disk, given the attached one and another device.
		disk func(attached hypervisor.Disk, other string) hypervisor.Disk
	}{
		{
			name: "serial attached with another device",
			disk: func(attached hypervisor.Disk, other string) hypervisor.Disk {
				return hypervisor.Disk{Serial: attached.Serial, Device: other}
			},
		},
		{
			name: "device attached under another serial",
			disk: func(attached hypervisor.Disk, _ string) hypervisor.Disk {
				return hypervisor.Disk{Serial: "disk-2", Device: attached.Device}
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			e := newEnv(t)
			vm := e.runningVM(t, "node-1")
			device, _ := e.loop(t, 16*mib)
			other, _ := e.loop(t, 16*mib)
			attached := hypervisor.Disk{Serial: "disk-1", Device: device}
			g.Expect(e.d.Attach(t.Context(), vm, attached)).To(Succeed())

			g.Expect(e.d.Attach(t.Context(), vm, tt.disk(attached, other))).To(MatchError(hypervisor.ErrConflict))
			// A restarted agent refuses it too.
			g.Expect(e.driver(t, Options{}).Attach(t.Context(), vm, tt.disk(attached, other))).To(MatchError(hypervisor.ErrConflict))

			expectDisk(g, e.vmDir(vm), "vda", "disk-1", device)
			g.Expect(e.d.Disks(t.Context(), vm)).To(Equal([]hypervisor.Disk{attached}))
			g.Expect(guestDisks(t, e.vmDir(vm))).To(Equal(map[string]string{"disk-1": "vda"}))
		})
	}
}

func TestAttachToAVMThatDoesNotRun(t *testing.T) {
	tests := []struct {
		name    string
		powerOn bool
	}{
		{name: "never powered on"},
		{name: "powered off", powerOn: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			e := newEnv(t)
			vm := hypervisor.VM{Namespace: "tenant-a", Name: "node-1"}
			if tt.powerOn {
				g.Expect(e.d.PowerOn(t.Context(), vm)).To(Succeed())
				g.Expect(e.d.PowerOff(t.Context(), vm)).To(Succeed())
			}
			device, _ := e.loop(t, 16*mib)

			g.Expect(e.d.Attach(t.Context(), vm, hypervisor.Disk{Serial: "disk-1", Device: device})).To(MatchError(hypervisor.ErrVMNotFound))

			g.Expect(e.d.Disks(t.Context(), vm)).To(BeEmpty())
			g.Expect(guestDisks(t, e.vmDir(vm))).To(BeEmpty())
		})
	}
}

func TestDetachRemovesTheDisk(t *testing.T) {
	g := NewWithT(t)
	e := newEnv(t)
	vm := e.runningVM(t, "node-1")
	device, _ := e.loop(t, 16*mib)
	g.Expect(e.d.Attach(t.Context(), vm, hypervisor.Disk{Serial: "disk-1", Device: device})).To(Succeed())

	g.Expect(e.d.Detach(t.Context(), vm, "disk-1")).To(Succeed())

	expectNoDisk(g, e.vmDir(vm), "vda", "disk-1")
	g.Expect(e.d.Disks(t.Context(), vm)).To(BeEmpty())
	g.Expect(guestDisks(t, e.vmDir(vm))).To(BeEmpty())
	g.Expect(os.ReadDir(filepath.Join(e.vmDir(vm), "dev/disk/by-id"))).To(BeEmpty())
}

func TestDetachOfWhatIsNotAttachedSucceeds(t *testing.T) {
	tests := []struct {
		name  string
		setup func(t *testing.T, e *env) hypervisor.VM
	}{
		{
			name:  "unknown VM",
			setup: func(*testing.T, *env) hypervisor.VM { return hypervisor.VM{Namespace: "tenant-a", Name: "ghost"} },
		},
		{
			name:  "VM without that disk",
			setup: func(t *testing.T, e *env) hypervisor.VM { return e.runningVM(t, "node-1") },
		},
		{
			name: "disk detached already",
			setup: func(t *testing.T, e *env) hypervisor.VM {
				vm := e.runningVM(t, "node-1")
				device, _ := e.loop(t, 16*mib)
				g := NewWithT(t)
				g.Expect(e.d.Attach(t.Context(), vm, hypervisor.Disk{Serial: "disk-1", Device: device})).To(Succeed())
				g.Expect(e.d.Detach(t.Context(), vm, "disk-1")).To(Succeed())
				return vm
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := newEnv(t)
			vm := tt.setup(t, e)
			NewWithT(t).Expect(e.d.Detach(t.Context(), vm, "disk-1")).To(Succeed())
		})
	}
}

func TestDetachIsRefusedWhileTheDiskIsHeld(t *testing.T) {
	tests := []struct {
		name string
		// fakeSysfs makes the driver read a sysfs the test writes, with the device's real size.
		fakeSysfs bool
		// hold makes the disk busy and returns what releases it.
		hold func(t *testing.T, e *env, sysfs, vmDir, device string) (release func())
		// reason is part of the ErrBusy message.
		reason string
	}{
		{
			name: "filesystem mounted through the by-id link",
			hold: func(t *testing.T, e *env, _, vmDir, _ string) func() {
				byID := filepath.Join(vmDir, "dev/disk/by-id/virtio-disk-1")
				run(t, "mkfs.ext4", "-q", byID)
				mnt := e.path("staging")
				NewWithT(t).Expect(os.Mkdir(mnt, 0o755)).To(Succeed())
				run(t, "mount", byID, mnt)
				return func() { run(t, "umount", mnt) }
			},
			reason: "mounted at ",
		},
		{
			name: "device node bind-mounted, as a raw block volume is published",
			hold: func(t *testing.T, e *env, _, vmDir, _ string) func() {
				target := e.path("block-target")
				NewWithT(t).Expect(os.WriteFile(target, nil, 0o644)).To(Succeed())
				run(t, "mount", "--bind", filepath.Join(vmDir, "dev/vda"), target)
				return func() { run(t, "umount", target) }
			},
			reason: "device node is bind-mounted at ",
		},
		{
			name:      "device stacked under another one",
			fakeSysfs: true,
			hold: func(t *testing.T, _ *env, sysfs, _, device string) func() {
				holder := filepath.Join(sysfs, "dev/block", numberOf(t, device), "holders/dm-7")
				NewWithT(t).Expect(os.MkdirAll(holder, 0o755)).To(Succeed())
				return func() { NewWithT(t).Expect(os.Remove(holder)).To(Succeed()) }
			},
			reason: "held by dm-7",
		},
		{
			name: "filesystem mounted in another mount namespace",
			hold: func(t *testing.T, e *env, _, vmDir, _ string) func() {
				byID := filepath.Join(vmDir, "dev/disk/by-id/virtio-disk-1")
				run(t, "mkfs.ext4", "-q", byID)
				mnt := e.path("private")
				NewWithT(t).Expect(os.Mkdir(mnt, 0o755)).To(Succeed())
				return mountElsewhere(t, byID, mnt)
			},
			reason: "claimed exclusively",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			e := newEnv(t)
			device, _ := e.loop(t, 64*mib)
			var sysfs string
			if tt.fakeSysfs {
				sysfs = e.path("sys")
				size := filepath.Join(sysfs, "dev/block", numberOf(t, device), "size")
				g.Expect(os.MkdirAll(filepath.Dir(size), 0o755)).To(Succeed())
				g.Expect(os.WriteFile(size, []byte(itoa(sectorsOf(g, device))+"\n"), 0o644)).To(Succeed())
				e.d = e.driver(t, Options{Sysfs: sysfs})
			}
			vm := e.runningVM(t, "node-1")
			vmDir := e.vmDir(vm)
			g.Expect(e.d.Attach(t.Context(), vm, hypervisor.Disk{Serial: "disk-1", Device: device})).To(Succeed())
			release := tt.hold(t, e, sysfs, vmDir, device)

			err := e.d.Detach(t.Context(), vm, "disk-1")
			g.Expect(err).To(MatchError(hypervisor.ErrBusy))
			g.Expect(err).To(MatchError(ContainSubstring(tt.reason)))
			expectDisk(g, vmDir, "vda", "disk-1", device)
			g.Expect(e.d.Disks(t.Context(), vm)).To(HaveLen(1))
			g.Expect(e.d.PowerOff(t.Context(), vm)).To(MatchError(hypervisor.ErrBusy), "a VM with a disk does not power off")

			release()
			// The kernel may release a claim of a torn-down mount namespace a moment later.
			g.Eventually(func() error { return e.d.Detach(t.Context(), vm, "disk-1") }).
				WithTimeout(10 * time.Second).WithPolling(100 * time.Millisecond).Should(Succeed())
			expectNoDisk(g, vmDir, "vda", "disk-1")
		})
	}
}

func TestForceOffTakesTheDisksTheGuestHolds(t *testing.T) {
	g := NewWithT(t)
	e := newEnv(t)
	vm := e.runningVM(t, "node-1")
	vmDir := e.vmDir(vm)
	for _, serial := range []string{"disk-1", "disk-2"} {
		device, _ := e.loop(t, 64*mib)
		g.Expect(e.d.Attach(t.Context(), vm, hypervisor.Disk{Serial: serial, Device: device})).To(Succeed())
	}
	// The guest mounts one disk's filesystem and publishes the other as a raw block volume.
	byID := filepath.Join(vmDir, "dev/disk/by-id/virtio-disk-1")
	run(t, "mkfs.ext4", "-q", byID)
	mnt, target := e.path("staging"), e.path("block-target")
	g.Expect(os.Mkdir(mnt, 0o755)).To(Succeed())
	g.Expect(os.WriteFile(target, nil, 0o644)).To(Succeed())
	run(t, "mount", byID, mnt)
	run(t, "mount", "--bind", filepath.Join(vmDir, "dev/vdb"), target)
	g.Expect(e.d.Detach(t.Context(), vm, "disk-1")).To(MatchError(hypervisor.ErrBusy))

	g.Expect(e.d.ForceOff(t.Context(), vm)).To(Succeed())

	g.Expect(e.d.Running(t.Context(), vm)).To(BeFalse())
	g.Expect(e.d.Disks(t.Context(), vm)).To(BeEmpty())
	expectNoDisk(g, vmDir, "vda", "disk-1")
	expectNoDisk(g, vmDir, "vdb", "disk-2")
	table, err := os.ReadFile(mountInfo)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(string(table)).NotTo(Or(ContainSubstring(mnt+" "), ContainSubstring(target+" ")), "the guest's mounts went with it")
	g.Expect(e.d.ForceOff(t.Context(), vm)).To(Succeed(), "forcing off a stopped VM does nothing")
}

func TestForceOffCannotTakeADeviceStackedUpon(t *testing.T) {
	g := NewWithT(t)
	e := newEnv(t)
	device, _ := e.loop(t, 64*mib)
	sysfs := e.path("sys")
	g.Expect(os.MkdirAll(filepath.Join(sysfs, "dev/block", numberOf(t, device), "holders/dm-7"), 0o755)).To(Succeed())
	g.Expect(os.WriteFile(filepath.Join(sysfs, "dev/block", numberOf(t, device), "size"), []byte(itoa(sectorsOf(g, device))+"\n"), 0o644)).To(Succeed())
	e.d = e.driver(t, Options{Sysfs: sysfs})
	vm := e.runningVM(t, "node-1")
	g.Expect(e.d.Attach(t.Context(), vm, hypervisor.Disk{Serial: "disk-1", Device: device})).To(Succeed())

	err := e.d.ForceOff(t.Context(), vm)

	g.Expect(err).To(MatchError(hypervisor.ErrBusy))
	g.Expect(err).To(MatchError(ContainSubstring("held by dm-7")))
	g.Expect(e.d.Running(t.Context(), vm)).To(BeTrue())
}

// mountElsewhere mounts source on target in a new mount namespace, invisible to this process's
// mount table, and returns what ends that namespace.
func mountElsewhere(t *testing.T, source, target string) (release func()) {
	t.Helper()
	cmd := exec.Command("unshare", "--mount", "--propagation", "private", "sh", "-c",
		`mount "$1" "$2" && echo mounted && exec sleep 300`, "sh", source, target)
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	stop := func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	}
	if line, err := bufio.NewReader(stdout).ReadString('\n'); err != nil || line != "mounted\n" {
		stop()
		t.Fatalf("mount %s in a new mount namespace: %q, %v", source, line, err)
	}
	t.Cleanup(stop)
	return stop
}

// numberOf returns the "major:minor" of the block device at path.
func numberOf(t *testing.T, path string) string {
	dev := deviceNumber(t, path)
	return fmt.Sprintf("%d:%d", unix.Major(dev), unix.Minor(dev))
}

func TestDiskNamesAreReusedLowestFirst(t *testing.T) {
	g := NewWithT(t)
	e := newEnv(t)
	vm := e.runningVM(t, "node-1")
	var devices []string
	for range 5 {
		device, _ := e.loop(t, 16*mib)
		devices = append(devices, device)
	}
	for i, device := range devices[:3] {
		g.Expect(e.d.Attach(t.Context(), vm, hypervisor.Disk{Serial: fmt.Sprintf("disk-%d", i), Device: device})).To(Succeed())
	}
	g.Expect(guestDisks(t, e.vmDir(vm))).To(Equal(map[string]string{"disk-0": "vda", "disk-1": "vdb", "disk-2": "vdc"}))

	g.Expect(e.d.Detach(t.Context(), vm, "disk-1")).To(Succeed())
	g.Expect(e.d.Attach(t.Context(), vm, hypervisor.Disk{Serial: "disk-3", Device: devices[3]})).To(Succeed())
	g.Expect(e.d.Attach(t.Context(), vm, hypervisor.Disk{Serial: "disk-4", Device: devices[4]})).To(Succeed())

	g.Expect(guestDisks(t, e.vmDir(vm))).To(Equal(map[string]string{"disk-0": "vda", "disk-3": "vdb", "disk-2": "vdc", "disk-4": "vdd"}))
	expectDisk(g, e.vmDir(vm), "vdb", "disk-3", devices[3])
	g.Expect(e.d.Disks(t.Context(), vm)).To(Equal([]hypervisor.Disk{
		{Serial: "disk-0", Device: devices[0]},
		{Serial: "disk-3", Device: devices[3]},
		{Serial: "disk-2", Device: devices[2]},
		{Serial: "disk-4", Device: devices[4]},
	}), "Disks lists in the order of the names")
}

func TestAttachBeyondTheSlotsIsRefused(t *testing.T) {
	tests := []struct {
		name      string
		opts      Options
		vmSlots   int
		wantSlots int
	}{
		{name: "the driver's default", opts: Options{}, wantSlots: hypervisor.MaxSlots},
		{name: "the driver's configured number", opts: Options{Slots: 2}, wantSlots: 2},
		{name: "the VM's own number wins", opts: Options{Slots: 5}, vmSlots: 3, wantSlots: 3},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			e := newEnv(t)
			d := e.driver(t, tt.opts)
			vm := hypervisor.VM{Namespace: "tenant-a", Name: "node-1", UID: "uid-1", Slots: tt.vmSlots}
			g.Expect(d.Slots(t.Context(), vm)).To(BeZero(), "a VM that does not run has no slots")
			g.Expect(d.PowerOn(t.Context(), vm)).To(Succeed())
			g.Expect(d.Slots(t.Context(), vm)).To(Equal(tt.wantSlots))
			if tt.wantSlots > 5 {
				return // filling 64 slots with loop devices proves nothing more
			}
			var disks []hypervisor.Disk
			for i := range tt.wantSlots + 1 {
				device, _ := e.loop(t, 16*mib)
				disks = append(disks, hypervisor.Disk{Serial: fmt.Sprintf("disk-%d", i), Device: device})
			}
			for _, disk := range disks[:tt.wantSlots] {
				g.Expect(d.Attach(t.Context(), vm, disk)).To(Succeed())
			}
			extra := disks[tt.wantSlots]
			g.Expect(d.Attach(t.Context(), vm, extra)).To(MatchError(hypervisor.ErrNoSlot))
			g.Expect(d.Disks(t.Context(), vm)).To(HaveLen(tt.wantSlots), "the refused disk is not plugged")
			g.Expect(d.Attach(t.Context(), vm, disks[0])).To(Succeed(), "repeating an attach of a disk that has its slot succeeds")

			g.Expect(d.Detach(t.Context(), vm, disks[0].Serial)).To(Succeed())
			g.Expect(d.Attach(t.Context(), vm, extra)).To(Succeed(), "a detach frees a slot")
			for _, disk := range disks[1:] {
				g.Expect(d.Detach(t.Context(), vm, disk.Serial)).To(Succeed())
			}
		})
	}
}

func TestSizeIsRefreshedAfterTheDeviceGrew(t *testing.T) {
	tests := []struct {
		name    string
		refresh func(t *testing.T, d *Driver, vm hypervisor.VM, disk hypervisor.Disk)
	}{
		{
			name: "by Disks",
			refresh: func(t *testing.T, d *Driver, vm hypervisor.VM, _ hypervisor.Disk) {
				NewWithT(t).Expect(d.Disks(t.Context(), vm)).To(HaveLen(1))
			},
		},
		{
			name: "by a repeated Attach",
			refresh: func(t *testing.T, d *Driver, vm hypervisor.VM, disk hypervisor.Disk) {
				NewWithT(t).Expect(d.Attach(t.Context(), vm, disk)).To(Succeed())
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			e := newEnv(t)
			vm := e.runningVM(t, "node-1")
			device, file := e.loop(t, 16*mib)
			disk := hypervisor.Disk{Serial: "disk-1", Device: device}
			g.Expect(e.d.Attach(t.Context(), vm, disk)).To(Succeed())
			size := filepath.Join(e.vmDir(vm), "sys/block/vda/size")
			g.Expect(os.ReadFile(size)).To(BeEquivalentTo("32768\n"))

			grow(t, device, file, 48*mib)
			tt.refresh(t, e.d, vm, disk)

			g.Expect(os.ReadFile(size)).To(BeEquivalentTo("98304\n"))
		})
	}
}

// TestInterruptedOperationsConverge starts from the states an agent killed in the middle of an
// Attach or a Detach leaves, made by removing from a complete disk what the interrupted
// operation had not written yet (Attach) or had removed already (Detach).
func TestInterruptedOperationsConverge(t *testing.T) {
	tests := []struct {
		name string
		// missing are the paths in the VM directory that the interrupted operation left absent.
		missing []string
		// visible says whether the guest sees the disk by its serial in that state.
		visible bool
	}{
		{
			name:    "attach interrupted after the record",
			missing: []string{"dev/disk/by-id/virtio-disk-1", "sys/block/vda", "dev/vda"},
		},
		{
			name:    "attach interrupted after the device node",
			missing: []string{"dev/disk/by-id/virtio-disk-1", "sys/block/vda"},
		},
		{
			name:    "attach interrupted before the by-id link, or detach after removing it",
			missing: []string{"dev/disk/by-id/virtio-disk-1"},
			visible: true,
		},
		{
			name:    "detach interrupted after the device node",
			missing: []string{"dev/disk/by-id/virtio-disk-1", "dev/vda"},
			visible: true,
		},
	}
	for _, tt := range tests {
		for _, resume := range []string{"attach", "detach"} {
			t.Run(tt.name+", then "+resume, func(t *testing.T) {
				g := NewWithT(t)
				e := newEnv(t)
				vm := e.runningVM(t, "node-1")
				vmDir := e.vmDir(vm)
				device, _ := e.loop(t, 16*mib)
				disk := hypervisor.Disk{Serial: "disk-1", Device: device}
				g.Expect(e.d.Attach(t.Context(), vm, disk)).To(Succeed())
				for _, p := range tt.missing {
					g.Expect(os.RemoveAll(filepath.Join(vmDir, p))).To(Succeed())
				}
				// A half-built sys/block directory from the interrupted write.
				g.Expect(os.MkdirAll(filepath.Join(vmDir, ".hypervisor/tmp/vda"), 0o755)).To(Succeed())
				g.Expect(os.WriteFile(filepath.Join(vmDir, ".hypervisor/tmp/vda/dev"), []byte("7:0\n"), 0o644)).To(Succeed())

				if tt.visible {
					g.Expect(guestDisks(t, vmDir)).To(Equal(map[string]string{"disk-1": "vda"}))
				} else {
					g.Expect(guestDisks(t, vmDir)).To(BeEmpty(), "the guest never sees an incomplete disk")
				}
				d := e.driver(t, Options{}) // the restarted agent
				g.Expect(d.Disks(t.Context(), vm)).To(BeEmpty(), "a disk is listed once Attach made all of it")
				g.Expect(d.PowerOff(t.Context(), vm)).To(MatchError(hypervisor.ErrBusy), "it holds its device until it is resolved")

				switch resume {
				case "attach":
					g.Expect(d.Attach(t.Context(), vm, disk)).To(Succeed())
					expectDisk(g, vmDir, "vda", "disk-1", device)
					g.Expect(guestDisks(t, vmDir)).To(Equal(map[string]string{"disk-1": "vda"}))
					g.Expect(d.Disks(t.Context(), vm)).To(Equal([]hypervisor.Disk{disk}))
				case "detach":
					g.Expect(d.Detach(t.Context(), vm, "disk-1")).To(Succeed())
					expectNoDisk(g, vmDir, "vda", "disk-1")
					g.Expect(d.Disks(t.Context(), vm)).To(BeEmpty())
				}
			})
		}
	}
}

func TestConcurrentAttachesAndDetaches(t *testing.T) {
	g := NewWithT(t)
	e := newEnv(t)
	vm := e.runningVM(t, "node-1")
	const n = 6
	disks := make([]hypervisor.Disk, n)
	for i := range disks {
		device, _ := e.loop(t, 16*mib)
		disks[i] = hypervisor.Disk{Serial: fmt.Sprintf("disk-%d", i), Device: device}
	}

	var wg sync.WaitGroup
	errs := make([]error, n)
	for i, disk := range disks {
		wg.Go(func() { errs[i] = e.d.Attach(t.Context(), vm, disk) })
	}
	wg.Wait()
	for _, err := range errs {
		g.Expect(err).NotTo(HaveOccurred())
	}
	g.Expect(e.d.Disks(t.Context(), vm)).To(ConsistOf(disks))
	names := make(map[string]bool)
	for serial, name := range guestDisks(t, e.vmDir(vm)) {
		g.Expect(names).NotTo(HaveKey(name), "disk %s has a name of its own", serial)
		names[name] = true
	}
	g.Expect(names).To(HaveLen(n))

	for i, disk := range disks {
		wg.Go(func() { errs[i] = e.d.Detach(t.Context(), vm, disk.Serial) })
	}
	wg.Wait()
	for _, err := range errs {
		g.Expect(err).NotTo(HaveOccurred())
	}
	g.Expect(e.d.Disks(t.Context(), vm)).To(BeEmpty())
	g.Expect(guestDisks(t, e.vmDir(vm))).To(BeEmpty())
}
