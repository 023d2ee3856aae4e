package mounter

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"golang.org/x/sys/unix"
)

const (
	mib = int64(1) << 20
	// volumeSize is the size of a test device: mkfs.xfs refuses filesystems under 300 MB.
	// The backing files are sparse, so this costs only what mkfs writes.
	volumeSize = 512 * mib
)

// env is one test's sandbox: a temporary directory for backing files and mount points, and
// the loop devices made in it. Its cleanup fails the test if a mount under the directory or
// an attached loop device is left behind, after taking them away so that later tests start
// clean.
type env struct {
	dir   string
	m     *Mounter
	loops []loop
}

type loop struct{ device, file string }

func newEnv(t *testing.T) *env {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Fatal("these tests mount real loop devices and must run as root")
	}
	e := &env{dir: t.TempDir(), m: New()}
	t.Cleanup(func() {
		for _, mp := range mountsUnder(t, e.dir) {
			t.Errorf("mount left behind at %s", mp)
			_ = unix.Unmount(mp, unix.MNT_DETACH)
		}
		for _, l := range e.loops {
			if attached(t, l.file) {
				if out, err := exec.Command("losetup", "-d", l.device).CombinedOutput(); err != nil {
					t.Errorf("detach %s: %v: %s", l.device, err, out)
				}
			}
			// A device another process has open at that moment (losetup --associated opens
			// every loop device) is only set to auto-clear, and goes when it is closed.
			g := NewGomega(func(message string, _ ...int) { t.Error(message) })
			g.Eventually(func() bool { return attached(t, l.file) }).
				WithTimeout(10*time.Second).WithPolling(20*time.Millisecond).
				Should(BeFalse(), "loop device %s still attached to %s", l.device, l.file)
		}
	})
	return e
}

// path returns a path under the sandbox.
func (e *env) path(name string) string { return filepath.Join(e.dir, name) }

// loopDevice attaches a sparse file of size bytes as a loop device.
func (e *env) loopDevice(t *testing.T, size int64) loop {
	t.Helper()
	f, err := os.CreateTemp(e.dir, "backing-*.img")
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	_ = f.Close()
	out, err := exec.Command("losetup", "--find", "--show", f.Name()).CombinedOutput()
	if err != nil {
		t.Fatalf("losetup: %v: %s", err, out)
	}
	l := loop{device: strings.TrimSpace(string(out)), file: f.Name()}
	e.loops = append(e.loops, l)
	return l
}

// grow makes the loop device's backing file size bytes and tells the kernel.
func (e *env) grow(t *testing.T, l loop, size int64) {
	t.Helper()
	if err := os.Truncate(l.file, size); err != nil {
		t.Fatal(err)
	}
	run(t, "losetup", "--set-capacity", l.device)
}

// detach detaches a loop device in use by the test and waits until the kernel has cleared it:
// while another process has it open (see newEnv's cleanup) it keeps its capacity.
func detach(t *testing.T, device string) {
	t.Helper()
	run(t, "losetup", "--detach", device)
	size := filepath.Join("/sys/block", filepath.Base(device), "size")
	NewWithT(t).Eventually(func() (string, error) {
		b, err := os.ReadFile(size)
		return strings.TrimSpace(string(b)), err
	}).WithTimeout(10*time.Second).WithPolling(20*time.Millisecond).Should(Equal("0"), "%s is not cleared", device)
}

// staged returns a blank loop device staged with fsType at a new staging path.
func (e *env) staged(t *testing.T, fsType string) (loop, string) {
	t.Helper()
	l := e.loopDevice(t, volumeSize)
	staging := e.path("staging-" + filepath.Base(l.device))
	if err := e.m.Stage(t.Context(), l.device, staging, fsType, nil); err != nil {
		t.Fatalf("stage: %v", err)
	}
	t.Cleanup(func() { _ = e.m.Unmount(t.Context(), staging) })
	return l, staging
}

