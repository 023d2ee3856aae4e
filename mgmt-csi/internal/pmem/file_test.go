package pmem

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"

	. "github.com/onsi/gomega"
	"golang.org/x/sys/unix"

	"pvbridge.io/mgmt-csi/internal/loop"
)

const mib = int64(1) << 20

// These tests run for real, as root: sparse files, loop devices bound by ioctl, an xfs
// filesystem with reflink and a tmpfs on loop devices and mounts of their own. Each test
// leaves no loop device and no mount behind, which t.Cleanup checks with losetup -a.

// newTestFile opens a file back end of capacity bytes on a fresh directory (ext4 here).
func newTestFile(t *testing.T, capacity int64) (*File, string) {
	t.Helper()
	dir := t.TempDir()
	f, err := NewFile(FileOptions{Dir: dir, Capacity: capacity})
	if err != nil {
		t.Fatal(err)
	}
	cleanupLoops(t, dir)
	return f, dir
}

// cleanupLoops unbinds, at the end of the test, loop devices left bound to files under dir,
// and fails the test if there were any.
func cleanupLoops(t *testing.T, dir string) {
	t.Helper()
	dir, err := filepath.EvalSymlinks(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		left := loopsUnder(t, dir)
		for _, dev := range left {
			_ = exec.Command("losetup", "-d", dev).Run()
		}
		if len(left) > 0 {
			t.Errorf("loop devices left bound under %s: %v", dir, left)
		}
	})
}

// loopsUnder lists, from losetup -a, the loop devices bound to files under dir.
func loopsUnder(t *testing.T, dir string) []string {
	t.Helper()
	out, err := exec.Command("losetup", "-a", "--noheadings", "--raw", "-O", "NAME,BACK-FILE").Output()
	if err != nil {
		t.Fatalf("losetup -a: %v", err)
	}
	var devs []string
	for line := range strings.Lines(string(out)) {
		name, backing, ok := strings.Cut(strings.TrimSpace(line), " ")
		if ok && strings.HasPrefix(backing, dir+"/") {
			devs = append(devs, name)
		}
	}
	return devs
}

// mountScratch mounts a filesystem made by mkfs (nil: tmpfs) of size bytes on a new directory
// and returns it.
func mountScratch(t *testing.T, size int64, mkfs ...string) string {
	t.Helper()
	g := NewWithT(t)
	base := t.TempDir()
	mnt := filepath.Join(base, "mnt")
	g.Expect(os.Mkdir(mnt, 0o700)).To(Succeed())
	if mkfs == nil {
		g.Expect(run("mount", "-t", "tmpfs", "-o", "size="+strconv.FormatInt(size, 10), "tmpfs", mnt)).To(Succeed())
		t.Cleanup(func() { _ = run("umount", mnt) })
		return mnt
	}
	img := filepath.Join(base, "fs.img")
	g.Expect(os.WriteFile(img, nil, 0o600)).To(Succeed())
	g.Expect(os.Truncate(img, size)).To(Succeed())
	out, err := exec.Command("losetup", "--find", "--show", img).Output()
	g.Expect(err).NotTo(HaveOccurred())
	dev := strings.TrimSpace(string(out))
	t.Cleanup(func() { _ = run("losetup", "-d", dev) })
	g.Expect(run(mkfs[0], append(mkfs[1:], dev)...)).To(Succeed())
	g.Expect(run("mount", dev, mnt)).To(Succeed())
	t.Cleanup(func() { _ = run("umount", mnt) })
	return mnt
}

func run(name string, args ...string) error {
	if out, err := exec.Command(name, args...).CombinedOutput(); err != nil {
		return fmt.Errorf("%s %v: %w: %s", name, args, err, out)
	}
	return nil
}

// writeDevice writes p to dev at off and flushes it.
func writeDevice(t *testing.T, dev string, p []byte, off int64) {
	t.Helper()
	f, err := os.OpenFile(dev, os.O_WRONLY, 0)
	if err == nil {
		_, err = f.WriteAt(p, off)
	}
	if err == nil {
		err = f.Sync()
	}
	if err == nil {
		err = f.Close()
	}
	if err != nil {
		t.Fatalf("write %s: %v", dev, err)
	}
}

