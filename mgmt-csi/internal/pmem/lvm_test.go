package pmem

import (
	"context"
	"errors"
	"testing"

	. "github.com/onsi/gomega"

	pmemv1 "pvbridge.io/pkg/apis/pmem/v1alpha1"
)

// The lvm back end is tested against output recorded from lvm2 2.03 (testdata/lvm): there is
// no device-mapper on the machines that run these tests. The recorded node has two PMEM
// regions, each a volume group:
//
//	pmem-region0  63 GiB, 33 GiB free: root (not ours), vol.pvc-a (8 GiB), snap.snap-1 (of
//	              pvc-a, 8 GiB), vol.pvc-half (4 GiB, incomplete)
//	pmem-region1  31.5 GiB, 15.5 GiB free: vol.pvc-b (16 GiB, open)

const (
	gib = int64(1) << 30

	vgsCmd = "vgs --reportformat json --units b --nosuffix -o vg_name,vg_size,vg_free,vg_extent_size pmem-region0 pmem-region1"
	lvsCmd = "lvs --reportformat json --units b --nosuffix -o lv_name,vg_name,lv_size,lv_attr,lv_tags,lv_path pmem-region0 pmem-region1"
)

var (
	vgs = call{cmd: vgsCmd, stdout: "@vgs.json"}
	lvs = call{cmd: lvsCmd, stdout: "@lvs.json"}
)

// newTestLVM makes an lvm back end on the recorded volume groups that then expects calls.
func newTestLVM(t *testing.T, io *fakeIO, calls ...call) *LVM {
	t.Helper()
	startup := []call{vgs, {cmd: lvsCmd, stdout: "@lvs-empty.json"}}
	l, err := NewLVM(t.Context(), LVMOptions{
		VolumeGroups: []string{"pmem-region0", "pmem-region1"},
		Runner:       replay(t, "lvm", append(startup, calls...)...),
		BlockIO:      io,
	})
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func TestNewLVM(t *testing.T) {
	for _, tc := range []struct {
		name    string
		vgs     []string
		calls   []call
		wantErr bool
	}{
		{name: "removes incomplete volumes a crash left", vgs: []string{"pmem-region0", "pmem-region1"}, calls: []call{
			vgs, lvs, {cmd: "lvremove -fy pmem-region0/vol.pvc-half"},
		}},
		{name: "a missing volume group is an error", vgs: []string{"pmem-region0", "pmem-region1"}, wantErr: true, calls: []call{
			{cmd: vgsCmd, stdout: "@vgs-one.json", stderr: `  Volume group "pmem-region1" not found`, fail: true},
		}},
		{name: "a volume group vgs does not report is an error", vgs: []string{"pmem-region0", "pmem-region1"}, wantErr: true, calls: []call{
			{cmd: vgsCmd, stdout: "@vgs-one.json"},
		}},
		{name: "no volume group is an error", wantErr: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			l, err := NewLVM(t.Context(), LVMOptions{VolumeGroups: tc.vgs, Runner: replay(t, "lvm", tc.calls...), BlockIO: &fakeIO{}})
			if tc.wantErr {
				g.Expect(err).To(HaveOccurred())
				return
			}
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(l.Mode()).To(Equal(pmemv1.ModeLVM))
		})
	}
}

func TestLVMCapacity(t *testing.T) {
	g := NewWithT(t)
	l := newTestLVM(t, &fakeIO{}, vgs)
	c, err := l.Capacity(t.Context())
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(c).To(Equal(Capacity{
		Total:              67641540608 + 33818673152,
		Free:               35429285888 + 16638803968,
		LargestAllocatable: 35429285888, // a logical volume never spans volume groups
		Alignment:          4 << 20,
	}))
}

