package local

import (
	"bytes"
	"context"
	"encoding/binary"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"golang.org/x/sys/unix"

	"pvbridge.io/pkg/qsd"
	"pvbridge.io/vm-operator/internal/hypervisor"
)

func TestThrottledDiskIsLimitedLive(t *testing.T) {
	g := NewWithT(t)
	e := newEnv(t)
	vm := e.runningVM(t, "node-1")
	device, _ := e.loop(t, 64*mib)
	limits := hypervisor.Limits{BytesPerSecond: 4 * mib}
	disk := hypervisor.Disk{Serial: "disk-1", Device: device, Limits: &limits}

	g.Expect(e.d.Attach(t.Context(), vm, disk)).To(Succeed())

	expectThrottledDisk(g, e, vm, "vda", "disk-1", device)
	g.Expect(e.d.Disks(t.Context(), vm)).To(Equal([]hypervisor.Disk{disk}), "the original device, with its limits")
	node := filepath.Join(e.vmDir(vm), "dev/disk/by-id/virtio-disk-1")
	slow := readRate(t, node, 0, 6*mib)
	t.Logf("read at %.2f MiB/s with a limit of 4 MiB/s", slow/float64(mib))
	g.Expect(slow).To(BeNumerically("<", 1.5*float64(limits.BytesPerSecond)))

	raised := hypervisor.Limits{BytesPerSecond: 256 * mib}
	g.Expect(e.d.SetLimits(t.Context(), vm, "disk-1", raised)).To(Succeed())
	g.Expect(e.d.SetLimits(t.Context(), vm, "disk-1", raised)).To(Succeed(), "setting the limits it has")

	g.Expect(e.d.Disks(t.Context(), vm)).To(Equal([]hypervisor.Disk{{Serial: "disk-1", Device: device, Limits: &raised}}))
	fast := readRate(t, node, 8*mib, 16*mib)
	t.Logf("read at %.2f MiB/s with a limit of 256 MiB/s", fast/float64(mib))
	g.Expect(fast).To(BeNumerically(">", 4*slow), "the new limits apply at once")
	// The guest's writes land on the host device.
	data := bytes.Repeat([]byte("pvbridge"), int(mib)/8)
	writeDirect(t, node, 32*mib, data)
	g.Expect(readDirect(t, device, 32*mib, mib)).To(Equal(data))
	pid := daemonPidOf(g, e, vm, "disk-1")

	g.Expect(e.d.Detach(t.Context(), vm, "disk-1")).To(Succeed())

	expectNoDisk(g, e.vmDir(vm), "vda", "disk-1")
	expectNoThrottle(g, e, vm, "disk-1", pid)
	g.Expect(e.d.Disks(t.Context(), vm)).To(BeEmpty())
	g.Expect(e.d.Detach(t.Context(), vm, "disk-1")).To(Succeed(), "detaching it again does nothing")
}

// TestThrottledDiskKeepsConcurrentWritesIntact writes from many threads at once while the
// throttle holds writes back, as a guest's writeback does: QEMU 7.2's FUSE export mixes up
// the data of concurrent writes, which the loop device must not send it.
func TestThrottledDiskKeepsConcurrentWritesIntact(t *testing.T) {
	g := NewWithT(t)
	e := newEnv(t)
	vm := e.runningVM(t, "node-1")
	device, _ := e.loop(t, 64*mib)
	g.Expect(e.d.Attach(t.Context(), vm, hypervisor.Disk{Serial: "disk-1", Device: device, Limits: &hypervisor.Limits{BytesPerSecond: 64 * mib}})).To(Succeed())
	node := filepath.Join(e.vmDir(vm), "dev/vda")
	const writers, size = 16, 2 * mib
	patterns := make([][]byte, writers)
	var wg sync.WaitGroup
	for i := range writers {
		// Every 8 bytes hold their own offset on the disk: a misplaced piece shows.
		patterns[i] = make([]byte, size)
		for j := int64(0); j < size; j += 8 {
			binary.LittleEndian.PutUint64(patterns[i][j:], uint64(int64(i)*size*2+j))
		}
		wg.Go(func() { writeDirect(t, node, int64(i)*size*2, patterns[i]) })
	}
	wg.Wait()

	for i, want := range patterns {
		g.Expect(bytes.Equal(readDirect(t, device, int64(i)*size*2, size), want)).To(BeTrue(), "write %d landed intact", i)
	}
	g.Expect(e.d.Detach(t.Context(), vm, "disk-1")).To(Succeed())
}

