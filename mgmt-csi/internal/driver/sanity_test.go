package driver

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/kubernetes-csi/csi-test/v5/pkg/sanity"
	"github.com/onsi/ginkgo/v2"
	"github.com/onsi/gomega"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pvbridge.io/mgmt-csi/internal/pmem"
	pmemv1 "pvbridge.io/pkg/apis/pmem/v1alpha1"
	"pvbridge.io/pkg/csinode/csinodetest"
	"pvbridge.io/pkg/testenv"
)

const (
	// sanityNode is the one host of the csi-sanity run.
	sanityNode = "sanity-node"
	// sanityVolumeSize is csi-sanity's volume size: its mount volumes are ext4 (csi-sanity
	// leaves fs_type empty), which mkfs makes at any size. A multiple of the file back end's
	// 1 MiB alignment, so that volumes are exactly as large as asked.
	sanityVolumeSize = 64 * mib
	// sanityExpandSize is what csi-sanity expands volumes to.
	sanityExpandSize = 128 * mib
	// sanityCapacity is the node's PMEM: the largest spec (ListSnapshots pagination) holds five
	// volumes and five snapshots at once. The files are sparse; mkfs writes a few MiB.
	sanityCapacity = 2 << 30
	// sanityCallTimeout bounds every call: csi-sanity calls without a deadline, and the
	// controller waits for the node agent as long as the call lasts.
	sanityCallTimeout = time.Minute
)

// TestSanity runs csi-sanity against the real driver: a controller and a node agent (file back
// end: sparse files on real loop devices, real mkfs and mounts) on the package's apiserver, each
// on its own socket. The suite runs twice, with mount volumes (ext4) and with block volumes.
// Nothing is excluded: csi-sanity expands a mount volume before it stages it, so the one thing
// this sandbox cannot do, growing a mounted ext4 (CAP_SYS_RESOURCE), never comes up.
//
// Ginkgo flags (-ginkgo.v, -ginkgo.focus, ...) apply; Ginkgo runs one suite per process and
// refuses `go test -count` other than 1.
func TestSanity(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Fatal("csi-sanity stages volumes on real loop devices and must run as root")
	}
	dir := csinodetest.SocketDir(t)
	pmemDir := filepath.Join(dir, "pmem")
	if err := os.Mkdir(pmemDir, 0o700); err != nil {
		t.Fatal(err)
	}
	// Registered first, so that it runs last: after the drivers have stopped.
	t.Cleanup(func() { expectNothingLeftBehind(t, dir, pmemDir) })

	c := sanityClient(t)
	deleteNodes(t, c, sanityNode)
	t.Cleanup(func() { deleteNodes(t, c, "") }) // after the node agent has stopped
	controller, node := filepath.Join(dir, "controller.sock"), filepath.Join(dir, "node.sock")
	runDriver(t, Options{Endpoint: controller, Mode: ModeController})
	runDriver(t, Options{
		Endpoint: node, Mode: ModeNode, NodeID: sanityNode, PmemMode: pmemv1.ModeFile,
		Pmem: pmem.Options{File: pmem.FileOptions{Dir: pmemDir, Capacity: sanityCapacity}},
	})
	waitNodeReady(t, c)

	for _, accessType := range []string{"mount", "block"} {
		cfg := sanity.NewTestConfig()
		cfg.Address, cfg.ControllerAddress = node, controller
		cfg.DialOptions = append(cfg.DialOptions, grpc.WithUnaryInterceptor(withCallTimeout))
		cfg.ControllerDialOptions = append(cfg.ControllerDialOptions, grpc.WithUnaryInterceptor(withCallTimeout))
		cfg.TargetPath = filepath.Join(dir, accessType+"-target")
		cfg.StagingPath = filepath.Join(dir, accessType+"-staging")
		cfg.TestVolumeAccessType = accessType
		cfg.TestVolumeSize = sanityVolumeSize
		cfg.TestVolumeExpandSize = sanityExpandSize
		cfg.IdempotentCount = 10
		cfg.TestVolumeMutableParameters = map[string]string{"maxIOPS": "100000"}
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

// runDriver runs a driver with opts (on the package's apiserver, without metrics) until the
// test ends, and fails the test if it stops early or with an error.
func runDriver(t *testing.T, opts Options) {
	t.Helper()
	opts.Version, opts.Kubeconfig, opts.MetricsAddress = "sanity", kubeconfig, "0"
	// mgmt-csi's defaults: client-go's own (5 requests/s) would pace the tests.
	opts.KubeAPIQPS, opts.KubeAPIBurst = 50, 100
	d, err := New(opts)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.WithoutCancel(t.Context()))
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("%s driver: %v", opts.Mode, err)
		}
	})
}

func sanityClient(t *testing.T) client.Client {
	t.Helper()
	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	testenv.Unthrottle(cfg)
	scheme, err := newScheme()
	if err != nil {
		t.Fatal(err)
	}
	c, err := client.New(cfg, client.Options{Scheme: scheme})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// deleteNodes deletes every PmemNode but except. Other tests of the package leave the PmemNodes
// of the agents they ran behind, and csi-sanity creates most volumes without topology: they
// must land on its one node.
func deleteNodes(t *testing.T, c client.Client, except string) {
	t.Helper()
	ctx := context.WithoutCancel(t.Context())
	nodes := &pmemv1.PmemNodeList{}
	if err := c.List(ctx, nodes); err != nil {
		t.Fatal(err)
	}
	for i := range nodes.Items {
		if n := &nodes.Items[i]; n.Name != except {
			if err := c.Delete(ctx, n); client.IgnoreNotFound(err) != nil {
				t.Fatal(err)
			}
		}
	}
}

// waitNodeReady waits until the node agent reports its PMEM, which CreateVolume needs.
func waitNodeReady(t *testing.T, c client.Client) {
	t.Helper()
	g := gomega.NewWithT(t)
	g.Eventually(func(g gomega.Gomega) {
		n := &pmemv1.PmemNode{}
		g.Expect(c.Get(t.Context(), client.ObjectKey{Name: sanityNode}, n)).To(gomega.Succeed())
		g.Expect(isReady(n.Status.Conditions)).To(gomega.BeTrue())
	}).WithTimeout(time.Minute).Should(gomega.Succeed())
}

// expectNothingLeftBehind fails the test for every mount under dir, loop device on a file under
// pmemDir or volume or snapshot image left in pmemDir, and removes them.
func expectNothingLeftBehind(t *testing.T, dir, pmemDir string) {
	for _, mp := range mountsUnder(t, dir) {
		t.Errorf("mount left behind at %s", mp)
		if err := unix.Unmount(mp, unix.MNT_DETACH); err != nil {
			t.Errorf("unmount %s: %v", mp, err)
		}
	}
	err := filepath.WalkDir(pmemDir, func(path string, e os.DirEntry, err error) error {
		if err != nil || e.IsDir() {
			return err
		}
		t.Errorf("%s left behind", path)
		for _, device := range loopsOf(t, path) {
			t.Errorf("loop device %s left attached to %s", device, path)
			if out, err := exec.Command("losetup", "-d", device).CombinedOutput(); err != nil {
				t.Errorf("detach %s: %v: %s", device, err, out)
			}
		}
		return nil
	})
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Error(err)
	}
}