func TestLVMCreateVolume(t *testing.T) {
	lvcreate := func(size, name, vg string, tags ...string) call {
		cmd := "lvcreate -Zn -L " + size + "b -n " + name
		for _, t := range append(tags, "pmem.pvbridge.io/incomplete") {
			cmd += " --addtag " + t
		}
		return call{cmd: cmd + " " + vg}
	}
	complete := func(lv string) call { return call{cmd: "lvchange --deltag pmem.pvbridge.io/incomplete " + lv} }

	for _, tc := range []struct {
		name    string
		id      string
		size    int64
		src     *Source
		calls   []call
		ioFail  string
		want    Volume
		wantErr error
		wantIO  []string
	}{
		{
			name: "a new volume goes to the volume group with the least room that fits, zeroed",
			id:   "pvc-new", size: 2 * gib,
			calls: []call{lvs, vgs,
				lvcreate("2147483648", "vol.pvc-new", "pmem-region1", "pmem.pvbridge.io/volume"),
				complete("pmem-region1/vol.pvc-new")},
			want:   Volume{ID: "pvc-new", Size: 2 * gib, Device: "/dev/pmem-region1/vol.pvc-new"},
			wantIO: []string{"zero /dev/pmem-region1/vol.pvc-new 0 2147483648"},
		},
		{
			name: "a volume too large for region1 goes to region0",
			id:   "pvc-new", size: 20 * gib,
			calls: []call{lvs, vgs,
				lvcreate("21474836480", "vol.pvc-new", "pmem-region0", "pmem.pvbridge.io/volume"),
				complete("pmem-region0/vol.pvc-new")},
			want:   Volume{ID: "pvc-new", Size: 20 * gib, Device: "/dev/pmem-region0/vol.pvc-new"},
			wantIO: []string{"zero /dev/pmem-region0/vol.pvc-new 0 21474836480"},
		},
		{
			name: "sizes are rounded up to the extent size",
			id:   "pvc-new", size: 3*gib + 1,
			calls: []call{lvs, vgs,
				lvcreate("3225419776", "vol.pvc-new", "pmem-region1", "pmem.pvbridge.io/volume"),
				complete("pmem-region1/vol.pvc-new")},
			want:   Volume{ID: "pvc-new", Size: 3*gib + 4<<20, Device: "/dev/pmem-region1/vol.pvc-new"},
			wantIO: []string{"zero /dev/pmem-region1/vol.pvc-new 0 3225419776"},
		},
		{
			name: "more than any one volume group has is ErrNoSpace, though both have enough",
			id:   "pvc-new", size: 40 * gib,
			calls:   []call{lvs, vgs},
			wantErr: ErrNoSpace,
		},
		{
			name: "lvcreate finding no room is ErrNoSpace",
			id:   "pvc-new", size: 2 * gib,
			calls: []call{lvs, vgs, {
				cmd:    "lvcreate -Zn -L 2147483648b -n vol.pvc-new --addtag pmem.pvbridge.io/volume --addtag pmem.pvbridge.io/incomplete pmem-region1",
				stderr: `  Volume group "pmem-region1" has insufficient free space (100 extents): 512 required.` + "\n" + `  Insufficient free space: 512 extents needed, but only 100 available`,
				fail:   true,
			}},
			wantErr: ErrNoSpace,
		},
		{
			name: "an existing volume is returned as it is",
			id:   "pvc-a", size: 2 * gib,
			calls: []call{lvs},
			want:  Volume{ID: "pvc-a", Size: 8 * gib, Device: "/dev/pmem-region0/vol.pvc-a"},
		},
		{
			name: "an incomplete volume left by a crash is made again",
			id:   "pvc-half", size: 4 * gib,
			calls: []call{lvs, {cmd: "lvremove -fy pmem-region0/vol.pvc-half"}, vgs,
				lvcreate("4294967296", "vol.pvc-half", "pmem-region1", "pmem.pvbridge.io/volume"),
				complete("pmem-region1/vol.pvc-half")},
			want:   Volume{ID: "pvc-half", Size: 4 * gib, Device: "/dev/pmem-region1/vol.pvc-half"},
			wantIO: []string{"zero /dev/pmem-region1/vol.pvc-half 0 4294967296"},
		},
		{
			name: "from a snapshot: its data, then zeroes",
			id:   "pvc-new", size: 10 * gib, src: &Source{SnapshotID: "snap-1"},
			calls: []call{lvs, vgs,
				lvcreate("10737418240", "vol.pvc-new", "pmem-region1", "pmem.pvbridge.io/volume"),
				complete("pmem-region1/vol.pvc-new")},
			want: Volume{ID: "pvc-new", Size: 10 * gib, Device: "/dev/pmem-region1/vol.pvc-new"},
			wantIO: []string{
				"copy /dev/pmem-region1/vol.pvc-new /dev/pmem-region0/snap.snap-1 0 8589934592",
				"zero /dev/pmem-region1/vol.pvc-new 8589934592 2147483648",
			},
		},
		{
			name: "a clone of a volume, of its size",
			id:   "pvc-new", src: &Source{VolumeID: "pvc-a"},
			calls: []call{lvs, vgs,
				lvcreate("8589934592", "vol.pvc-new", "pmem-region1", "pmem.pvbridge.io/volume"),
				complete("pmem-region1/vol.pvc-new")},
			want:   Volume{ID: "pvc-new", Size: 8 * gib, Device: "/dev/pmem-region1/vol.pvc-new"},
			wantIO: []string{"copy /dev/pmem-region1/vol.pvc-new /dev/pmem-region0/vol.pvc-a 0 8589934592"},
		},
		{
			name: "a missing source is ErrNotFound",
			id:   "pvc-new", src: &Source{SnapshotID: "snap-9"},
			calls:   []call{lvs},
			wantErr: ErrNotFound,
		},
		{
			name: "an incomplete source is ErrNotFound",
			id:   "pvc-new", src: &Source{VolumeID: "pvc-half"},
			calls:   []call{lvs},
			wantErr: ErrNotFound,
		},
		{
			name: "smaller than the source is ErrInvalid",
			id:   "pvc-new", size: 4 * gib, src: &Source{VolumeID: "pvc-a"},
			calls:   []call{lvs},
			wantErr: ErrInvalid,
		},
		{
			name: "a failed copy removes the new volume",
			id:   "pvc-new", src: &Source{VolumeID: "pvc-a"},
			calls: []call{lvs, vgs,
				lvcreate("8589934592", "vol.pvc-new", "pmem-region1", "pmem.pvbridge.io/volume"),
				{cmd: "lvremove -fy pmem-region1/vol.pvc-new"}},
			ioFail:  "copy",
			wantErr: errAny,
			wantIO:  []string{"copy /dev/pmem-region1/vol.pvc-new /dev/pmem-region0/vol.pvc-a 0 8589934592"},
		},
		{
			name:    "an invalid ID runs nothing",
			id:      "Not-A-Label",
			wantErr: ErrInvalid,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			io := &fakeIO{fail: tc.ioFail}
			l := newTestLVM(t, io, tc.calls...)
			vol, err := l.CreateVolume(t.Context(), tc.id, tc.size, tc.src)
			switch {
			case errors.Is(tc.wantErr, errAny):
				g.Expect(err).To(HaveOccurred())
			case tc.wantErr != nil:
				g.Expect(err).To(MatchError(tc.wantErr))
			default:
				g.Expect(err).NotTo(HaveOccurred())
				g.Expect(vol).To(Equal(tc.want))
			}
			g.Expect(io.operations()).To(Equal(tc.wantIO))
		})
	}
}