// deviceSum is the SHA-256 of the first n bytes of dev.
func deviceSum(t *testing.T, dev string, n int64) [32]byte {
	t.Helper()
	data, err := os.ReadFile(dev)
	if err != nil {
		t.Fatal(err)
	}
	if int64(len(data)) < n {
		t.Fatalf("%s has %d bytes, want at least %d", dev, len(data), n)
	}
	return sha256.Sum256(data[:n])
}

// deviceSize is the size of a block device in bytes, as the kernel sees it.
func deviceSize(t *testing.T, dev string) int64 {
	t.Helper()
	data, err := os.ReadFile(filepath.Join("/sys/block", filepath.Base(dev), "size"))
	if err != nil {
		t.Fatal(err)
	}
	sectors, err := strconv.ParseInt(strings.TrimSpace(string(data)), 10, 64)
	if err != nil {
		t.Fatal(err)
	}
	return sectors * 512
}

func randomBytes(t *testing.T, n int64) []byte {
	t.Helper()
	p := make([]byte, n)
	if _, err := rand.Read(p); err != nil {
		t.Fatal(err)
	}
	return p
}

func dirNames(t *testing.T, dir string) []string {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	names := []string{}
	for _, e := range entries {
		names = append(names, e.Name())
	}
	return names
}

func TestNewFileValidatesOptions(t *testing.T) {
	for name, opts := range map[string]FileOptions{
		"no directory":          {},
		"missing directory":     {Dir: "/nonexistent/pvbridge"},
		"alignment not 4 KiB":   {Dir: t.TempDir(), Alignment: 1000},
		"negative capacity":     {Dir: t.TempDir(), Capacity: -1},
		"negative alignment":    {Dir: t.TempDir(), Alignment: -4096},
		"capacity of a nothing": {Dir: "relative/nothing"},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := NewFile(opts)
			NewWithT(t).Expect(err).To(HaveOccurred())
		})
	}
}

func TestFileCapacityDefaultsToTheFilesystem(t *testing.T) {
	g := NewWithT(t)
	mnt := mountScratch(t, 64*mib, nil...)
	f, err := NewFile(FileOptions{Dir: mnt})
	g.Expect(err).NotTo(HaveOccurred())
	c, err := f.Capacity(t.Context())
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(c).To(Equal(Capacity{Total: 64 * mib, Free: 64 * mib, LargestAllocatable: 64 * mib, Alignment: mib}))
}

func TestFileCreateVolume(t *testing.T) {
	for _, tc := range []struct {
		name     string
		id       string
		size     int64
		src      *Source
		wantSize int64
		wantErr  error
	}{
		{name: "rounds the size up to the alignment", id: "a", size: 3*mib + 1, wantSize: 4 * mib},
		{name: "size 0 is one alignment", id: "a", wantSize: mib},
		{name: "takes all of the capacity", id: "a", size: 16 * mib, wantSize: 16 * mib},
		{name: "more than the capacity is ErrNoSpace", id: "a", size: 16*mib + 1, wantErr: ErrNoSpace},
		{name: "a negative size is ErrInvalid", id: "a", size: -1, wantErr: ErrInvalid},
		{name: "an ID that is no DNS label is ErrInvalid", id: "A_b", wantErr: ErrInvalid},
		{name: "an ID of 64 characters is ErrInvalid", id: strings.Repeat("a", 64), wantErr: ErrInvalid},
		{name: "a missing source snapshot is ErrNotFound", id: "a", src: &Source{SnapshotID: "s"}, wantErr: ErrNotFound},
		{name: "a missing source volume is ErrNotFound", id: "a", src: &Source{VolumeID: "v"}, wantErr: ErrNotFound},
		{name: "two sources are ErrInvalid", id: "a", src: &Source{SnapshotID: "s", VolumeID: "v"}, wantErr: ErrInvalid},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			f, dir := newTestFile(t, 16*mib)
			vol, err := f.CreateVolume(t.Context(), tc.id, tc.size, tc.src)
			if tc.wantErr != nil {
				g.Expect(err).To(MatchError(tc.wantErr))
				g.Expect(dirNames(t, filepath.Join(dir, volumesDir))).To(BeEmpty(), "nothing left behind")
				g.Expect(loopsUnder(t, dir)).To(BeEmpty())
				c, err := f.Capacity(t.Context())
				g.Expect(err).NotTo(HaveOccurred())
				g.Expect(c.Free).To(Equal(16 * mib))
				return
			}
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(vol.ID).To(Equal(tc.id))
			g.Expect(vol.Size).To(Equal(tc.wantSize))
			g.Expect(deviceSize(t, vol.Device)).To(Equal(tc.wantSize))
			g.Expect(loopsUnder(t, dir)).To(ConsistOf(vol.Device))
			g.Expect(f.DeleteVolume(t.Context(), tc.id)).To(Succeed())
		})
	}
}

