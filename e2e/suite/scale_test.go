package suite_test

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"

	"pvbridge.io/e2e/deploy"
	"pvbridge.io/pkg/csinode/csinodetest"
	"pvbridge.io/pkg/names"
)

// The scale benchmark: 1 000 volumes attached across 50 VMs of 10 guest clusters on the one
// management cluster. Each guest cluster is a real control plane with its tenancy (namespace,
// Cluster, credential delivered by the tenants controller) and its guest-csi controller; its
// kubelets and sidecars would not fit on the machine, so the bench calls the controllers over
// CSI as csi-provisioner and csi-attacher would (with their workers: every volume of a cluster
// at once, each call retried as work in progress as they do; see retried).
const (
	scaleClusters      = 10
	scaleVMsPerCluster = 5
	scaleVolumesPerVM  = 20
	// scaleVolumeSize keeps 500 volumes of a host within its 4 GiB of PMEM.
	scaleVolumeSize = 4 << 20
	// scaleProbes is how many more volumes are attached, one at a time, at the full population.
	scaleProbes = 5
)

// scaleCluster is a guest cluster of the scale benchmark: its guest-csi controller's client and
// its VMs' hosts.
type scaleCluster struct {
	*deploy.Guest
	csi csi.ControllerClient
}

// scaleVolume is a volume of the benchmark: the cluster and VM it belongs to, its CSI name and
// the ID CreateVolume gave it.
type scaleVolume struct {
	cluster  *scaleCluster
	vm, name string
	id       string
}

// ref names the volume for the hop watchers: they know a management PVC by its guest PV
// annotation, which the bench sets to the CSI name, as csi-provisioner sets the PV's name.
func (v *scaleVolume) ref() string { return "pv/" + v.name }

// The hops of the scale benchmark's volumes besides the watched ones (see watchManagement):
// when the bench's CSI calls returned or were made.
const (
	hopCreateReturned  = "csi_create_returned"
	hopPublishCalled   = "csi_publish_called"
	hopPublishReturned = "csi_publish_returned"
)

// scale runs the benchmark and prints its figures as `BENCH scale_...`.
func scale(ctx context.Context) {
	GinkgoHelper()
	clusters := startScaleClusters(ctx)
	var volumes []*scaleVolume
	for _, c := range clusters {
		for _, vm := range slices.Sorted(maps.Keys(c.Options.VMs)) {
			for i := range scaleVolumesPerVM {
				volumes = append(volumes, &scaleVolume{cluster: c, vm: vm, name: fmt.Sprintf("pvc-%s-%s-%02d", c.Options.Name, vm, i)})
			}
		}
	}
	n := len(volumes)

	population := watchScale(ctx)
	By(fmt.Sprintf("creating %d volumes, every cluster's at once", n))
	phase(ctx, "scale_create", volumes, func(ctx context.Context, v *scaleVolume) error { return createScaleVolume(ctx, population, v) })
	By(fmt.Sprintf("attaching the %d volumes, every cluster's at once", n))
	phase(ctx, "scale_attach", volumes, func(ctx context.Context, v *scaleVolume) error { return publishScaleVolume(ctx, population, v) })
	benchf("scale_population %d volumes on %d VMs of %d guest clusters\n", n, scaleClusters*scaleVMsPerCluster, scaleClusters)
	printHopTable("scale_population", []*hops{population})
	printRSS("scale_rss_at_population", "VmRSS")

	By("creating and attaching one more volume at a time at the full population")
	var create, attach, detach []time.Duration
	probes := watchScale(ctx)
	for k := range scaleProbes {
		c := clusters[k*len(clusters)/scaleProbes]
		vm := slices.Sorted(maps.Keys(c.Options.VMs))[k%scaleVMsPerCluster]
		v := &scaleVolume{cluster: c, vm: vm, name: fmt.Sprintf("pvc-%s-one-more-%d", c.Options.Name, k)}
		create = append(create, timed(func() error { return createScaleVolume(ctx, probes, v) }))
		attach = append(attach, timed(func() error { return publishScaleVolume(ctx, probes, v) }))
		detach = append(detach, timed(func() error { return unpublishScaleVolume(ctx, v) }))
		Expect(deleteScaleVolume(ctx, v)).To(Succeed())
	}
	for _, f := range []struct {
		name string
		ds   []time.Duration
	}{{"create", create}, {"attach", attach}, {"detach", detach}} {
		benchf("scale_one_more_%s p50 %.3f s, max %.3f s (%d probes)\n", f.name, quantile(f.ds, 0.5), quantile(f.ds, 1), scaleProbes)
	}
	printHopTable("scale_one_more", []*hops{probes})

	By(fmt.Sprintf("detaching and deleting the %d volumes", n))
	phase(ctx, "scale_detach", volumes, unpublishScaleVolume)
	phase(ctx, "scale_delete", volumes, deleteScaleVolume)
}

// watchScale returns hops fed by watches of the management cluster until the spec ends.
func watchScale(ctx context.Context) *hops {
	GinkgoHelper()
	h := newHops()
	ctx, cancel := context.WithCancel(ctx)
	DeferCleanup(cancel)
	watchManagement(ctx, h, "")
	watchProvisioning(ctx, h)
	return h
}