func TestLVMGetAndListVolumes(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	l := newTestLVM(t, &fakeIO{},
		lvs, lvs,
		// After a reboot without autoactivation GetVolume activates the volume.
		call{cmd: lvsCmd, stdout: "@lvs-after-reboot.json"}, call{cmd: "lvchange -ay pmem-region0/vol.pvc-a"},
		lvs, lvs)

	vol, err := l.GetVolume(ctx, "pvc-a")
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(vol).To(Equal(Volume{ID: "pvc-a", Size: 8 * gib, Device: "/dev/pmem-region0/vol.pvc-a"}))
	_, err = l.GetVolume(ctx, "pvc-half")
	g.Expect(err).To(MatchError(ErrNotFound), "incomplete volumes do not exist")
	_, err = l.GetVolume(ctx, "pvc-a")
	g.Expect(err).NotTo(HaveOccurred())

	vols, err := l.ListVolumes(ctx)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(vols).To(Equal([]Volume{
		{ID: "pvc-a", Size: 8 * gib, Device: "/dev/pmem-region0/vol.pvc-a"},
		{ID: "pvc-b", Size: 16 * gib, Device: "/dev/pmem-region1/vol.pvc-b"},
	}), "neither snapshots, incomplete volumes nor foreign LVs")

	snaps, err := l.ListSnapshots(ctx)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(snaps).To(Equal([]Snapshot{
		{ID: "snap-1", SourceVolumeID: "pvc-a", Size: 8 * gib, CreationTime: 1767225600000000000},
	}))
}

