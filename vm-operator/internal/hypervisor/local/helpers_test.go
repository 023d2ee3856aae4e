package local

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	. "github.com/onsi/gomega"
	"golang.org/x/sys/unix"

	"pvbridge.io/pkg/csinode/csinodetest"
	"pvbridge.io/vm-operator/internal/hypervisor"
)

const mib = int64(1) << 20

// env is one test's sandbox: a temporary directory holding the VM root, the backing files of
// loop devices and mount points, a short run directory for the daemons of throttled disks, and
// a Driver on that root. Its cleanup fails the test if a daemon, a mount under either
// directory or a loop device on one of its files is left behind, after taking them away so
// that later tests start clean.
type env struct {
	dir    string
	root   string
	runDir string
	d      *Driver
	files  []string
}

func newEnv(t *testing.T) *env {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Fatal("these tests make device nodes and mount real loop devices: they must run as root")
	}
	dir := t.TempDir()
	// Not under dir, whose name follows the test's: the daemons' sockets need a short path.
	runDir, err := os.MkdirTemp("", "qsd-")
	if err != nil {
		t.Fatal(err)
	}
	e := &env{dir: dir, root: filepath.Join(dir, "vms"), runDir: runDir}
	e.d = e.driver(t, Options{})
	t.Cleanup(func() {
		// The daemons first: they hold loop devices of the test's files.
		entries, err := os.ReadDir(runDir)
		if err != nil {
			t.Error(err)
		}
		for _, entry := range entries {
			t.Errorf("qemu-storage-daemon directory left behind: %s", entry.Name())
			dd := daemonDir(filepath.Join(runDir, entry.Name()))
			if err := (&Driver{sysfs: "/sys"}).stopThrottle(context.Background(), dd); err != nil {
				t.Error(err)
			}
		}
		_ = os.RemoveAll(runDir)
		mounts := append(mountsUnder(t, runDir), mountsUnder(t, dir)...)
		for _, mp := range slices.Backward(mounts) {
			t.Errorf("mount left behind at %s", mp)
			_ = unix.Unmount(mp, unix.MNT_DETACH)
		}
		for _, f := range e.files {
			csinodetest.DetachLoops(t, f)
		}
	})
	return e
}

// driver returns a new Driver on the sandbox's root, as an agent restarted with opts would.
func (e *env) driver(t *testing.T, opts Options) *Driver {
	t.Helper()
	opts.Root = e.root
	if opts.RunDir == "" {
		opts.RunDir = e.runDir
	}
	d, err := New(opts)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// path returns a path under the sandbox.
func (e *env) path(elem ...string) string { return filepath.Join(append([]string{e.dir}, elem...)...) }

// vmDir returns the directory of vm.
func (e *env) vmDir(vm hypervisor.VM) string { return filepath.Join(e.root, vm.Namespace, vm.Name) }

// runningVM powers on a VM named name.
func (e *env) runningVM(t *testing.T, name string) hypervisor.VM {
	t.Helper()
	vm := hypervisor.VM{Namespace: "tenant-a", Name: name, UID: "uid-" + name}
	if err := e.d.PowerOn(t.Context(), vm); err != nil {
		t.Fatal(err)
	}
	return vm
}

// loop attaches a new sparse file of size bytes as a loop device and returns the device and
// the file.
func (e *env) loop(t *testing.T, size int64) (device, file string) {
	t.Helper()
	f, err := os.CreateTemp(e.dir, "backing-*.img")
	if err != nil {
		t.Fatal(err)
	}
	file = f.Name()
	e.files = append(e.files, file)
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	_ = f.Close()
	return run(t, "losetup", "--find", "--show", file), file
}

// grow makes the backing file of a loop device size bytes and tells the loop driver.
func grow(t *testing.T, device, file string, size int64) {
	t.Helper()
	if err := os.Truncate(file, size); err != nil {
		t.Fatal(err)
	}
	run(t, "losetup", "--set-capacity", device)
}

// mountsUnder lists the mount points under dir, in mount order.
func mountsUnder(t *testing.T, dir string) []string {
	t.Helper()
	data, err := os.ReadFile(mountInfo)
	if err != nil {
		t.Fatal(err)
	}
	mounts, err := parseMountInfo(data)
	if err != nil {
		t.Fatal(err)
	}
	var under []string
	for _, m := range mounts {
		if strings.HasPrefix(m.mountPoint, dir+"/") {
			under = append(under, m.mountPoint)
		}
	}
	return under
}

// run runs a command and returns its trimmed standard output; it fails the test on error.
func run(t *testing.T, name string, args ...string) string {
	t.Helper()
	cmd := exec.Command(name, args...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("%s %s: %v: %s", name, strings.Join(args, " "), err, stderr.String())
	}
	return strings.TrimSpace(string(out))
}

// deviceNumber returns the number of the block device at path.
func deviceNumber(t *testing.T, path string) uint64 {
	t.Helper()
	dev, err := blockDevice(path)
	if err != nil {
		t.Fatal(err)
	}
	return dev
}

// guestDisks returns what a guest sees in vmDir, the way the guest-csi node plugin looks:
// serial → name, from sys/block/*/serial.
func guestDisks(t *testing.T, vmDir string) map[string]string {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(vmDir, "sys/block/*/serial"))
	if err != nil {
		t.Fatal(err)
	}
	disks := make(map[string]string)
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		disks[strings.TrimSuffix(string(data), "\n")] = filepath.Base(filepath.Dir(f))
	}
	return disks
}