func TestFileCreateAndDeleteAreIdempotent(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	f, dir := newTestFile(t, 64*mib)

	first, err := f.CreateVolume(ctx, "pvc-1", 8*mib, nil)
	g.Expect(err).NotTo(HaveOccurred())
	again, err := f.CreateVolume(ctx, "pvc-1", 8*mib, nil)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(again).To(Equal(first), "the same volume on the same device")
	other, err := f.CreateVolume(ctx, "pvc-1", 32*mib, nil)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(other).To(Equal(first), "an existing volume is returned as it is; callers compare sizes")
	g.Expect(loopsUnder(t, dir)).To(ConsistOf(first.Device), "bound once")

	g.Expect(f.DeleteVolume(ctx, "pvc-1")).To(Succeed())
	g.Expect(f.DeleteVolume(ctx, "pvc-1")).To(Succeed())
	g.Expect(loopsUnder(t, dir)).To(BeEmpty())
	_, err = f.GetVolume(ctx, "pvc-1")
	g.Expect(err).To(MatchError(ErrNotFound))

	g.Expect(f.DeleteSnapshot(ctx, "never-made")).To(Succeed())
}

func TestFileCapacityAccounting(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	f, _ := newTestFile(t, 64*mib)
	capacity := func() Capacity {
		c, err := f.Capacity(ctx)
		g.Expect(err).NotTo(HaveOccurred())
		return c
	}
	g.Expect(capacity()).To(Equal(Capacity{Total: 64 * mib, Free: 64 * mib, LargestAllocatable: 64 * mib, Alignment: mib}))

	_, err := f.CreateVolume(ctx, "a", 10*mib, nil)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(capacity().Free).To(Equal(54*mib), "sparse files count with their full size")

	_, err = f.CreateSnapshot(ctx, "snap-a", "a")
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(capacity().Free).To(Equal(44*mib), "snapshots count too")

	_, err = f.CreateVolume(ctx, "b", 45*mib, nil)
	g.Expect(err).To(MatchError(ErrNoSpace))
	g.Expect(capacity().Free).To(Equal(44 * mib))

	_, err = f.ExpandVolume(ctx, "a", 20*mib)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(capacity().Free).To(Equal(34 * mib))

	g.Expect(f.DeleteVolume(ctx, "a")).To(Succeed())
	g.Expect(capacity().Free).To(Equal(54*mib), "deleting frees exactly what the volume took")
	g.Expect(f.DeleteSnapshot(ctx, "snap-a")).To(Succeed())
	g.Expect(capacity().Free).To(Equal(64 * mib))
}