func TestSetLimitsRefusals(t *testing.T) {
	tests := []struct {
		name string
		// setup returns the VM whose disk-1 gets limits.
		setup   func(t *testing.T, e *env) hypervisor.VM
		limits  hypervisor.Limits
		wantErr error
		// wantMsg is part of the error's message.
		wantMsg string
	}{
		{
			name: "disk attached without limits",
			setup: func(t *testing.T, e *env) hypervisor.VM {
				vm := e.runningVM(t, "node-1")
				device, _ := e.loop(t, 16*mib)
				NewWithT(t).Expect(e.d.Attach(t.Context(), vm, hypervisor.Disk{Serial: "disk-1", Device: device})).To(Succeed())
				return vm
			},
			limits:  hypervisor.Limits{IOPS: 100},
			wantErr: hypervisor.ErrNotLive,
		},
		{
			name:    "disk not attached",
			setup:   func(t *testing.T, e *env) hypervisor.VM { return e.runningVM(t, "node-1") },
			limits:  hypervisor.Limits{IOPS: 100},
			wantMsg: "no disk with that serial is attached",
		},
		{
			name:    "VM that does not run",
			setup:   func(*testing.T, *env) hypervisor.VM { return hypervisor.VM{Namespace: "tenant-a", Name: "node-1"} },
			limits:  hypervisor.Limits{IOPS: 100},
			wantErr: hypervisor.ErrVMNotFound,
		},
		{
			name:    "negative limits",
			setup:   func(t *testing.T, e *env) hypervisor.VM { return e.runningVM(t, "node-1") },
			limits:  hypervisor.Limits{BytesPerSecond: -1},
			wantErr: errInvalid,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			e := newEnv(t)
			vm := tt.setup(t, e)

			err := e.d.SetLimits(t.Context(), vm, "disk-1", tt.limits)

			g.Expect(err).To(HaveOccurred())
			if tt.wantErr != nil {
				g.Expect(err).To(MatchError(tt.wantErr))
			}
			if tt.wantMsg != "" {
				g.Expect(err).To(MatchError(ContainSubstring(tt.wantMsg)))
				g.Expect(err).NotTo(MatchError(hypervisor.ErrNotLive))
			}
			for _, disk := range mustDisks(g, e.d, vm) {
				g.Expect(disk.Limits).To(BeNil(), "the disk keeps no limits")
			}
			_ = e.d.Detach(t.Context(), vm, "disk-1")
		})
	}
}