// published bind-mounts a staged filesystem read-only at a new target path.
func (e *env) published(t *testing.T, staging string) string {
	t.Helper()
	target := e.path("target-" + filepath.Base(staging))
	if err := e.m.Publish(t.Context(), staging, target, true, nil); err != nil {
		t.Fatalf("publish: %v", err)
	}
	t.Cleanup(func() { _ = e.m.Unmount(t.Context(), target) })
	return target
}

// publishedBlock publishes device at target as a raw block device file.
func (e *env) publishedBlock(t *testing.T, device, target string) {
	t.Helper()
	if err := e.m.PublishBlock(t.Context(), device, target, false); err != nil {
		t.Fatalf("publish block: %v", err)
	}
	t.Cleanup(func() { _ = e.m.Unmount(t.Context(), target) })
}

func run(t *testing.T, name string, args ...string) string {
	t.Helper()
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %v: %v: %s", name, args, err, out)
	}
	return string(out)
}

func attached(t *testing.T, file string) bool {
	t.Helper()
	return strings.TrimSpace(run(t, "losetup", "--associated", file)) != ""
}

// mountsUnder lists the mount points under dir, from the mount table.
func mountsUnder(t *testing.T, dir string) []string {
	t.Helper()
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = f.Close() }()
	var mps []string
	s := bufio.NewScanner(f)
	for s.Scan() {
		fields := strings.Fields(s.Text())
		if len(fields) > 4 && (fields[4] == dir || strings.HasPrefix(fields[4], dir+"/")) {
			mps = append(mps, fields[4])
		}
	}
	// Innermost first, so that unmounting in this order works.
	for i, j := 0, len(mps)-1; i < j; i, j = i+1, j-1 {
		mps[i], mps[j] = mps[j], mps[i]
	}
	return mps
}

// mountCount counts the mounts stacked on path.
func mountCount(t *testing.T, path string) int {
	t.Helper()
	n := 0
	for _, mp := range mountsUnder(t, path) {
		if mp == path {
			n++
		}
	}
	return n
}

// blkid returns a tag (TYPE, LABEL, PTTYPE) of what is on the device, "" if none.
func blkid(t *testing.T, device, tag string) string {
	t.Helper()
	out, _ := exec.Command("blkid", "-p", "-s", tag, "-o", "value", device).Output()
	return strings.TrimSpace(string(out))
}

// writeAt writes data into the device at offset.
func writeAt(t *testing.T, device string, offset int64, data []byte) {
	t.Helper()
	f, err := os.OpenFile(device, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = f.Close() }()
	if _, err := f.WriteAt(data, offset); err != nil {
		t.Fatal(err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
}

// readAt reads n bytes from a file or device at offset, bypassing nothing: callers sync first.
func readAt(t *testing.T, path string, offset int64, n int) []byte {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = f.Close() }()
	buf := make([]byte, n)
	if _, err := f.ReadAt(buf, offset); err != nil {
		t.Fatal(err)
	}
	return buf
}

// partitionTable writes an MBR with one partition, which blkid reports as PTTYPE=dos.
func partitionTable(t *testing.T, device string) {
	t.Helper()
	var entry bytes.Buffer
	_ = binary.Write(&entry, binary.LittleEndian, struct {
		Boot      uint8
		StartCHS  [3]byte
		Type      uint8
		EndCHS    [3]byte
		StartLBA  uint32
		SectorCnt uint32
	}{Type: 0x83, StartLBA: 2048, SectorCnt: 4096})
	writeAt(t, device, 446, entry.Bytes())
	writeAt(t, device, 510, []byte{0x55, 0xaa})
}

// mkfs formats a device outside the package under test.
func mkfs(t *testing.T, fsType, device string, args ...string) {
	t.Helper()
	run(t, "mkfs."+fsType, append(args, device)...)
}

func expectNoMount(g Gomega, t *testing.T, path string) {
	g.Expect(mountCount(t, path)).To(BeZero(), "no mount at %s", path)
}
