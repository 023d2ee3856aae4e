package suite_test

import (
	"bufio"
	"context"
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
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pvbridge.io/e2e/cluster"
	"pvbridge.io/e2e/deploy"
)

// The figures of `make bench` (go test ./suite -args -ginkgo.label-filter=bench), each printed
// as `BENCH <name> <value> <unit>`. The sidecars, controller-managers and clients run with the
// lab's settings, which are those of the shipped manifests.
var _ = Describe("Benchmarks", Label("bench"), Ordered, func() {
	const n = 100
	var bridge, direct *podStartFigures

	It("starts 100 guest pods with new volumes at once, through both layers", func(ctx SpecContext) {
		writes := apiWrites(ctx, mgmt.CP)
		bridge = podStart(ctx, alpha.CP, alpha.c, deploy.StorageClassGuest, n)
		perVolume := float64(apiWrites(ctx, mgmt.CP)-writes) / n
		bridge.print("guest")
		benchf("mgmt_api_writes_per_volume %.1f writes\n", perVolume)
	}, NodeTimeout(30*time.Minute))

	It("starts 100 pods with new volumes at once directly against mgmt-csi", func(ctx SpecContext) {
		direct = podStart(ctx, mgmt.CP, mc, deploy.StorageClassPmem, n)
		direct.print("direct")
		benchf("bridge_over_direct_pod_running_p50 %.2f x\n", bridge.running.percentile(0.5)/direct.running.percentile(0.5))
		benchf("bridge_over_direct_pod_running_p99 %.2f x\n", bridge.running.percentile(0.99)/direct.running.percentile(0.99))
	}, NodeTimeout(30*time.Minute))

	It("reports the peak memory of every component", func() {
		peak := map[string]int{}
		for _, p := range lab.Processes() {
			if p.Exited() {
				continue
			}
			kib, err := peakRSS(p.Pid())
			Expect(err).NotTo(HaveOccurred(), p.Name)
			c := component(p.Name)
			peak[c] = max(peak[c], kib)
		}
		for _, c := range slices.Sorted(maps.Keys(peak)) {
			benchf("peak_rss_%s %.1f MiB\n", c, float64(peak[c])/1024)
		}
	})
})

// benchf prints one figure on a line of its own (Ginkgo's progress marks share stdout).
func benchf(format string, args ...any) {
	fmt.Printf("\nBENCH "+format, args...)
}

// podStartFigures are the latencies of one pod-start run.
type podStartFigures struct {
	bound, attached, running *firsts
	throughput               float64
}

func (f *podStartFigures) print(prefix string) {
	benchf("%s_pvc_bound_p50 %.3f s\n", prefix, f.bound.percentile(0.5))
	benchf("%s_pvc_bound_p99 %.3f s\n", prefix, f.bound.percentile(0.99))
	if f.attached.count() > 0 {
		benchf("%s_attach_p50 %.3f s\n", prefix, f.attached.percentile(0.5))
		benchf("%s_attach_p99 %.3f s\n", prefix, f.attached.percentile(0.99))
	}
	benchf("%s_pod_running_p50 %.3f s\n", prefix, f.running.percentile(0.5))
	benchf("%s_pod_running_p99 %.3f s\n", prefix, f.running.percentile(0.99))
	benchf("%s_provisioning_throughput %.2f volumes/s\n", prefix, f.throughput)
}