// TestInterruptedThrottledOperationsConverge starts from the states that an agent or a daemon
// killed in the middle of things leaves, made by taking away from a complete throttled disk
// what had not been made yet, or had been removed already, and resumes with a restarted agent.
func TestInterruptedThrottledOperationsConverge(t *testing.T) {
	tests := []struct {
		name string
		// interrupt takes the complete disk to the state to start from.
		interrupt func(t *testing.T, e *env, vm hypervisor.VM, dd daemonDir)
		// sameDaemon says whether the resumed Attach keeps the daemon that ran.
		sameDaemon bool
	}{
		{
			name:       "agent restarted",
			interrupt:  func(*testing.T, *env, hypervisor.VM, daemonDir) {},
			sameDaemon: true,
		},
		{
			name: "daemon killed",
			interrupt: func(t *testing.T, _ *env, _ hypervisor.VM, dd daemonDir) {
				killDaemon(t, dd)
			},
		},
		{
			name: "attach interrupted after the record",
			interrupt: func(t *testing.T, e *env, vm hypervisor.VM, dd daemonDir) {
				removeView(t, e.vmDir(vm), "vda", "disk-1")
				NewWithT(t).Expect(e.d.stopThrottle(t.Context(), dd)).To(Succeed())
			},
		},
		{
			name: "attach interrupted after starting the daemon",
			interrupt: func(t *testing.T, e *env, vm hypervisor.VM, dd daemonDir) {
				removeView(t, e.vmDir(vm), "vda", "disk-1")
				NewWithT(t).Expect(e.d.detachLoops(dd.Path(exportFile))).To(Succeed())
			},
			sameDaemon: true,
		},
		{
			name: "detach interrupted after removing the guest's view",
			interrupt: func(t *testing.T, e *env, vm hypervisor.VM, _ daemonDir) {
				removeView(t, e.vmDir(vm), "vda", "disk-1")
			},
			sameDaemon: true,
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
				limits := hypervisor.Limits{IOPS: 1000, BytesPerSecond: 64 * mib}
				disk := hypervisor.Disk{Serial: "disk-1", Device: device, Limits: &limits}
				g.Expect(e.d.Attach(t.Context(), vm, disk)).To(Succeed())
				dd := e.d.daemonDir(vm, "disk-1")
				pid := daemonPidOf(g, e, vm, "disk-1")
				tt.interrupt(t, e, vm, dd)
				d := e.driver(t, Options{}) // the restarted agent

				switch resume {
				case "attach":
					g.Expect(d.Attach(t.Context(), vm, disk)).To(Succeed())
					expectThrottledDisk(g, e, vm, "vda", "disk-1", device)
					g.Expect(d.Disks(t.Context(), vm)).To(Equal([]hypervisor.Disk{disk}))
					if tt.sameDaemon {
						g.Expect(daemonPidOf(g, e, vm, "disk-1")).To(Equal(pid), "the daemon that runs is kept")
					}
					g.Expect(readDirect(t, filepath.Join(vmDir, "dev/vda"), 15*mib, mib)).To(HaveLen(int(mib)), "the guest reads its disk")
					pid = daemonPidOf(g, e, vm, "disk-1")
					g.Expect(d.Detach(t.Context(), vm, "disk-1")).To(Succeed())
				case "detach":
					g.Expect(d.Detach(t.Context(), vm, "disk-1")).To(Succeed())
				}
				expectNoDisk(g, vmDir, "vda", "disk-1")
				expectNoThrottle(g, e, vm, "disk-1", pid)
				g.Expect(d.Disks(t.Context(), vm)).To(BeEmpty())
			})
		}
	}
}

func TestKilledDaemonMakesTheDiskUnlisted(t *testing.T) {
	g := NewWithT(t)
	e := newEnv(t)
	vm := e.runningVM(t, "node-1")
	device, _ := e.loop(t, 16*mib)
	disk := hypervisor.Disk{Serial: "disk-1", Device: device, Limits: &hypervisor.Limits{}}
	g.Expect(e.d.Attach(t.Context(), vm, disk)).To(Succeed())
	g.Expect(e.d.Disks(t.Context(), vm)).To(HaveLen(1))

	killDaemon(t, e.d.daemonDir(vm, "disk-1"))

	g.Expect(e.d.Disks(t.Context(), vm)).To(BeEmpty(), "the guest cannot use it: the caller attaches it again")
	g.Expect(e.d.SetLimits(t.Context(), vm, "disk-1", hypervisor.Limits{IOPS: 10})).To(MatchError(ContainSubstring("does not run")))
	g.Expect(e.d.PowerOff(t.Context(), vm)).To(MatchError(hypervisor.ErrBusy), "it holds its device until it is resolved")
	g.Expect(e.d.Attach(t.Context(), vm, disk)).To(Succeed())
	g.Expect(e.d.Disks(t.Context(), vm)).To(Equal([]hypervisor.Disk{disk}))
	g.Expect(e.d.Detach(t.Context(), vm, "disk-1")).To(Succeed())
}

func TestThrottledDiskFollowsItsDeviceWhenItGrows(t *testing.T) {
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
			disk := hypervisor.Disk{Serial: "disk-1", Device: device, Limits: &hypervisor.Limits{BytesPerSecond: 64 * mib}}
			g.Expect(e.d.Attach(t.Context(), vm, disk)).To(Succeed())
			size := filepath.Join(e.vmDir(vm), "sys/block/vda/size")
			g.Expect(os.ReadFile(size)).To(BeEquivalentTo("32768\n"))

			grow(t, device, file, 48*mib)
			tt.refresh(t, e.d, vm, disk)

			g.Expect(os.ReadFile(size)).To(BeEquivalentTo("98304\n"))
			node := filepath.Join(e.vmDir(vm), "dev/vda")
			g.Expect(sectorsOf(g, node)).To(BeEquivalentTo(98304), "the guest's device grew")
			data := bytes.Repeat([]byte("grown"), int(mib)/5+1)[:mib]
			writeDirect(t, node, 47*mib, data)
			g.Expect(readDirect(t, device, 47*mib, mib)).To(Equal(data), "the new space is the device's")
			g.Expect(e.d.Detach(t.Context(), vm, "disk-1")).To(Succeed())
		})
	}
}

