package suite_test

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"sync/atomic"
	"time"

	groupsnapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumegroupsnapshot/v1"
	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/utils/ptr"

	"pvbridge.io/e2e/deploy"
	"pvbridge.io/pkg/names"
	"pvbridge.io/pkg/qos"
	"pvbridge.io/pkg/tenancy"
)

// A cluster's operations beside a neighbour's abuse, timed in rounds that alternate quiet and
// abused so that the machine's own drift falls on both. The tenancy specs run one round and
// check that the operations complete and the abuse took place; `make bench` runs three and
// prints how much slower the fastest abused round was than the fastest quiet one (a neighbour
// that slows beta slows every round it abuses, the 2-core machine's load slows rounds of
// either kind at random: a CI run timed quiet attaches of 1.4, 2.6 and 7.2 s).

// attachBesideVMFlood times beta's attach, a pod of a bound claim on vm-b1 from its creation
// until it runs (attach, hot-plug, mount), then detached, quiet and while alpha floods its VM
// with entries for claims that do not exist (floodVM).
func attachBesideVMFlood(ctx context.Context, rounds int) (quiet, flooded []time.Duration) {
	GinkgoHelper()
	ns := beta.namespace(ctx)
	beta.create(ctx, deploy.PVC(ns, "data", deploy.StorageClassGuest, "64Mi", false))
	beta.deletePod(ctx, beta.runPod(ctx, ns, "warm", "data", "vm-b1", false))
	attach := func(name string) time.Duration {
		start := time.Now()
		pod := beta.runPod(ctx, ns, name, "data", "vm-b1", false)
		took := time.Since(start)
		beta.deletePod(ctx, pod)
		return took
	}
	for round := range rounds {
		quiet = append(quiet, attach(fmt.Sprintf("quiet-%d", round)))
		stop := floodVM(ctx, alpha, "vm-1")
		flooded = append(flooded, attach(fmt.Sprintf("flooded-%d", round)))
		patches := stop()
		Expect(patches).To(BeNumerically(">=", 2), "the flood ran")
	}
	return quiet, flooded
}

