package pmem

// The tests in this file run inside a QEMU guest with emulated NVDIMMs (TestModesOnEmulatedNVDIMMs
// in nvdimm_test.go boots the guest with its own test binary, which calls inGuest there): the
// ndctl and lvm back ends and the node's filesystems on real PMEM regions, with Debian's ndctl and
// lvm2. The guest has two regions, region0 for the ndctl back end and region1 for a volume group.

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	. "github.com/onsi/gomega"

	"pvbridge.io/pkg/mounter"
)

const guestAlignment = 32 << 20

func guestContext(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

// sh runs a command of the guest's setup.
func sh(t *testing.T, name string, args ...string) string {
	t.Helper()
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
	return string(out)
}

// writeAt writes data at offset 0 of device and syncs it.
func writeAt(g Gomega, device string, data []byte) {
	f, err := os.OpenFile(device, os.O_WRONLY, 0)
	g.Expect(err).NotTo(HaveOccurred())
	_, err = f.WriteAt(data, 0)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(f.Sync()).To(Succeed())
	g.Expect(f.Close()).To(Succeed())
}

func readAt(g Gomega, device string, n int) []byte {
	f, err := os.Open(device)
	g.Expect(err).NotTo(HaveOccurred())
	defer f.Close()
	buf := make([]byte, n)
	_, err = f.ReadAt(buf, 0)
	g.Expect(err).NotTo(HaveOccurred())
	return buf
}

// exerciseBackend takes a back end through a volume's life on real PMEM: create, write,
// snapshot, restore, clone, a fresh back end finding everything again from the devices alone,
// expansion (grow, or the back end's refusal), and deletion back to the first capacity.
// reopen makes the fresh back end, as a restarted node agent would.
func exerciseBackend(t *testing.T, b Backend, reopen func() Backend, canGrow bool) {
	g := NewWithT(t)
	ctx := guestContext(t)
	before, err := b.Capacity(ctx)
	g.Expect(err).NotTo(HaveOccurred())
	t.Logf("capacity: %+v", before)
	g.Expect(before.Total).To(BeNumerically(">=", 256<<20))
	g.Expect(before.LargestAllocatable).To(BeNumerically(">=", 256<<20))

	vol, err := b.CreateVolume(ctx, "vol-a", 64<<20, nil)
	g.Expect(err).NotTo(HaveOccurred())
	t.Logf("volume: %+v", vol)
	g.Expect(vol.Size).To(BeNumerically(">=", 64<<20))
	g.Expect(readAt(g, vol.Device, 4096)).To(Equal(make([]byte, 4096)), "a new volume reads as zeroes")
	data := []byte("written on emulated PMEM")
	writeAt(g, vol.Device, data)
	again, err := b.CreateVolume(ctx, "vol-a", 64<<20, nil)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(again).To(Equal(vol), "create is idempotent")

	snap, err := b.CreateSnapshot(ctx, "snap-1", "vol-a")
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(snap.SourceVolumeID).To(Equal("vol-a"))
	restored, err := b.CreateVolume(ctx, "vol-b", 0, &Source{SnapshotID: "snap-1"})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(readAt(g, restored.Device, len(data))).To(Equal(data), "a restore holds the snapshot's data")
	clone, err := b.CreateVolume(ctx, "vol-c", 0, &Source{VolumeID: "vol-a"})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(readAt(g, clone.Device, len(data))).To(Equal(data), "a clone holds its source's data")

	// A restarted node agent knows nothing but what is on the devices.
	fresh := reopen()
	vols, err := fresh.ListVolumes(ctx)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(vols).To(ConsistOf(vol, restored, clone))
	snaps, err := fresh.ListSnapshots(ctx)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(snaps).To(ConsistOf(HaveField("ID", "snap-1")))

	grown, err := fresh.ExpandVolume(ctx, "vol-a", vol.Size+guestAlignment)
	if canGrow {
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(grown.Size).To(BeNumerically(">=", vol.Size+guestAlignment))
		g.Expect(readAt(g, grown.Device, len(data))).To(Equal(data), "growing keeps the data")
	} else {
		g.Expect(errors.Is(err, ErrInvalid)).To(BeTrue(), "%v", err)
	}

	for _, id := range []string{"vol-a", "vol-b", "vol-c"} {
		g.Expect(fresh.DeleteVolume(ctx, id)).To(Succeed())
	}
	g.Expect(fresh.DeleteSnapshot(ctx, "snap-1")).To(Succeed())
	g.Expect(fresh.DeleteVolume(ctx, "vol-a")).To(Succeed(), "delete is idempotent")
	vols, err = fresh.ListVolumes(ctx)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(vols).To(BeEmpty())
	after, err := fresh.Capacity(ctx)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(after).To(Equal(before), "everything is freed")
}

// inGuest runs the tests of the NVDIMM guest, in order: the lvm test makes the volume group the
// filesystems test uses.
func inGuest(t *testing.T) {
	t.Run("ndctl", ndctlOnNVDIMM)
	t.Run("lvm", lvmOnNVDIMM)
	t.Run("filesystems", filesystemsOnPMEM)
}

func ndctlOnNVDIMM(t *testing.T) {
	t.Log(sh(t, "ndctl", "list", "-R"))
	open := func() Backend {
		n, err := NewNdctl(NdctlOptions{Regions: []string{"region0"}, Alignment: guestAlignment})
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	exerciseBackend(t, open(), open, false)
}

func lvmOnNVDIMM(t *testing.T) {
	// pmem-csi's lvm mode: one fsdax namespace over the region, a volume group on it. The
	// region is the NVDIMM less its 128 KiB of labels; a namespace's size must be a multiple
	// of the region's alignment (16 MiB), so all of it is not.
	sh(t, "ndctl", "create-namespace", "--mode", "fsdax", "--map", "dev", "--region", "region1", "--size", "496M")
	sh(t, "pvcreate", "/dev/pmem1")
	sh(t, "vgcreate", "pvb-region1", "/dev/pmem1")
	t.Log(sh(t, "vgs", "pvb-region1"))
	open := func() Backend {
		l, err := NewLVM(guestContext(t), LVMOptions{VolumeGroups: []string{"pvb-region1"}})
		if err != nil {
			t.Fatal(err)
		}
		return l
	}
	exerciseBackend(t, open(), open, true)
}

// filesystemsOnPMEM formats, mounts with -o dax, measures and grows ext4 and xfs on
// logical volumes of the PMEM volume group, as mgmt-csi's node service stages its volumes.
func filesystemsOnPMEM(t *testing.T) {
	ctx := guestContext(t)
	l, err := NewLVM(ctx, LVMOptions{VolumeGroups: []string{"pvb-region1"}})
	if err != nil {
		t.Fatal(err)
	}
	m := mounter.New()
	// mkfs.xfs refuses filesystems under 300 MB.
	for fsType, size := range map[string]int64{"ext4": 160 << 20, "xfs": 320 << 20} {
		t.Run(fsType, func(t *testing.T) {
			g := NewWithT(t)
			vol, err := l.CreateVolume(ctx, "fs-"+fsType, size, nil)
			g.Expect(err).NotTo(HaveOccurred())
			path := filepath.Join(t.TempDir(), "staging")
			t.Cleanup(func() {
				_ = m.Unmount(ctx, path)
				_ = l.DeleteVolume(ctx, vol.ID)
			})
			dax, err := m.SupportsDAX(vol.Device)
			g.Expect(err).NotTo(HaveOccurred())
			t.Logf("%s supports DAX: %v", vol.Device, dax)
			options := []string{}
			if dax {
				options = append(options, "dax")
			}
			g.Expect(m.Stage(ctx, vol.Device, path, fsType, options)).To(Succeed())
			mounts, err := os.ReadFile("/proc/mounts")
			g.Expect(err).NotTo(HaveOccurred())
			line := ""
			for _, l := range strings.Split(string(mounts), "\n") {
				if strings.Contains(l, " "+path+" ") {
					line = l
				}
			}
			t.Logf("mounted: %s", line)
			g.Expect(line).To(ContainSubstring(" " + fsType + " "))
			if dax {
				g.Expect(line).To(ContainSubstring("dax"), "mounted with DAX")
			}
			g.Expect(os.WriteFile(filepath.Join(path, "file"), bytes.Repeat([]byte("p"), 1<<20), 0o600)).To(Succeed())

			stats, err := m.Stats(ctx, path, vol.Device)
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(stats.TotalBytes).To(BeNumerically(">", 100<<20))
			grown, err := l.ExpandVolume(ctx, vol.ID, size+128<<20)
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(m.Expand(ctx, path, grown.Device)).To(Succeed())
			after, err := m.Stats(ctx, path, vol.Device)
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(after.TotalBytes).To(BeNumerically(">", stats.TotalBytes+100<<20), "the filesystem grew online")

			g.Expect(m.Unmount(ctx, path)).To(Succeed())
			g.Expect(l.DeleteVolume(ctx, vol.ID)).To(Succeed())
		})
	}
}
