package driver

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	. "github.com/onsi/gomega"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"

	"pvbridge.io/pkg/mounter"
)

func TestNodeGetCapabilities(t *testing.T) {
	g := NewWithT(t)
	n := newNodeServer(testNode, nil, "/", mounter.New())
	resp, err := n.NodeGetCapabilities(t.Context(), &csi.NodeGetCapabilitiesRequest{})
	g.Expect(err).NotTo(HaveOccurred())
	var got []csi.NodeServiceCapability_RPC_Type
	for _, c := range resp.GetCapabilities() {
		got = append(got, c.GetRpc().GetType())
	}
	g.Expect(got).To(ConsistOf(
		csi.NodeServiceCapability_RPC_STAGE_UNSTAGE_VOLUME,
		csi.NodeServiceCapability_RPC_GET_VOLUME_STATS,
		csi.NodeServiceCapability_RPC_GET_VOLUME_HEALTH,
		csi.NodeServiceCapability_RPC_EXPAND_VOLUME,
		csi.NodeServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER,
	))
}

func TestNodeGetInfo(t *testing.T) {
	tests := []struct {
		name     string
		host     Host
		wantMax  int64
		wantCode codes.Code
		wantMsg  string
	}{
		{name: "the VM is the node, its host the topology", host: fakeHost{host: testHost}},
		{name: "the VM's slots are the node's volume limit", host: fakeHost{host: testHost, slots: 5}, wantMax: 5},
		{name: "no source of the host is unavailable", host: nil, wantCode: codes.Unavailable, wantMsg: "not known yet"},
		{name: "an unlabelled node is unavailable", host: fakeHost{err: ErrHostUnknown}, wantCode: codes.Unavailable, wantMsg: "not known yet"},
		{name: "an empty host is unavailable", host: fakeHost{}, wantCode: codes.Unavailable, wantMsg: "not known yet"},
		{name: "a failed read is unavailable", host: fakeHost{err: errors.New("connection refused")}, wantCode: codes.Unavailable, wantMsg: "connection refused"},
		{name: "a host that is no label value is internal", host: fakeHost{host: "host a"}, wantCode: codes.Internal, wantMsg: "no topology value"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			n := newNodeServer(testNode, tt.host, "/", mounter.New())
			resp, err := n.NodeGetInfo(t.Context(), &csi.NodeGetInfoRequest{})
			expectCode(g, err, tt.wantCode, tt.wantMsg)
			if tt.wantCode != codes.OK {
				return
			}
			g.Expect(resp.GetNodeId()).To(Equal(testNode))
			g.Expect(resp.GetAccessibleTopology().GetSegments()).To(Equal(map[string]string{TopologyKey: testHost}))
			g.Expect(resp.GetMaxVolumesPerNode()).To(Equal(tt.wantMax))
		})
	}
}

func TestDisksBySerial(t *testing.T) {
	const serial = "pvb-0123456789abcdef"
	tests := []struct {
		name string
		// attach attaches disks to the VM and returns the node expected for serial ("" if
		// none).
		attach   func(t *testing.T, e *vmEnv) string
		wantCode codes.Code
	}{
		{
			name:   "by the serial in sysfs",
			attach: func(t *testing.T, e *vmEnv) string { return e.hotplug(t, "vdb", serial, true, false) },
		},
		{
			name: "by the by-id link when sysfs has no serial",
			attach: func(t *testing.T, e *vmEnv) string {
				e.hotplug(t, "vdb", serial, false, true)
				return e.path("vm/dev/disk/by-id/virtio-" + serial)
			},
		},
		{
			name: "among other disks",
			attach: func(t *testing.T, e *vmEnv) string {
				e.disk(t, "vdb", "pvb-other")
				return e.disk(t, "vdc", serial)
			},
		},
		{
			name:     "not attached yet is not found",
			attach:   func(t *testing.T, e *vmEnv) string { e.disk(t, "vdb", "pvb-other"); return "" },
			wantCode: codes.NotFound,
		},
		{
			name:     "an empty VM is not found",
			attach:   func(*testing.T, *vmEnv) string { return "" },
			wantCode: codes.NotFound,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			e := newVMEnv(t)
			want := tt.attach(t, e)
			got, err := e.n.device(t.Context(), serial)
			expectCode(g, err, tt.wantCode, serial)
			if tt.wantCode == codes.OK {
				g.Expect(got).To(Equal(want))
			}
		})
	}
}