// checkSnapshotAndRestore writes to a volume, snapshots it, overwrites the volume, restores the
// snapshot into a new, larger volume and clones the volume, checking the data of each.
func checkSnapshotAndRestore(t *testing.T, f *File) {
	g := NewWithT(t)
	ctx := t.Context()
	vol, err := f.CreateVolume(ctx, "origin", 32*mib, nil)
	g.Expect(err).NotTo(HaveOccurred())
	writeDevice(t, vol.Device, randomBytes(t, 3*mib), 0)
	writeDevice(t, vol.Device, randomBytes(t, mib), 20*mib)
	before := deviceSum(t, vol.Device, vol.Size)

	snap, err := f.CreateSnapshot(ctx, "snap-1", "origin")
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(snap.SourceVolumeID).To(Equal("origin"))
	g.Expect(snap.Size).To(Equal(32 * mib))
	g.Expect(snap.CreationTime).To(BeNumerically(">", 0))
	again, err := f.CreateSnapshot(ctx, "snap-1", "origin")
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(again).To(Equal(snap), "idempotent")

	writeDevice(t, vol.Device, randomBytes(t, mib), 0) // the snapshot must not change

	restored, err := f.CreateVolume(ctx, "restored", 40*mib, &Source{SnapshotID: "snap-1"})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(restored.Size).To(Equal(40 * mib))
	g.Expect(deviceSum(t, restored.Device, 32*mib)).To(Equal(before))
	g.Expect(deviceSum(t, restored.Device, 40*mib)).To(Equal(sha256.Sum256(append(mustRead(t, restored.Device)[:32*mib], make([]byte, 8*mib)...))),
		"zeroes past the snapshot")

	now := deviceSum(t, vol.Device, vol.Size)
	clone, err := f.CreateVolume(ctx, "clone", 0, &Source{VolumeID: "origin"})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(clone.Size).To(Equal(32*mib), "size 0 takes the source's")
	g.Expect(deviceSum(t, clone.Device, clone.Size)).To(Equal(now))

	_, err = f.CreateVolume(ctx, "too-small", 16*mib, &Source{VolumeID: "origin"})
	g.Expect(err).To(MatchError(ErrInvalid))

	// The snapshot outlives its volume.
	for _, id := range []string{"origin", "restored", "clone"} {
		g.Expect(f.DeleteVolume(ctx, id)).To(Succeed())
	}
	snaps, err := f.ListSnapshots(ctx)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(snaps).To(ConsistOf(snap))
	restored, err = f.CreateVolume(ctx, "restored", 0, &Source{SnapshotID: "snap-1"})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(deviceSum(t, restored.Device, 32*mib)).To(Equal(before))
	g.Expect(f.DeleteVolume(ctx, "restored")).To(Succeed())
	g.Expect(f.DeleteSnapshot(ctx, "snap-1")).To(Succeed())
	g.Expect(f.DeleteSnapshot(ctx, "snap-1")).To(Succeed())
}

func mustRead(t *testing.T, dev string) []byte {
	t.Helper()
	data, err := os.ReadFile(dev)
	if err != nil {
		t.Fatal(err)
	}
	return data
}

func TestFileSnapshotOfAnotherVolumeIsInvalid(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	f, _ := newTestFile(t, 64*mib)
	for _, id := range []string{"a", "b"} {
		_, err := f.CreateVolume(ctx, id, mib, nil)
		g.Expect(err).NotTo(HaveOccurred())
		defer func() { g.Expect(f.DeleteVolume(ctx, id)).To(Succeed()) }()
	}
	_, err := f.CreateSnapshot(ctx, "snap", "a")
	g.Expect(err).NotTo(HaveOccurred())
	_, err = f.CreateSnapshot(ctx, "snap", "b")
	g.Expect(err).To(MatchError(ErrInvalid))
	_, err = f.CreateSnapshot(ctx, "other", "missing")
	g.Expect(err).To(MatchError(ErrNotFound))
	_, err = f.CreateSnapshot(ctx, "big", "a")
	g.Expect(err).NotTo(HaveOccurred())
}

// TestFileSparseCopy runs on tmpfs, which cannot share extents: data is copied, holes are not.
func TestFileSparseCopy(t *testing.T) {
	g := NewWithT(t)
	mnt := mountScratch(t, 256*mib, nil...)
	f, err := NewFile(FileOptions{Dir: mnt})
	g.Expect(err).NotTo(HaveOccurred())
	cleanupLoops(t, mnt)

	checkSnapshotAndRestore(t, f)

	ctx := t.Context()
	vol, err := f.CreateVolume(ctx, "sparse", 128*mib, nil)
	g.Expect(err).NotTo(HaveOccurred())
	writeDevice(t, vol.Device, randomBytes(t, 8*mib), 64*mib)
	_, err = f.CreateSnapshot(ctx, "sparse-snap", "sparse")
	g.Expect(err).NotTo(HaveOccurred())
	var st syscall.Stat_t
	g.Expect(syscall.Stat(f.snapshotPath("sparse-snap"), &st)).To(Succeed())
	g.Expect(st.Size).To(Equal(128 * mib))
	g.Expect(st.Blocks*512).To(BeNumerically("~", 8*mib, mib), "only the data is allocated")
	g.Expect(f.DeleteSnapshot(ctx, "sparse-snap")).To(Succeed())
	g.Expect(f.DeleteVolume(ctx, "sparse")).To(Succeed())
}

