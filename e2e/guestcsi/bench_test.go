package guestcsi_test

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"

	"pvbridge.io/e2e/deploy"
)

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
	var l []time.Duration
	for _, d := range f.at {
		l = append(l, d)
	}
	if len(l) == 0 {
		return 0
	}
	slices.Sort(l)
	return l[int(q*float64(len(l)-1))].Seconds()
}

// watchEach feeds every event of w to fn until ctx ends.
func watchEach(ctx context.Context, w watch.Interface, fn func(watch.Event)) {
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

// BenchmarkGuestPodStart100 creates 100 guest PVCs and 100 pods using them at once, across the
// guest's three VMs, and measures through both layers: guest PVC created → Bound (guest
// csi-provisioner, guest-csi, management PVC, csi-provisioner, mgmt-csi, both binders), guest
// VolumeAttachment created → attached (guest csi-attacher, guest-csi, VM spec.volumes,
// vm-operator, management VolumeAttachment, csi-attacher, host agent stage/publish/hot-plug, VM
// status), pod created → Running (adds the scheduler and the guest kubelet's stage and publish),
// and the provisioning throughput. The sidecars, controller-managers and clients run with the
// lab's settings, which are those of the shipped manifests.
func BenchmarkGuestPodStart100(b *testing.B) {
	const n = 100
	g := NewWithT(b)
	ctx, cancel := context.WithCancel(b.Context())
	defer cancel()
	bound, attached, running := newFirsts(), newFirsts(), newFirsts()
	var provisioning time.Duration
	for range b.N {
		ns, err := deploy.CreateNamespace(ctx, gc, "bench")
		g.Expect(err).NotTo(HaveOccurred())
		pvcs, err := gc.CoreV1().PersistentVolumeClaims(ns).Watch(ctx, metav1.ListOptions{})
		g.Expect(err).NotTo(HaveOccurred())
		watchEach(ctx, pvcs, func(ev watch.Event) {
			if pvc, ok := ev.Object.(*corev1.PersistentVolumeClaim); ok && pvc.Status.Phase == corev1.ClaimBound {
				bound.happened(ns + "/" + pvc.Name)
			}
		})
		pods, err := gc.CoreV1().Pods(ns).Watch(ctx, metav1.ListOptions{})
		g.Expect(err).NotTo(HaveOccurred())
		watchEach(ctx, pods, func(ev watch.Event) {
			if pod, ok := ev.Object.(*corev1.Pod); ok && pod.Status.Phase == corev1.PodRunning {
				running.happened(ns + "/" + pod.Name)
			}
		})
		vas, err := gc.StorageV1().VolumeAttachments().Watch(ctx, metav1.ListOptions{})
		g.Expect(err).NotTo(HaveOccurred())
		watchEach(ctx, vas, func(ev watch.Event) {
			va, ok := ev.Object.(*storagev1.VolumeAttachment)
			if !ok {
				return
			}
			attached.started(va.Name)
			if va.Status.Attached {
				attached.happened(va.Name)
			}
		})

		start := time.Now()
		var wg sync.WaitGroup
		for i := range n {
			name := fmt.Sprintf("b%03d", i)
			bound.started(ns + "/" + name)
			running.started(ns + "/" + name)
			wg.Go(func() {
				_, err := gc.CoreV1().PersistentVolumeClaims(ns).Create(ctx, deploy.PVC(ns, name, "", "16Mi", false), metav1.CreateOptions{})
				g.Expect(err).NotTo(HaveOccurred())
				_, err = gc.CoreV1().Pods(ns).Create(ctx, deploy.Pod(ns, name, name, "", false), metav1.CreateOptions{})
				g.Expect(err).NotTo(HaveOccurred())
			})
		}
		wg.Wait()
		g.Eventually(bound.count).WithContext(ctx).WithTimeout(10 * time.Minute).Should(BeNumerically(">=", n))
		provisioning += time.Since(start)
		g.Eventually(running.count).WithContext(ctx).WithTimeout(10 * time.Minute).Should(BeNumerically(">=", n))

		g.Expect(gc.CoreV1().Pods(ns).DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{})).To(Succeed())
		g.Expect(gc.CoreV1().PersistentVolumeClaims(ns).DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{})).To(Succeed())
		g.Eventually(func(g Gomega) {
			pvs, err := gc.CoreV1().PersistentVolumes().List(ctx, metav1.ListOptions{})
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(pvs.Items).To(BeEmpty())
		}).WithContext(ctx).WithTimeout(10 * time.Minute).Should(Succeed())
	}
	fmt.Printf("BENCH guest_pvc_bound_p50 %.3f s\n", bound.percentile(0.5))
	fmt.Printf("BENCH guest_pvc_bound_p99 %.3f s\n", bound.percentile(0.99))
	fmt.Printf("BENCH guest_attach_p50 %.3f s\n", attached.percentile(0.5))
	fmt.Printf("BENCH guest_attach_p99 %.3f s\n", attached.percentile(0.99))
	fmt.Printf("BENCH guest_pod_running_p50 %.3f s\n", running.percentile(0.5))
	fmt.Printf("BENCH guest_pod_running_p99 %.3f s\n", running.percentile(0.99))
	fmt.Printf("BENCH guest_provisioning_throughput %.2f volumes/s\n", float64(n*b.N)/provisioning.Seconds())
	b.ReportMetric(running.percentile(0.5), "pod-p50-s")
}