func TestNodeStageVolume(t *testing.T) {
	const (
		id     = "mgmt-pvc-1"
		serial = "pvb-1"
	)
	tests := []struct {
		name string
		// setup prepares the VM and returns the request.
		setup    func(t *testing.T, e *vmEnv, req *csi.NodeStageVolumeRequest)
		wantCode codes.Code
		wantMsg  string
		// check checks the staged volume.
		check func(t *testing.T, g Gomega, e *vmEnv, staging string)
	}{
		{name: "no volume ID", setup: func(_ *testing.T, _ *vmEnv, r *csi.NodeStageVolumeRequest) { r.VolumeId = "" }, wantCode: codes.InvalidArgument, wantMsg: "volume_id"},
		{name: "no staging path", setup: func(_ *testing.T, _ *vmEnv, r *csi.NodeStageVolumeRequest) { r.StagingTargetPath = "" }, wantCode: codes.InvalidArgument, wantMsg: "staging_target_path"},
		{name: "no capability", setup: func(_ *testing.T, _ *vmEnv, r *csi.NodeStageVolumeRequest) { r.VolumeCapability = nil }, wantCode: codes.InvalidArgument, wantMsg: "volume_capability"},
		{name: "no access mode", setup: func(_ *testing.T, _ *vmEnv, r *csi.NodeStageVolumeRequest) { r.VolumeCapability.AccessMode = nil }, wantCode: codes.InvalidArgument, wantMsg: "volume_capability.access_mode"},
		{
			name: "a multi-node access mode",
			setup: func(_ *testing.T, _ *vmEnv, r *csi.NodeStageVolumeRequest) {
				withMode(r.VolumeCapability, csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER)
			},
			wantCode: codes.InvalidArgument, wantMsg: "volume_capability.access_mode",
		},
		{name: "an unsupported filesystem", setup: func(_ *testing.T, _ *vmEnv, r *csi.NodeStageVolumeRequest) { r.VolumeCapability = fsCap("btrfs") }, wantCode: codes.InvalidArgument, wantMsg: "fs_type"},
		{name: "no serial", setup: func(_ *testing.T, _ *vmEnv, r *csi.NodeStageVolumeRequest) { r.PublishContext = nil }, wantCode: codes.InvalidArgument, wantMsg: "diskSerial"},
		{name: "a serial that is a path", setup: func(_ *testing.T, _ *vmEnv, r *csi.NodeStageVolumeRequest) {
			r.PublishContext = publishContext("../vdb")
		}, wantCode: codes.InvalidArgument, wantMsg: "diskSerial"},
		{name: "a disk not attached yet is not found, so kubelet retries", setup: func(*testing.T, *vmEnv, *csi.NodeStageVolumeRequest) {}, wantCode: codes.NotFound, wantMsg: serial},
		{name: "another operation on the volume is aborted", setup: func(t *testing.T, e *vmEnv, _ *csi.NodeStageVolumeRequest) { e.disk(t, "vdb", serial); e.locked(t, id) }, wantCode: codes.Aborted, wantMsg: id},
		{
			name: "ext4 by default, found by the serial",
			setup: func(t *testing.T, e *vmEnv, r *csi.NodeStageVolumeRequest) {
				e.disk(t, "vdb", serial)
				r.VolumeCapability = fsCap("")
			},
			check: func(t *testing.T, g Gomega, e *vmEnv, staging string) {
				g.Expect(blkidType(t, e.nodes[serial])).To(Equal("ext4"))
				g.Expect(mountsUnder(t, staging)).To(ConsistOf(staging))
			},
		},
		{
			name: "xfs",
			setup: func(t *testing.T, e *vmEnv, r *csi.NodeStageVolumeRequest) {
				e.disk(t, "vdb", serial)
				r.VolumeCapability = fsCap("xfs")
			},
			check: func(t *testing.T, g Gomega, e *vmEnv, staging string) {
				g.Expect(blkidType(t, e.nodes[serial])).To(Equal("xfs"))
				g.Expect(mountsUnder(t, staging)).To(ConsistOf(staging))
			},
		},
		{
			name:  "a disk seen only through its by-id link",
			setup: func(t *testing.T, e *vmEnv, _ *csi.NodeStageVolumeRequest) { e.hotplug(t, "vdb", serial, false, true) },
			check: func(t *testing.T, g Gomega, e *vmEnv, staging string) {
				g.Expect(blkidType(t, e.nodes[serial])).To(Equal("ext4"))
				g.Expect(mountsUnder(t, staging)).To(ConsistOf(staging))
			},
		},
		{
			name: "a disk holding another filesystem is not formatted",
			setup: func(t *testing.T, e *vmEnv, _ *csi.NodeStageVolumeRequest) {
				format(t, e.disk(t, "vdb", serial), "xfs")
			},
			wantCode: codes.FailedPrecondition, wantMsg: "not formatted over",
		},
		{
			name: "a block volume is only checked",
			setup: func(t *testing.T, e *vmEnv, r *csi.NodeStageVolumeRequest) {
				e.disk(t, "vdb", serial)
				r.VolumeCapability = rawCap()
			},
			check: func(t *testing.T, g Gomega, e *vmEnv, staging string) {
				g.Expect(blkidType(t, e.nodes[serial])).To(BeEmpty())
				g.Expect(mountsUnder(t, e.dir)).To(BeEmpty())
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			e := newVMEnv(t)
			staging := e.path("staging")
			req := &csi.NodeStageVolumeRequest{
				VolumeId: id, StagingTargetPath: staging, VolumeCapability: fsCap("ext4"), PublishContext: publishContext(serial),
			}
			tt.setup(t, e, req)
			_, err := e.n.NodeStageVolume(t.Context(), req)
			t.Cleanup(func() { _ = e.n.Mounter.Unmount(t.Context(), staging) })
			expectCode(g, err, tt.wantCode, tt.wantMsg)
			if tt.check != nil {
				tt.check(t, g, e, staging)
				// Staging again is a no-op.
				_, err := e.n.NodeStageVolume(t.Context(), req)
				g.Expect(err).NotTo(HaveOccurred())
				tt.check(t, g, e, staging)
			}
		})
	}
}

