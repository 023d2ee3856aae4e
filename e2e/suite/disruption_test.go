package suite_test

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pvbridge.io/e2e/cluster"
	"pvbridge.io/e2e/deploy"
	"pvbridge.io/pkg/tenancy"
)

// detachWatch records every VolumeAttachment of a cluster that, once attached, is deleted or
// stops being attached.
type detachWatch struct {
	mu         sync.Mutex
	violations []string
	stop       func()
	done       chan struct{}
}

func watchDetaches(ctx context.Context, cp *cluster.ControlPlane) *detachWatch {
	GinkgoHelper()
	w, err := cp.Client().StorageV1().VolumeAttachments().Watch(ctx, metav1.ListOptions{})
	Expect(err).NotTo(HaveOccurred())
	d := &detachWatch{stop: w.Stop, done: make(chan struct{})}
	go func() {
		defer close(d.done)
		attached := map[string]bool{}
		for ev := range w.ResultChan() {
			va, ok := ev.Object.(*storagev1.VolumeAttachment)
			if !ok {
				continue
			}
			switch {
			case !attached[va.Name]:
				attached[va.Name] = va.Status.Attached && ev.Type != watch.Deleted
			case ev.Type == watch.Deleted || va.DeletionTimestamp != nil:
				d.record("%s: VolumeAttachment %s deleted", cp.Name, va.Name)
			case !va.Status.Attached:
				d.record("%s: VolumeAttachment %s detached", cp.Name, va.Name)
			}
		}
	}()
	return d
}

func (d *detachWatch) record(format string, args ...any) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.violations = append(d.violations, fmt.Sprintf(format, args...))
}

// finish stops the watch and returns what it saw.
func (d *detachWatch) finish() []string {
	d.stop()
	<-d.done
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.violations
}

var _ = Describe("Disruption", Label("disruptive"), func() {
	DescribeTable("restarting kube-controller-manager detaches nothing that should stay attached",
		func(ctx SpecContext, which func() *cluster.ControlPlane) {
			cp := which()
			ns := alpha.namespace(ctx)
			alpha.create(ctx, deploy.PVC(ns, "data", "", "256Mi", false))
			pod := alpha.runPod(ctx, ns, "app", "data", "vm-2", false)
			_, pv := alpha.bound(ctx, ns, "data")
			want := alpha.writeBlob(pod, pv.Name, 5)
			watches := []*detachWatch{watchDetaches(ctx, mgmt.CP), watchDetaches(ctx, alpha.CP)}

			Expect(cp.StopControllerManager()).To(Succeed())
			Expect(cp.StartControllerManager()).To(Succeed())
			// A new volume bound and attached proves the restarted controllers (binder,
			// attach-detach) have synced and reconciled; a wrong detach would have happened by then.
			alpha.create(ctx, deploy.PVC(ns, "after", "", "256Mi", false))
			alpha.runPod(ctx, ns, "after", "after", "vm-2", false)

			var violations []string
			for _, w := range watches {
				violations = append(violations, w.finish()...)
			}
			Expect(violations).To(BeEmpty())
			Expect(alpha.readBlob(pod, pv.Name)).To(Equal(want))
		},
		Entry("of the guest cluster", func() *cluster.ControlPlane { return alpha.CP }),
		Entry("of the management cluster", func() *cluster.ControlPlane { return mgmt.CP }),
	)

	It("converges after the management apiserver was unreachable for 60 s during attach", func(ctx SpecContext) {
		ns := alpha.namespace(ctx)
		alpha.create(ctx, deploy.PVC(ns, "data", "", "256Mi", false))
		alpha.create(ctx, deploy.Pod(ns, "app", "data", "vm-2", false))
		_, pv := alpha.bound(ctx, ns, "data")

		By("stopping the management apiserver for 60 s")
		Expect(mgmt.CP.StopAPIServer()).To(Succeed())
		DeferCleanup(func(ctx SpecContext) { _ = mgmt.CP.StartAPIServer(ctx) }) // idempotent if the spec already restarted it
		outage := time.After(60 * time.Second)
		seen := map[string]bool{}
	during:
		for {
			select {
			case <-outage:
				break during
			case <-ctx.Done():
				Fail("interrupted during the outage")
			case <-time.After(time.Second):
				messages, err := attachErrors(ctx, alpha, pv.Name)
				Expect(err).NotTo(HaveOccurred())
				for _, m := range messages {
					seen[m] = true
				}
			}
		}
		Expect(mgmt.CP.StartAPIServer(ctx)).To(Succeed())

		By("the attach converges once it is back")
		Eventually(func(g Gomega) {
			running := &corev1.Pod{}
			g.Expect(alpha.c.Get(ctx, client.ObjectKey{Namespace: ns, Name: "app"}, running)).To(Succeed())
			g.Expect(running.Status.Phase).To(Equal(corev1.PodRunning))
		}).WithContext(ctx).WithTimeout(2 * timeout).Should(Succeed())
		retryableMessage := regexp.MustCompile(`code = (Unavailable|DeadlineExceeded|Aborted)`)
		for m := range seen {
			Expect(m).To(MatchRegexp(retryableMessage.String()), "only retryable errors while the apiserver was away")
		}
		Expect(claimsOf(ctx, pv.Name)).To(HaveLen(1), "one management PVC for the guest PV")
		Expect(vm(ctx, alpha.Options.Namespace, "vm-2").Spec.Volumes).To(ContainElement(HaveField("PersistentVolumeClaim.ClaimName", pv.Spec.CSI.VolumeHandle)))
	})
})

