package pmem

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"

	. "github.com/onsi/gomega"
	"k8s.io/apimachinery/pkg/util/validation"

	pmemv1 "pvbridge.io/pkg/apis/pmem/v1alpha1"
)

// The ndctl back end is tested against output in the shape of ndctl v78 (testdata/ndctl):
// there is no NVDIMM on the machines that run these tests. The recorded node has two regions
// of 64 GiB:
//
//	region0  40 GiB free, fragmented: its largest free extent is 24 GiB. Namespaces:
//	         pvc-a (2 GiB, complete), snap:snap-1 (of pvc-a), pvc-half (left incomplete)
//	region1  30 GiB free in one extent, and an unnamed namespace that is not ours

var (
	listNamespaces = call{cmd: "ndctl list -N", stdout: "@namespaces.json"}
	listRegions    = call{cmd: "ndctl list -R", stdout: "@regions.json"}
)

const (
	snap1Size  = 3168796672
	pvcASize   = 2111832064
	pvcHalfDev = "/dev/pmem0.2"
	snap1Dev   = "/dev/pmem0.1"
)

// recordedIO is a fakeIO holding what the recorded namespaces hold: the trailer of snap-1
// and the incomplete record of pvc-half.
func recordedIO(t *testing.T) *fakeIO {
	t.Helper()
	io := &fakeIO{}
	io.put(pvcHalfDev, 0, incompleteRecord(namespaceRow{UUID: "3f0a9b8c-7d6e-4f5a-9b8c-7d6e5f4a3b2c"}))
	tr, err := json.Marshal(snapshotTrailer{
		Magic: trailerMagic, UUID: "9e1d7c2b-3a4f-4e6d-8b0a-1c2d3e4f5a6b",
		ID: "snap-1", SourceVolumeID: "pvc-a", Size: pvcASize, CreationTime: 1767225600000000000,
	})
	if err != nil {
		t.Fatal(err)
	}
	io.put(snap1Dev, snap1Size-recordSize, tr)
	return io
}

func newTestNdctl(t *testing.T, io *fakeIO, calls ...call) *Ndctl {
	t.Helper()
	n, err := NewNdctl(NdctlOptions{Runner: replay(t, "ndctl", calls...), BlockIO: io})
	if err != nil {
		t.Fatal(err)
	}
	return n
}

func TestNewNdctlValidatesAlignment(t *testing.T) {
	g := NewWithT(t)
	for _, align := range []int64{-1, 4096, 3 << 30} {
		_, err := NewNdctl(NdctlOptions{Alignment: align})
		g.Expect(err).To(HaveOccurred(), "alignment %d", align)
	}
	n, err := NewNdctl(NdctlOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(n.Mode()).To(Equal(pmemv1.ModeNdctl))
	g.Expect(n.alignment).To(Equal(int64(1 << 30)))
}

func TestNdctlCapacity(t *testing.T) {
	for _, tc := range []struct {
		name    string
		regions []string
		want    Capacity
	}{
		{name: "every region; the largest volume fits the largest free extent with its page map",
			want: Capacity{Total: 128 * gib, Free: 70 * gib, LargestAllocatable: 29 * gib, Alignment: gib}},
		{name: "only the regions asked for", regions: []string{"region0"},
			want: Capacity{Total: 64 * gib, Free: 40 * gib, LargestAllocatable: 23 * gib, Alignment: gib}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			n, err := NewNdctl(NdctlOptions{Regions: tc.regions, Runner: replay(t, "ndctl", listRegions), BlockIO: &fakeIO{}})
			g.Expect(err).NotTo(HaveOccurred())
			c, err := n.Capacity(t.Context())
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(c).To(Equal(tc.want))
		})
	}
}