func TestNodePublishVolume(t *testing.T) {
	tests := []struct {
		name       string
		capability *csi.VolumeCapability
		readOnly   bool
		// change changes a valid request.
		change   func(*csi.NodePublishVolumeRequest)
		wantCode codes.Code
		wantMsg  string
		wantRO   bool
	}{
		{name: "ext4", capability: fsCap("ext4")},
		{name: "xfs read-only", capability: fsCap("xfs"), readOnly: true, wantRO: true},
		{name: "read-only by access mode", capability: withMode(fsCap("ext4"), csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY), wantRO: true},
		{name: "raw block as a device file", capability: rawCap()},
		{name: "raw block read-only", capability: rawCap(), readOnly: true, wantRO: true},
		{name: "no target path", capability: fsCap("ext4"), change: func(r *csi.NodePublishVolumeRequest) { r.TargetPath = "" }, wantCode: codes.InvalidArgument, wantMsg: "target_path"},
		{name: "no staging path", capability: fsCap("ext4"), change: func(r *csi.NodePublishVolumeRequest) { r.StagingTargetPath = "" }, wantCode: codes.InvalidArgument, wantMsg: "staging_target_path"},
		{name: "raw block without a serial", capability: rawCap(), change: func(r *csi.NodePublishVolumeRequest) { r.PublishContext = nil }, wantCode: codes.InvalidArgument, wantMsg: "diskSerial"},
		{name: "a filesystem that is not staged", capability: fsCap("ext4"), change: func(r *csi.NodePublishVolumeRequest) { r.StagingTargetPath += "-not" }, wantCode: codes.NotFound},
		{name: "single writer (ReadWriteOncePod)", capability: withMode(fsCap("ext4"), csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER)},
		{name: "single writer without a serial", capability: withMode(fsCap("ext4"), csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER), change: func(r *csi.NodePublishVolumeRequest) { r.PublishContext = nil }, wantCode: codes.InvalidArgument, wantMsg: "diskSerial"},
		{name: "multi writer raw block", capability: withMode(rawCap(), csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			e := newVMEnv(t)
			staging := e.staged(t, "v", "pvb-v", tt.capability)
			target := e.path("pods/p/volumes/v")
			req := &csi.NodePublishVolumeRequest{
				VolumeId: "v", StagingTargetPath: staging, TargetPath: target, VolumeCapability: tt.capability,
				Readonly: tt.readOnly, PublishContext: publishContext("pvb-v"),
			}
			if tt.change != nil {
				tt.change(req)
			}
			_, err := e.n.NodePublishVolume(t.Context(), req)
			t.Cleanup(func() { _ = e.n.Mounter.Unmount(t.Context(), target) })
			expectCode(g, err, tt.wantCode, tt.wantMsg)
			if tt.wantCode != codes.OK {
				return
			}
			var st unix.Statfs_t
			g.Expect(unix.Statfs(target, &st)).To(Succeed())
			readOnly := st.Flags&unix.ST_RDONLY != 0
			g.Expect(readOnly).To(Equal(tt.wantRO))
			if tt.capability.GetBlock() != nil {
				var dev, pub unix.Stat_t
				g.Expect(unix.Stat(e.nodes["pvb-v"], &dev)).To(Succeed())
				g.Expect(unix.Stat(target, &pub)).To(Succeed())
				g.Expect(pub.Mode & unix.S_IFMT).To(Equal(uint32(unix.S_IFBLK)))
				g.Expect(pub.Rdev).To(Equal(dev.Rdev))
			}
			// Publishing again is a no-op.
			_, err = e.n.NodePublishVolume(t.Context(), req)
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(mountsUnder(t, target)).To(HaveLen(1))
		})
	}
}