// claimsOf returns the names of the management PVCs made for alpha's guest PV pv.
func claimsOf(ctx context.Context, pv string) ([]string, error) {
	pvcs := &corev1.PersistentVolumeClaimList{}
	if err := mc.List(ctx, pvcs, client.MatchingLabels{tenancy.ClusterUIDLabel: alpha.UID}); err != nil {
		return nil, err
	}
	var names []string
	for _, p := range pvcs.Items {
		if p.Annotations[tenancy.GuestPVAnnotation] == pv {
			names = append(names, p.Name)
		}
	}
	return names, nil
}

// victims are the processes the churn kills: every pvbridge component and one of each kind of
// sidecar, on both clusters.
func victims() []*cluster.Process {
	ps := []*cluster.Process{alpha.Controller, mgmt.Controller, op.Controller}
	for _, h := range mgmt.Hosts {
		ps = append(ps, h.Agent, op.Agents[h.Node.Name])
	}
	for _, p := range alpha.Plugins {
		ps = append(ps, p)
	}
	for _, s := range []map[string]*cluster.Process{alpha.Sidecars, mgmt.Sidecars} {
		for _, p := range s {
			ps = append(ps, p)
		}
	}
	return ps
}

// churnLifecycles is how many volume lifecycles the kill -9 churn runs at least; it goes on until
// every component was killed once. CI runs this size, `make soak` 200.
var churnLifecycles = flag.Int("churn-lifecycles", 40, "volume lifecycles of the kill -9 churn (at least; it runs until every component was killed once)")

// churnRounds bounds the kills: each round kills every component once. Kills stop after this many
// rounds or once the last lifecycle has started, whichever comes first; the lifecycles still
// running then must converge without further kills.
var churnRounds = flag.Int("churn-rounds", 4, "rounds of kills of the kill -9 churn (at most; each kills every component once)")

var _ = Describe("Crashes", Label("disruptive", "churn"), func() {
	It("converges after kill -9 of every component at random points during volume lifecycles", func(ctx SpecContext) {
		const concurrency = 20
		ns := alpha.namespace(ctx)
		killCtx, stopKilling := context.WithCancel(ctx)
		killed := map[string]int{}
		killing := make(chan struct{})
		// everyKilled is closed once every component was killed at least once.
		everyKilled := make(chan struct{})
		var lastKill atomic.Int64 // unix nanoseconds
		lastKill.Store(time.Now().UnixNano())
		go func() {
			defer GinkgoRecover()
			defer close(killing)
			// Each round kills every component once, in a new random order, at random times.
			ps := victims()
			for i := 0; i < *churnRounds*len(ps); i++ {
				if i%len(ps) == 0 {
					rand.Shuffle(len(ps), func(a, b int) { ps[a], ps[b] = ps[b], ps[a] })
				}
				select {
				case <-killCtx.Done():
					return
				case <-time.After(time.Duration(2000+rand.IntN(4000)) * time.Millisecond):
				}
				p := ps[i%len(ps)]
				if err := p.Kill(); err != nil {
					GinkgoWriter.Printf("kill %s: %v\n", p.Name, err)
					continue
				}
				lastKill.Store(time.Now().UnixNano())
				killed[p.Name]++
				if len(killed) == len(ps) && killed[p.Name] == 1 {
					close(everyKilled)
				}
			}
		}()

		var (
			mu     sync.Mutex
			failed []error
			wg     sync.WaitGroup
		)
		slots := make(chan struct{}, concurrency)
		started := 0
	launch:
		for ; ; started++ {
			if started >= *churnLifecycles {
				select {
				case <-everyKilled:
					break launch
				case <-killing: // the rounds are over; a component that was never killed fails below
					break launch
				default:
				}
			}
			slots <- struct{}{}
			i := started
			wg.Go(func() {
				defer func() { <-slots }()
				if err := lifecycle(ctx, ns, fmt.Sprintf("v%d", i), byte(i), &lastKill); err != nil {
					mu.Lock()
					failed = append(failed, fmt.Errorf("lifecycle %d: %w", i, err))
					mu.Unlock()
				}
			})
		}
		stopKilling()
		<-killing
		wg.Wait()
		GinkgoWriter.Printf("lifecycles: %d, killed: %v\n", started, killed)
		Expect(errors.Join(failed...)).NotTo(HaveOccurred())
		Expect(killed).To(HaveLen(len(victims())), "every component was killed at least once")
	})
})

