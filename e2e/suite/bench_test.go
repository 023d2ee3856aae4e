package suite_test

import (
	"bufio"
	"cmp"
	"context"
	"flag"
	"fmt"
	"io"
	"maps"
	"os"
	"path"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pvbridge.io/e2e/cluster"
	"pvbridge.io/e2e/deploy"
	pmemv1 "pvbridge.io/pkg/apis/pmem/v1alpha1"
	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/pkg/tenancy"
)

// The figures of `make bench` (go test ./suite -args -ginkgo.label-filter=bench), each printed
// as `BENCH <name> <value> <unit>`. The sidecars, controller-managers and clients run with the
// lab's settings, which are those of the shipped manifests.
//
// A burst creates 100 PVCs and 100 pods using them at once, then deletes them and waits until
// both clusters hold what they held before. Bursts alternate through both layers (guest-csi)
// and directly against mgmt-csi on the same hosts, three of each; every figure is the median of
// the three, with its spread (largest ÷ smallest). Each volume's way is timed hop by hop from
// its PVC's creation, as the watches of both clusters see the objects change.
var _ = Describe("Benchmarks", Label("bench"), Ordered, func() {
	const n = 100

	It("starts 100 pods with new volumes at once, through both layers and directly", func(ctx SpecContext) {
		bursts := *benchBursts
		var bridge, direct []*burst
		for range bursts {
			bridge = append(bridge, podStart(ctx, alpha.CP, alpha.c, deploy.StorageClassGuest, n))
			direct = append(direct, podStart(ctx, mgmt.CP, mc, deploy.StorageClassPmem, n))
		}
		printBursts("guest", bridge)
		printBursts("direct", direct)
		for _, q := range []float64{0.5, 0.99} {
			ratio := func(i int) float64 {
				return bridge[i].hops.percentile(hopPodRunning, q) / direct[i].hops.percentile(hopPodRunning, q)
			}
			benchFigure(fmt.Sprintf("bridge_over_direct_pod_running_p%02.0f", q*100), "x", bursts, ratio)
		}
	}, NodeTimeout(60*time.Minute))

	It("attaches 1 000 volumes across 50 VMs of 10 guest clusters, then one more", Label("scale"), func(ctx SpecContext) {
		scale(ctx)
	}, NodeTimeout(60*time.Minute))

	It("times another cluster's operations beside each neighbour's abuse", Label("neighbours"), func(ctx SpecContext) {
		const rounds = 3
		quiet, flooded := attachBesideVMFlood(ctx, rounds)
		neighbourFigure("vm_flood_attach", quiet, flooded)
		quietGroup, floodedGroup := snapshotBesideGroupFlood(ctx, rounds)
		neighbourFigure("group_flood_snapshot", quietGroup[0], floodedGroup[0])
		neighbourFigure("group_flood_attach", quietGroup[1], floodedGroup[1])
		quiet, beside := credentialBesideSlowGuest(ctx, rounds)
		neighbourFigure("slow_guest_credential", quiet, beside)
	}, NodeTimeout(60*time.Minute))

	It("reports the peak memory of every component", func() {
		printRSS("peak_rss", "VmHWM")
	})
})

// benchBursts is how many bursts of each kind the bench runs.
var benchBursts = flag.Int("bench.bursts", 3, "bursts of each kind the benchmark runs; each figure is their median")

// benchf prints one figure on a line of its own (Ginkgo's progress marks share stdout).
func benchf(format string, args ...any) {
	fmt.Printf("\nBENCH "+format, args...)
}

// benchFigure prints the median of a figure over n bursts and its spread (largest ÷ smallest).
func benchFigure(name, unit string, n int, figure func(burst int) float64) {
	vs := sorted(n, figure)
	spread := "-"
	if vs[0] > 0 {
		spread = fmt.Sprintf("%.2fx", vs[n-1]/vs[0])
	}
	benchf("%s %.3f %s (spread %s)\n", name, vs[n/2], unit, spread)
}

// neighbourFigure prints how much slower beta's operation was beside a neighbour's abuse: the
// fastest abused round over the fastest quiet one (neighbours_test.go). pvbridge's aim is at
// most 2.
func neighbourFigure(name string, quiet, abused []time.Duration) {
	ms := func(ds []time.Duration) []time.Duration {
		out := make([]time.Duration, len(ds))
		for i, d := range ds {
			out[i] = d.Round(time.Millisecond)
		}
		return out
	}
	benchf("neighbour_%s_over_quiet %.2f x (fastest quiet %s, abused %s; quiet %v, abused %v)\n",
		name, slices.Min(abused).Seconds()/slices.Min(quiet).Seconds(), slices.Min(quiet).Round(time.Millisecond), slices.Min(abused).Round(time.Millisecond), ms(quiet), ms(abused))
}