// TestNodePublishVolumeAtASecondTarget: a SINGLE_NODE_SINGLE_WRITER volume (ReadWriteOncePod)
// is published once, a SINGLE_NODE_MULTI_WRITER one (ReadWriteOnce) at every target asked.
func TestNodePublishVolumeAtASecondTarget(t *testing.T) {
	tests := []struct {
		name       string
		capability *csi.VolumeCapability
		wantCode   codes.Code
	}{
		{"single-writer filesystem", withMode(fsCap("ext4"), csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER), codes.FailedPrecondition},
		{"single-writer raw block", withMode(rawCap(), csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER), codes.FailedPrecondition},
		{"multi-writer filesystem", withMode(fsCap("ext4"), csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER), codes.OK},
		{"multi-writer raw block", withMode(rawCap(), csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER), codes.OK},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			e := newVMEnv(t)
			staging, _ := e.published(t, "v", "pvb-v", tt.capability)
			second := e.path("pods/second/volumes/v")
			_, err := e.n.NodePublishVolume(t.Context(), &csi.NodePublishVolumeRequest{
				VolumeId: "v", StagingTargetPath: staging, TargetPath: second, VolumeCapability: tt.capability, PublishContext: publishContext("pvb-v"),
			})
			t.Cleanup(func() { _ = e.n.Mounter.Unmount(t.Context(), second) })
			expectCode(g, err, tt.wantCode, "SINGLE_NODE_SINGLE_WRITER")
		})
	}
}

