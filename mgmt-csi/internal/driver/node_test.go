package driver

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	. "github.com/onsi/gomega"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"

	"pvbridge.io/pkg/csinode/csinodetest"
)

func TestNodeGetCapabilities(t *testing.T) {
	g := NewWithT(t)
	resp, err := newNodeServer(testNode, 0, &fakeDevices{}, nil).NodeGetCapabilities(t.Context(), &csi.NodeGetCapabilitiesRequest{})
	g.Expect(err).NotTo(HaveOccurred())
	var rpcs []csi.NodeServiceCapability_RPC_Type
	for _, c := range resp.GetCapabilities() {
		rpcs = append(rpcs, c.GetRpc().GetType())
	}
	g.Expect(rpcs).To(ConsistOf(
		csi.NodeServiceCapability_RPC_STAGE_UNSTAGE_VOLUME,
		csi.NodeServiceCapability_RPC_GET_VOLUME_STATS,
		csi.NodeServiceCapability_RPC_GET_VOLUME_HEALTH,
		csi.NodeServiceCapability_RPC_EXPAND_VOLUME,
		csi.NodeServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER,
	))
}

func TestNodeGetInfo(t *testing.T) {
	tests := []struct {
		name       string
		maxVolumes int64
	}{
		{name: "no volume limit", maxVolumes: 0},
		{name: "a volume limit", maxVolumes: 24},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			resp, err := newNodeServer(testNode, tt.maxVolumes, &fakeDevices{}, nil).NodeGetInfo(t.Context(), &csi.NodeGetInfoRequest{})
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(resp.GetNodeId()).To(Equal(testNode))
			g.Expect(resp.GetMaxVolumesPerNode()).To(Equal(tt.maxVolumes))
			g.Expect(resp.GetAccessibleTopology().GetSegments()).To(Equal(map[string]string{"pmem.csi.pvbridge.io/node": testNode}))
		})
	}
}

