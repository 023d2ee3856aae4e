package driver

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"

	"pvbridge.io/mgmt-csi/internal/pmem"
	"pvbridge.io/pkg/csinode/csinodetest"
	"pvbridge.io/pkg/mounter"
)

const (
	mib = int64(1) << 20
	// testVolumeSize is the size of a test volume: mkfs.xfs refuses filesystems under 300 MB.
	// The loop devices' backing files are sparse.
	testVolumeSize = 512 * mib
	testNode       = "host-a"
)

// fakeDevices is a PMEM back end reduced to what the node service asks of it.
type fakeDevices struct {
	mu      sync.Mutex
	devices map[string]string
	// err, when set, is what every lookup fails with.
	err error
}

func (f *fakeDevices) Device(_ context.Context, volumeID string) (string, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.err != nil {
		return "", f.err
	}
	d, ok := f.devices[volumeID]
	if !ok {
		return "", fmt.Errorf("volume %s: %w", volumeID, pmem.ErrNotFound)
	}
	return d, nil
}

func (f *fakeDevices) Stage(ctx context.Context, volumeID string) (string, error) {
	return f.Device(ctx, volumeID)
}

func (f *fakeDevices) Unstage(context.Context, string) error { return nil }

func (f *fakeDevices) set(volumeID, device string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.devices[volumeID] = device
}

func (f *fakeDevices) remove(volumeID string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.devices, volumeID)
}

// nodeEnv is a node service on real loop devices in a temporary directory. Its cleanup fails
// the test if a mount under the directory or an attached loop device is left behind.
type nodeEnv struct {
	n       *nodeServer
	devices *fakeDevices
	dir     string
	files   map[string]string // volume ID → backing file
}

func newNodeEnv(t *testing.T) *nodeEnv {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Fatal("the node service tests mount real loop devices and must run as root")
	}
	devices := &fakeDevices{devices: map[string]string{}}
	e := &nodeEnv{
		n:       newNodeServer(testNode, 16, devices, mounter.New()),
		devices: devices,
		dir:     t.TempDir(),
		files:   map[string]string{},
	}
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

// path returns a path under the sandbox.
func (e *nodeEnv) path(name string) string { return filepath.Join(e.dir, name) }

// volume makes volume id: a blank loop device on a sparse file.
func (e *nodeEnv) volume(t *testing.T, id string) string {
	t.Helper()
	file := e.path(id + ".img")
	if err := os.WriteFile(file, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(file, testVolumeSize); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("losetup", "--find", "--show", file).CombinedOutput()
	if err != nil {
		t.Fatalf("losetup: %v: %s", err, out)
	}
	device := strings.TrimSpace(string(out))
	e.files[id] = file
	e.devices.set(id, device)
	return device
}

// grow grows volume id's device to size bytes.
func (e *nodeEnv) grow(t *testing.T, id string, size int64) {
	t.Helper()
	if err := os.Truncate(e.files[id], size); err != nil {
		t.Fatal(err)
	}
	device, _ := e.devices.Device(t.Context(), id)
	if out, err := exec.Command("losetup", "--set-capacity", device).CombinedOutput(); err != nil {
		t.Fatalf("losetup --set-capacity: %v: %s", err, out)
	}
}

// staged makes volume id and stages it with capability c at <dir>/<id>-staging.
func (e *nodeEnv) staged(t *testing.T, id string, c *csi.VolumeCapability) string {
	t.Helper()
	e.volume(t, id)
	staging := e.path(id + "-staging")
	if _, err := e.n.NodeStageVolume(t.Context(), &csi.NodeStageVolumeRequest{
		VolumeId: id, StagingTargetPath: staging, VolumeCapability: c,
	}); err != nil {
		t.Fatalf("stage: %v", err)
	}
	t.Cleanup(func() { _ = e.n.Mounter.Unmount(t.Context(), staging) })
	return staging
}

// published stages volume id and publishes it at <dir>/<id>-target.
func (e *nodeEnv) published(t *testing.T, id string, c *csi.VolumeCapability, readOnly bool) (staging, target string) {
	t.Helper()
	staging = e.staged(t, id, c)
	target = e.path(id + "-target")
	if _, err := e.n.NodePublishVolume(t.Context(), &csi.NodePublishVolumeRequest{
		VolumeId: id, StagingTargetPath: staging, TargetPath: target, VolumeCapability: c, Readonly: readOnly,
	}); err != nil {
		t.Fatalf("publish: %v", err)
	}
	t.Cleanup(func() { _ = e.n.Mounter.Unmount(t.Context(), target) })
	return staging, target
}

// locked holds volume id's lock for the rest of the test, as a call in progress would.
func (e *nodeEnv) locked(t *testing.T, id string) {
	t.Helper()
	if !e.n.Locks.TryLock(id) {
		t.Fatalf("volume %s is locked already", id)
	}
	t.Cleanup(func() { e.n.Locks.Unlock(id) })
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
	mounts      = csinodetest.Mounts
)