func TestNdctlCreateVolume(t *testing.T) {
	create := func(size, name, out string) []call {
		return []call{
			{cmd: "ndctl create-namespace --mode fsdax --map dev --region region0 --size " + size + " --name " + name, stdout: "@create-" + out + ".json"},
			{cmd: "ndctl list -N -n namespace0.3", stdout: "@list-" + out + ".json"},
		}
	}
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
			name: "a namespace one alignment larger for its page map, in the tightest region, zeroed first block last",
			id:   "pvc-new", size: gib,
			calls: append([]call{listNamespaces, listRegions}, create("2147483648", "pvc-new", "pvc-new")...),
			want:  Volume{ID: "pvc-new", Size: pvcASize, Device: "/dev/pmem0.3"},
			wantIO: []string{
				"write /dev/pmem0.3 0",
				"zero /dev/pmem0.3 4096 2111827968",
				"zero /dev/pmem0.3 0 4096",
			},
		},
		{
			name: "an existing volume is returned as it is",
			id:   "pvc-a", size: gib,
			calls: []call{listNamespaces},
			want:  Volume{ID: "pvc-a", Size: pvcASize, Device: "/dev/pmem0"},
		},
		{
			name: "a volume a crash left incomplete is filled again in place",
			id:   "pvc-half", size: gib,
			calls: []call{listNamespaces},
			want:  Volume{ID: "pvc-half", Size: pvcASize, Device: pvcHalfDev},
			wantIO: []string{
				"zero /dev/pmem0.2 4096 2111827968",
				"zero /dev/pmem0.2 0 4096",
			},
		},
		{
			name: "more than the largest free extent is ErrNoSpace, though the region has more free",
			id:   "pvc-new", size: 30 * gib,
			calls:   []call{listNamespaces, listRegions},
			wantErr: ErrNoSpace,
		},
		{
			name: "from a snapshot: its data, zeroes, its first block last",
			id:   "pvc-restored", src: &Source{SnapshotID: "snap-1"},
			calls: append([]call{listNamespaces, listRegions}, create("3221225472", "pvc-restored", "pvc-restored")...),
			want:  Volume{ID: "pvc-restored", Size: snap1Size, Device: "/dev/pmem0.3"},
			wantIO: []string{
				"write /dev/pmem0.3 0",
				"copy /dev/pmem0.3 /dev/pmem0.1 4096 2111827968",
				"zero /dev/pmem0.3 2111832064 1056964608",
				"copy /dev/pmem0.3 /dev/pmem0.1 0 4096",
			},
		},
		{name: "a missing source is ErrNotFound", id: "pvc-new", src: &Source{VolumeID: "pvc-gone"},
			calls: []call{listNamespaces}, wantErr: ErrNotFound},
		{name: "an incomplete source is ErrNotFound", id: "pvc-new", src: &Source{VolumeID: "pvc-half"},
			calls: []call{listNamespaces}, wantErr: ErrNotFound},
		{name: "a snapshot ID does not name a volume", id: "pvc-new", src: &Source{SnapshotID: "pvc-a"},
			calls: []call{listNamespaces}, wantErr: ErrNotFound},
		{
			name: "a failed copy destroys the new namespace",
			id:   "pvc-new", size: gib, ioFail: "zero",
			calls: append(append([]call{listNamespaces, listRegions}, create("2147483648", "pvc-new", "pvc-new")...),
				call{cmd: "ndctl destroy-namespace --force namespace0.3"}),
			wantErr: errAny,
			wantIO:  []string{"write /dev/pmem0.3 0", "zero /dev/pmem0.3 4096 2111827968"},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			io := recordedIO(t)
			io.fail = tc.ioFail
			vol, err := newTestNdctl(t, io, tc.calls...).CreateVolume(t.Context(), tc.id, tc.size, tc.src)
			switch {
			case errors.Is(tc.wantErr, errAny):
				g.Expect(err).To(HaveOccurred())
			case tc.wantErr != nil:
				g.Expect(err).To(MatchError(tc.wantErr))
			default:
				g.Expect(err).NotTo(HaveOccurred())
				g.Expect(vol).To(Equal(tc.want))
				complete, err := newTestNdctl(t, io).complete(t.Context(), namespaceRow{Blockdev: strings.TrimPrefix(vol.Device, "/dev/")})
				g.Expect(err).NotTo(HaveOccurred())
				g.Expect(complete).To(BeTrue())
			}
			g.Expect(io.operations()).To(Equal(tc.wantIO))
		})
	}
}

func TestNdctlGetAndList(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	n := newTestNdctl(t, recordedIO(t), listNamespaces, listNamespaces, listNamespaces, listNamespaces)

	vol, err := n.GetVolume(ctx, "pvc-a")
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(vol).To(Equal(Volume{ID: "pvc-a", Size: pvcASize, Device: "/dev/pmem0"}))
	_, err = n.GetVolume(ctx, "pvc-half")
	g.Expect(err).To(MatchError(ErrNotFound), "an incomplete volume does not exist")

	vols, err := n.ListVolumes(ctx)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(vols).To(Equal([]Volume{{ID: "pvc-a", Size: pvcASize, Device: "/dev/pmem0"}}),
		"neither snapshots, incomplete volumes nor namespaces without our names")

	snaps, err := n.ListSnapshots(ctx)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(snaps).To(Equal([]Snapshot{{ID: "snap-1", SourceVolumeID: "pvc-a", Size: pvcASize, CreationTime: 1767225600000000000}}))
}