// median is the median of figure over n bursts.
func median(n int, figure func(burst int) float64) float64 { return sorted(n, figure)[n/2] }

// sorted returns figure of each of n bursts, in increasing order.
func sorted(n int, figure func(burst int) float64) []float64 {
	vs := make([]float64, n)
	for i := range n {
		vs[i] = figure(i)
	}
	slices.Sort(vs)
	return vs
}

// The hops of a volume's way, named as the bench prints them. The ones of the cluster where the
// PVC and pod are made have no prefix; "mgmt_" ones are the management cluster's objects of a
// guest volume (a PV, directly, is the management cluster's object either way).
const (
	hopPodScheduled       = "pod_scheduled"
	hopProvisionerSet     = "pvc_provisioner_set" // by the PV binder: csi-provisioner may start
	hopMgmtPVCCreated     = "mgmt_pvc_created"
	hopMgmtProvisionerSet = "mgmt_pvc_provisioner_set"
	hopPmemCreated        = "pmem_volume_created"
	hopPmemReady          = "pmem_volume_ready"
	hopMgmtPVCreated      = "mgmt_pv_created"
	hopMgmtPVCBound       = "mgmt_pvc_bound"
	hopPVCBound           = "pvc_bound"
	hopVACreated          = "va_created"
	hopVMSpecVolume       = "vm_spec_volume"
	hopMgmtVACreated      = "mgmt_va_created"
	hopMgmtVAAttached     = "mgmt_va_attached"
	hopVMStatusAttach     = "vm_status_attached"
	hopVAAttached         = "va_attached"
	hopVolumesMounted     = "pod_volumes_mounted"
	hopPodRunning         = "pod_running"
)

// burst is what one burst measured.
type burst struct {
	hops *hops
	// throughput is volumes per second, from the first PVC created to the last one bound.
	throughput float64
	// api is what the management apiserver served per volume from the burst's start to its end
	// (deletion included).
	api apiPerVolume
	// guestAPI is the same of the guest cluster's apiserver, for a burst through both layers.
	guestAPI *apiPerVolume
	// cpu is the CPU time per volume, in seconds, by "<cluster>/<component>" (see cpuTimes).
	cpu map[string]float64
}

// printBursts prints the figures of bursts of one kind: the ends (PVC bound, attach, pod
// running, throughput, API writes), then the hop table: every hop in the order the volumes
// pass them (by median time), the time from the PVC's creation to it and the step from the
// hop before, p50 and p99.
func printBursts(prefix string, bs []*burst) {
	n := len(bs)
	at := func(hop string, q float64) func(int) float64 {
		return func(i int) float64 { return bs[i].hops.percentile(hop, q) }
	}
	for _, q := range []float64{0.5, 0.99} {
		benchFigure(fmt.Sprintf("%s_pvc_bound_p%02.0f", prefix, q*100), "s", n, at(hopPVCBound, q))
		if bs[0].hops.count(hopVAAttached) > 0 {
			attach := func(i int) float64 { return bs[i].hops.stepPercentile(hopVACreated, hopVAAttached, q) }
			benchFigure(fmt.Sprintf("%s_attach_p%02.0f", prefix, q*100), "s", n, attach)
		}
		benchFigure(fmt.Sprintf("%s_pod_running_p%02.0f", prefix, q*100), "s", n, at(hopPodRunning, q))
	}
	benchFigure(prefix+"_provisioning_throughput", "volumes/s", n, func(i int) float64 { return bs[i].throughput })
	cpu := func(c string) func(int) float64 { return func(i int) float64 { return bs[i].cpu[c] } }
	benchFigure(prefix+"_cpu_per_volume", "s", n, func(i int) float64 { return sum(slices.Collect(maps.Values(bs[i].cpu))) })
	for _, c := range largest(bs[0].cpu, 10) {
		benchFigure(prefix+"_cpu_per_volume_"+strings.ReplaceAll(c, "/", "_"), "s", n, cpu(c))
	}
	printAPI(prefix+"_mgmt_api", n, func(i int) apiPerVolume { return bs[i].api })
	if bs[0].guestAPI != nil {
		printAPI(prefix+"_guest_api", n, func(i int) apiPerVolume { return *bs[i].guestAPI })
	}

	hs := make([]*hops, n)
	for i, b := range bs {
		hs[i] = b.hops
	}
	printHopTable(prefix, hs)
}