func TestNodeStageVolume(t *testing.T) {
	tests := []struct {
		name    string
		prepare func(t *testing.T, e *nodeEnv) *csi.NodeStageVolumeRequest
		code    codes.Code
		msg     string
		check   func(g Gomega, t *testing.T, e *nodeEnv, req *csi.NodeStageVolumeRequest)
	}{
		{
			name: "volume_id is required",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeStageVolumeRequest {
				return &csi.NodeStageVolumeRequest{StagingTargetPath: e.path("s"), VolumeCapability: fsCap("")}
			},
			code: codes.InvalidArgument, msg: "volume_id",
		},
		{
			name: "staging_target_path is required",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeStageVolumeRequest {
				return &csi.NodeStageVolumeRequest{VolumeId: "v", VolumeCapability: fsCap("")}
			},
			code: codes.InvalidArgument, msg: "staging_target_path",
		},
		{
			name: "volume_capability is required",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeStageVolumeRequest {
				return &csi.NodeStageVolumeRequest{VolumeId: "v", StagingTargetPath: e.path("s")}
			},
			code: codes.InvalidArgument, msg: "volume_capability",
		},
		{
			name: "an access type is required",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeStageVolumeRequest {
				c := &csi.VolumeCapability{AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}
				return &csi.NodeStageVolumeRequest{VolumeId: "v", StagingTargetPath: e.path("s"), VolumeCapability: c}
			},
			code: codes.InvalidArgument, msg: "access_type",
		},
		{
			name: "a filesystem other than ext4 and xfs is refused",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeStageVolumeRequest {
				return &csi.NodeStageVolumeRequest{VolumeId: "v", StagingTargetPath: e.path("s"), VolumeCapability: fsCap("btrfs")}
			},
			code: codes.InvalidArgument, msg: "fs_type",
		},
		{
			name: "a multi-node access mode is refused",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeStageVolumeRequest {
				c := withMode(fsCap(""), csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER)
				return &csi.NodeStageVolumeRequest{VolumeId: "v", StagingTargetPath: e.path("s"), VolumeCapability: c}
			},
			code: codes.InvalidArgument, msg: "access mode",
		},
		{
			name: "a volume this node does not have is not found",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeStageVolumeRequest {
				return &csi.NodeStageVolumeRequest{VolumeId: "elsewhere", StagingTargetPath: e.path("s"), VolumeCapability: fsCap("")}
			},
			code: codes.NotFound, msg: "elsewhere",
		},
		{
			name: "a block volume whose device is there is staged without a mount",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeStageVolumeRequest {
				e.volume(t, "v")
				return &csi.NodeStageVolumeRequest{VolumeId: "v", StagingTargetPath: e.path("s"), VolumeCapability: rawCap()}
			},
			check: func(g Gomega, t *testing.T, e *nodeEnv, req *csi.NodeStageVolumeRequest) {
				g.Expect(mounts(t, req.GetStagingTargetPath())).To(BeZero())
				g.Expect(blkidType(t, e.devices.devices["v"])).To(BeEmpty(), "not formatted")
			},
		},
		{
			name: "a block volume whose device is gone is not found",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeStageVolumeRequest {
				e.devices.set("v", e.path("no-such-device"))
				return &csi.NodeStageVolumeRequest{VolumeId: "v", StagingTargetPath: e.path("s"), VolumeCapability: rawCap()}
			},
			code: codes.NotFound, msg: "no-such-device",
		},
		{
			name: "a blank volume is formatted as ext4 by default and mounted",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeStageVolumeRequest {
				e.volume(t, "v")
				return &csi.NodeStageVolumeRequest{VolumeId: "v", StagingTargetPath: e.path("s"), VolumeCapability: fsCap("")}
			},
			check: func(g Gomega, t *testing.T, e *nodeEnv, req *csi.NodeStageVolumeRequest) {
				g.Expect(blkidType(t, e.devices.devices["v"])).To(Equal("ext4"))
				g.Expect(mounts(t, req.GetStagingTargetPath())).To(Equal(1))
			},
		},
		{
			name: "a blank volume is formatted as xfs and mounted with the mount flags",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeStageVolumeRequest {
				e.volume(t, "v")
				return &csi.NodeStageVolumeRequest{VolumeId: "v", StagingTargetPath: e.path("s"), VolumeCapability: fsCap("xfs", "noatime")}
			},
			check: func(g Gomega, t *testing.T, e *nodeEnv, req *csi.NodeStageVolumeRequest) {
				g.Expect(blkidType(t, e.devices.devices["v"])).To(Equal("xfs"))
				var sfs unix.Statfs_t
				g.Expect(unix.Statfs(req.GetStagingTargetPath(), &sfs)).To(Succeed())
				g.Expect(sfs.Flags & unix.ST_NOATIME).NotTo(BeZero())
			},
		},
		{
			name: "staging again is success and mounts nothing more",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeStageVolumeRequest {
				staging := e.staged(t, "v", fsCap("xfs"))
				return &csi.NodeStageVolumeRequest{VolumeId: "v", StagingTargetPath: staging, VolumeCapability: fsCap("xfs")}
			},
			check: func(g Gomega, t *testing.T, e *nodeEnv, req *csi.NodeStageVolumeRequest) {
				g.Expect(mounts(t, req.GetStagingTargetPath())).To(Equal(1))
			},
		},
		{
			name: "a volume holding another filesystem is not formatted over",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeStageVolumeRequest {
				staging := e.staged(t, "v", fsCap("xfs"))
				if _, err := e.n.NodeUnstageVolume(t.Context(), &csi.NodeUnstageVolumeRequest{VolumeId: "v", StagingTargetPath: staging}); err != nil {
					t.Fatal(err)
				}
				return &csi.NodeStageVolumeRequest{VolumeId: "v", StagingTargetPath: staging, VolumeCapability: fsCap("ext4")}
			},
			code: codes.FailedPrecondition, msg: "holds xfs, not ext4",
			check: func(g Gomega, t *testing.T, e *nodeEnv, req *csi.NodeStageVolumeRequest) {
				g.Expect(blkidType(t, e.devices.devices["v"])).To(Equal("xfs"))
			},
		},
		{
			name: "a staging path holding another volume is already in use",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeStageVolumeRequest {
				staging := e.staged(t, "other", fsCap(""))
				e.volume(t, "v")
				return &csi.NodeStageVolumeRequest{VolumeId: "v", StagingTargetPath: staging, VolumeCapability: fsCap("")}
			},
			code: codes.AlreadyExists, msg: "not",
		},
		{
			name: "a failing back end is an internal error",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeStageVolumeRequest {
				e.devices.err = errors.New("lvs: device-mapper is broken")
				return &csi.NodeStageVolumeRequest{VolumeId: "v", StagingTargetPath: e.path("s"), VolumeCapability: fsCap("")}
			},
			code: codes.Internal, msg: "device-mapper is broken",
		},
		{
			name: "a back end that runs out of time is a deadline",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeStageVolumeRequest {
				e.devices.err = context.DeadlineExceeded
				return &csi.NodeStageVolumeRequest{VolumeId: "v", StagingTargetPath: e.path("s"), VolumeCapability: fsCap("")}
			},
			code: codes.DeadlineExceeded,
		},
		{
			name: "a call while another one for the volume is in progress is aborted",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeStageVolumeRequest {
				e.volume(t, "v")
				e.locked(t, "v")
				return &csi.NodeStageVolumeRequest{VolumeId: "v", StagingTargetPath: e.path("s"), VolumeCapability: fsCap("")}
			},
			code: codes.Aborted, msg: "in progress",
			check: func(g Gomega, t *testing.T, e *nodeEnv, req *csi.NodeStageVolumeRequest) {
				g.Expect(blkidType(t, e.devices.devices["v"])).To(BeEmpty(), "nothing was done")
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			e := newNodeEnv(t)
			req := tt.prepare(t, e)
			t.Cleanup(func() { _ = e.n.Mounter.Unmount(t.Context(), req.GetStagingTargetPath()) })

			_, err := e.n.NodeStageVolume(t.Context(), req)
			expectCode(g, err, tt.code, tt.msg)
			if tt.check != nil {
				tt.check(g, t, e, req)
			}
		})
	}
}

func TestStageOptions(t *testing.T) {
	tests := []struct {
		name  string
		flags []string
		dax   bool
		want  []string
	}{
		{name: "no flags, no DAX", want: nil},
		{name: "flags are kept", flags: []string{"noatime", "discard"}, want: []string{"noatime", "discard"}},
		{name: "DAX adds dax", flags: []string{"noatime"}, dax: true, want: []string{"noatime", "dax"}},
		{name: "an explicit dax is not repeated", flags: []string{"dax"}, dax: true, want: []string{"dax"}},
		{name: "an explicit dax mode wins", flags: []string{"dax=never"}, dax: true, want: []string{"dax=never"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			NewWithT(t).Expect(stageOptions(tt.flags, tt.dax)).To(Equal(tt.want))
		})
	}
}