func TestNodeGetVolumeStats(t *testing.T) {
	tests := []struct {
		name       string
		capability *csi.VolumeCapability
		// path returns the volume path to ask about.
		path     func(t *testing.T, e *vmEnv, staging, target string) string
		wantCode codes.Code
		wantMsg  string
		wantUnit []csi.VolumeUsage_Unit
	}{
		{name: "a published filesystem", capability: fsCap("ext4"), path: func(_ *testing.T, _ *vmEnv, _, target string) string { return target }, wantUnit: []csi.VolumeUsage_Unit{csi.VolumeUsage_BYTES, csi.VolumeUsage_INODES}},
		{name: "a staged filesystem", capability: fsCap("xfs"), path: func(_ *testing.T, _ *vmEnv, staging, _ string) string { return staging }, wantUnit: []csi.VolumeUsage_Unit{csi.VolumeUsage_BYTES, csi.VolumeUsage_INODES}},
		{name: "a raw block device", capability: rawCap(), path: func(_ *testing.T, _ *vmEnv, _, target string) string { return target }, wantUnit: []csi.VolumeUsage_Unit{csi.VolumeUsage_BYTES}},
		{name: "a path that does not exist", capability: fsCap("ext4"), path: func(_ *testing.T, e *vmEnv, _, _ string) string { return e.path("nothing") }, wantCode: codes.NotFound},
		{
			name: "a directory that is no mount", capability: fsCap("ext4"),
			path:     func(t *testing.T, e *vmEnv, _, _ string) string { p := e.path("empty"); mkdir(t, p); return p },
			wantCode: codes.FailedPrecondition, wantMsg: "not a mount point",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			e := newVMEnv(t)
			staging, target := e.published(t, "v", "pvb-v", tt.capability)
			resp, err := e.n.NodeGetVolumeStats(t.Context(), &csi.NodeGetVolumeStatsRequest{VolumeId: "v", VolumePath: tt.path(t, e, staging, target)})
			expectCode(g, err, tt.wantCode, tt.wantMsg)
			if tt.wantCode != codes.OK {
				return
			}
			var units []csi.VolumeUsage_Unit
			for _, u := range resp.GetUsage() {
				units = append(units, u.GetUnit())
				g.Expect(u.GetTotal()).To(BeNumerically(">", 0))
			}
			g.Expect(units).To(Equal(tt.wantUnit))
			if tt.capability.GetBlock() != nil {
				g.Expect(resp.GetUsage()[0].GetTotal()).To(Equal(testDiskSize))
			}
		})
	}
}