// printAPI prints what an apiserver served per volume in n bursts (api of each), each figure
// named after prefix: writes, conflicts and refusals, the writes of the 8 kinds most written,
// the conflicts of each kind, the Events of the 6 reasons most emitted, and the time and requests
// of the 8 kinds that took the most time.
func printAPI(prefix string, n int, api func(burst int) apiPerVolume) {
	benchFigure(prefix+"_writes_per_volume", "writes", n, func(i int) float64 { return api(i).writes })
	benchFigure(prefix+"_conflicts_per_volume", "conflicts", n, func(i int) float64 { return sum(slices.Collect(maps.Values(api(i).conflicts))) })
	benchFigure(prefix+"_refused_per_volume", "requests", n, func(i int) float64 { return sum(slices.Collect(maps.Values(api(i).refused))) })
	benchFigure(prefix+"_seconds_per_volume", "s", n, func(i int) float64 { return sum(slices.Collect(maps.Values(api(i).seconds))) })
	for _, k := range largest(api(0).writesBy, 8) {
		benchFigure(prefix+"_writes_per_volume_"+k, "writes", n, func(i int) float64 { return api(i).writesBy[k] })
	}
	kinds := map[string]bool{}
	for i := range n {
		for k := range api(i).conflicts {
			kinds[k] = true
		}
	}
	for _, k := range slices.Sorted(maps.Keys(kinds)) {
		benchFigure(prefix+"_conflicts_per_volume_"+k, "conflicts", n, func(i int) float64 { return api(i).conflicts[k] })
	}
	for _, k := range largest(api(0).events, 6) {
		benchFigure(prefix+"_events_per_volume_"+k, "events", n, func(i int) float64 { return api(i).events[k] })
	}
	for _, k := range largest(api(0).seconds, 8) {
		benchFigure(prefix+"_seconds_per_volume_"+k, "s", n, func(i int) float64 { return api(i).seconds[k] })
		benchFigure(prefix+"_requests_per_volume_"+k, "requests", n, func(i int) float64 { return api(i).requests[k] })
	}
}

// printHopTable prints every hop in the order the volumes pass them (by median time), the time
// from the volume's start to it and the step from the hop before, p50 and p99, each the median
// over hs.
func printHopTable(prefix string, hs []*hops) {
	n := len(hs)
	at := func(hop string, q float64) func(int) float64 {
		return func(i int) float64 { return hs[i].percentile(hop, q) }
	}
	order := hs[0].order()
	benchf("%s hops (median of %d runs; time from the volume's start, step from the hop before):\n", prefix, n)
	for k, hop := range order {
		prev := ""
		if k > 0 {
			prev = order[k-1]
		}
		var cols []string
		for _, q := range []float64{0.5, 0.99} {
			cols = append(cols, fmt.Sprintf("at_p%02.0f %6.2f s", q*100, median(n, at(hop, q))))
		}
		for _, q := range []float64{0.5, 0.99} {
			step := func(i int) float64 { return hs[i].stepPercentile(prev, hop, q) }
			cols = append(cols, fmt.Sprintf("step_p%02.0f %6.2f s", q*100, median(n, step)))
		}
		benchf("%s_hop %-24s %s\n", prefix, hop, strings.Join(cols, "  "))
	}
}