// TestFileReflink runs on xfs with reflink=1: snapshots and clones share extents with their
// source, so they take no space on the filesystem until either side is written.
func TestFileReflink(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	mnt := mountScratch(t, 512*mib, "mkfs.xfs", "-q", "-m", "reflink=1")
	f, err := NewFile(FileOptions{Dir: mnt, Capacity: 400 * mib})
	g.Expect(err).NotTo(HaveOccurred())
	cleanupLoops(t, mnt)

	checkSnapshotAndRestore(t, f)

	vol, err := f.CreateVolume(ctx, "data", 96*mib, nil)
	g.Expect(err).NotTo(HaveOccurred())
	writeDevice(t, vol.Device, randomBytes(t, 64*mib), 0)
	sum := deviceSum(t, vol.Device, vol.Size)
	freeBefore := fsFree(t, mnt)
	_, err = f.CreateSnapshot(ctx, "data-snap", "data")
	g.Expect(err).NotTo(HaveOccurred())
	clone, err := f.CreateVolume(ctx, "data-clone", 0, &Source{VolumeID: "data"})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(fsFree(t, mnt)).To(BeNumerically(">", freeBefore-4*mib), "64 MiB copied twice took (almost) nothing")
	g.Expect(deviceSum(t, clone.Device, clone.Size)).To(Equal(sum))
	for _, id := range []string{"data", "data-clone"} {
		g.Expect(f.DeleteVolume(ctx, id)).To(Succeed())
	}
	g.Expect(f.DeleteSnapshot(ctx, "data-snap")).To(Succeed())
}

func fsFree(t *testing.T, dir string) int64 {
	t.Helper()
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		t.Fatal(err)
	}
	return int64(st.Bfree) * st.Bsize
}

func TestFileExpandVolume(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	f, _ := newTestFile(t, 64*mib)
	vol, err := f.CreateVolume(ctx, "grow", 8*mib, nil)
	g.Expect(err).NotTo(HaveOccurred())
	writeDevice(t, vol.Device, randomBytes(t, mib), 0)
	sum := deviceSum(t, vol.Device, mib)

	for _, tc := range []struct {
		name     string
		size     int64
		wantSize int64
		wantErr  error
	}{
		{name: "grows the file and the device, rounded up", size: 20*mib + 1, wantSize: 21 * mib},
		{name: "a smaller size leaves it as it is", size: 4 * mib, wantSize: 21 * mib},
		{name: "the same size leaves it as it is", size: 21 * mib, wantSize: 21 * mib},
		{name: "beyond the free space is ErrNoSpace", size: 65 * mib, wantErr: ErrNoSpace},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			got, err := f.ExpandVolume(ctx, "grow", tc.size)
			if tc.wantErr != nil {
				g.Expect(err).To(MatchError(tc.wantErr))
				return
			}
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(got).To(Equal(Volume{ID: "grow", Size: tc.wantSize, Device: vol.Device}))
			g.Expect(deviceSize(t, vol.Device)).To(Equal(tc.wantSize))
			g.Expect(deviceSum(t, vol.Device, mib)).To(Equal(sum), "data kept")
		})
	}
	_, err = f.ExpandVolume(ctx, "missing", mib)
	g.Expect(err).To(MatchError(ErrNotFound))
	g.Expect(f.DeleteVolume(ctx, "grow")).To(Succeed())
}