// lifecycle runs one volume's life in guest alpha under churn: claim, pod, data written, pod
// gone, a second pod on a VM of the same host reads the data back, everything deleted. It
// checks that the claim got exactly one management PVC and one VM entry at a time.
func lifecycle(ctx context.Context, ns, name string, seed byte, lastKill *atomic.Int64) error {
	// A step converges within the suite's budget twice after the later of its start and the last
	// kill: while kills go on, every component's restart and every retry's backoff is owed to
	// them (ci13: steps that met a dozen kills under load took over 4 minutes). A failed read (a
	// component just killed) is retried like an unmet condition.
	budget := 2 * timeout
	waitFor := func(what string, cond func() (bool, error)) error {
		start := time.Now()
		err := wait.PollUntilContextCancel(ctx, 250*time.Millisecond, true, func(context.Context) (bool, error) {
			if ok, err := cond(); err == nil && ok {
				return true, nil
			}
			since := start
			if k := time.Unix(0, lastKill.Load()); k.After(since) {
				since = k
			}
			if time.Since(since) > budget {
				return false, fmt.Errorf("not within %s of its start or the last kill (waited %s)", budget, time.Since(start).Round(time.Second))
			}
			return false, nil
		})
		if err != nil {
			return fmt.Errorf("%s: %w", what, err)
		}
		return nil
	}
	running := func(pod *corev1.Pod) func() (bool, error) {
		return func() (bool, error) {
			err := alpha.c.Get(ctx, client.ObjectKeyFromObject(pod), pod)
			return pod.Status.Phase == corev1.PodRunning, err
		}
	}
	detachedFrom := func(node string, pv string) func() (bool, error) {
		return func() (bool, error) {
			vas := &storagev1.VolumeAttachmentList{}
			if err := alpha.c.List(ctx, vas); err != nil {
				return false, err
			}
			return !slices.ContainsFunc(vas.Items, func(va storagev1.VolumeAttachment) bool {
				return va.Spec.NodeName == node && ptr.Deref(va.Spec.Source.PersistentVolumeName, "") == pv
			}), nil
		}
	}

	pvc := deploy.PVC(ns, name, "", "64Mi", false)
	if err := alpha.c.Create(ctx, pvc); err != nil {
		return err
	}
	first := deploy.Pod(ns, name+"-w", name, "", false)
	if err := alpha.c.Create(ctx, first); err != nil {
		return err
	}
	if err := waitFor("writer running", running(first)); err != nil {
		return err
	}
	if err := alpha.c.Get(ctx, client.ObjectKeyFromObject(pvc), pvc); err != nil {
		return err
	}
	pv := pvc.Spec.VolumeName
	claims, err := claimsOf(ctx, pv)
	if err != nil {
		return err
	}
	if len(claims) != 1 {
		return fmt.Errorf("guest PV %s has management PVCs %v, not one", pv, claims)
	}
	content := []byte(fmt.Sprintf("volume %s seed %d", name, seed))
	if err := writeSynced(filepath.Join(alpha.volumePath(first, pv), "data"), content); err != nil {
		return err
	}
	if err := alpha.c.Delete(ctx, first); err != nil {
		return err
	}
	if err := waitFor("writer detached", detachedFrom(first.Spec.NodeName, pv)); err != nil {
		return err
	}
	second := deploy.Pod(ns, name+"-r", name, "", false)
	if err := alpha.c.Create(ctx, second); err != nil {
		return err
	}
	if err := waitFor("reader running", running(second)); err != nil {
		return err
	}
	got, err := os.ReadFile(filepath.Join(alpha.volumePath(second, pv), "data"))
	if err != nil {
		return err
	}
	if !bytes.Equal(got, content) {
		return fmt.Errorf("data of %s: read %q, wrote %q", name, got, content)
	}
	if err := alpha.c.Delete(ctx, second); err != nil {
		return err
	}
	if err := waitFor("reader detached", detachedFrom(second.Spec.NodeName, pv)); err != nil {
		return err
	}
	if err := alpha.c.Delete(ctx, pvc); err != nil {
		return err
	}
	return waitFor("volume deleted", func() (bool, error) {
		claims, err := claimsOf(ctx, pv)
		return len(claims) == 0, err
	})
}