// podStart runs one burst in cluster cp: it creates n PVCs of class and n pods using them at
// once and times each volume's hops; then deletes them all and waits until both clusters hold
// as many PVs, VolumeAttachments and PMEM volumes as before.
func podStart(ctx context.Context, cp *cluster.ControlPlane, c client.Client, class string, n int) *burst {
	GinkgoHelper()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	before := storageObjects(ctx)
	api := apiStatsOf(ctx, mgmt.CP)
	var guestAPI apiStats
	if cp != mgmt.CP {
		guestAPI = apiStatsOf(ctx, cp)
	}
	cpuBefore := cpuTimes()
	h := newHops()
	ns, err := deploy.CreateNamespace(ctx, cp.Client(), "bench")
	Expect(err).NotTo(HaveOccurred())
	watchClaims(ctx, h, cp, ns)
	watchProvisioning(ctx, h)
	if cp != mgmt.CP {
		watchManagement(ctx, h, alpha.Options.Namespace)
	}

	start := time.Now()
	var wg sync.WaitGroup
	for i := range n {
		name := fmt.Sprintf("b%03d", i)
		h.start("pvc/" + name)
		wg.Go(func() {
			defer GinkgoRecover()
			Expect(c.Create(ctx, deploy.PVC(ns, name, class, "16Mi", false))).To(Succeed())
			Expect(c.Create(ctx, deploy.Pod(ns, name, name, "", false))).To(Succeed())
		})
	}
	wg.Wait()
	Eventually(func() int { return h.count(hopPVCBound) }).WithContext(ctx).WithTimeout(10 * time.Minute).Should(BeNumerically(">=", n))
	b := &burst{hops: h, throughput: float64(n) / time.Since(start).Seconds()}
	Eventually(func() int { return h.count(hopPodRunning) }).WithContext(ctx).WithTimeout(10 * time.Minute).Should(BeNumerically(">=", n))

	Expect(c.DeleteAllOf(ctx, &corev1.Pod{}, client.InNamespace(ns))).To(Succeed())
	Expect(c.DeleteAllOf(ctx, &corev1.PersistentVolumeClaim{}, client.InNamespace(ns))).To(Succeed())
	Eventually(storageObjects).WithContext(ctx).WithTimeout(10 * time.Minute).WithPolling(time.Second).Should(Equal(before))
	b.api = apiStatsOf(ctx, mgmt.CP).since(api, n)
	b.api.events = eventsSince(ctx, mgmt.CP, start, n)
	if cp != mgmt.CP {
		guest := apiStatsOf(ctx, cp).since(guestAPI, n)
		guest.events = eventsSince(ctx, cp, start, n)
		b.guestAPI = &guest
	}
	b.cpu = cpuPerVolume(cpuBefore, n)
	return b
}

// storageObjects counts the PVs and VolumeAttachments of every cluster and the PMEM volumes.
func storageObjects(ctx context.Context) map[string]int {
	GinkgoHelper()
	counts := map[string]int{}
	for name, c := range map[string]client.Client{"mgmt": mc, "alpha": alpha.c} {
		pvs, vas := &corev1.PersistentVolumeList{}, &storagev1.VolumeAttachmentList{}
		Expect(c.List(ctx, pvs)).To(Succeed())
		Expect(c.List(ctx, vas)).To(Succeed())
		counts[name+" PVs"], counts[name+" VolumeAttachments"] = len(pvs.Items), len(vas.Items)
	}
	vols := &pmemv1.PmemVolumeList{}
	Expect(mc.List(ctx, vols)).To(Succeed())
	counts["PmemVolumes"] = len(vols.Items)
	return counts
}

// watchClaims times the hops of the cluster where the burst's PVCs and pods are (namespace ns),
// and of the management cluster's PVCs and VolumeAttachments when that is another one.
func watchClaims(ctx context.Context, h *hops, cp *cluster.ControlPlane, ns string) {
	GinkgoHelper()
	watchEach(ctx, cp.Client().CoreV1().PersistentVolumeClaims(ns).Watch, func(ev watch.Event) {
		pvc, ok := ev.Object.(*corev1.PersistentVolumeClaim)
		if !ok {
			return
		}
		if pvc.Annotations[provisionerAnnotation] != "" {
			h.seen(hopProvisionerSet, "pvc/"+pvc.Name)
		}
		if pvc.Status.Phase == corev1.ClaimBound {
			h.alias("pv/"+pvc.Spec.VolumeName, "pvc/"+pvc.Name)
			h.seen(hopPVCBound, "pvc/"+pvc.Name)
		}
	})
	watchEach(ctx, cp.Client().CoreV1().Pods(ns).Watch, func(ev watch.Event) {
		pod, ok := ev.Object.(*corev1.Pod)
		if !ok || len(pod.Spec.Volumes) == 0 || pod.Spec.Volumes[0].PersistentVolumeClaim == nil {
			return
		}
		ref := "pvc/" + pod.Spec.Volumes[0].PersistentVolumeClaim.ClaimName
		for _, c := range pod.Status.Conditions {
			if c.Status != corev1.ConditionTrue {
				continue
			}
			switch c.Type {
			case corev1.PodScheduled:
				h.seen(hopPodScheduled, ref)
			case corev1.PodReadyToStartContainers:
				h.seen(hopVolumesMounted, ref)
			}
		}
		if pod.Status.Phase == corev1.PodRunning {
			h.seen(hopPodRunning, ref)
		}
	})
	watchAttachments(ctx, h, cp, "")
}

