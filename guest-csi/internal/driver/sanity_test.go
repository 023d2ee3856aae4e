package driver

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	"github.com/kubernetes-csi/csi-test/v5/pkg/sanity"
	"github.com/onsi/ginkgo/v2"
	"github.com/onsi/gomega"
	"google.golang.org/grpc"

	"pvbridge.io/guest-csi/internal/request"
	"pvbridge.io/pkg/csinode/csinodetest"
	"pvbridge.io/pkg/testenv"
)

const (
	// sanityVM is the VM whose node plugin csi-sanity drives.
	sanityVM = "sanity-vm"
	// sanityCallTimeout bounds every call: csi-sanity calls without a deadline, and the
	// controller waits for the management side as long as the call lasts.
	sanityCallTimeout = 30 * time.Second
)

// TestSanity runs csi-sanity against the real driver: the controller on the package's
// apiserver, where the responder plays the management side (binds PVCs, attaches each volume
// as a real loop device under the VM's device root), and the node plugin of that VM, which
// finds the disks by serial and formats and mounts them for real. The suite runs twice, with
// mount volumes (ext4) and with block volumes. Nothing is excluded.
//
// Ginkgo flags (-ginkgo.v, -ginkgo.focus, ...) apply; Ginkgo runs one suite per process and
// refuses `go test -count` other than 1.
func TestSanity(t *testing.T) {
	e := newGuestEnv(t, envOptions{vms: []string{sanityVM}})
	dir := csinodetest.SocketDir(t)
	t.Cleanup(func() {
		for _, mp := range mountsUnder(t, dir) {
			t.Errorf("mount left behind at %s", mp)
		}
	})
	node := filepath.Join(dir, "node.sock")
	runDriver(t, Options{
		Endpoint: node, Mode: ModeNode, NodeID: sanityVM, Version: "test", GuestKubeconfig: adminKubeconfig,
		DeviceRoot: e.roots[sanityVM], Host: fakeHost{host: envHost},
	})

	for _, accessType := range []string{"mount", "block"} {
		cfg := sanity.NewTestConfig()
		cfg.Address, cfg.ControllerAddress = node, e.socket
		cfg.DialOptions = append(cfg.DialOptions, grpc.WithUnaryInterceptor(withCallTimeout))
		cfg.ControllerDialOptions = append(cfg.ControllerDialOptions, grpc.WithUnaryInterceptor(withCallTimeout))
		cfg.TargetPath = filepath.Join(dir, accessType+"-target")
		cfg.StagingPath = filepath.Join(dir, accessType+"-staging")
		cfg.TestVolumeAccessType = accessType
		cfg.TestVolumeSize = envMountSize
		cfg.TestVolumeExpandSize = 2 * envMountSize
		cfg.IdempotentCount = 5
		cfg.TestVolumeMutableParameters = map[string]string{request.ParamMgmtAttributesClass: "sanity"}
		ginkgo.Describe(accessType+" volumes", func() { sanity.GinkgoTest(&cfg) })
	}
	suiteConfig, reporterConfig := ginkgo.GinkgoConfiguration()
	gomega.RegisterFailHandler(ginkgo.Fail)
	testenv.ReportFailures(t)
	ginkgo.RunSpecs(t, "csi-sanity", suiteConfig, reporterConfig)
}

// withCallTimeout gives a call without a deadline sanityCallTimeout.
func withCallTimeout(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, sanityCallTimeout)
		defer cancel()
	}
	return invoker(ctx, method, req, reply, cc, opts...)
}