func TestNodeGetVolumeHealth(t *testing.T) {
	inaccessible := func(reason string) []*csi.VolumeHealth_VolumeHealthEntry {
		return []*csi.VolumeHealth_VolumeHealthEntry{{Status: csi.VolumeHealthErrorType_INACCESSIBLE, Reason: reason}}
	}
	// unplug takes the disk out of the VM's device tree, as a hot-unplug the guest did not
	// agree to (a surprise removal) leaves it.
	unplug := func(t *testing.T, e *vmEnv) {
		t.Helper()
		for _, p := range []string{e.path("vm/dev/disk/by-id/virtio-pvb-v"), e.nodes["pvb-v"], e.path("vm/sys/block/vdb")} {
			if err := os.RemoveAll(p); err != nil {
				t.Fatal(err)
			}
		}
	}
	tests := []struct {
		name       string
		capability *csi.VolumeCapability
		// request makes the request, and breaks what the case is about.
		request  func(t *testing.T, e *vmEnv, staging, target string) *csi.NodeGetVolumeHealthRequest
		want     []*csi.VolumeHealth_VolumeHealthEntry
		wantCode codes.Code
		wantMsg  string
	}{
		{
			name: "a healthy published filesystem", capability: fsCap("ext4"),
			request: func(_ *testing.T, _ *vmEnv, staging, target string) *csi.NodeGetVolumeHealthRequest {
				return &csi.NodeGetVolumeHealthRequest{VolumeId: "v", StagingTargetPath: staging, VolumePublishPath: target}
			},
		},
		{
			name: "a healthy raw block volume, whose staging directory is no mount", capability: rawCap(),
			request: func(t *testing.T, _ *vmEnv, staging, _ string) *csi.NodeGetVolumeHealthRequest {
				mkdir(t, staging) // kubelet's
				return &csi.NodeGetVolumeHealthRequest{VolumeId: "v", StagingTargetPath: staging}
			},
		},
		{
			name: "a disk that left the VM under a filesystem", capability: fsCap("ext4"),
			request: func(t *testing.T, e *vmEnv, staging, target string) *csi.NodeGetVolumeHealthRequest {
				unplug(t, e)
				return &csi.NodeGetVolumeHealthRequest{VolumeId: "v", StagingTargetPath: staging, VolumePublishPath: target}
			},
			want: inaccessible(mounter.ReasonDeviceGone),
		},
		{
			name: "a disk that left the VM under a raw block volume", capability: rawCap(),
			request: func(t *testing.T, e *vmEnv, staging, target string) *csi.NodeGetVolumeHealthRequest {
				unplug(t, e)
				return &csi.NodeGetVolumeHealthRequest{VolumeId: "v", StagingTargetPath: staging, VolumePublishPath: target}
			},
			want: inaccessible(mounter.ReasonDeviceGone),
		},
		{
			name: "a disk whose backing device lost its capacity", capability: fsCap("xfs"),
			request: func(t *testing.T, e *vmEnv, staging, target string) *csi.NodeGetVolumeHealthRequest {
				e.grow(t, "pvb-v", 0)
				return &csi.NodeGetVolumeHealthRequest{VolumeId: "v", StagingTargetPath: staging, VolumePublishPath: target}
			},
			want: inaccessible(mounter.ReasonDeviceGone),
		},
		{
			name: "a publish path that is no mount", capability: fsCap("ext4"),
			request: func(t *testing.T, e *vmEnv, staging, _ string) *csi.NodeGetVolumeHealthRequest {
				p := e.path("empty")
				mkdir(t, p)
				return &csi.NodeGetVolumeHealthRequest{VolumeId: "v", StagingTargetPath: staging, VolumePublishPath: p}
			},
			want: inaccessible(mounter.ReasonNotMounted),
		},
		{
			name: "no path: nothing adverse is known", capability: fsCap("ext4"),
			request: func(*testing.T, *vmEnv, string, string) *csi.NodeGetVolumeHealthRequest {
				return &csi.NodeGetVolumeHealthRequest{VolumeId: "v"}
			},
		},
		{
			name: "a path that does not exist", capability: fsCap("ext4"),
			request: func(_ *testing.T, e *vmEnv, _, _ string) *csi.NodeGetVolumeHealthRequest {
				return &csi.NodeGetVolumeHealthRequest{VolumeId: "v", VolumePublishPath: e.path("nothing")}
			},
			wantCode: codes.NotFound,
		},
		{
			name: "no volume ID", capability: fsCap("ext4"),
			request: func(_ *testing.T, _ *vmEnv, _, target string) *csi.NodeGetVolumeHealthRequest {
				return &csi.NodeGetVolumeHealthRequest{VolumePublishPath: target}
			},
			wantCode: codes.InvalidArgument, wantMsg: "volume_id",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			e := newVMEnv(t)
			staging, target := e.published(t, "v", "pvb-v", tt.capability)
			resp, err := e.n.NodeGetVolumeHealth(t.Context(), tt.request(t, e, staging, target))
			expectCode(g, err, tt.wantCode, tt.wantMsg)
			if tt.wantCode != codes.OK {
				return
			}
			g.Expect(resp.GetVolumeHealth().GetVolumeId()).To(Equal("v"))
			entries := resp.GetVolumeHealth().GetHealthStatuses()
			g.Expect(entries).To(HaveLen(len(tt.want)))
			for i, want := range tt.want {
				g.Expect(entries[i].GetStatus()).To(Equal(want.GetStatus()))
				g.Expect(entries[i].GetReason()).To(Equal(want.GetReason()))
				g.Expect(entries[i].GetMessage()).To(ContainSubstring("volume v on node " + testNode))
			}
		})
	}
}

