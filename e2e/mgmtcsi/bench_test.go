package mgmtcsi_test

import (
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pvbridge.io/e2e/deploy"
)

// BenchmarkProvision100PVCs creates 100 claims at once through csi-provisioner (Immediate
// binding, so the scheduler is not measured), waits until all are Bound, deletes them and waits
// until their volumes are gone. It prints the create latency (claim created → Bound) and the
// create+delete throughput.
func BenchmarkProvision100PVCs(b *testing.B) {
	const n = 100
	g := NewWithT(b)
	ctx := b.Context()
	var latencies []time.Duration
	var total time.Duration
	for range b.N {
		ns, err := deploy.CreateNamespace(ctx, mgmt.CP.Client(), "bench")
		g.Expect(err).NotTo(HaveOccurred())
		w, err := mgmt.CP.Client().CoreV1().PersistentVolumeClaims(ns).Watch(ctx, metav1.ListOptions{})
		g.Expect(err).NotTo(HaveOccurred())

		var mu sync.Mutex
		created := map[string]time.Time{}
		bound := map[string]time.Duration{}
		done := make(chan struct{})
		go func() {
			defer close(done)
			for ev := range w.ResultChan() {
				pvc, ok := ev.Object.(*corev1.PersistentVolumeClaim)
				if !ok || ev.Type == watch.Deleted || pvc.Status.Phase != corev1.ClaimBound {
					continue
				}
				mu.Lock()
				if _, seen := bound[pvc.Name]; !seen {
					bound[pvc.Name] = time.Since(created[pvc.Name])
				}
				all := len(bound) == n
				mu.Unlock()
				if all {
					return
				}
			}
		}()

		start := time.Now()
		var wg sync.WaitGroup
		for i := range n {
			name := fmt.Sprintf("b%03d", i)
			mu.Lock()
			created[name] = time.Now()
			mu.Unlock()
			wg.Go(func() {
				g.Expect(c.Create(ctx, deploy.PVC(ns, name, deploy.StorageClassPmemImmediate, "8Mi", true))).To(Succeed())
			})
		}
		wg.Wait()
		<-done
		w.Stop()
		var objs []client.Object
		for name, d := range bound {
			latencies = append(latencies, d)
			objs = append(objs, &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}})
		}
		deleteAndWait(ctx, g, objs...)
		noVolumesLeft(ctx, g)
		total += time.Since(start)
	}
	slices.Sort(latencies)
	p := func(q float64) float64 { return latencies[int(q*float64(len(latencies)-1))].Seconds() }
	rate := float64(n*b.N) / total.Seconds()
	b.ReportMetric(rate, "pvc/s")
	b.ReportMetric(p(0.5), "p50-s")
	b.ReportMetric(p(0.99), "p99-s")
	fmt.Printf("BENCH mgmt_csi_create_delete_throughput_100 %.2f pvc/s\n", rate)
	fmt.Printf("BENCH mgmt_csi_create_latency_p50 %.3f s\n", p(0.5))
	fmt.Printf("BENCH mgmt_csi_create_latency_p99 %.3f s\n", p(0.99))
}