// snapshotBesideGroupFlood times beta's snapshot of a volume, from creation until ready, and
// its attach of another (as attachBesideVMFlood), quiet and while alpha floods host-a with
// group snapshots whose holds overrun: quiet[0], flooded[0] are the snapshots, [1] the
// attaches.
func snapshotBesideGroupFlood(ctx context.Context, rounds int) (quiet, flooded [2][]time.Duration) {
	GinkgoHelper()
	// alpha and beta share host-a: its node agent cuts every snapshot, its host agent
	// holds and plugs every disk. alpha's group snapshots each hold vm-1's writes to two
	// volumes: group "slow"'s pair has one limited to 1 MiB/s with 24 MiB of dirty data
	// behind it, whose freeze writes that back for about 24 s, past the hold's 10 s bound;
	// group "fast"'s pair waits for the host's group lock and hold meanwhile.
	const crawl = "pmem-crawl"
	class := &storagev1.VolumeAttributesClass{ObjectMeta: metaName("", crawl), DriverName: names.PmemDriver, Parameters: map[string]string{qos.MaxBytesPerSecondParam: "1Mi"}}
	Expect(mc.Create(ctx, class)).To(Succeed())
	DeferCleanup(func(ctx SpecContext) { Expect(mc.Delete(ctx, class)).To(Succeed()) })
	allowClass(ctx, alpha, tenancy.AttributesClassesAnnotation, tenancy.ParamAttributesClasses, crawl)
	guestClass := &storagev1.VolumeAttributesClass{ObjectMeta: metaName("", "crawl"), DriverName: names.GuestDriver, Parameters: map[string]string{names.MgmtVolumeAttributesClassParam: crawl}}
	alpha.create(ctx, guestClass)
	DeferCleanup(func(ctx SpecContext) { Expect(alpha.c.Delete(ctx, guestClass)).To(Succeed()) })

	ans := alpha.namespace(ctx)
	var slow string // where alpha's limited volume is mounted
	for _, claim := range []string{"slow-a", "slow-b", "fast-a", "fast-b"} {
		pvc := deploy.PVC(ans, claim, "", "64Mi", false)
		pvc.Labels = map[string]string{"app": claim[:4]}
		if claim == "slow-a" {
			pvc.Spec.VolumeAttributesClassName = ptr.To("crawl")
		}
		alpha.create(ctx, pvc)
		pod := alpha.runPod(ctx, ans, claim, claim, "vm-1", false)
		if _, pv := alpha.bound(ctx, ans, claim); claim == "slow-a" {
			slow = alpha.volumePath(pod, pv.Name)
		}
	}

	bns := beta.namespace(ctx)
	beta.create(ctx, deploy.PVC(bns, "data", deploy.StorageClassGuest, "64Mi", false))
	beta.deletePod(ctx, beta.runPod(ctx, bns, "writer", "data", "vm-b1", false))
	beta.create(ctx, deploy.PVC(bns, "other", deploy.StorageClassGuest, "64Mi", false))
	beta.deletePod(ctx, beta.runPod(ctx, bns, "warm", "other", "vm-b1", false))
	// beta's snapshot of a volume, from creation until ready, then its attach of another
	// (a pod, from creation until it runs), each undone after.
	neighbour := func(name string) (snapshot, attach time.Duration) {
		start := time.Now()
		snap := beta.snapshot(ctx, bns, name, "data")
		beta.readySnapshot(ctx, snap)
		snapshot = time.Since(start)
		Expect(beta.c.Delete(ctx, snap)).To(Succeed())
		start = time.Now()
		pod := beta.runPod(ctx, bns, name, "other", "vm-b1", false)
		attach = time.Since(start)
		beta.deletePod(ctx, pod)
		return snapshot, attach
	}

	// The host agent's log: holds started, and those let go after they overran.
	agentLog := op.Agents["host-a"].LogPath
	holds, overruns := logged(agentLog, "Starting to hold writers"), logged(agentLog, "Released writers held past the longest hold")
	for round := range rounds {
		s, a := neighbour(fmt.Sprintf("quiet-%d", round))
		quiet[0], quiet[1] = append(quiet[0], s), append(quiet[1], a)

		By(fmt.Sprintf("round %d: alpha dirties 24 MiB of its limited volume and asks for group snapshots of both pairs", round))
		started, before := holds(), overruns()
		// Written over in place, never truncated: ext4 starts writing back a file rewritten
		// from empty at once (auto_da_alloc), the rest after 30 s.
		dirty, err := os.OpenFile(filepath.Join(slow, "dirty"), os.O_CREATE|os.O_WRONLY, 0o644)
		Expect(err).NotTo(HaveOccurred())
		_, err = dirty.WriteAt(bytes.Repeat([]byte{byte(round + 1)}, 24<<20), 0)
		Expect(err).NotTo(HaveOccurred())
		Expect(dirty.Close()).To(Succeed())
		groups := []*groupsnapshotv1.VolumeGroupSnapshot{alpha.newGroupSnapshot(ctx, ans, fmt.Sprintf("slow-%d", round), "slow")}
		// Once its hold starts, the freeze writes back for about 24 s: the other group and
		// beta's turn start inside it. Whether the turn also ends inside it is the machine's
		// load (a CI run's turn outlasted it), so it is reported, not asserted.
		Eventually(holds).WithContext(ctx).WithTimeout(timeout).Should(BeNumerically(">", started))
		groups = append(groups, alpha.newGroupSnapshot(ctx, ans, fmt.Sprintf("fast-%d", round), "fast"))
		Expect(overruns()).To(Equal(before), "beta's turn starts while alpha's writers are being held")
		s, a = neighbour(fmt.Sprintf("flooded-%d", round))
		flooded[0], flooded[1] = append(flooded[0], s), append(flooded[1], a)
		inside := overruns() == before
		Eventually(overruns).WithContext(ctx).WithTimeout(timeout).Should(BeNumerically(">", before), "alpha's hold overran")
		// Once the freeze is through, a retry cuts group slow, then group fast is cut. Both
		// are deleted when the spec ends, once made: csi-snapshotter notices the deletion of
		// a group it is still making only at its next resync (15 minutes).
		for _, vgs := range groups {
			alpha.readyGroup(ctx, vgs)
		}
		GinkgoWriter.Printf("round %d: beta's snapshot quiet %s, flooded %s; attach quiet %s, flooded %s; ended inside alpha's hold: %t\n",
			round, quiet[0][round], flooded[0][round], quiet[1][round], flooded[1][round], inside)
	}
	return quiet, flooded
}

// credentialBesideSlowGuest times the delivery of beta's renewed credential after its identity
// is revoked, quiet and beside a guest whose apiserver answers a byte a second: the quiet rounds
// first, since the slow guest stays until the spec ends.
func credentialBesideSlowGuest(ctx context.Context, rounds int) (quiet, beside []time.Duration) {
	GinkgoHelper()
	// renew revokes beta's identity and returns how long until the tenants controller has
	// delivered the one it made anew into beta (guest-csi reads it within its poll period,
	// 10 s, which "rotates a revoked credential" proves).
	renew := func() time.Duration {
		delivered := func() string {
			data, err := deploy.DeliveredCredential(ctx, beta.CP)
			Expect(err).NotTo(HaveOccurred())
			return string(data)
		}
		before, start := delivered(), time.Now()
		revokeIdentity(ctx, beta)()
		Eventually(delivered).WithContext(ctx).WithTimeout(timeout).ShouldNot(Equal(before))
		return time.Since(start)
	}
	for range rounds {
		quiet = append(quiet, renew())
	}

	By("a guest whose apiserver answers a byte a second, holding each request for the 15 s the controller allows")
	var slow atomic.Int32
	hostileGuest(ctx, "tenant-s", "slow", func(w http.ResponseWriter, r *http.Request) {
		slow.Add(1)
		defer slow.Add(-1)
		w.WriteHeader(http.StatusOK)
		tick := time.NewTicker(time.Second)
		defer tick.Stop()
		for {
			select {
			case <-r.Context().Done():
				return
			case <-tick.C:
				if _, err := w.Write([]byte(" ")); err != nil {
					return
				}
				w.(http.Flusher).Flush()
			}
		}
	})
	for range rounds {
		Eventually(slow.Load).WithContext(ctx).WithTimeout(timeout).Should(BeNumerically(">", 0))
		beside = append(beside, renew())
	}
	return quiet, beside
}