func TestNodeUnstageVolume(t *testing.T) {
	tests := []struct {
		name    string
		prepare func(t *testing.T, e *nodeEnv) *csi.NodeUnstageVolumeRequest
		code    codes.Code
		msg     string
	}{
		{
			name: "volume_id is required",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeUnstageVolumeRequest {
				return &csi.NodeUnstageVolumeRequest{StagingTargetPath: e.path("s")}
			},
			code: codes.InvalidArgument, msg: "volume_id",
		},
		{
			name: "staging_target_path is required",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeUnstageVolumeRequest {
				return &csi.NodeUnstageVolumeRequest{VolumeId: "v"}
			},
			code: codes.InvalidArgument, msg: "staging_target_path",
		},
		{
			name: "a staged filesystem is unmounted and its path removed",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeUnstageVolumeRequest {
				return &csi.NodeUnstageVolumeRequest{VolumeId: "v", StagingTargetPath: e.staged(t, "v", fsCap("ext4"))}
			},
		},
		{
			name: "a staged block volume's empty staging directory is removed",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeUnstageVolumeRequest {
				staging := e.staged(t, "v", rawCap())
				if err := os.Mkdir(staging, 0o750); err != nil {
					t.Fatal(err)
				}
				return &csi.NodeUnstageVolumeRequest{VolumeId: "v", StagingTargetPath: staging}
			},
		},
		{
			name: "a volume that is gone from the node is unstaged all the same",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeUnstageVolumeRequest {
				staging := e.staged(t, "v", fsCap("ext4"))
				e.devices.remove("v")
				return &csi.NodeUnstageVolumeRequest{VolumeId: "v", StagingTargetPath: staging}
			},
		},
		{
			name: "a staging path that does not exist is success",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeUnstageVolumeRequest {
				return &csi.NodeUnstageVolumeRequest{VolumeId: "unknown", StagingTargetPath: e.path("gone")}
			},
		},
		{
			name: "a call while another one for the volume is in progress is aborted",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeUnstageVolumeRequest {
				staging := e.staged(t, "v", fsCap("ext4"))
				e.locked(t, "v")
				return &csi.NodeUnstageVolumeRequest{VolumeId: "v", StagingTargetPath: staging}
			},
			code: codes.Aborted, msg: "in progress",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			e := newNodeEnv(t)
			req := tt.prepare(t, e)

			_, err := e.n.NodeUnstageVolume(t.Context(), req)
			expectCode(g, err, tt.code, tt.msg)
			if tt.code == codes.OK {
				g.Expect(mounts(t, req.GetStagingTargetPath())).To(BeZero())
				g.Expect(req.GetStagingTargetPath()).NotTo(BeAnExistingFile())
				_, err = e.n.NodeUnstageVolume(t.Context(), req)
				g.Expect(err).NotTo(HaveOccurred(), "again")
			}
		})
	}
}

