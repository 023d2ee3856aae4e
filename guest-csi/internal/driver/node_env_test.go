package driver

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"

	"pvbridge.io/pkg/csinode/csinodetest"
	"pvbridge.io/pkg/mounter"
)

const (
	mib = int64(1) << 20
	// testDiskSize is the size of a test disk: mkfs.xfs refuses filesystems under 300 MB. The
	// loop devices' backing files are sparse.
	testDiskSize = 512 * mib
	testNode     = "tenant-a-md-0-x7k2p"
	testHost     = "host-a"
)

// fakeHost is a Host that knows host, or fails with err.
type fakeHost struct {
	host string
	err  error
}

func (f fakeHost) HostOf(context.Context) (string, error) { return f.host, f.err }

// vmEnv is a node service in a fake VM: a device tree in a temporary directory laid out as the
// local hypervisor lays out a VM's (<root>/sys/block/vdX/serial, the block node <root>/dev/vdX,
// the link <root>/dev/disk/by-id/virtio-<serial>), with disks that are real loop devices. Its
// cleanup fails the test if a mount under the directory or an attached loop device is left
// behind.
type vmEnv struct {
	n     *nodeServer
	dir   string
	root  string
	files map[string]string // serial → backing file
	nodes map[string]string // serial → device node in the VM
}

func newVMEnv(t *testing.T) *vmEnv {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Fatal("the node service tests mount real loop devices and must run as root")
	}
	dir := t.TempDir()
	e := &vmEnv{
		dir:   dir,
		root:  filepath.Join(dir, "vm"),
		files: map[string]string{},
		nodes: map[string]string{},
	}
	e.n = newNodeServer(testNode, fakeHost{host: testHost}, e.root, mounter.New())
	t.Cleanup(func() {
		for _, mp := range mountsUnder(t, e.dir) {
			t.Errorf("mount left behind at %s", mp)
			_ = unix.Unmount(mp, unix.MNT_DETACH)
		}
		for _, file := range e.files {
			for _, device := range loopsOf(t, file) {
				if out, err := exec.Command("losetup", "-d", device).CombinedOutput(); err != nil {
					t.Errorf("detach %s: %v: %s", device, err, out)
				}
			}
			if devs := loopsOf(t, file); len(devs) > 0 {
				t.Errorf("loop devices %v still attached to %s", devs, file)
			}
		}
	})
	return e
}

// path returns a path under the sandbox, outside the VM's device tree.
func (e *vmEnv) path(name string) string { return filepath.Join(e.dir, name) }

// hotplug makes a blank loop device and attaches it to the VM as disk name with serial:
// the node, then sys/block (unless bySysfs is false), then the by-id link (unless byID is
// false), as the local hypervisor does. It returns the node in the VM.
func (e *vmEnv) hotplug(t *testing.T, name, serial string, bySysfs, byID bool) string {
	t.Helper()
	file := e.path(serial + ".img")
	if err := os.WriteFile(file, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(file, testDiskSize); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("losetup", "--find", "--show", file).CombinedOutput()
	if err != nil {
		t.Fatalf("losetup: %v: %s", err, out)
	}
	e.files[serial] = file
	var loop unix.Stat_t
	if err := unix.Stat(strings.TrimSpace(string(out)), &loop); err != nil {
		t.Fatal(err)
	}

	node := filepath.Join(e.root, "dev", name)
	mkdir(t, filepath.Dir(node))
	if err := unix.Mknod(node, unix.S_IFBLK|0o660, int(loop.Rdev)); err != nil {
		t.Fatalf("mknod %s: %v", node, err)
	}
	if bySysfs {
		sys := filepath.Join(e.root, "sys", "block", name)
		mkdir(t, sys)
		if err := os.WriteFile(filepath.Join(sys, "serial"), []byte(serial+"\n"), 0o444); err != nil {
			t.Fatal(err)
		}
	} else {
		// The disk is listed, without a serial file: like a disk udev has seen first.
		mkdir(t, filepath.Join(e.root, "sys", "block", name))
	}
	if byID {
		link := filepath.Join(e.root, "dev", "disk", "by-id", "virtio-"+serial)
		mkdir(t, filepath.Dir(link))
		if err := os.Symlink("../../"+name, link); err != nil {
			t.Fatal(err)
		}
	}
	e.nodes[serial] = node
	return node
}

// disk attaches a disk the usual way, seen through both sysfs and udev.
func (e *vmEnv) disk(t *testing.T, name, serial string) string {
	t.Helper()
	return e.hotplug(t, name, serial, true, true)
}

// grow grows the disk with serial to size bytes.
func (e *vmEnv) grow(t *testing.T, serial string, size int64) {
	t.Helper()
	if err := os.Truncate(e.files[serial], size); err != nil {
		t.Fatal(err)
	}
	for _, device := range loopsOf(t, e.files[serial]) {
		if out, err := exec.Command("losetup", "--set-capacity", device).CombinedOutput(); err != nil {
			t.Fatalf("losetup --set-capacity: %v: %s", err, out)
		}
	}
}

// staged attaches disk vdb with serial as volume id and stages it with capability c at
// <dir>/<id>-staging.
func (e *vmEnv) staged(t *testing.T, id, serial string, c *csi.VolumeCapability) string {
	t.Helper()
	e.disk(t, "vdb", serial)
	staging := e.path(id + "-staging")
	if _, err := e.n.NodeStageVolume(t.Context(), &csi.NodeStageVolumeRequest{
		VolumeId: id, StagingTargetPath: staging, VolumeCapability: c, PublishContext: publishContext(serial),
	}); err != nil {
		t.Fatalf("stage: %v", err)
	}
	t.Cleanup(func() { _ = e.n.Mounter.Unmount(context.Background(), staging) })
	return staging
}

// published stages volume id and publishes it at <dir>/<id>-target.
func (e *vmEnv) published(t *testing.T, id, serial string, c *csi.VolumeCapability) (staging, target string) {
	t.Helper()
	staging = e.staged(t, id, serial, c)
	target = e.path(id + "-target")
	if _, err := e.n.NodePublishVolume(t.Context(), &csi.NodePublishVolumeRequest{
		VolumeId: id, StagingTargetPath: staging, TargetPath: target, VolumeCapability: c, PublishContext: publishContext(serial),
	}); err != nil {
		t.Fatalf("publish: %v", err)
	}
	t.Cleanup(func() { _ = e.n.Mounter.Unmount(context.Background(), target) })
	return staging, target
}

// locked holds volume id's lock for the rest of the test, as a call in progress would.
func (e *vmEnv) locked(t *testing.T, id string) {
	t.Helper()
	if !e.n.Locks.TryLock(id) {
		t.Fatalf("volume %s is locked already", id)
	}
	t.Cleanup(func() { e.n.Locks.Unlock(id) })
}

func publishContext(serial string) map[string]string {
	return map[string]string{PublishContextSerial: serial}
}

func mkdir(t *testing.T, dir string) {
	t.Helper()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
}

// The helpers shared with the other driver's tests.
var (
	fsCap       = csinodetest.FsCap
	rawCap      = csinodetest.RawCap
	withMode    = csinodetest.WithMode
	expectCode  = csinodetest.ExpectCode
	mountsUnder = csinodetest.MountsUnder
	loopsOf     = csinodetest.LoopsOf
	blkidType   = csinodetest.BlkidType
)

// format makes a filesystem of fsType on device, as data a tenant left there.
func format(t *testing.T, device, fsType string) {
	t.Helper()
	if out, err := exec.Command("mkfs."+fsType, device).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.%s: %v: %s", fsType, err, out)
	}
}