func TestNdctlExpandVolume(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	n := newTestNdctl(t, recordedIO(t), listNamespaces, listNamespaces, listNamespaces)
	vol, err := n.ExpandVolume(ctx, "pvc-a", gib)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(vol.Size).To(Equal(int64(pvcASize)), "large enough already")
	_, err = n.ExpandVolume(ctx, "pvc-a", 4*gib)
	g.Expect(err).To(MatchError(ErrInvalid))
	g.Expect(err).To(MatchError(ContainSubstring("cannot grow")))
	_, err = n.ExpandVolume(ctx, "pvc-gone", gib)
	g.Expect(err).To(MatchError(ErrNotFound))
}

func TestNdctlDelete(t *testing.T) {
	for _, tc := range []struct {
		name    string
		del     func(*Ndctl) error
		calls   []call
		wantErr error
	}{
		{name: "destroys the volume's namespace", del: func(n *Ndctl) error { return n.DeleteVolume(t.Context(), "pvc-a") },
			calls: []call{listNamespaces, {cmd: "ndctl destroy-namespace --force namespace0.0"}}},
		{name: "a missing volume is no error", del: func(n *Ndctl) error { return n.DeleteVolume(t.Context(), "pvc-gone") },
			calls: []call{listNamespaces}},
		{name: "a mounted volume is ErrInUse", del: func(n *Ndctl) error { return n.DeleteVolume(t.Context(), "pvc-a") }, wantErr: ErrInUse,
			calls: []call{listNamespaces, {cmd: "ndctl destroy-namespace --force namespace0.0", fail: true,
				stderr: "libndctl: ndctl_namespace_disable_safe: namespace0.0: pmem0 failed exclusive open: Device or resource busy\n" +
					"error destroying namespaces: Device or resource busy\ndestroyed 0 namespaces"}}},
		{name: "destroys the snapshot's namespace", del: func(n *Ndctl) error { return n.DeleteSnapshot(t.Context(), "snap-1") },
			calls: []call{listNamespaces, {cmd: "ndctl destroy-namespace --force namespace0.1"}}},
		{name: "a snapshot ID never names a volume", del: func(n *Ndctl) error { return n.DeleteSnapshot(t.Context(), "pvc-a") },
			calls: []call{listNamespaces}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			err := tc.del(newTestNdctl(t, recordedIO(t), tc.calls...))
			if tc.wantErr != nil {
				g.Expect(err).To(MatchError(tc.wantErr))
				return
			}
			g.Expect(err).NotTo(HaveOccurred())
		})
	}
}

func TestNdctlCreateSnapshot(t *testing.T) {
	createSnap2 := []call{
		{cmd: "ndctl create-namespace --mode fsdax --map dev --region region0 --size 3221225472 --name snap:snap-2", stdout: "@create-snap-2.json"},
		{cmd: "ndctl list -N -n namespace0.3", stdout: "@list-snap-2.json"},
	}
	for _, tc := range []struct {
		name    string
		id, vol string
		calls   []call
		want    Snapshot
		wantErr error
	}{
		{name: "a block copy in a namespace of its own, then its trailer", id: "snap-2", vol: "pvc-a",
			calls: append([]call{listNamespaces, listRegions}, createSnap2...),
			want:  Snapshot{ID: "snap-2", SourceVolumeID: "pvc-a", Size: pvcASize}},
		{name: "an existing snapshot is returned as it is", id: "snap-1", vol: "pvc-a", calls: []call{listNamespaces},
			want: Snapshot{ID: "snap-1", SourceVolumeID: "pvc-a", Size: pvcASize, CreationTime: 1767225600000000000}},
		{name: "an existing snapshot of another volume is ErrInvalid", id: "snap-1", vol: "pvc-half", calls: []call{listNamespaces}, wantErr: ErrInvalid},
		{name: "a missing volume is ErrNotFound", id: "snap-2", vol: "pvc-gone", calls: []call{listNamespaces}, wantErr: ErrNotFound},
		{name: "an incomplete volume is ErrNotFound", id: "snap-2", vol: "pvc-half", calls: []call{listNamespaces}, wantErr: ErrNotFound},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			io := recordedIO(t)
			snap, err := newTestNdctl(t, io, tc.calls...).CreateSnapshot(t.Context(), tc.id, tc.vol)
			if tc.wantErr != nil {
				g.Expect(err).To(MatchError(tc.wantErr))
				return
			}
			g.Expect(err).NotTo(HaveOccurred())
			if tc.want.CreationTime == 0 {
				g.Expect(snap.CreationTime).To(BeNumerically(">", 1767225600000000000))
				g.Expect(io.operations()).To(Equal([]string{
					"copy /dev/pmem0.3 /dev/pmem0 0 2111832064",
					"write /dev/pmem0.3 3168792576",
				}))
				ns := namespaceRow{Blockdev: "pmem0.3", Size: snap1Size, UUID: "a1b2c3d4-e5f6-4a7b-8c9d-0e1f2a3b4c5d", Name: "snap:snap-2"}
				got, complete, err := newTestNdctl(t, io).readTrailer(t.Context(), ns)
				g.Expect(err).NotTo(HaveOccurred())
				g.Expect(complete).To(BeTrue())
				g.Expect(got).To(Equal(snap), "the trailer records the snapshot")
				snap.CreationTime = 0
			}
			g.Expect(snap).To(Equal(tc.want))
		})
	}
}