// expectDisk checks the guest's complete view of disk name with serial, backed by device.
func expectDisk(g Gomega, vmDir, name, serial, device string) {
	g.Expect(os.ReadFile(filepath.Join(vmDir, "sys/block", name, "serial"))).To(BeEquivalentTo(serial + "\n"))
	var host, node unix.Stat_t
	g.Expect(unix.Stat(device, &host)).To(Succeed())
	g.Expect(os.ReadFile(filepath.Join(vmDir, "sys/block", name, "dev"))).
		To(BeEquivalentTo(itoa(unix.Major(host.Rdev)) + ":" + itoa(unix.Minor(host.Rdev)) + "\n"))
	g.Expect(unix.Lstat(filepath.Join(vmDir, "dev", name), &node)).To(Succeed())
	g.Expect(node.Mode&unix.S_IFMT).To(BeEquivalentTo(unix.S_IFBLK), "dev/%s is a block device", name)
	g.Expect(node.Rdev).To(Equal(host.Rdev), "dev/%s has the host device's number", name)
	g.Expect(os.Readlink(filepath.Join(vmDir, "dev/disk/by-id", "virtio-"+serial))).To(Equal("../../" + name))
	g.Expect(os.ReadFile(filepath.Join(vmDir, "sys/block", name, "size"))).To(BeEquivalentTo(itoa(sectorsOf(g, device)) + "\n"))
}

// expectNoDisk checks that nothing of disk name with serial is left in vmDir.
func expectNoDisk(g Gomega, vmDir, name, serial string) {
	for _, p := range []string{
		"sys/block/" + name,
		"dev/" + name,
		"dev/disk/by-id/virtio-" + serial,
		".hypervisor/disks/" + serial + ".json",
	} {
		_, err := os.Lstat(filepath.Join(vmDir, p))
		g.Expect(err).To(MatchError(os.ErrNotExist), "%s is gone", p)
	}
}

// sectorsOf returns the size of a block device in 512-byte sectors.
func sectorsOf(g Gomega, device string) uint64 {
	f, err := os.Open(device)
	g.Expect(err).NotTo(HaveOccurred())
	defer f.Close()
	size, err := unix.IoctlGetInt(int(f.Fd()), unix.BLKGETSIZE64)
	g.Expect(err).NotTo(HaveOccurred())
	return uint64(size) / 512
}

func itoa[T ~uint32 | ~uint64](n T) string { return strconv.FormatUint(uint64(n), 10) }
