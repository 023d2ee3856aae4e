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
// until their volumes are gone. It prints the provisioning latency (claim created → its PV
// exists: csi-provisioner and mgmt-csi), the create latency (claim created → Bound, which adds
// kube-controller-manager's binder) and the create+delete throughput.
func BenchmarkProvision100PVCs(b *testing.B) {
	const n = 100
	g := NewWithT(b)
	ctx := b.Context()
	var latencies, provLatencies []time.Duration
	var total time.Duration
	for range b.N {
		ns, err := deploy.CreateNamespace(ctx, mgmt.CP.Client(), "bench")
		g.Expect(err).NotTo(HaveOccurred())
		w, err := mgmt.CP.Client().CoreV1().PersistentVolumeClaims(ns).Watch(ctx, metav1.ListOptions{})
		g.Expect(err).NotTo(HaveOccurred())
		pvWatch, err := mgmt.CP.Client().CoreV1().PersistentVolumes().Watch(ctx, metav1.ListOptions{})
		g.Expect(err).NotTo(HaveOccurred())

		var mu sync.Mutex
		created := map[string]time.Time{}
		bound := map[string]time.Duration{}
		provisioned := map[string]time.Duration{}
		go func() {
			for ev := range pvWatch.ResultChan() {
				pv, ok := ev.Object.(*corev1.PersistentVolume)
				if !ok || ev.Type != watch.Added || pv.Spec.ClaimRef == nil || pv.Spec.ClaimRef.Namespace != ns {
					continue
				}
				mu.Lock()
				provisioned[pv.Spec.ClaimRef.Name] = time.Since(created[pv.Spec.ClaimRef.Name])
				mu.Unlock()
			}
		}()
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
		pvWatch.Stop()
		var objs []client.Object
		mu.Lock()
		for _, d := range provisioned {
			provLatencies = append(provLatencies, d)
		}
		mu.Unlock()
		for name, d := range bound {
			latencies = append(latencies, d)
			objs = append(objs, &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}})
		}
		deleteAndWait(ctx, g, objs...)
		noVolumesLeft(ctx, g)
		total += time.Since(start)
	}
	slices.Sort(latencies)
	slices.Sort(provLatencies)
	pct := func(l []time.Duration, q float64) float64 { return l[int(q*float64(len(l)-1))].Seconds() }
	p := func(q float64) float64 { return pct(latencies, q) }
	rate := float64(n*b.N) / total.Seconds()
	b.ReportMetric(rate, "pvc/s")
	b.ReportMetric(p(0.5), "p50-s")
	b.ReportMetric(p(0.99), "p99-s")
	fmt.Printf("BENCH mgmt_csi_create_delete_throughput_100 %.2f pvc/s\n", rate)
	fmt.Printf("BENCH mgmt_csi_provision_latency_p50 %.3f s\n", pct(provLatencies, 0.5))
	fmt.Printf("BENCH mgmt_csi_provision_latency_p99 %.3f s\n", pct(provLatencies, 0.99))
	fmt.Printf("BENCH mgmt_csi_create_latency_p50 %.3f s\n", p(0.5))
	fmt.Printf("BENCH mgmt_csi_create_latency_p99 %.3f s\n", p(0.99))
}