func TestSnapshotNamespaceNames(t *testing.T) {
	g := NewWithT(t)
	long := strings.Repeat("s", 63)
	longer := strings.Repeat("s", 62) + "t"
	for _, id := range []string{"snap-1", "snapshot-3f2e6f0c-9d1b-4a55-8f62-2f7c0d9e4b11", strings.Repeat("a", 58), long, longer} {
		name := snapshotNamespaceName(id)
		g.Expect(len(name)).To(BeNumerically("<=", 63), name)
		g.Expect(validation.IsDNS1123Label(name)).NotTo(BeEmpty(), "%s can be no volume's name", name)
		g.Expect(isSnapshotNamespace(name)).To(BeTrue())
	}
	g.Expect(snapshotNamespaceName("snap-1")).To(Equal("snap:snap-1"), "readable when it fits")
	g.Expect(snapshotNamespaceName(long)).To(HavePrefix("snap#"))
	g.Expect(snapshotNamespaceName(long)).NotTo(Equal(snapshotNamespaceName(longer)))
}

// TestNamespaceSizes checks the namespace sizes against the usable size the kernel leaves an
// fsdax namespace with its page map in it: 64 bytes per 4 KiB page and an 8 KiB info block,
// rounded up to the 2 MiB data alignment.
func TestNamespaceSizes(t *testing.T) {
	g := NewWithT(t)
	kernelUsable := func(raw int64) int64 { return raw - AlignUp(8<<10+raw/4096*64, 2<<20) }
	g.Expect(kernelUsable(2*gib)).To(Equal(int64(pvcASize)), "as recorded")
	g.Expect(kernelUsable(3*gib)).To(Equal(int64(snap1Size)), "as recorded")
	for size := gib; size <= 1024*gib; size += gib {
		raw := rawSize(size, gib)
		g.Expect(raw % gib).To(BeZero())
		g.Expect(kernelUsable(raw)).To(BeNumerically(">=", size), "a %d GiB volume fits its namespace", size/gib)
		g.Expect(usableSize(raw, gib)).To(BeNumerically(">=", size))
		g.Expect(rawSize(usableSize(raw, gib), gib)).To(BeNumerically("<=", raw), "largest allocatable is allocatable")
	}
	g.Expect(rawSize(gib, gib)).To(Equal(2 * gib))
	g.Expect(rawSize(63*gib, gib)).To(Equal(65*gib), "more than one alignment of page map past 63 GiB")
}

func TestParseNdctlList(t *testing.T) {
	g := NewWithT(t)
	for _, tc := range []struct {
		out  string
		want int
	}{
		{out: "", want: 0},
		{out: "\n", want: 0},
		{out: `[{"dev":"region0"},{"dev":"region1"}]`, want: 2},
		{out: `{"dev":"region0"}`, want: 1},
	} {
		got, err := parseList[regionRow]([]byte(tc.out))
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(got).To(HaveLen(tc.want))
	}
	_, err := parseList[regionRow]([]byte("garbage"))
	g.Expect(err).To(HaveOccurred())
}