func TestNodePublishVolume(t *testing.T) {
	tests := []struct {
		name    string
		prepare func(t *testing.T, e *nodeEnv) *csi.NodePublishVolumeRequest
		code    codes.Code
		msg     string
		check   func(g Gomega, t *testing.T, e *nodeEnv, req *csi.NodePublishVolumeRequest)
	}{
		{
			name: "volume_id is required",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodePublishVolumeRequest {
				return &csi.NodePublishVolumeRequest{StagingTargetPath: e.path("s"), TargetPath: e.path("t"), VolumeCapability: fsCap("")}
			},
			code: codes.InvalidArgument, msg: "volume_id",
		},
		{
			name: "staging_target_path is required",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodePublishVolumeRequest {
				return &csi.NodePublishVolumeRequest{VolumeId: "v", TargetPath: e.path("t"), VolumeCapability: fsCap("")}
			},
			code: codes.InvalidArgument, msg: "staging_target_path",
		},
		{
			name: "target_path is required",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodePublishVolumeRequest {
				return &csi.NodePublishVolumeRequest{VolumeId: "v", StagingTargetPath: e.path("s"), VolumeCapability: fsCap("")}
			},
			code: codes.InvalidArgument, msg: "target_path",
		},
		{
			name: "volume_capability is required",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodePublishVolumeRequest {
				return &csi.NodePublishVolumeRequest{VolumeId: "v", StagingTargetPath: e.path("s"), TargetPath: e.path("t")}
			},
			code: codes.InvalidArgument, msg: "volume_capability",
		},
		{
			name: "a volume this node does not have is not found",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodePublishVolumeRequest {
				return &csi.NodePublishVolumeRequest{VolumeId: "elsewhere", StagingTargetPath: e.path("s"), TargetPath: e.path("t"), VolumeCapability: fsCap("")}
			},
			code: codes.NotFound, msg: "elsewhere",
		},
		{
			name: "a filesystem volume that is not staged is a failed precondition",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodePublishVolumeRequest {
				e.volume(t, "v")
				if err := os.Mkdir(e.path("s"), 0o750); err != nil {
					t.Fatal(err)
				}
				return &csi.NodePublishVolumeRequest{VolumeId: "v", StagingTargetPath: e.path("s"), TargetPath: e.path("t"), VolumeCapability: fsCap("")}
			},
			code: codes.FailedPrecondition, msg: "not staged",
		},
		{
			name: "a filesystem is bind-mounted read-write",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodePublishVolumeRequest {
				staging := e.staged(t, "v", fsCap("ext4"))
				return &csi.NodePublishVolumeRequest{VolumeId: "v", StagingTargetPath: staging, TargetPath: e.path("t"), VolumeCapability: fsCap("ext4")}
			},
			check: func(g Gomega, t *testing.T, e *nodeEnv, req *csi.NodePublishVolumeRequest) {
				g.Expect(os.WriteFile(filepath.Join(req.GetTargetPath(), "f"), []byte("data"), 0o600)).To(Succeed())
				g.Expect(os.ReadFile(filepath.Join(req.GetStagingTargetPath(), "f"))).To(Equal([]byte("data")))
			},
		},
		{
			name: "a read-only publish refuses writes",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodePublishVolumeRequest {
				staging := e.staged(t, "v", fsCap("xfs"))
				return &csi.NodePublishVolumeRequest{VolumeId: "v", StagingTargetPath: staging, TargetPath: e.path("t"), VolumeCapability: fsCap("xfs"), Readonly: true}
			},
			check: func(g Gomega, t *testing.T, e *nodeEnv, req *csi.NodePublishVolumeRequest) {
				g.Expect(os.WriteFile(filepath.Join(req.GetTargetPath(), "f"), nil, 0o600)).To(MatchError(unix.EROFS))
			},
		},
		{
			name: "a reader-only access mode publishes read-only",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodePublishVolumeRequest {
				staging := e.staged(t, "v", fsCap("ext4"))
				c := withMode(fsCap("ext4"), csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY)
				return &csi.NodePublishVolumeRequest{VolumeId: "v", StagingTargetPath: staging, TargetPath: e.path("t"), VolumeCapability: c}
			},
			check: func(g Gomega, t *testing.T, e *nodeEnv, req *csi.NodePublishVolumeRequest) {
				g.Expect(os.WriteFile(filepath.Join(req.GetTargetPath(), "f"), nil, 0o600)).To(MatchError(unix.EROFS))
			},
		},
		{
			name: "publishing again is success and mounts nothing more",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodePublishVolumeRequest {
				staging, target := e.published(t, "v", fsCap("ext4"), true)
				return &csi.NodePublishVolumeRequest{VolumeId: "v", StagingTargetPath: staging, TargetPath: target, VolumeCapability: fsCap("ext4"), Readonly: true}
			},
		},
		{
			name: "a target published with another read-only mode is already in use",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodePublishVolumeRequest {
				staging, target := e.published(t, "v", fsCap("ext4"), true)
				return &csi.NodePublishVolumeRequest{VolumeId: "v", StagingTargetPath: staging, TargetPath: target, VolumeCapability: fsCap("ext4")}
			},
			code: codes.AlreadyExists, msg: "read-only",
		},
		{
			name: "a block volume's device appears as the target file",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodePublishVolumeRequest {
				staging := e.staged(t, "v", rawCap())
				return &csi.NodePublishVolumeRequest{VolumeId: "v", StagingTargetPath: staging, TargetPath: e.path("pod/t"), VolumeCapability: rawCap()}
			},
			check: func(g Gomega, t *testing.T, e *nodeEnv, req *csi.NodePublishVolumeRequest) {
				var dev, tgt unix.Stat_t
				g.Expect(unix.Stat(e.devices.devices["v"], &dev)).To(Succeed())
				g.Expect(unix.Stat(req.GetTargetPath(), &tgt)).To(Succeed())
				g.Expect(tgt.Mode & unix.S_IFMT).To(BeEquivalentTo(unix.S_IFBLK))
				g.Expect(tgt.Rdev).To(Equal(dev.Rdev))
			},
		},
		{
			name: "publishing a block volume again is success",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodePublishVolumeRequest {
				staging, target := e.published(t, "v", rawCap(), false)
				return &csi.NodePublishVolumeRequest{VolumeId: "v", StagingTargetPath: staging, TargetPath: target, VolumeCapability: rawCap()}
			},
		},
		{
			name: "a single-writer filesystem published at another target is a failed precondition",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodePublishVolumeRequest {
				c := withMode(fsCap("ext4"), csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER)
				staging, _ := e.published(t, "v", c, false)
				return &csi.NodePublishVolumeRequest{VolumeId: "v", StagingTargetPath: staging, TargetPath: e.path("other"), VolumeCapability: c}
			},
			code: codes.FailedPrecondition, msg: "SINGLE_NODE_SINGLE_WRITER",
		},
		{
			name: "a single-writer block volume published at another target is a failed precondition",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodePublishVolumeRequest {
				c := withMode(rawCap(), csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER)
				staging, _ := e.published(t, "v", c, false)
				return &csi.NodePublishVolumeRequest{VolumeId: "v", StagingTargetPath: staging, TargetPath: e.path("other"), VolumeCapability: c}
			},
			code: codes.FailedPrecondition, msg: "SINGLE_NODE_SINGLE_WRITER",
		},
		{
			name: "a single-writer volume is published again at its target",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodePublishVolumeRequest {
				c := withMode(fsCap("ext4"), csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER)
				staging, target := e.published(t, "v", c, false)
				return &csi.NodePublishVolumeRequest{VolumeId: "v", StagingTargetPath: staging, TargetPath: target, VolumeCapability: c}
			},
		},
		{
			name: "a single-writer volume is published again at a target with a space in its path",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodePublishVolumeRequest {
				c := withMode(fsCap("ext4"), csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER)
				staging := e.staged(t, "v", c)
				req := &csi.NodePublishVolumeRequest{VolumeId: "v", StagingTargetPath: staging, TargetPath: e.path("pod t"), VolumeCapability: c}
				if _, err := e.n.NodePublishVolume(t.Context(), req); err != nil {
					t.Fatal(err)
				}
				return req
			},
		},
		{
			name: "a single-writer volume is published through a symbolic link to its staging path",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodePublishVolumeRequest {
				c := withMode(fsCap("ext4"), csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER)
				staging := e.staged(t, "v", c)
				if err := os.Symlink(e.dir, e.path("link")); err != nil {
					t.Fatal(err)
				}
				return &csi.NodePublishVolumeRequest{VolumeId: "v", StagingTargetPath: filepath.Join(e.path("link"), filepath.Base(staging)),
					TargetPath: e.path("t"), VolumeCapability: c}
			},
		},
		{
			name: "a multi-writer volume is published at a second target",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodePublishVolumeRequest {
				c := withMode(rawCap(), csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER)
				staging, _ := e.published(t, "v", c, false)
				return &csi.NodePublishVolumeRequest{VolumeId: "v", StagingTargetPath: staging, TargetPath: e.path("other"), VolumeCapability: c}
			},
		},
		{
			name: "a call while another one for the volume is in progress is aborted",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodePublishVolumeRequest {
				staging := e.staged(t, "v", fsCap("ext4"))
				e.locked(t, "v")
				return &csi.NodePublishVolumeRequest{VolumeId: "v", StagingTargetPath: staging, TargetPath: e.path("t"), VolumeCapability: fsCap("ext4")}
			},
			code: codes.Aborted, msg: "in progress",
			check: func(g Gomega, t *testing.T, e *nodeEnv, req *csi.NodePublishVolumeRequest) {
				g.Expect(req.GetTargetPath()).NotTo(BeAnExistingFile())
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			e := newNodeEnv(t)
			req := tt.prepare(t, e)
			t.Cleanup(func() { _ = e.n.Mounter.Unmount(t.Context(), req.GetTargetPath()) })

			_, err := e.n.NodePublishVolume(t.Context(), req)
			expectCode(g, err, tt.code, tt.msg)
			if tt.code == codes.OK {
				g.Expect(mounts(t, req.GetTargetPath())).To(Equal(1))
			}
			if tt.check != nil {
				tt.check(g, t, e, req)
			}
		})
	}
}