// podStart creates n PVCs of class and n pods using them at once in cluster cp and measures
// PVC created → Bound, VolumeAttachment created → attached (where the driver attaches) and pod
// created → Running, and the provisioning throughput; then deletes them all and waits until
// every PV is gone.
func podStart(ctx context.Context, cp *cluster.ControlPlane, c client.Client, class string, n int) *podStartFigures {
	GinkgoHelper()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	f := &podStartFigures{bound: newFirsts(), attached: newFirsts(), running: newFirsts()}
	ns, err := deploy.CreateNamespace(ctx, cp.Client(), "bench")
	Expect(err).NotTo(HaveOccurred())
	watchEach(ctx, cp.Client().CoreV1().PersistentVolumeClaims(ns).Watch, func(ev watch.Event) {
		if pvc, ok := ev.Object.(*corev1.PersistentVolumeClaim); ok && pvc.Status.Phase == corev1.ClaimBound {
			f.bound.happened(pvc.Name)
		}
	})
	watchEach(ctx, cp.Client().CoreV1().Pods(ns).Watch, func(ev watch.Event) {
		if pod, ok := ev.Object.(*corev1.Pod); ok && pod.Status.Phase == corev1.PodRunning {
			f.running.happened(pod.Name)
		}
	})
	watchEach(ctx, cp.Client().StorageV1().VolumeAttachments().Watch, func(ev watch.Event) {
		if va, ok := ev.Object.(*storagev1.VolumeAttachment); ok {
			f.attached.started(va.Name)
			if va.Status.Attached {
				f.attached.happened(va.Name)
			}
		}
	})

	start := time.Now()
	var wg sync.WaitGroup
	for i := range n {
		name := fmt.Sprintf("b%03d", i)
		f.bound.started(name)
		f.running.started(name)
		wg.Go(func() {
			defer GinkgoRecover()
			Expect(c.Create(ctx, deploy.PVC(ns, name, class, "16Mi", false))).To(Succeed())
			Expect(c.Create(ctx, deploy.Pod(ns, name, name, "", false))).To(Succeed())
		})
	}
	wg.Wait()
	Eventually(f.bound.count).WithContext(ctx).WithTimeout(10 * time.Minute).Should(BeNumerically(">=", n))
	f.throughput = float64(n) / time.Since(start).Seconds()
	Eventually(f.running.count).WithContext(ctx).WithTimeout(10 * time.Minute).Should(BeNumerically(">=", n))

	Expect(c.DeleteAllOf(ctx, &corev1.Pod{}, client.InNamespace(ns))).To(Succeed())
	Expect(c.DeleteAllOf(ctx, &corev1.PersistentVolumeClaim{}, client.InNamespace(ns))).To(Succeed())
	Eventually(func(g Gomega) {
		pvs := &corev1.PersistentVolumeList{}
		g.Expect(c.List(ctx, pvs)).To(Succeed())
		g.Expect(pvs.Items).To(BeEmpty())
	}).WithContext(ctx).WithTimeout(10 * time.Minute).Should(Succeed())
	return f
}

// firsts records when each named thing first happened, measured from its start.
type firsts struct {
	mu    sync.Mutex
	start map[string]time.Time
	at    map[string]time.Duration
}

func newFirsts() *firsts {
	return &firsts{start: map[string]time.Time{}, at: map[string]time.Duration{}}
}

func (f *firsts) started(name string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.start[name]; !ok {
		f.start[name] = time.Now()
	}
}

func (f *firsts) happened(name string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, done := f.at[name]; !done {
		if s, ok := f.start[name]; ok {
			f.at[name] = time.Since(s)
		}
	}
}

func (f *firsts) count() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.at)
}

// percentile returns quantile q of the recorded durations, in seconds.
func (f *firsts) percentile(q float64) float64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	l := slices.Sorted(maps.Values(f.at))
	if len(l) == 0 {
		return 0
	}
	return l[int(q*float64(len(l)-1))].Seconds()
}

// watchEach starts a watch and feeds every event to fn until ctx ends.
func watchEach(ctx context.Context, start func(context.Context, metav1.ListOptions) (watch.Interface, error), fn func(watch.Event)) {
	GinkgoHelper()
	w, err := start(ctx, metav1.ListOptions{})
	Expect(err).NotTo(HaveOccurred())
	go func() {
		<-ctx.Done()
		w.Stop()
	}()
	go func() {
		for ev := range w.ResultChan() {
			fn(ev)
		}
	}()
}

// apiWrites is the number of write requests (create, update, patch, delete) the apiserver of cp
// has served for storage objects so far: every resource but the heartbeats of nodes (Node
// status, Leases) and Events.
func apiWrites(ctx context.Context, cp *cluster.ControlPlane) int {
	GinkgoHelper()
	body, err := cp.Client().CoreV1().RESTClient().Get().AbsPath("/metrics").Stream(ctx)
	Expect(err).NotTo(HaveOccurred())
	defer body.Close()
	total := 0
	scanner := bufio.NewScanner(body)
	scanner.Buffer(make([]byte, 1<<20), 1<<20)
	for scanner.Scan() {
		line := scanner.Text()
		if !strings.HasPrefix(line, "apiserver_request_total{") {
			continue
		}
		labels, value, _ := strings.Cut(line[len("apiserver_request_total{"):], "} ")
		verb, resource := label(labels, "verb"), label(labels, "resource")
		switch {
		case !slices.Contains([]string{"POST", "PUT", "PATCH", "DELETE", "DELETECOLLECTION"}, verb):
		case slices.Contains([]string{"nodes", "leases", "events"}, resource):
		default:
			v, err := strconv.ParseFloat(value, 64)
			Expect(err).NotTo(HaveOccurred())
			total += int(v)
		}
	}
	Expect(scanner.Err()).To(Or(Not(HaveOccurred()), MatchError(io.EOF)))
	return total
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

// peakRSS is the peak resident set size (VmHWM) of a process, in KiB.
func peakRSS(pid int) (int, error) {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	for line := range strings.SplitSeq(string(data), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			return strconv.Atoi(strings.TrimSuffix(strings.TrimSpace(rest), " kB"))
		}
	}
	return 0, fmt.Errorf("no VmHWM in /proc/%d/status", pid)
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
