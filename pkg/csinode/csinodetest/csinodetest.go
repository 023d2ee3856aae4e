// Package csinodetest holds the test helpers of the drivers: their sockets, capabilities, gRPC
// status expectations, and what is mounted or attached on the machine.
package csinodetest

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/onsi/gomega"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"pvbridge.io/pkg/mounter"
)

// SocketDir returns a temporary directory with a path short enough for unix sockets (t.TempDir's
// can exceed their 107 bytes), removed when the test ends.
func SocketDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "csi-sock")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	return dir
}

// Dial connects to the gRPC server on unix socket path, until the test ends.
func Dial(t *testing.T, path string) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient("unix://"+path, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

// FsCap is a single-node-writer mount capability.
func FsCap(fsType string, flags ...string) *csi.VolumeCapability {
	return &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: fsType, MountFlags: flags}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
	}
}

// RawCap is a single-node-writer raw block capability.
func RawCap() *csi.VolumeCapability {
	return &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
	}
}

// WithMode sets c's access mode.
func WithMode(c *csi.VolumeCapability, mode csi.VolumeCapability_AccessMode_Mode) *csi.VolumeCapability {
	c.AccessMode.Mode = mode
	return c
}

// ExpectCode expects err to be a gRPC status with code (nil for OK) whose message contains msg.
func ExpectCode(g gomega.Gomega, err error, code codes.Code, msg string) {
	if code == codes.OK {
		g.Expect(err).NotTo(gomega.HaveOccurred())
		return
	}
	g.Expect(err).To(gomega.HaveOccurred())
	s, ok := status.FromError(err)
	g.Expect(ok).To(gomega.BeTrue(), "a gRPC status, not a raw error: %v", err)
	g.Expect(s.Code()).To(gomega.Equal(code), "%v", err)
	g.Expect(s.Message()).To(gomega.ContainSubstring(msg))
}

// MountsUnder lists the mount points under dir, innermost first.
func MountsUnder(t *testing.T, dir string) []string {
	t.Helper()
	mps, err := mounter.MountPointsBelow(dir)
	if err != nil {
		t.Fatal(err)
	}
	return mps
}

// Mounts counts the mounts stacked on path.
func Mounts(t *testing.T, path string) int {
	t.Helper()
	n := 0
	for _, mp := range MountsUnder(t, path) {
		if mp == path {
			n++
		}
	}
	return n
}

// LoopsOf lists the loop devices attached to file.
func LoopsOf(t *testing.T, file string) []string {
	t.Helper()
	devices, err := LoopDevices(file)
	if err != nil {
		t.Fatal(err)
	}
	return devices
}

// DetachLoops detaches the loop devices attached to file and waits until they are gone, as a
// test's cleanup. A device that another process of the machine has open at that moment
// (losetup --associated, which a lab's mgmt-csi or another package's test may be running,
// opens every loop device) is only set to auto-clear, and goes when that process closes it.
func DetachLoops(t *testing.T, file string) {
	t.Helper()
	for _, device := range LoopsOf(t, file) {
		if out, err := exec.Command("losetup", "--detach", device).CombinedOutput(); err != nil {
			t.Errorf("detach %s: %v: %s", device, err, out)
		}
	}
	g := gomega.NewGomega(func(message string, _ ...int) { t.Error(message) })
	g.Eventually(func() []string { return LoopsOf(t, file) }).
		WithTimeout(10*time.Second).WithPolling(20*time.Millisecond).
		Should(gomega.BeEmpty(), "loop devices still attached to %s", file)
}

// DetachLoop detaches a loop device in use by the test and waits until the kernel has cleared it
// (its size is 0). Another process that has it open at that moment (losetup --associated, run by
// a parallel test, opens every loop device) only sets it to auto-clear until that process closes
// it, and the device keeps its capacity until then.
func DetachLoop(t *testing.T, device string) {
	t.Helper()
	if out, err := exec.Command("losetup", "--detach", device).CombinedOutput(); err != nil {
		t.Fatalf("losetup --detach %s: %v: %s", device, err, out)
	}
	size := filepath.Join("/sys/block", filepath.Base(device), "size")
	gomega.NewWithT(t).Eventually(func() (string, error) {
		b, err := os.ReadFile(size)
		return strings.TrimSpace(string(b)), err
	}).WithTimeout(10*time.Second).WithPolling(20*time.Millisecond).Should(gomega.Equal("0"), "%s is not cleared", device)
}

// LoopDevices lists the loop devices attached to file, for helpers that run outside the
// test's goroutine.
func LoopDevices(file string) ([]string, error) {
	out, err := exec.Command("losetup", "--associated", file, "--noheadings", "--output", "NAME").CombinedOutput()
	if err != nil {
		return nil, fmt.Errorf("losetup --associated %s: %w: %s", file, err, out)
	}
	return strings.Fields(string(out)), nil
}

// BlkidType is the filesystem blkid finds on device ("" for none).
func BlkidType(t *testing.T, device string) string {
	t.Helper()
	out, _ := exec.Command("blkid", "-p", "-s", "TYPE", "-o", "value", device).Output()
	return strings.TrimSpace(string(out))
}