func TestLVMDelete(t *testing.T) {
	for _, tc := range []struct {
		name    string
		delete  func(l *LVM) error
		calls   []call
		wantErr error
	}{
		{name: "removes the volume", delete: deleteVolume("pvc-a"),
			calls: []call{lvs, {cmd: "lvremove -fy pmem-region0/vol.pvc-a"}}},
		{name: "a missing volume is no error", delete: deleteVolume("pvc-gone"), calls: []call{lvs}},
		{name: "an incomplete volume is removed", delete: deleteVolume("pvc-half"),
			calls: []call{lvs, {cmd: "lvremove -fy pmem-region0/vol.pvc-half"}}},
		{name: "an open volume is ErrInUse and stays", delete: deleteVolume("pvc-b"), calls: []call{lvs}, wantErr: ErrInUse},
		{name: "a volume lvremove finds in use is ErrInUse", delete: deleteVolume("pvc-a"), wantErr: ErrInUse, calls: []call{lvs, {
			cmd: "lvremove -fy pmem-region0/vol.pvc-a", fail: true,
			stderr: "  Logical volume pmem-region0/vol.pvc-a in use.",
		}}},
		{name: "removes the snapshot", delete: deleteSnapshot("snap-1"),
			calls: []call{lvs, {cmd: "lvremove -fy pmem-region0/snap.snap-1"}}},
		{name: "a missing snapshot is no error", delete: deleteSnapshot("snap-9"), calls: []call{lvs}},
		{name: "a snapshot ID never names a volume", delete: deleteSnapshot("pvc-a"), calls: []call{lvs}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			err := tc.delete(newTestLVM(t, &fakeIO{}, tc.calls...))
			if tc.wantErr != nil {
				g.Expect(err).To(MatchError(tc.wantErr))
				return
			}
			g.Expect(err).NotTo(HaveOccurred())
		})
	}
}

func deleteVolume(id string) func(*LVM) error {
	return func(l *LVM) error { return l.DeleteVolume(context.Background(), id) }
}

func deleteSnapshot(id string) func(*LVM) error {
	return func(l *LVM) error { return l.DeleteSnapshot(context.Background(), id) }
}

func TestLVMExpandVolume(t *testing.T) {
	for _, tc := range []struct {
		name    string
		id      string
		size    int64
		calls   []call
		want    Volume
		wantErr error
		wantIO  []string
	}{
		{
			name: "extends within its volume group and zeroes the new space",
			id:   "pvc-a", size: 12 * gib,
			calls: []call{lvs, vgs,
				{cmd: "lvchange --addtag pmem.pvbridge.io/zero-from=8589934592 pmem-region0/vol.pvc-a"},
				{cmd: "lvextend -L 12884901888b pmem-region0/vol.pvc-a"},
				{cmd: "lvchange --deltag pmem.pvbridge.io/zero-from=8589934592 pmem-region0/vol.pvc-a"}},
			want:   Volume{ID: "pvc-a", Size: 12 * gib, Device: "/dev/pmem-region0/vol.pvc-a"},
			wantIO: []string{"zero /dev/pmem-region0/vol.pvc-a 8589934592 4294967296"},
		},
		{
			name: "a smaller size leaves it as it is",
			id:   "pvc-a", size: 4 * gib,
			calls: []call{lvs},
			want:  Volume{ID: "pvc-a", Size: 8 * gib, Device: "/dev/pmem-region0/vol.pvc-a"},
		},
		{
			name: "zeroing a crash interrupted is finished",
			id:   "pvc-a", size: 12 * gib,
			calls: []call{{cmd: lvsCmd, stdout: "@lvs-expanding.json"},
				{cmd: "lvchange --deltag pmem.pvbridge.io/zero-from=8589934592 pmem-region0/vol.pvc-a"}},
			want:   Volume{ID: "pvc-a", Size: 12 * gib, Device: "/dev/pmem-region0/vol.pvc-a"},
			wantIO: []string{"zero /dev/pmem-region0/vol.pvc-a 8589934592 4294967296"},
		},
		{
			name: "more than its volume group has is ErrNoSpace, though the other has room",
			id:   "pvc-b", size: 32 * gib,
			calls:   []call{lvs, vgs},
			wantErr: ErrNoSpace,
		},
		{name: "a missing volume is ErrNotFound", id: "pvc-gone", size: gib, calls: []call{lvs}, wantErr: ErrNotFound},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			io := &fakeIO{}
			vol, err := newTestLVM(t, io, tc.calls...).ExpandVolume(t.Context(), tc.id, tc.size)
			if tc.wantErr != nil {
				g.Expect(err).To(MatchError(tc.wantErr))
				return
			}
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(vol).To(Equal(tc.want))
			g.Expect(io.operations()).To(Equal(tc.wantIO))
		})
	}
}