func TestFileDeleteVolumeInUse(t *testing.T) {
	for _, tc := range []struct {
		name string
		// use opens or mounts the device and returns how to stop.
		use func(t *testing.T, dev string) func()
	}{
		{name: "mounted", use: func(t *testing.T, dev string) func() {
			mnt := t.TempDir()
			NewWithT(t).Expect(run("mkfs.ext4", "-q", dev)).To(Succeed())
			NewWithT(t).Expect(run("mount", dev, mnt)).To(Succeed())
			return func() { NewWithT(t).Expect(run("umount", mnt)).To(Succeed()) }
		}},
		{name: "open", use: func(t *testing.T, dev string) func() {
			f, err := os.Open(dev)
			NewWithT(t).Expect(err).NotTo(HaveOccurred())
			return func() { _ = f.Close() }
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			ctx := t.Context()
			f, dir := newTestFile(t, 64*mib)
			vol, err := f.CreateVolume(ctx, "busy", 16*mib, nil)
			g.Expect(err).NotTo(HaveOccurred())
			stop := tc.use(t, vol.Device)

			g.Expect(f.DeleteVolume(ctx, "busy")).To(MatchError(ErrInUse))
			got, err := f.GetVolume(ctx, "busy")
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(got).To(Equal(vol), "still there, on the same device")
			autoclear, err := os.ReadFile(filepath.Join("/sys/block", filepath.Base(vol.Device), "loop", "autoclear"))
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(strings.TrimSpace(string(autoclear))).To(Equal("0"), "not left to vanish on the last close")

			stop()
			g.Expect(f.DeleteVolume(ctx, "busy")).To(Succeed())
			g.Expect(loopsUnder(t, dir)).To(BeEmpty())
		})
	}
}

func TestFileRestart(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	f, dir := newTestFile(t, 64*mib)
	vol, err := f.CreateVolume(ctx, "keep", 8*mib, nil)
	g.Expect(err).NotTo(HaveOccurred())
	writeDevice(t, vol.Device, randomBytes(t, mib), 0)
	sum := deviceSum(t, vol.Device, vol.Size)
	snap, err := f.CreateSnapshot(ctx, "keep-snap", "keep")
	g.Expect(err).NotTo(HaveOccurred())

	// A reboot: loop devices are gone. A crash: a half-copied volume and the sidecar of a
	// snapshot whose data never got in place.
	g.Expect(loop.Detach(ctx, vol.Device)).To(Succeed())
	partial := filepath.Join(dir, volumesDir, ".half"+imageSuffix+partialSuffix)
	g.Expect(os.WriteFile(partial, []byte("half"), 0o600)).To(Succeed())
	orphan := filepath.Join(dir, snapshotsDir, "lost"+metaSuffix)
	g.Expect(os.WriteFile(orphan, []byte(`{}`), 0o600)).To(Succeed())

	f, err = NewFile(FileOptions{Dir: dir, Capacity: 64 * mib})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(partial).NotTo(BeAnExistingFile())
	g.Expect(orphan).NotTo(BeAnExistingFile())

	vols, err := f.ListVolumes(ctx)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(vols).To(HaveLen(1))
	g.Expect(vols[0].ID).To(Equal("keep"))
	g.Expect(vols[0].Device).NotTo(BeEmpty(), "bound again")
	g.Expect(deviceSum(t, vols[0].Device, vols[0].Size)).To(Equal(sum))
	got, err := f.GetVolume(ctx, "keep")
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(got).To(Equal(vols[0]), "not bound twice")
	g.Expect(loopsUnder(t, dir)).To(HaveLen(1))

	snaps, err := f.ListSnapshots(ctx)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(snaps).To(ConsistOf(snap))
	c, err := f.Capacity(ctx)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(c.Free).To(Equal(48 * mib))

	// After a reboot GetVolume binds the device as well.
	g.Expect(loop.Detach(ctx, got.Device)).To(Succeed())
	got, err = f.GetVolume(ctx, "keep")
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(loopsUnder(t, dir)).To(ConsistOf(got.Device))

	g.Expect(f.DeleteVolume(ctx, "keep")).To(Succeed())
	g.Expect(f.DeleteSnapshot(ctx, "keep-snap")).To(Succeed())
}

