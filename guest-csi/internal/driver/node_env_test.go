package driver

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"

	"pvbridge.io/guest-csi/internal/request"
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

// fakeHost is a Host that knows host and slots, or fails with err.
type fakeHost struct {
	host  string
	slots int64
	err   error
}

func (f fakeHost) VMOf(context.Context) (VM, error) {
	return VM{Host: f.host, MaxVolumes: f.slots}, f.err
}

func (f fakeHost) WaitForHost(ctx context.Context) error {
	if f.host == "" {
		<-ctx.Done()
		return ctx.Err()
	}
	return nil
}

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
			csinodetest.DetachLoops(t, file)
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
	e.files[serial] = file
	node, err := plugDisk(e.root, file, name, serial, testDiskSize, bySysfs, byID)
	if err != nil {
		t.Fatal(err)
	}
	e.nodes[serial] = node
	return node
}

// plugDisk makes a sparse file of size bytes, attaches it to a loop device and shows that as
// disk name with serial in the device tree at root, the way the local hypervisor does. It
// returns the disk's node in the tree.
func plugDisk(root, file, name, serial string, size int64, bySysfs, byID bool) (string, error) {
	if err := os.WriteFile(file, nil, 0o600); err != nil {
		return "", err
	}
	if err := os.Truncate(file, size); err != nil {
		return "", err
	}
	out, err := exec.Command("losetup", "--find", "--show", file).CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("losetup: %w: %s", err, out)
	}
	var loop unix.Stat_t
	if err := unix.Stat(strings.TrimSpace(string(out)), &loop); err != nil {
		return "", err
	}
	node := filepath.Join(root, "dev", name)
	sys := filepath.Join(root, "sys", "block", name)
	link := filepath.Join(root, "dev", "disk", "by-id", "virtio-"+serial)
	for _, dir := range []string{filepath.Dir(node), sys, filepath.Dir(link)} {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return "", err
		}
	}
	if err := unix.Mknod(node, unix.S_IFBLK|0o660, int(loop.Rdev)); err != nil {
		return "", fmt.Errorf("mknod %s: %w", node, err)
	}
	// Without bySysfs the disk is listed without a serial file: like a disk udev has seen first.
	if bySysfs {
		if err := os.WriteFile(filepath.Join(sys, "serial"), []byte(serial+"\n"), 0o444); err != nil {
			return "", err
		}
	}
	if byID {
		if err := os.Symlink("../../"+name, link); err != nil {
			return "", err
		}
	}
	return node, nil
}

// unplugDisk removes disk name with serial from the device tree at root and frees the loop
// devices of its file.
func unplugDisk(root, file, name, serial string) error {
	for _, p := range []string{
		filepath.Join(root, "dev", "disk", "by-id", "virtio-"+serial),
		filepath.Join(root, "dev", name),
		filepath.Join(root, "sys", "block", name),
	} {
		if err := os.RemoveAll(p); err != nil {
			return err
		}
	}
	devices, err := csinodetest.LoopDevices(file)
	if err != nil {
		return err
	}
	for _, device := range devices {
		if out, err := exec.Command("losetup", "-d", device).CombinedOutput(); err != nil {
			return fmt.Errorf("losetup -d %s: %w: %s", device, err, out)
		}
	}
	return os.Remove(file)
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
	return map[string]string{request.PublishContextSerial: serial}
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