func TestNodeExpandVolume(t *testing.T) {
	tests := []struct {
		name       string
		capability *csi.VolumeCapability
		grow       bool
		required   int64
		wantCode   codes.Code
		wantMsg    string
	}{
		{name: "xfs grows online to fill its disk", capability: fsCap("xfs"), grow: true, required: 2 * testDiskSize},
		{name: "a raw block volume reports its size", capability: rawCap(), grow: true, required: 2 * testDiskSize},
		{name: "a disk that has not grown yet", capability: fsCap("xfs"), required: 2 * testDiskSize, wantCode: codes.Aborted, wantMsg: "not grown yet"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			e := newVMEnv(t)
			_, target := e.published(t, "v", "pvb-v", tt.capability)
			if tt.grow {
				e.grow(t, "pvb-v", 2*testDiskSize)
			}
			resp, err := e.n.NodeExpandVolume(t.Context(), &csi.NodeExpandVolumeRequest{
				VolumeId: "v", VolumePath: target, VolumeCapability: tt.capability,
				CapacityRange: &csi.CapacityRange{RequiredBytes: tt.required},
			})
			expectCode(g, err, tt.wantCode, tt.wantMsg)
			if tt.wantCode != codes.OK {
				return
			}
			g.Expect(resp.GetCapacityBytes()).To(Equal(2 * testDiskSize))
			if tt.capability.GetMount() != nil {
				var st unix.Statfs_t
				g.Expect(unix.Statfs(target, &st)).To(Succeed())
				g.Expect(int64(st.Blocks) * st.Bsize).To(BeNumerically(">", testDiskSize))
			}
		})
	}
}

// TestNodeVolumeLifecycle goes through a volume's life on a guest node as kubelet drives it,
// each call twice, and proves nothing is left behind.
func TestNodeVolumeLifecycle(t *testing.T) {
	for _, c := range []*csi.VolumeCapability{fsCap("ext4"), fsCap("xfs"), rawCap()} {
		name := "block"
		if c.GetMount() != nil {
			name = c.GetMount().GetFsType()
		}
		t.Run(name, func(t *testing.T) {
			g := NewWithT(t)
			e := newVMEnv(t)
			const id, serial = "mgmt-pvc-1", "pvb-0123456789abcdef"
			ctx := t.Context()
			pc := publishContext(serial)
			staging, target := e.path("staging"), e.path("pods/p/volumes/v")

			// The disk appears only after the first stage: kubelet retries until it does.
			_, err := e.n.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: c, PublishContext: pc})
			expectCode(g, err, codes.NotFound, serial)
			e.disk(t, "vdb", serial)
			for range 2 {
				_, err := e.n.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: c, PublishContext: pc})
				g.Expect(err).NotTo(HaveOccurred())
			}
			for range 2 {
				_, err := e.n.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{
					VolumeId: id, StagingTargetPath: staging, TargetPath: target, VolumeCapability: c, PublishContext: pc,
				})
				g.Expect(err).NotTo(HaveOccurred())
			}
			if c.GetMount() != nil {
				g.Expect(os.WriteFile(filepath.Join(target, "data"), []byte("tenant data"), 0o600)).To(Succeed())
			}
			_, err = e.n.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: id, VolumePath: target})
			g.Expect(err).NotTo(HaveOccurred())
			for range 2 {
				_, err := e.n.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: target})
				g.Expect(err).NotTo(HaveOccurred())
			}
			g.Expect(target).NotTo(BeAnExistingFile())
			for range 2 {
				_, err := e.n.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging})
				g.Expect(err).NotTo(HaveOccurred())
			}
			g.Expect(staging).NotTo(BeAnExistingFile())
			g.Expect(mountsUnder(t, e.dir)).To(BeEmpty())

			if c.GetMount() != nil {
				// Staged again, the data is still there: the disk was not formatted twice.
				_, err := e.n.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: c, PublishContext: pc})
				g.Expect(err).NotTo(HaveOccurred())
				g.Expect(os.ReadFile(filepath.Join(staging, "data"))).To(BeEquivalentTo("tenant data"))
				_, err = e.n.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging})
				g.Expect(err).NotTo(HaveOccurred())
			}
		})
	}
}