// startScaleClusters starts the benchmark's guest clusters, their VMs spread over both hosts.
func startScaleClusters(ctx context.Context) []*scaleCluster {
	GinkgoHelper()
	var clusters []*scaleCluster
	hosts := []string{"host-a", "host-b"}
	for i := range scaleClusters {
		name := fmt.Sprintf("scale-%02d", i)
		By("starting guest cluster " + name + ", its guest-csi controller only")
		gcp, err := lab.StartControlPlane(ctx, name)
		Expect(err).NotTo(HaveOccurred())
		// Nothing of the guest needs kube-controller-manager: the bench makes no guest objects.
		Expect(gcp.StopControllerManager()).To(Succeed())
		opts := deploy.GuestOptions{Name: name, Namespace: name, VMs: map[string]string{}}
		for v := range scaleVMsPerCluster {
			opts.VMs[fmt.Sprintf("vm-%d", v)] = hosts[(i*scaleVMsPerCluster+v)%len(hosts)]
		}
		g, err := deploy.StartGuestController(ctx, lab, mgmt, op, gcp, opts)
		Expect(err).NotTo(HaveOccurred())
		clusters = append(clusters, &scaleCluster{Guest: g, csi: controllerClient(g)})
	}
	return clusters
}

// phase runs step on every volume, each cluster's at once, and prints its latency p50/p99, its
// throughput and the management API writes and conflicts per volume.
func phase(ctx context.Context, name string, volumes []*scaleVolume, step func(context.Context, *scaleVolume) error) {
	GinkgoHelper()
	api := apiStatsOf(ctx, mgmt.CP)
	cpuBefore := cpuTimes()
	start := time.Now()
	took := make([]time.Duration, len(volumes))
	var wg sync.WaitGroup
	for i, v := range volumes {
		wg.Go(func() {
			defer GinkgoRecover()
			took[i] = timed(func() error { return step(ctx, v) })
		})
	}
	wg.Wait()
	elapsed := time.Since(start)
	n := float64(len(volumes))
	d := apiStatsOf(ctx, mgmt.CP).since(api, len(volumes))
	cpu := cpuPerVolume(cpuBefore, len(volumes))
	var seconds []string
	for _, k := range largest(d.seconds, 4) {
		seconds = append(seconds, fmt.Sprintf("%s %.3f s (%.1f requests, %.1f refused)", k, d.seconds[k], d.requests[k], d.refused[k]))
	}
	benchf("%s p50 %.2f s, p99 %.2f s, %.1f volumes/s, %.1f mgmt writes and %.2f conflicts per volume; CPU per volume %.3f s, most in %s; mgmt apiserver seconds per volume most in %s\n",
		name, quantile(took, 0.5), quantile(took, 0.99), n/elapsed.Seconds(), d.writes, sum(slices.Collect(maps.Values(d.conflicts))),
		sum(slices.Collect(maps.Values(cpu))), top(cpu, 6), strings.Join(seconds, ", "))
}

// top lists the k largest figures of m, largest first, each as "<key> <value> s".
func top(m map[string]float64, k int) string {
	var out []string
	for _, key := range largest(m, k) {
		out = append(out, fmt.Sprintf("%s %.3f s", key, m[key]))
	}
	return strings.Join(out, ", ")
}

// timed runs f, which must succeed, and returns how long it took.
func timed(f func() error) time.Duration {
	GinkgoHelper()
	start := time.Now()
	Expect(f()).To(Succeed())
	return time.Since(start)
}

// createScaleVolume creates v's volume and keeps its ID; its hops start with the first call.
func createScaleVolume(ctx context.Context, h *hops, v *scaleVolume) error {
	h.start(v.ref())
	defer h.seen(hopCreateReturned, v.ref())
	host := v.cluster.Options.VMs[v.vm]
	resp, err := retried(ctx, v.cluster.csi.CreateVolume, &csi.CreateVolumeRequest{
		Name:               v.name,
		CapacityRange:      &csi.CapacityRange{RequiredBytes: scaleVolumeSize},
		VolumeCapabilities: []*csi.VolumeCapability{csinodetest.RawCap()},
		Parameters:         map[string]string{"csi.storage.k8s.io/pv/name": v.name},
		AccessibilityRequirements: &csi.TopologyRequirement{
			Requisite: []*csi.Topology{{Segments: map[string]string{names.GuestTopologyKey: host}}},
			Preferred: []*csi.Topology{{Segments: map[string]string{names.GuestTopologyKey: host}}},
		},
	})
	v.id = resp.GetVolume().GetVolumeId()
	return err
}

// publishScaleVolume attaches v to its VM.
func publishScaleVolume(ctx context.Context, h *hops, v *scaleVolume) error {
	h.seen(hopPublishCalled, v.ref())
	defer h.seen(hopPublishReturned, v.ref())
	_, err := retried(ctx, v.cluster.csi.ControllerPublishVolume, &csi.ControllerPublishVolumeRequest{
		VolumeId: v.id, NodeId: v.vm, VolumeCapability: csinodetest.RawCap(),
	})
	return err
}

// unpublishScaleVolume detaches v from its VM.
func unpublishScaleVolume(ctx context.Context, v *scaleVolume) error {
	_, err := retried(ctx, v.cluster.csi.ControllerUnpublishVolume, &csi.ControllerUnpublishVolumeRequest{VolumeId: v.id, NodeId: v.vm})
	return err
}

// deleteScaleVolume deletes v's volume.
func deleteScaleVolume(ctx context.Context, v *scaleVolume) error {
	_, err := retried(ctx, v.cluster.csi.DeleteVolume, &csi.DeleteVolumeRequest{VolumeId: v.id})
	return err
}
