package vmoperator_test

import (
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"k8s.io/apimachinery/pkg/watch"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pvbridge.io/e2e/deploy"
	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
)

// BenchmarkAttachDetach100VolumesAcross10VMs gives 10 VMs (5 per host) 10 volumes each in one
// update per VM, and measures for each volume the time from that update until status.volumes
// reports it attached with a serial (VolumeAttachment, csi-attacher, mgmt-csi, host agent stage
// + publish + hot-plug, status). Then it removes them all and measures until each entry leaves
// status (unplug, unpublish, unstage).
func BenchmarkAttachDetach100VolumesAcross10VMs(b *testing.B) {
	const vms, perVM = 10, 10
	g := NewWithT(b)
	var attach, detach []time.Duration
	for range b.N {
		ctx := b.Context()
		ns, err := deploy.CreateNamespace(ctx, mgmt.CP.Client(), "bench")
		g.Expect(err).NotTo(HaveOccurred())
		var machines []*vmv1.VirtualMachine
		for v := range vms {
			host := []string{"host-a", "host-b"}[v%2]
			vm := virtualMachine(ns, fmt.Sprintf("vm-%d", v), host)
			for i := range perVM {
				name := fmt.Sprintf("d-%d-%d", v, i)
				blockClaim(ctx, g, ns, name, host)
				vm.Spec.Volumes = append(vm.Spec.Volumes, vmv1.VirtualMachineVolume{
					Name: name, PersistentVolumeClaim: vmv1.PersistentVolumeClaimVolumeSource{ClaimName: name},
				})
			}
			machines = append(machines, vm)
		}

		watcher, err := c.Watch(ctx, &vmv1.VirtualMachineList{}, client.InNamespace(ns))
		g.Expect(err).NotTo(HaveOccurred())

		var mu sync.Mutex
		start := map[string]time.Time{}
		attachedAt := map[string]time.Duration{}
		detachedAt := map[string]time.Duration{}
		removed := false
		done := make(chan struct{})
		go func() {
			defer close(done)
			for ev := range watcher.ResultChan() {
				vm, ok := ev.Object.(*vmv1.VirtualMachine)
				if !ok || ev.Type == watch.Deleted {
					continue
				}
				mu.Lock()
				inStatus := map[string]bool{}
				for _, e := range vm.Status.Volumes {
					inStatus[e.Name] = true
					if _, seen := attachedAt[e.Name]; !seen && e.Attached && e.DiskSerial != "" {
						attachedAt[e.Name] = time.Since(start[e.Name])
					}
				}
				if removed {
					for name := range attachedAt {
						if _, seen := detachedAt[name]; !seen && !inStatus[name] && volumeOf(name) == vm.Name {
							detachedAt[name] = time.Since(start[name])
						}
					}
				}
				finished := len(detachedAt) == vms*perVM
				mu.Unlock()
				if finished {
					return
				}
			}
		}()

		for _, vm := range machines {
			mu.Lock()
			for _, v := range vm.Spec.Volumes {
				start[v.Name] = time.Now()
			}
			mu.Unlock()
			g.Expect(c.Create(ctx, vm)).To(Succeed())
		}
		g.Eventually(func() int {
			mu.Lock()
			defer mu.Unlock()
			return len(attachedAt)
		}).WithContext(ctx).WithTimeout(5 * time.Minute).Should(Equal(vms * perVM))

		mu.Lock()
		removed = true
		mu.Unlock()
		for _, vm := range machines {
			g.Expect(c.Get(ctx, client.ObjectKeyFromObject(vm), vm)).To(Succeed())
			mu.Lock()
			for _, v := range vm.Spec.Volumes {
				start[v.Name] = time.Now()
			}
			mu.Unlock()
			detachAll(ctx, g, vm)
		}
		<-done
		watcher.Stop()
		for _, d := range attachedAt {
			attach = append(attach, d)
		}
		for _, d := range detachedAt {
			detach = append(detach, d)
		}
		for _, vm := range machines {
			g.Expect(c.Delete(ctx, vm)).To(Succeed())
		}
	}
	slices.Sort(attach)
	slices.Sort(detach)
	p := func(l []time.Duration, q float64) float64 { return l[int(q*float64(len(l)-1))].Seconds() }
	for _, f := range []struct {
		name string
		l    []time.Duration
	}{{"attach", attach}, {"detach", detach}} {
		b.ReportMetric(p(f.l, 0.5), f.name+"-p50-s")
		b.ReportMetric(p(f.l, 0.99), f.name+"-p99-s")
		fmt.Printf("BENCH vm_operator_%s_latency_p50 %.3f s\n", f.name, p(f.l, 0.5))
		fmt.Printf("BENCH vm_operator_%s_latency_p99 %.3f s\n", f.name, p(f.l, 0.99))
	}
}

// volumeOf names the VM a benchmark volume "d-<vm>-<i>" belongs to.
func volumeOf(volume string) string {
	var v, i int
	_, _ = fmt.Sscanf(volume, "d-%d-%d", &v, &i)
	return fmt.Sprintf("vm-%d", v)
}