// watchAttachments times the VolumeAttachments of cp, their hops named with prefix.
func watchAttachments(ctx context.Context, h *hops, cp *cluster.ControlPlane, prefix string) {
	GinkgoHelper()
	watchEach(ctx, cp.Client().StorageV1().VolumeAttachments().Watch, func(ev watch.Event) {
		if va, ok := ev.Object.(*storagev1.VolumeAttachment); ok && va.Spec.Source.PersistentVolumeName != nil {
			ref := "pv/" + *va.Spec.Source.PersistentVolumeName
			h.seen(prefix+hopVACreated, ref)
			if va.Status.Attached {
				h.seen(prefix+hopVAAttached, ref)
			}
		}
	})
}

// provisionerAnnotation is set on a claim by the PV binder of kube-controller-manager when the
// claim's class names an external provisioner; csi-provisioner only provisions claims with it.
const provisionerAnnotation = "volume.kubernetes.io/storage-provisioner"

// watchProvisioning times when PMEM volumes are created and become ready and when csi-provisioner
// creates their PVs (where the PV binder's second trip starts), known by the PV.
func watchProvisioning(ctx context.Context, h *hops) {
	GinkgoHelper()
	watchObjects(ctx, &pmemv1.PmemVolumeList{}, func(o client.Object) {
		ref := "pv/" + o.GetAnnotations()[pmemv1.NameAnnotation]
		h.seen(hopPmemCreated, ref)
		if meta.IsStatusConditionTrue(o.(*pmemv1.PmemVolume).Status.Conditions, pmemv1.ReadyCondition) {
			h.seen(hopPmemReady, ref)
		}
	})
	watchObjects(ctx, &corev1.PersistentVolumeList{}, func(o client.Object) {
		h.seen(hopMgmtPVCreated, "pv/"+o.GetName())
	})
}

// watchManagement times the management hops of guest volumes: their management PVCs in
// namespace ns ("" for all; known by the guest PV they were created for), PMEM volumes,
// VolumeAttachments and VirtualMachine entries.
func watchManagement(ctx context.Context, h *hops, ns string) {
	GinkgoHelper()
	watchEach(ctx, mgmt.CP.Client().CoreV1().PersistentVolumeClaims(ns).Watch, func(ev watch.Event) {
		pvc, ok := ev.Object.(*corev1.PersistentVolumeClaim)
		if !ok || pvc.Annotations[tenancy.GuestPVAnnotation] == "" {
			return
		}
		ref := "mpvc/" + pvc.Name
		h.alias(ref, "pv/"+pvc.Annotations[tenancy.GuestPVAnnotation])
		h.seen(hopMgmtPVCCreated, ref)
		if pvc.Annotations[provisionerAnnotation] != "" {
			h.seen(hopMgmtProvisionerSet, ref)
		}
		if pvc.Status.Phase == corev1.ClaimBound {
			h.alias("pv/"+pvc.Spec.VolumeName, ref)
			h.seen(hopMgmtPVCBound, ref)
		}
	})
	watchAttachments(ctx, h, mgmt.CP, "mgmt_")
	watchObjects(ctx, &vmv1.VirtualMachineList{}, func(o client.Object) {
		vm := o.(*vmv1.VirtualMachine)
		for _, v := range vm.Spec.Volumes {
			h.seen(hopVMSpecVolume, "mpvc/"+v.PersistentVolumeClaim.ClaimName)
		}
		for _, v := range vm.Status.Volumes {
			if v.Attached {
				h.seen(hopVMStatusAttach, "mpvc/"+v.Name)
			}
		}
	})
}

// hops records, for every volume, when each hop of its way was first seen. Objects are known by
// refs ("pvc/<name>", "pv/<name>", "mpvc/<name>") that aliases lead to the volume's own ref, the
// PVC the burst created; aliases may come after the hops they resolve.
type hops struct {
	mu      sync.Mutex
	started map[string]time.Time            // volume ref -> its PVC's creation
	seenAt  map[string]map[string]time.Time // hop -> ref -> first seen
	aliases map[string]string               // ref -> ref closer to the volume's
}

func newHops() *hops {
	return &hops{started: map[string]time.Time{}, seenAt: map[string]map[string]time.Time{}, aliases: map[string]string{}}
}

func (h *hops) start(volume string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.started[volume] = time.Now()
}

func (h *hops) alias(ref, to string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.aliases[ref] = to
}

func (h *hops) seen(hop, ref string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.seenAt[hop] == nil {
		h.seenAt[hop] = map[string]time.Time{}
	}
	if _, ok := h.seenAt[hop][ref]; !ok {
		h.seenAt[hop][ref] = time.Now()
	}
}