func TestNodeUnpublishVolume(t *testing.T) {
	tests := []struct {
		name    string
		prepare func(t *testing.T, e *nodeEnv) *csi.NodeUnpublishVolumeRequest
		code    codes.Code
		msg     string
	}{
		{
			name: "volume_id is required",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeUnpublishVolumeRequest {
				return &csi.NodeUnpublishVolumeRequest{TargetPath: e.path("t")}
			},
			code: codes.InvalidArgument, msg: "volume_id",
		},
		{
			name: "target_path is required",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeUnpublishVolumeRequest {
				return &csi.NodeUnpublishVolumeRequest{VolumeId: "v"}
			},
			code: codes.InvalidArgument, msg: "target_path",
		},
		{
			name: "a bind mount is unmounted and its path removed, the staging mount stays",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeUnpublishVolumeRequest {
				staging, target := e.published(t, "v", fsCap("ext4"), false)
				t.Cleanup(func() {
					if mounts(t, staging) != 1 {
						t.Error("the staging mount went away")
					}
				})
				return &csi.NodeUnpublishVolumeRequest{VolumeId: "v", TargetPath: target}
			},
		},
		{
			name: "a block device file is unmounted and removed",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeUnpublishVolumeRequest {
				_, target := e.published(t, "v", rawCap(), false)
				return &csi.NodeUnpublishVolumeRequest{VolumeId: "v", TargetPath: target}
			},
		},
		{
			name: "a volume that is gone from the node is unpublished all the same",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeUnpublishVolumeRequest {
				_, target := e.published(t, "v", rawCap(), false)
				e.devices.remove("v")
				return &csi.NodeUnpublishVolumeRequest{VolumeId: "v", TargetPath: target}
			},
		},
		{
			name: "a target path that does not exist is success",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeUnpublishVolumeRequest {
				return &csi.NodeUnpublishVolumeRequest{VolumeId: "unknown", TargetPath: e.path("gone")}
			},
		},
		{
			name: "a call while another one for the volume is in progress is aborted",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeUnpublishVolumeRequest {
				_, target := e.published(t, "v", fsCap("ext4"), false)
				e.locked(t, "v")
				return &csi.NodeUnpublishVolumeRequest{VolumeId: "v", TargetPath: target}
			},
			code: codes.Aborted, msg: "in progress",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			e := newNodeEnv(t)
			req := tt.prepare(t, e)

			_, err := e.n.NodeUnpublishVolume(t.Context(), req)
			expectCode(g, err, tt.code, tt.msg)
			if tt.code == codes.OK {
				g.Expect(mounts(t, req.GetTargetPath())).To(BeZero())
				g.Expect(req.GetTargetPath()).NotTo(BeAnExistingFile())
				_, err = e.n.NodeUnpublishVolume(t.Context(), req)
				g.Expect(err).NotTo(HaveOccurred(), "again")
			}
		})
	}
}