func TestForceOffReleasesAThrottledDiskTheGuestHolds(t *testing.T) {
	g := NewWithT(t)
	e := newEnv(t)
	vm := e.runningVM(t, "node-1")
	vmDir := e.vmDir(vm)
	device, _ := e.loop(t, 64*mib)
	g.Expect(e.d.Attach(t.Context(), vm, hypervisor.Disk{Serial: "disk-1", Device: device, Limits: &hypervisor.Limits{}})).To(Succeed())
	pid := daemonPidOf(g, e, vm, "disk-1")
	byID := filepath.Join(vmDir, "dev/disk/by-id/virtio-disk-1")
	run(t, "mkfs.ext4", "-q", byID)
	mnt := e.path("staging")
	g.Expect(os.Mkdir(mnt, 0o755)).To(Succeed())
	run(t, "mount", byID, mnt)
	g.Expect(os.WriteFile(filepath.Join(mnt, "hello"), []byte("from the guest"), 0o644)).To(Succeed())
	err := e.d.Detach(t.Context(), vm, "disk-1")
	g.Expect(err).To(MatchError(hypervisor.ErrBusy))
	g.Expect(err).To(MatchError(ContainSubstring("mounted at " + mnt)))

	g.Expect(e.d.ForceOff(t.Context(), vm)).To(Succeed())

	g.Expect(e.d.Running(t.Context(), vm)).To(BeFalse())
	expectNoDisk(g, vmDir, "vda", "disk-1")
	expectNoThrottle(g, e, vm, "disk-1", pid)
	g.Expect(mountsUnder(t, e.dir)).To(BeEmpty(), "the guest's mount went with it")
	g.Expect(run(t, "debugfs", "-R", "cat /hello", device)).To(Equal("from the guest"), "what the guest wrote is on the device")
}

// expectThrottledDisk checks the guest's complete view of the throttled disk name with serial
// over device: what expectDisk checks, with the number of the loop device over the export of
// the disk's daemon, which runs.
func expectThrottledDisk(g Gomega, e *env, vm hypervisor.VM, name, serial, device string) {
	dd := e.d.daemonDir(vm, serial)
	g.Expect(qsd.Pid(dd)).NotTo(BeZero(), "the daemon runs")
	loops, err := e.d.loopsOver(dd.Path(exportFile))
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(loops).To(HaveLen(1), "one loop device over the daemon's export")
	loop := loops[0]
	vmDir := e.vmDir(vm)
	g.Expect(os.ReadFile(filepath.Join(vmDir, "sys/block", name, "serial"))).To(BeEquivalentTo(serial + "\n"))
	g.Expect(os.ReadFile(filepath.Join(vmDir, "sys/block", name, "dev"))).To(BeEquivalentTo(formatDev(loop.dev) + "\n"))
	var node unix.Stat_t
	g.Expect(unix.Lstat(filepath.Join(vmDir, "dev", name), &node)).To(Succeed())
	g.Expect(node.Mode&unix.S_IFMT).To(BeEquivalentTo(unix.S_IFBLK), "dev/%s is a block device", name)
	g.Expect(node.Rdev).To(Equal(loop.dev), "dev/%s is the loop device over the export", name)
	g.Expect(os.Readlink(filepath.Join(vmDir, "dev/disk/by-id", "virtio-"+serial))).To(Equal("../../" + name))
	g.Expect(os.ReadFile(filepath.Join("/sys/block", loop.name, "loop/dio"))).To(BeEquivalentTo("0\n"), "no direct I/O (see attachLoop)")
	sectors := sectorsOf(g, device)
	g.Expect(sectorsOf(g, "/dev/"+loop.name)).To(Equal(sectors), "the loop device has the host device's size")
	g.Expect(os.ReadFile(filepath.Join(vmDir, "sys/block", name, "size"))).To(BeEquivalentTo(itoa(sectors) + "\n"))
}