// times returns, per volume, the time from its start to hop; volumes not seen there are absent.
func (h *hops) times(hop string) map[string]time.Duration {
	h.mu.Lock()
	defer h.mu.Unlock()
	out := map[string]time.Duration{}
	for ref, at := range h.seenAt[hop] {
		for range 4 { // pvc/ <- pv/ <- mpvc/ <- pv/ (management)
			if _, ok := h.started[ref]; ok {
				break
			}
			ref = h.aliases[ref]
		}
		if s, ok := h.started[ref]; ok {
			out[ref] = at.Sub(s)
		}
	}
	return out
}

func (h *hops) count(hop string) int { return len(h.times(hop)) }

// percentile is quantile q of the times to hop, in seconds (0 when no volume got there).
func (h *hops) percentile(hop string, q float64) float64 {
	return quantile(slices.Collect(maps.Values(h.times(hop))), q)
}

// stepPercentile is quantile q of the time from hop from to hop to, per volume, in seconds;
// from "" is the volume's start.
func (h *hops) stepPercentile(from, to string, q float64) float64 {
	end := h.times(to)
	var steps []time.Duration
	if from == "" {
		steps = slices.Collect(maps.Values(end))
	} else {
		for v, t0 := range h.times(from) {
			if t1, ok := end[v]; ok {
				steps = append(steps, t1-t0)
			}
		}
	}
	return quantile(steps, q)
}

// order is every hop seen, by its median time.
func (h *hops) order() []string {
	h.mu.Lock()
	names := slices.Collect(maps.Keys(h.seenAt))
	h.mu.Unlock()
	medians := map[string]float64{}
	for _, hop := range names {
		medians[hop] = h.percentile(hop, 0.5)
	}
	slices.SortFunc(names, func(a, b string) int { return cmp.Compare(medians[a], medians[b]) })
	return names
}

// quantile returns quantile q of ds, in seconds.
func quantile(ds []time.Duration, q float64) float64 {
	if len(ds) == 0 {
		return 0
	}
	slices.Sort(ds)
	return ds[int(q*float64(len(ds)-1))].Seconds()
}

// watchObjects starts a watch of the management cluster's objects of list's kind and feeds every
// object to fn until ctx ends.
func watchObjects(ctx context.Context, list client.ObjectList, fn func(client.Object)) {
	GinkgoHelper()
	start := func(ctx context.Context, _ metav1.ListOptions) (watch.Interface, error) { return mc.Watch(ctx, list) }
	watchEach(ctx, start, func(ev watch.Event) {
		if o, ok := ev.Object.(client.Object); ok {
			fn(o)
		}
	})
}

// watchEach starts a watch and feeds every event to fn until ctx ends. A watch the apiserver
// ends is started again (a watch cache closes the watch of a client that falls behind; the first
// burst with it on counted no volume): its first events are the objects as they are, so a hop
// passed in between is seen late, not lost.
func watchEach(ctx context.Context, start func(context.Context, metav1.ListOptions) (watch.Interface, error), fn func(watch.Event)) {
	GinkgoHelper()
	w, err := start(ctx, metav1.ListOptions{})
	Expect(err).NotTo(HaveOccurred())
	go func() {
		for {
			select {
			case <-ctx.Done():
				w.Stop()
				return
			case ev, ok := <-w.ResultChan():
				if ok {
					fn(ev)
					continue
				}
			}
			for w, err = start(ctx, metav1.ListOptions{}); err != nil; w, err = start(ctx, metav1.ListOptions{}) {
				select {
				case <-ctx.Done():
					return
				case <-time.After(time.Second):
				}
			}
		}
	}()
}

// apiStats is what the apiserver's metrics say of the requests it has served so far.
type apiStats struct {
	// writes counts the write requests (create, update, patch, delete) for storage objects:
	// every resource but the heartbeats of nodes (Node status, Leases) and Events.
	writes int
	// writesBy counts the writes by kind (see requestKind).
	writesBy map[string]int
	// conflicts counts those of the writes answered 409 (a conflict, or a create of an object
	// that exists), by kind (see requestKind).
	conflicts map[string]int
	// seconds is the time the apiserver spent serving requests, reads included and watches
	// excluded, by kind; requests counts those requests, and refused those of them it answered
	// 429 (API Priority and Fairness turned it away: the client retries) or 5xx.
	seconds           map[string]float64
	requests, refused map[string]int
}