func TestFileConcurrentCreates(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	f, dir := newTestFile(t, 40*mib)
	// 16 volumes of 4 MiB and 4 clones of 4 MiB compete for 40 MiB; clones of one source
	// also run concurrently with creates.
	_, err := f.CreateVolume(ctx, "source", 4*mib, nil)
	g.Expect(err).NotTo(HaveOccurred())

	var wg sync.WaitGroup
	errs := make([]error, 20)
	for i := range errs {
		wg.Go(func() {
			var src *Source
			if i%5 == 0 {
				src = &Source{VolumeID: "source"}
			}
			_, errs[i] = f.CreateVolume(ctx, "vol-"+strconv.Itoa(i), 4*mib, src)
		})
	}
	wg.Wait()
	created := 0
	for _, err := range errs {
		if err == nil {
			created++
			continue
		}
		g.Expect(err).To(MatchError(ErrNoSpace))
	}
	g.Expect(created).To(Equal(9), "exactly what fits besides the source")
	c, err := f.Capacity(ctx)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(c.Free).To(BeZero())
	vols, err := f.ListVolumes(ctx)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(vols).To(HaveLen(10))
	g.Expect(loopsUnder(t, dir)).To(HaveLen(10))

	// The same volume asked for concurrently is made once.
	for _, v := range vols {
		g.Expect(f.DeleteVolume(ctx, v.ID)).To(Succeed())
	}
	devices := make([]string, 8)
	for i := range devices {
		wg.Go(func() {
			vol, err := f.CreateVolume(ctx, "same", 4*mib, nil)
			if err == nil {
				devices[i] = vol.Device
			}
		})
	}
	wg.Wait()
	for _, dev := range devices {
		g.Expect(dev).To(Equal(devices[0]))
	}
	g.Expect(loopsUnder(t, dir)).To(HaveLen(1))
	g.Expect(f.DeleteVolume(ctx, "same")).To(Succeed())
}

func TestFileOperationWaitsAreBoundedByTheContext(t *testing.T) {
	g := NewWithT(t)
	f, _ := newTestFile(t, 64*mib)
	unlock, err := f.keys.lock(t.Context(), volumeKey("held"))
	g.Expect(err).NotTo(HaveOccurred())
	defer unlock()
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	_, err = f.CreateVolume(ctx, "held", mib, nil)
	g.Expect(err).To(MatchError(context.Canceled))
	g.Expect(errors.Is(f.DeleteVolume(ctx, "held"), context.Canceled)).To(BeTrue())
}

func TestDeviceIOOnLoopDevices(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	f, _ := newTestFile(t, 64*mib)
	src, err := f.CreateVolume(ctx, "src", 8*mib, nil)
	g.Expect(err).NotTo(HaveOccurred())
	dst, err := f.CreateVolume(ctx, "dst", 8*mib, nil)
	g.Expect(err).NotTo(HaveOccurred())
	data := randomBytes(t, 8*mib)
	writeDevice(t, src.Device, data, 0)
	writeDevice(t, dst.Device, randomBytes(t, 8*mib), 0)

	var io DeviceIO
	g.Expect(io.Copy(ctx, dst.Device, src.Device, mib, 5*mib)).To(Succeed())
	g.Expect(io.Zero(ctx, dst.Device, 6*mib, 2*mib)).To(Succeed())
	g.Expect(io.WriteAt(ctx, dst.Device, []byte("record"), 4096)).To(Succeed())
	got := mustRead(t, dst.Device)
	g.Expect(got[mib : 4096+mib]).To(Equal(data[mib : 4096+mib]))
	g.Expect(bytes.Equal(got[mib:6*mib], data[mib:6*mib])).To(BeTrue(), "copied")
	g.Expect(bytes.Count(got[6*mib:], []byte{0})).To(Equal(int(2*mib)), "zeroed")
	p := make([]byte, 6)
	g.Expect(io.ReadAt(ctx, dst.Device, p, 4096)).To(Succeed())
	g.Expect(string(p)).To(Equal("record"))
	g.Expect(io.Copy(ctx, dst.Device, "/nonexistent", 0, mib)).NotTo(Succeed())

	for _, id := range []string{"src", "dst"} {
		g.Expect(f.DeleteVolume(ctx, id)).To(Succeed())
	}
}