func TestNodeGetVolumeStats(t *testing.T) {
	tests := []struct {
		name    string
		prepare func(t *testing.T, e *nodeEnv) *csi.NodeGetVolumeStatsRequest
		code    codes.Code
		msg     string
		check   func(g Gomega, resp *csi.NodeGetVolumeStatsResponse)
	}{
		{
			name: "volume_id is required",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeGetVolumeStatsRequest {
				return &csi.NodeGetVolumeStatsRequest{VolumePath: e.path("t")}
			},
			code: codes.InvalidArgument, msg: "volume_id",
		},
		{
			name: "volume_path is required",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeGetVolumeStatsRequest {
				return &csi.NodeGetVolumeStatsRequest{VolumeId: "v"}
			},
			code: codes.InvalidArgument, msg: "volume_path",
		},
		{
			name: "an unknown volume at a path that does not exist is not found",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeGetVolumeStatsRequest {
				return &csi.NodeGetVolumeStatsRequest{VolumeId: "unknown", VolumePath: e.path("gone")}
			},
			code: codes.NotFound,
		},
		{
			name: "a volume at a path that does not exist is not found",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeGetVolumeStatsRequest {
				e.published(t, "v", fsCap("ext4"), false)
				return &csi.NodeGetVolumeStatsRequest{VolumeId: "v", VolumePath: e.path("gone")}
			},
			code: codes.NotFound,
		},
		{
			name: "a path that holds another volume is not found",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeGetVolumeStatsRequest {
				_, target := e.published(t, "other", fsCap("ext4"), false)
				e.volume(t, "v")
				return &csi.NodeGetVolumeStatsRequest{VolumeId: "v", VolumePath: target}
			},
			code: codes.NotFound, msg: "another device",
		},
		{
			name: "a published filesystem reports bytes and inodes",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeGetVolumeStatsRequest {
				_, target := e.published(t, "v", fsCap("xfs"), true)
				return &csi.NodeGetVolumeStatsRequest{VolumeId: "v", VolumePath: target}
			},
			check: func(g Gomega, resp *csi.NodeGetVolumeStatsResponse) {
				g.Expect(resp.GetUsage()).To(HaveLen(2))
				bytes, inodes := resp.GetUsage()[0], resp.GetUsage()[1]
				g.Expect(bytes.GetUnit()).To(Equal(csi.VolumeUsage_BYTES))
				g.Expect(bytes.GetTotal()).To(BeNumerically(">", testVolumeSize*8/10))
				g.Expect(bytes.GetUsed()).To(BeNumerically(">", 0))
				g.Expect(bytes.GetAvailable()).To(BeNumerically("<", bytes.GetTotal()))
				g.Expect(inodes.GetUnit()).To(Equal(csi.VolumeUsage_INODES))
				g.Expect(inodes.GetTotal()).To(BeNumerically(">", 0))
				g.Expect(inodes.GetUsed() + inodes.GetAvailable()).To(Equal(inodes.GetTotal()))
			},
		},
		{
			name: "a staged filesystem reports its usage too",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeGetVolumeStatsRequest {
				return &csi.NodeGetVolumeStatsRequest{VolumeId: "v", VolumePath: e.staged(t, "v", fsCap("ext4"))}
			},
			check: func(g Gomega, resp *csi.NodeGetVolumeStatsResponse) {
				g.Expect(resp.GetUsage()).To(HaveLen(2))
			},
		},
		{
			name: "a published block volume reports its size",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeGetVolumeStatsRequest {
				_, target := e.published(t, "v", rawCap(), false)
				return &csi.NodeGetVolumeStatsRequest{VolumeId: "v", VolumePath: target}
			},
			check: func(g Gomega, resp *csi.NodeGetVolumeStatsResponse) {
				g.Expect(resp.GetUsage()).To(HaveExactElements(
					And(HaveField("Unit", csi.VolumeUsage_BYTES), HaveField("Total", testVolumeSize)),
				))
			},
		},
		{
			name: "a path that is no mount point has no usage to report",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeGetVolumeStatsRequest {
				e.volume(t, "v")
				if err := os.Mkdir(e.path("t"), 0o750); err != nil {
					t.Fatal(err)
				}
				return &csi.NodeGetVolumeStatsRequest{VolumeId: "v", VolumePath: e.path("t")}
			},
			code: codes.FailedPrecondition, msg: "not a mount point",
		},
		{
			name: "a failing back end is an internal error",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeGetVolumeStatsRequest {
				e.devices.err = errors.New("ndctl: no such bus")
				return &csi.NodeGetVolumeStatsRequest{VolumeId: "v", VolumePath: e.path("t")}
			},
			code: codes.Internal, msg: "no such bus",
		},
		{
			name: "stats are answered while another call for the volume is in progress",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeGetVolumeStatsRequest {
				_, target := e.published(t, "v", rawCap(), false)
				e.locked(t, "v")
				return &csi.NodeGetVolumeStatsRequest{VolumeId: "v", VolumePath: target}
			},
			check: func(g Gomega, resp *csi.NodeGetVolumeStatsResponse) {
				g.Expect(resp.GetUsage()).To(HaveLen(1))
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			e := newNodeEnv(t)
			req := tt.prepare(t, e)

			resp, err := e.n.NodeGetVolumeStats(t.Context(), req)
			expectCode(g, err, tt.code, tt.msg)
			if tt.check != nil {
				tt.check(g, resp)
			}
		})
	}
}