// apiStatsOf scrapes the metrics of the apiserver of cp.
func apiStatsOf(ctx context.Context, cp *cluster.ControlPlane) apiStats {
	GinkgoHelper()
	body, err := cp.Client().CoreV1().RESTClient().Get().AbsPath("/metrics").Stream(ctx)
	Expect(err).NotTo(HaveOccurred())
	defer body.Close()
	stats := apiStats{writesBy: map[string]int{}, conflicts: map[string]int{}, seconds: map[string]float64{}, requests: map[string]int{}, refused: map[string]int{}}
	scanner := bufio.NewScanner(body)
	scanner.Buffer(make([]byte, 1<<20), 1<<20)
	for scanner.Scan() {
		metric, rest, ok := strings.Cut(scanner.Text(), "{")
		if !ok || (metric != "apiserver_request_total" && metric != "apiserver_request_duration_seconds_sum") {
			continue
		}
		labels, value, _ := strings.Cut(rest, "} ")
		v, err := strconv.ParseFloat(value, 64)
		Expect(err).NotTo(HaveOccurred())
		verb, resource, code, kind := label(labels, "verb"), label(labels, "resource"), label(labels, "code"), requestKind(labels)
		// A watch lasts as long as its watcher: its time is not work.
		served := !slices.Contains([]string{"WATCH", "WATCHLIST", "CONNECT"}, verb)
		if metric == "apiserver_request_duration_seconds_sum" {
			if served {
				stats.seconds[kind] += v
			}
			continue
		}
		if served {
			stats.requests[kind] += int(v)
			if code == "429" || strings.HasPrefix(code, "5") {
				stats.refused[kind] += int(v)
			}
		}
		if !slices.Contains([]string{"POST", "PUT", "PATCH", "APPLY", "DELETE", "DELETECOLLECTION"}, verb) ||
			slices.Contains([]string{"nodes", "leases", "events"}, resource) {
			continue
		}
		stats.writes += int(v)
		stats.writesBy[kind] += int(v)
		if code == "409" {
			stats.conflicts[kind] += int(v)
		}
	}
	Expect(scanner.Err()).To(Or(Not(HaveOccurred()), MatchError(io.EOF)))
	return stats
}

// apiPerVolume is what an apiserver served per volume between two scrapes.
type apiPerVolume struct {
	writes float64
	// writesBy, conflicts, seconds, requests and refused split by kind (see requestKind) the
	// writes, those answered 409, the time serving requests, the requests and those refused
	// (watches excluded).
	writesBy, conflicts, seconds, requests, refused map[string]float64
	// events counts the Events emitted, each repetition included, by reason (see eventsSince).
	events map[string]float64
}

// eventsSince counts, per volume of n and by reason, the Events of cp emitted or repeated since
// start, each with its count: a repeated Event is a PATCH of its count, a new one a POST.
func eventsSince(ctx context.Context, cp *cluster.ControlPlane, start time.Time, n int) map[string]float64 {
	GinkgoHelper()
	list, err := cp.Client().CoreV1().Events("").List(ctx, metav1.ListOptions{})
	Expect(err).NotTo(HaveOccurred())
	out := map[string]float64{}
	for _, e := range list.Items {
		last, count := e.LastTimestamp.Time, e.Count
		if e.Series != nil { // the events.k8s.io API's (kube-scheduler's)
			last, count = e.Series.LastObservedTime.Time, e.Series.Count
		}
		if last.IsZero() {
			last = e.EventTime.Time
		}
		if last.Before(start.Truncate(time.Second)) {
			continue
		}
		out[e.Reason] += float64(max(count, 1)) / float64(n)
	}
	return out
}

// since returns what the apiserver served per volume of n volumes since before.
func (s apiStats) since(before apiStats, n int) apiPerVolume {
	return apiPerVolume{
		writes:    float64(s.writes-before.writes) / float64(n),
		writesBy:  perVolume(s.writesBy, before.writesBy, n),
		conflicts: perVolume(s.conflicts, before.conflicts, n),
		seconds:   perVolume(s.seconds, before.seconds, n),
		requests:  perVolume(s.requests, before.requests, n),
		refused:   perVolume(s.refused, before.refused, n),
	}
}

// perVolume is what grew from before to now, by kind, per volume of n; kinds that did not grow
// are left out.
func perVolume[T int | float64](now, before map[string]T, n int) map[string]float64 {
	out := map[string]float64{}
	for k, v := range now {
		if d := v - before[k]; d > 0 {
			out[k] = float64(d) / float64(n)
		}
	}
	return out
}

// requestKind names the requests of a metric's labels "<verb>_<resource>[_<subresource>]".
func requestKind(labels string) string {
	kind := label(labels, "verb") + "_" + label(labels, "resource")
	if sub := label(labels, "subresource"); sub != "" {
		kind += "_" + sub
	}
	return kind
}