// expectNoThrottle checks that nothing is left of the daemon of the disk with serial, which
// ran as pid: neither the process, nor its directory, nor a loop device over its export, nor a
// mount in the run directory.
func expectNoThrottle(g Gomega, e *env, vm hypervisor.VM, serial string, pid int) {
	g.Expect(processAlive(pid)).To(BeFalse(), "qemu-storage-daemon %d has exited", pid)
	dd := e.d.daemonDir(vm, serial)
	_, err := os.Lstat(string(dd))
	g.Expect(err).To(MatchError(os.ErrNotExist), "the daemon's directory is gone")
	g.Expect(e.d.loopsOver(dd.Path(exportFile))).To(BeEmpty(), "no loop device over the export")
	data, err := os.ReadFile(mountInfo)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(string(data)).NotTo(ContainSubstring(e.runDir), "no mount in the run directory")
}

// daemonPidOf returns the pid of the running daemon of the disk with serial.
func daemonPidOf(g Gomega, e *env, vm hypervisor.VM, serial string) int {
	pid, err := qsd.Pid(e.d.daemonDir(vm, serial))
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(pid).NotTo(BeZero(), "the daemon of %s runs", serial)
	return pid
}

// killDaemon kills the daemon of dd as a crash would and waits until it has exited.
func killDaemon(t *testing.T, dd daemonDir) {
	t.Helper()
	g := NewWithT(t)
	g.Expect(qsd.Pid(dd)).NotTo(BeZero())
	g.Expect(qsd.Kill(t.Context(), dd)).To(Succeed())
}

// processAlive reports whether pid runs (a zombie has exited).
func processAlive(pid int) bool {
	data, err := os.ReadFile(filepath.Join("/proc", itoa(uint64(pid)), "stat"))
	if err != nil {
		return false
	}
	// The state follows the command's name, which is in parentheses.
	fields := strings.Fields(string(data[bytes.LastIndexByte(data, ')')+1:]))
	return len(fields) > 0 && fields[0] != "Z" && fields[0] != "X"
}

// removeView removes what the guest sees of disk name with serial, as an interrupted attach
// had not made it yet or an interrupted detach had removed it already.
func removeView(t *testing.T, vmDir, name, serial string) {
	t.Helper()
	for _, p := range []string{"dev/disk/by-id/virtio-" + serial, "sys/block/" + name, "dev/" + name} {
		if err := os.RemoveAll(filepath.Join(vmDir, p)); err != nil {
			t.Fatal(err)
		}
	}
}

// mustDisks returns the disks of vm.
func mustDisks(g Gomega, d *Driver, vm hypervisor.VM) []hypervisor.Disk {
	disks, err := d.Disks(context.Background(), vm)
	g.Expect(err).NotTo(HaveOccurred())
	return disks
}

// readRate reads n bytes of the block device at path from offset with direct I/O, a MiB at a
// time as a guest reading its disk would, and returns the rate in bytes per second.
func readRate(t *testing.T, path string, offset, n int64) float64 {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDONLY|unix.O_DIRECT, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	buf := alignedBuffer(t, int(mib))
	start := time.Now()
	for done := int64(0); done < n; done += mib {
		if _, err := f.ReadAt(buf, offset+done); err != nil {
			t.Fatal(err)
		}
	}
	return float64(n) / time.Since(start).Seconds()
}

// readDirect reads n bytes of the block device at path from offset, with direct I/O.
func readDirect(t *testing.T, path string, offset, n int64) []byte {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDONLY|unix.O_DIRECT, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	buf := alignedBuffer(t, int(n))
	if _, err := f.ReadAt(buf, offset); err != nil {
		t.Fatal(err)
	}
	return bytes.Clone(buf)
}

// writeDirect writes data to the block device at path at offset, with direct I/O.
func writeDirect(t *testing.T, path string, offset int64, data []byte) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_WRONLY|unix.O_DIRECT, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	buf := alignedBuffer(t, len(data))
	copy(buf, data)
	if _, err := f.WriteAt(buf, offset); err != nil {
		t.Fatal(err)
	}
}

// alignedBuffer returns a page-aligned buffer of size bytes, as direct I/O needs.
func alignedBuffer(t *testing.T, size int) []byte {
	t.Helper()
	buf, err := unix.Mmap(-1, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Munmap(buf) })
	return buf
}