func TestLVMCreateSnapshot(t *testing.T) {
	for _, tc := range []struct {
		name     string
		id, vol  string
		calls    []call
		want     Snapshot
		wantErr  error
		wantCopy bool
	}{
		{
			name: "a full copy in an LV of its own, tagged with its volume and time",
			id:   "snap-2", vol: "pvc-a",
			calls: []call{lvs, vgs,
				{cmd: "lvcreate -Zn -L 8589934592b -n snap.snap-2 --addtag pmem.pvbridge.io/snapshot --addtag pmem.pvbridge.io/source=pvc-a --addtag pmem.pvbridge.io/created=<now> --addtag pmem.pvbridge.io/incomplete pmem-region1"},
				{cmd: "lvchange --deltag pmem.pvbridge.io/incomplete pmem-region1/snap.snap-2"}},
			want:     Snapshot{ID: "snap-2", SourceVolumeID: "pvc-a", Size: 8 * gib},
			wantCopy: true,
		},
		{
			name: "an existing snapshot of the volume is returned as it is",
			id:   "snap-1", vol: "pvc-a",
			calls: []call{lvs},
			want:  Snapshot{ID: "snap-1", SourceVolumeID: "pvc-a", Size: 8 * gib, CreationTime: 1767225600000000000},
		},
		{name: "an existing snapshot of another volume is ErrInvalid", id: "snap-1", vol: "pvc-b", calls: []call{lvs}, wantErr: ErrInvalid},
		{name: "a missing volume is ErrNotFound", id: "snap-2", vol: "pvc-gone", calls: []call{lvs}, wantErr: ErrNotFound},
		{name: "no volume group with room is ErrNoSpace", id: "snap-2", vol: "pvc-b", calls: []call{lvs, {cmd: vgsCmd, stdout: "@vgs-full.json"}}, wantErr: ErrNoSpace},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			io := &fakeIO{}
			r := replay(t, "lvm", append([]call{vgs, {cmd: lvsCmd, stdout: "@lvs-empty.json"}}, tc.calls...)...)
			l, err := NewLVM(t.Context(), LVMOptions{VolumeGroups: []string{"pmem-region0", "pmem-region1"}, Runner: nowRunner{r}, BlockIO: io})
			g.Expect(err).NotTo(HaveOccurred())
			snap, err := l.CreateSnapshot(t.Context(), tc.id, tc.vol)
			if tc.wantErr != nil {
				g.Expect(err).To(MatchError(tc.wantErr))
				return
			}
			g.Expect(err).NotTo(HaveOccurred())
			if tc.wantCopy {
				g.Expect(snap.CreationTime).To(BeNumerically(">", 1767225600000000000))
				snap.CreationTime = 0
				g.Expect(io.operations()).To(Equal([]string{"copy /dev/pmem-region1/snap.snap-2 /dev/pmem-region0/vol.pvc-a 0 8589934592"}))
			}
			g.Expect(snap).To(Equal(tc.want))
		})
	}
}
