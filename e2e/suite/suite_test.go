// Package suite_test is pvbridge's end-to-end suite: every spec runs against the whole system, as
// `make run` starts it. A management cluster (two hosts with mgmt-csi over emulated PMEM and
// vm-operator, every real sidecar) serves two guest clusters: alpha (namespace tenant-a, three
// VMs) and beta (namespace tenant-b, one VM). Each guest node is a real kubelet with the
// guest-csi node plugin looking at its VM's device tree. A guest pod's volume goes guest PVC →
// management PVC → PMEM volume → VM spec.volumes → VolumeAttachment → hot-plug → disk found by
// serial → mounted, and back.
//
// Labels pick subsets (go test ./suite -args -ginkgo.label-filter=...): provisioning, data,
// static, reclaim, expansion, snapshot, isolation, disruptive, churn; bench (the figures of
// `make bench`) runs only when asked for. Before and after every spec the suite checks that
// nothing leaked; on failure it dumps both clusters' storage objects and the logs' tails into
// $PVBRIDGE_ARTIFACTS (default: a directory under the system's temporary directory).
package suite_test

import (
	"context"
	"flag"
	"fmt"
	"os"
	"testing"
	"time"

	groupsnapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumegroupsnapshot/v1"
	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"sigs.k8s.io/controller-runtime/pkg/client"
	logf "sigs.k8s.io/controller-runtime/pkg/log"

	"pvbridge.io/e2e/cluster"
	"pvbridge.io/e2e/deploy"
	"pvbridge.io/e2e/polling"
	pmemv1 "pvbridge.io/pkg/apis/pmem/v1alpha1"
	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
)

// timeout bounds every wait of a spec for a condition of the system.
const timeout = 2 * time.Minute

var (
	lab  *cluster.Lab
	mgmt *deploy.Management
	op   *deploy.VMOperator
	// mc is the management cluster's admin client.
	mc client.WithWatch
	// alpha and beta are the two guest clusters.
	alpha, beta *guestCluster
)

// guestCluster is a guest cluster with its admin client.
type guestCluster struct {
	*deploy.Guest
	c client.Client
}

// guestMirror is the registry the lab's tenants controller installs guests from, as an
// air-gapped platform's mirror (the process lab pulls no image: the guest's workloads are
// checked to name it).
const guestMirror = "mirror.pvbridge.test:5000/k8s"

var (
	alphaOptions = deploy.GuestOptions{
		Name: "alpha", Namespace: "tenant-a",
		VMs: map[string]string{"vm-1": "host-a", "vm-2": "host-b", "vm-3": "host-a"},
	}
	betaOptions = deploy.GuestOptions{
		Name: "beta", Namespace: "tenant-b",
		VMs: map[string]string{"vm-b1": "host-a"},
	}
)

func TestE2E(t *testing.T) {
	polling.Set()
	RegisterFailHandler(Fail)
	suiteConfig, reporterConfig := GinkgoConfiguration()
	if suiteConfig.LabelFilter == "" {
		suiteConfig.LabelFilter = "!bench" // the benchmarks run with `make bench`
	}
	RunSpecs(t, "pvbridge end-to-end", suiteConfig, reporterConfig)
}

// scheme holds every object the suite reads in either cluster.
func scheme() *runtime.Scheme {
	s := runtime.NewScheme()
	for _, add := range []func(*runtime.Scheme) error{clientgoscheme.AddToScheme, vmv1.AddToScheme, pmemv1.AddToScheme, snapshotv1.AddToScheme, groupsnapshotv1.AddToScheme} {
		Expect(add(s)).To(Succeed())
	}
	return s
}

var watchCache = flag.Bool("watch-cache", false, "run the apiservers with their watch cache, as production runs them (the lab runs without: half the idle CPU)")

var _ = BeforeSuite(func(ctx SpecContext) {
	logf.SetLogger(GinkgoLogr)
	bin, err := cluster.DefaultBinaries()
	Expect(err).NotTo(HaveOccurred())
	root, err := cluster.NewRoot()
	Expect(err).NotTo(HaveOccurred())
	lab, err = cluster.NewLab(root, bin)
	Expect(err).NotTo(HaveOccurred())
	lab.WatchCache = *watchCache
	By("starting the management cluster in " + root)
	mcp, err := lab.StartControlPlane(ctx, "mgmt")
	Expect(err).NotTo(HaveOccurred())
	mgmt, err = deploy.StartManagement(ctx, lab, mcp, deploy.MgmtOptions{
		Hosts: []string{"host-a", "host-b"}, PmemSize: 4 << 30, HostLabels: deploy.VMHostLabels,
	})
	Expect(err).NotTo(HaveOccurred())
	op, err = deploy.StartVMOperator(lab, mgmt, nil)
	Expect(err).NotTo(HaveOccurred())
	// The shortest credential life the apiserver grants: every guest credential is renewed
	// (after 6m40s) while the suite runs.
	_, err = deploy.StartTenants(ctx, lab, mgmt, deploy.TenantsOptions{TokenTTL: "10m", GuestImageRegistry: guestMirror})
	Expect(err).NotTo(HaveOccurred())
	mc, err = client.NewWithWatch(mcp.RESTConfig(), client.Options{Scheme: scheme()})
	Expect(err).NotTo(HaveOccurred())
	alpha = startGuest(ctx, "guest-a", alphaOptions)
	beta = startGuest(ctx, "guest-b", betaOptions)
}, NodeTimeout(10*time.Minute))

func startGuest(ctx context.Context, name string, opts deploy.GuestOptions) *guestCluster {
	By(fmt.Sprintf("starting guest cluster %s (namespace %s)", opts.Name, opts.Namespace))
	gcp, err := lab.StartControlPlane(ctx, name)
	Expect(err).NotTo(HaveOccurred())
	g, err := deploy.StartGuest(ctx, lab, mgmt, op, gcp, opts)
	Expect(err).NotTo(HaveOccurred())
	c, err := client.New(gcp.RESTConfig(), client.Options{Scheme: scheme()})
	Expect(err).NotTo(HaveOccurred())
	return &guestCluster{Guest: g, c: c}
}

var _ = AfterSuite(func() {
	if lab == nil {
		return
	}
	Expect(lab.Stop()).To(Succeed())
	if suiteFailed || os.Getenv("PVBRIDGE_KEEP_LAB") != "" {
		GinkgoWriter.Println("lab kept in", lab.Root)
		return
	}
	Expect(os.RemoveAll(lab.Root)).To(Succeed())
})