// label returns the value of a Prometheus label in a list of them.
func label(labels, name string) string {
	for l := range strings.SplitSeq(labels, ",") {
		if k, v, ok := strings.Cut(l, "="); ok && k == name {
			return strings.Trim(v, `"`)
		}
	}
	return ""
}

// printRSS prints, for every component (see component) of the running lab, the largest
// resident set size of its processes: field "VmHWM" for their peaks, "VmRSS" for now, which
// also prints the anonymous part (RssAnon): the rest is pages of the binary, shared by the
// instances of a binary and given back under memory pressure.
func printRSS(prefix, field string) {
	GinkgoHelper()
	largest, anon := map[string]int{}, map[string]int{}
	for _, p := range lab.Processes() {
		if p.Exited() {
			continue
		}
		fields, err := procStatus(p.Pid())
		Expect(err).NotTo(HaveOccurred(), p.Name)
		c := component(p.Name)
		largest[c] = max(largest[c], fields[field])
		anon[c] = max(anon[c], fields["RssAnon"])
	}
	for _, c := range slices.Sorted(maps.Keys(largest)) {
		if field == "VmRSS" {
			benchf("%s_%s %.1f MiB (anonymous %.1f MiB)\n", prefix, c, float64(largest[c])/1024, float64(anon[c])/1024)
		} else {
			benchf("%s_%s %.1f MiB\n", prefix, c, float64(largest[c])/1024)
		}
	}
}

// cpuTimes is the CPU time (user and system, in seconds) the lab's running processes and the
// bench itself have used so far, summed by "<cluster>/<component>": the cluster is "mgmt" or
// "guest" (every guest cluster), the component as component names it.
func cpuTimes() map[string]float64 {
	GinkgoHelper()
	times := map[string]float64{"bench/suite.test": cpuTime(os.Getpid())}
	for _, p := range lab.Processes() {
		if p.Exited() {
			continue
		}
		cluster, _, _ := strings.Cut(p.Name, "/")
		if cluster != mgmt.CP.Name {
			cluster = "guest"
		}
		times[cluster+"/"+component(p.Name)] += cpuTime(p.Pid())
	}
	return times
}

// cpuPerVolume is the CPU time per volume of n volumes since before (cpuTimes), by component.
func cpuPerVolume(before map[string]float64, n int) map[string]float64 {
	GinkgoHelper()
	cpu := map[string]float64{}
	for c, t := range cpuTimes() {
		cpu[c] = (t - before[c]) / float64(n)
	}
	return cpu
}

// largest returns the k keys of m with the largest values, largest first.
func largest(m map[string]float64, k int) []string {
	keys := slices.Collect(maps.Keys(m))
	slices.SortFunc(keys, func(a, b string) int { return cmp.Compare(m[b], m[a]) })
	return keys[:min(k, len(keys))]
}

// cpuTime is the user and system time of a process, in seconds; 0 if it is gone.
func cpuTime(pid int) float64 {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	// Fields after the command's closing parenthesis: state is the 3rd field of stat, utime
	// and stime the 14th and 15th, in clock ticks (100 per second on Linux).
	_, rest, _ := strings.Cut(string(data), ") ")
	fields := strings.Fields(rest)
	utime, _ := strconv.ParseFloat(fields[11], 64)
	stime, _ := strconv.ParseFloat(fields[12], 64)
	return (utime + stime) / 100
}

// sum adds vs.
func sum(vs []float64) float64 {
	var s float64
	for _, v := range vs {
		s += v
	}
	return s
}

// procStatus returns the sizes (in KiB) of a process's status file: VmHWM, VmRSS, RssAnon...
func procStatus(pid int) (map[string]int, error) {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return nil, err
	}
	fields := map[string]int{}
	for line := range strings.SplitSeq(string(data), "\n") {
		name, value, ok := strings.Cut(line, ":")
		if value, isKiB := strings.CutSuffix(strings.TrimSpace(value), " kB"); ok && isKiB {
			kib, err := strconv.Atoi(value)
			if err != nil {
				return nil, fmt.Errorf("/proc/%d/status: %s: %w", pid, name, err)
			}
			fields[name] = kib
		}
	}
	return fields, nil
}

// component names a lab process by what it runs: its binary, and "-node" for pvbridge's node
// plugins (cluster/node/binary) as opposed to their controllers (cluster/binary).
func component(process string) string {
	c := path.Base(process)
	if strings.Count(process, "/") == 2 && strings.HasSuffix(c, "-csi") {
		c += "-node"
	}
	return c
}