func TestNodeGetVolumeHealth(t *testing.T) {
	inaccessible := func(reason string) []any {
		return []any{And(
			HaveField("Status", csi.VolumeHealthErrorType_INACCESSIBLE),
			HaveField("Reason", reason),
			HaveField("Message", Not(BeEmpty())),
		)}
	}
	tests := []struct {
		name    string
		prepare func(t *testing.T, e *nodeEnv) *csi.NodeGetVolumeHealthRequest
		code    codes.Code
		msg     string
		// want are matchers for the health entries, none for a healthy volume.
		want []any
	}{
		{
			name: "volume_id is required",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeGetVolumeHealthRequest {
				return &csi.NodeGetVolumeHealthRequest{VolumePublishPath: e.path("t")}
			},
			code: codes.InvalidArgument, msg: "volume_id",
		},
		{
			name: "a published filesystem is healthy",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeGetVolumeHealthRequest {
				staging, target := e.published(t, "v", fsCap("ext4"), false)
				return &csi.NodeGetVolumeHealthRequest{VolumeId: "v", StagingTargetPath: staging, VolumePublishPath: target}
			},
		},
		{
			name: "a published block volume is healthy",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeGetVolumeHealthRequest {
				staging, target := e.published(t, "v", rawCap(), false)
				return &csi.NodeGetVolumeHealthRequest{VolumeId: "v", StagingTargetPath: staging, VolumePublishPath: target}
			},
		},
		{
			name: "a staged block volume, with nothing mounted at its staging path, is healthy",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeGetVolumeHealthRequest {
				staging := e.staged(t, "v", rawCap())
				if err := os.Mkdir(staging, 0o750); err != nil {
					t.Fatal(err)
				}
				return &csi.NodeGetVolumeHealthRequest{VolumeId: "v", StagingTargetPath: staging}
			},
		},
		{
			name: "a publish path that is no mount point is inaccessible",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeGetVolumeHealthRequest {
				staging := e.staged(t, "v", fsCap("ext4"))
				if err := os.Mkdir(e.path("t"), 0o750); err != nil {
					t.Fatal(err)
				}
				return &csi.NodeGetVolumeHealthRequest{VolumeId: "v", StagingTargetPath: staging, VolumePublishPath: e.path("t")}
			},
			want: inaccessible("NotMounted"),
		},
		{
			name: "a publish path that holds another volume is inaccessible",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeGetVolumeHealthRequest {
				_, target := e.published(t, "other", fsCap("ext4"), false)
				e.volume(t, "v")
				return &csi.NodeGetVolumeHealthRequest{VolumeId: "v", VolumePublishPath: target}
			},
			want: inaccessible("NotMounted"),
		},
		{
			name: "a mounted volume that the back end no longer has is inaccessible",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeGetVolumeHealthRequest {
				staging, target := e.published(t, "v", fsCap("ext4"), false)
				e.devices.remove("v")
				return &csi.NodeGetVolumeHealthRequest{VolumeId: "v", StagingTargetPath: staging, VolumePublishPath: target}
			},
			want: inaccessible("DeviceGone"),
		},
		{
			name: "a block volume whose device was detached is inaccessible",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeGetVolumeHealthRequest {
				_, target := e.published(t, "v", rawCap(), false)
				device, _ := e.devices.Device(t.Context(), "v")
				csinodetest.DetachLoop(t, device)
				return &csi.NodeGetVolumeHealthRequest{VolumeId: "v", VolumePublishPath: target}
			},
			want: inaccessible("DeviceGone"),
		},
		{
			name: "a volume that is neither on the node nor at its path is not found",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeGetVolumeHealthRequest {
				return &csi.NodeGetVolumeHealthRequest{VolumeId: "unknown", VolumePublishPath: e.path("gone")}
			},
			code: codes.NotFound,
		},
		{
			name: "a volume that is not on the node, asked without paths, is not found",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeGetVolumeHealthRequest {
				return &csi.NodeGetVolumeHealthRequest{VolumeId: "unknown"}
			},
			code: codes.NotFound,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			e := newNodeEnv(t)
			req := tt.prepare(t, e)

			resp, err := e.n.NodeGetVolumeHealth(t.Context(), req)
			expectCode(g, err, tt.code, tt.msg)
			if tt.code != codes.OK {
				return
			}
			g.Expect(resp.GetVolumeHealth().GetVolumeId()).To(Equal(req.GetVolumeId()))
			g.Expect(resp.GetVolumeHealth().GetHealthStatuses()).To(HaveExactElements(tt.want...))
		})
	}
}