func TestNodeUnpublishAndUnstageValidation(t *testing.T) {
	g := NewWithT(t)
	n := newNodeServer(testNode, nil, "/", mounter.New())
	_, err := n.NodeUnpublishVolume(t.Context(), &csi.NodeUnpublishVolumeRequest{VolumeId: "v"})
	expectCode(g, err, codes.InvalidArgument, "target_path")
	_, err = n.NodeUnpublishVolume(t.Context(), &csi.NodeUnpublishVolumeRequest{TargetPath: "/t"})
	expectCode(g, err, codes.InvalidArgument, "volume_id")
	_, err = n.NodeUnstageVolume(t.Context(), &csi.NodeUnstageVolumeRequest{VolumeId: "v"})
	expectCode(g, err, codes.InvalidArgument, "staging_target_path")
	_, err = n.NodeGetVolumeStats(t.Context(), &csi.NodeGetVolumeStatsRequest{VolumeId: "v"})
	expectCode(g, err, codes.InvalidArgument, "volume_path")
	_, err = n.NodeExpandVolume(t.Context(), &csi.NodeExpandVolumeRequest{VolumeId: "v", VolumePath: "/v", CapacityRange: &csi.CapacityRange{RequiredBytes: -1}})
	expectCode(g, err, codes.InvalidArgument, "capacity_range")
	n.Locks.TryLock("v")
	_, err = n.NodeUnstageVolume(t.Context(), &csi.NodeUnstageVolumeRequest{VolumeId: "v", StagingTargetPath: "/s"})
	expectCode(g, err, codes.Aborted, "in progress")
}

// TestNodeDiskDetachedUnderneath proves that a volume whose disk left the VM (its VM was
// stopped, the management side detached it) reports no usage, and still unpublishes and
// unstages, which need no disk.
func TestNodeDiskDetachedUnderneath(t *testing.T) {
	g := NewWithT(t)
	e := newVMEnv(t)
	staging, target := e.published(t, "v", "pvb-v", fsCap("ext4"))
	// Hot-unplug as the local hypervisor does: the link, the node, the sys/block directory.
	g.Expect(os.Remove(e.path("vm/dev/disk/by-id/virtio-pvb-v"))).To(Succeed())
	g.Expect(os.Remove(e.nodes["pvb-v"])).To(Succeed())
	g.Expect(os.RemoveAll(e.path("vm/sys/block/vdb"))).To(Succeed())

	_, err := e.n.NodeGetVolumeStats(t.Context(), &csi.NodeGetVolumeStatsRequest{VolumeId: "v", VolumePath: target})
	expectCode(g, err, codes.FailedPrecondition, "device is gone")
	_, err = e.n.NodeExpandVolume(t.Context(), &csi.NodeExpandVolumeRequest{VolumeId: "v", VolumePath: target})
	expectCode(g, err, codes.NotFound, "no disk attached")
	_, err = e.n.NodeUnpublishVolume(t.Context(), &csi.NodeUnpublishVolumeRequest{VolumeId: "v", TargetPath: target})
	g.Expect(err).NotTo(HaveOccurred())
	_, err = e.n.NodeUnstageVolume(t.Context(), &csi.NodeUnstageVolumeRequest{VolumeId: "v", StagingTargetPath: staging})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(mountsUnder(t, e.dir)).To(BeEmpty())
}