func TestNodeExpandVolume(t *testing.T) {
	tests := []struct {
		name    string
		prepare func(t *testing.T, e *nodeEnv) *csi.NodeExpandVolumeRequest
		code    codes.Code
		msg     string
		check   func(g Gomega, t *testing.T, e *nodeEnv, req *csi.NodeExpandVolumeRequest, resp *csi.NodeExpandVolumeResponse)
	}{
		{
			name: "volume_id is required",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeExpandVolumeRequest {
				return &csi.NodeExpandVolumeRequest{VolumePath: e.path("t")}
			},
			code: codes.InvalidArgument, msg: "volume_id",
		},
		{
			name: "volume_path is required",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeExpandVolumeRequest {
				return &csi.NodeExpandVolumeRequest{VolumeId: "v"}
			},
			code: codes.InvalidArgument, msg: "volume_path",
		},
		{
			name: "a negative capacity is invalid",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeExpandVolumeRequest {
				return &csi.NodeExpandVolumeRequest{VolumeId: "v", VolumePath: e.path("t"), CapacityRange: &csi.CapacityRange{RequiredBytes: -1}}
			},
			code: codes.InvalidArgument, msg: "capacity_range",
		},
		{
			name: "an invalid capability is invalid",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeExpandVolumeRequest {
				return &csi.NodeExpandVolumeRequest{VolumeId: "v", VolumePath: e.path("t"), VolumeCapability: fsCap("btrfs")}
			},
			code: codes.InvalidArgument, msg: "fs_type",
		},
		{
			name: "a volume this node does not have is not found",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeExpandVolumeRequest {
				return &csi.NodeExpandVolumeRequest{VolumeId: "elsewhere", VolumePath: e.path("t")}
			},
			code: codes.NotFound, msg: "elsewhere",
		},
		{
			name: "a volume path that does not exist is not found",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeExpandVolumeRequest {
				e.volume(t, "v")
				return &csi.NodeExpandVolumeRequest{VolumeId: "v", VolumePath: e.path("gone")}
			},
			code: codes.NotFound, msg: "gone",
		},
		{
			name: "a grown filesystem fills its device, through a read-only publish path",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeExpandVolumeRequest {
				staging, target := e.published(t, "v", fsCap("xfs"), true)
				e.grow(t, "v", 2*testVolumeSize)
				return &csi.NodeExpandVolumeRequest{
					VolumeId: "v", VolumePath: target, StagingTargetPath: staging,
					CapacityRange: &csi.CapacityRange{RequiredBytes: 2 * testVolumeSize},
				}
			},
			check: func(g Gomega, t *testing.T, e *nodeEnv, req *csi.NodeExpandVolumeRequest, resp *csi.NodeExpandVolumeResponse) {
				g.Expect(resp.GetCapacityBytes()).To(Equal(2 * testVolumeSize))
				var sfs unix.Statfs_t
				g.Expect(unix.Statfs(req.GetVolumePath(), &sfs)).To(Succeed())
				g.Expect(int64(sfs.Blocks) * sfs.Bsize).To(BeNumerically(">", 2*testVolumeSize*9/10))
			},
		},
		{
			name: "a block volume has nothing to grow and reports its size",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeExpandVolumeRequest {
				_, target := e.published(t, "v", rawCap(), false)
				e.grow(t, "v", 2*testVolumeSize)
				return &csi.NodeExpandVolumeRequest{VolumeId: "v", VolumePath: target}
			},
			check: func(g Gomega, t *testing.T, e *nodeEnv, req *csi.NodeExpandVolumeRequest, resp *csi.NodeExpandVolumeResponse) {
				g.Expect(resp.GetCapacityBytes()).To(Equal(2 * testVolumeSize))
			},
		},
		{
			name: "a device that has not grown to the required size yet is work in progress (Aborted), which kubelet retries",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeExpandVolumeRequest {
				_, target := e.published(t, "v", fsCap("xfs"), false)
				return &csi.NodeExpandVolumeRequest{VolumeId: "v", VolumePath: target, CapacityRange: &csi.CapacityRange{RequiredBytes: 2 * testVolumeSize}}
			},
			code: codes.Aborted, msg: "has not grown yet",
		},
		{
			name: "a call while another one for the volume is in progress is aborted",
			prepare: func(t *testing.T, e *nodeEnv) *csi.NodeExpandVolumeRequest {
				_, target := e.published(t, "v", fsCap("xfs"), false)
				e.locked(t, "v")
				return &csi.NodeExpandVolumeRequest{VolumeId: "v", VolumePath: target}
			},
			code: codes.Aborted, msg: "in progress",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			e := newNodeEnv(t)
			req := tt.prepare(t, e)

			resp, err := e.n.NodeExpandVolume(t.Context(), req)
			expectCode(g, err, tt.code, tt.msg)
			if tt.code == codes.OK {
				again, err := e.n.NodeExpandVolume(t.Context(), req)
				g.Expect(err).NotTo(HaveOccurred(), "again")
				g.Expect(again.GetCapacityBytes()).To(Equal(resp.GetCapacityBytes()))
			}
			if tt.check != nil {
				tt.check(g, t, e, req, resp)
			}
		})
	}
}

// TestNodeVolumeLifecycle runs every call of a volume's life on the node twice, as a CO that
// lost track of its calls would, and leaves no mount behind.
func TestNodeVolumeLifecycle(t *testing.T) {
	tests := []struct {
		name       string
		capability *csi.VolumeCapability
	}{
		{name: "ext4", capability: fsCap("")},
		{name: "xfs", capability: fsCap("xfs")},
		{name: "raw block", capability: rawCap()},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			e := newNodeEnv(t)
			e.volume(t, "v")
			staging, target := e.path("staging"), e.path("pods/p1/volume")
			twice := func(what string, call func() error) {
				for i := range 2 {
					g.Expect(call()).To(Succeed(), "%s, call %d", what, i+1)
				}
			}

			twice("stage", func() error {
				_, err := e.n.NodeStageVolume(t.Context(), &csi.NodeStageVolumeRequest{VolumeId: "v", StagingTargetPath: staging, VolumeCapability: tt.capability})
				return err
			})
			twice("publish", func() error {
				_, err := e.n.NodePublishVolume(t.Context(), &csi.NodePublishVolumeRequest{VolumeId: "v", StagingTargetPath: staging, TargetPath: target, VolumeCapability: tt.capability})
				return err
			})
			twice("stats", func() error {
				_, err := e.n.NodeGetVolumeStats(t.Context(), &csi.NodeGetVolumeStatsRequest{VolumeId: "v", VolumePath: target, StagingTargetPath: staging})
				return err
			})
			twice("expand", func() error {
				_, err := e.n.NodeExpandVolume(t.Context(), &csi.NodeExpandVolumeRequest{VolumeId: "v", VolumePath: target, StagingTargetPath: staging, VolumeCapability: tt.capability})
				return err
			})
			twice("unpublish", func() error {
				_, err := e.n.NodeUnpublishVolume(t.Context(), &csi.NodeUnpublishVolumeRequest{VolumeId: "v", TargetPath: target})
				return err
			})
			twice("unstage", func() error {
				_, err := e.n.NodeUnstageVolume(t.Context(), &csi.NodeUnstageVolumeRequest{VolumeId: "v", StagingTargetPath: staging})
				return err
			})
			g.Expect(mountsUnder(t, e.dir)).To(BeEmpty())
			g.Expect(target).NotTo(BeAnExistingFile())
			g.Expect(staging).NotTo(BeAnExistingFile())
		})
	}
}
