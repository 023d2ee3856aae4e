package suite_test

import (
	"context"
	"encoding/binary"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"

	groupsnapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumegroupsnapshot/v1"
	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pvbridge.io/e2e/deploy"
	pmemv1 "pvbridge.io/pkg/apis/pmem/v1alpha1"
	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/pkg/tenancy"
)

// counter is an application that keeps one counter on two volumes, in order: it writes n to
// volume a and makes it durable, then to volume b, then n+1 to a, and so on. Whatever instant a
// crash leaves, b is never ahead of a, and a is at most one ahead of b.
type counter struct {
	files [2]*os.File
	n     atomic.Uint64
	stop  chan struct{}
	done  sync.WaitGroup
	once  sync.Once
	err   error
}

// startCounter writes each volume's name ("a", "b") into it, then counts until stopped.
func startCounter(dirs [2]string) *counter {
	GinkgoHelper()
	c := &counter{stop: make(chan struct{})}
	for i, dir := range dirs {
		Expect(writeSynced(filepath.Join(dir, "name"), []byte{"ab"[i]})).To(Succeed())
		f, err := os.OpenFile(filepath.Join(dir, "counter"), os.O_CREATE|os.O_RDWR, 0o644)
		Expect(err).NotTo(HaveOccurred())
		c.files[i] = f
	}
	c.done.Add(1)
	go func() {
		defer c.done.Done()
		buf := make([]byte, 8)
		for n := uint64(1); ; n++ {
			select {
			case <-c.stop:
				return
			default:
			}
			binary.LittleEndian.PutUint64(buf, n)
			for _, f := range c.files {
				// One 8-byte write in one block, made durable before the other volume's.
				if _, err := f.WriteAt(buf, 0); err != nil {
					c.err = err
					return
				}
				if err := f.Sync(); err != nil {
					c.err = err
					return
				}
			}
			c.n.Store(n)
		}
	}()
	return c
}

// advance waits until the counter has counted by more than n from now.
func (c *counter) advance(ctx context.Context, n uint64) {
	GinkgoHelper()
	from := c.n.Load()
	Eventually(c.n.Load).WithContext(ctx).WithTimeout(timeout).Should(BeNumerically(">", from+n))
}

// finish stops the counter (once) and returns its last complete count.
func (c *counter) finish() uint64 {
	GinkgoHelper()
	c.once.Do(func() {
		close(c.stop)
		c.done.Wait()
		for _, f := range c.files {
			Expect(f.Close()).To(Succeed())
		}
	})
	Expect(c.err).NotTo(HaveOccurred())
	return c.n.Load()
}

// readCounter reads the volume's name and count in the pod's volume.
func (g *guestCluster) readCounter(pod *corev1.Pod, pv string) (string, uint64) {
	GinkgoHelper()
	name, err := os.ReadFile(filepath.Join(g.volumePath(pod, pv), "name"))
	Expect(err).NotTo(HaveOccurred())
	data, err := os.ReadFile(filepath.Join(g.volumePath(pod, pv), "counter"))
	Expect(err).NotTo(HaveOccurred())
	Expect(data).To(HaveLen(8))
	return string(name), binary.LittleEndian.Uint64(data)
}

// groupSnapshot creates VolumeGroupSnapshot name of the claims labelled app=<app> in guest g
// (the guest's class), deleted when the spec ends, and waits until it is ready; it returns its
// member VolumeSnapshots' names.
func (g *guestCluster) groupSnapshot(ctx context.Context, ns, name, app string) []string {
	GinkgoHelper()
	return g.readyGroup(ctx, g.newGroupSnapshot(ctx, ns, name, app))
}

// newGroupSnapshot creates VolumeGroupSnapshot name of the claims labelled app=<app> in guest g
// (the guest's class), deleted when the spec ends.
func (g *guestCluster) newGroupSnapshot(ctx context.Context, ns, name, app string) *groupsnapshotv1.VolumeGroupSnapshot {
	GinkgoHelper()
	vgs := &groupsnapshotv1.VolumeGroupSnapshot{
		ObjectMeta: metaName(ns, name),
		Spec: groupsnapshotv1.VolumeGroupSnapshotSpec{
			Source:                       groupsnapshotv1.VolumeGroupSnapshotSource{Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": app}}},
			VolumeGroupSnapshotClassName: ptr.To(deploy.SnapshotClassGuest),
		},
	}
	g.create(ctx, vgs)
	DeferCleanup(func(ctx SpecContext) {
		Expect(client.IgnoreNotFound(g.c.Delete(ctx, vgs))).To(Succeed())
		gone(ctx, g.c, vgs)
	})
	return vgs
}

// readyGroup waits until group snapshot vgs of guest g is ready and returns its two member
// VolumeSnapshots' names.
func (g *guestCluster) readyGroup(ctx context.Context, vgs *groupsnapshotv1.VolumeGroupSnapshot) []string {
	GinkgoHelper()
	ns := vgs.Namespace
	var members []string
	Eventually(func(g2 Gomega) {
		g2.Expect(g.c.Get(ctx, client.ObjectKeyFromObject(vgs), vgs)).To(Succeed())
		g2.Expect(vgs.Status).NotTo(BeNil())
		g2.Expect(vgs.Status.ReadyToUse).To(HaveValue(BeTrue()))
		snaps := &snapshotv1.VolumeSnapshotList{}
		g2.Expect(g.c.List(ctx, snaps, client.InNamespace(ns))).To(Succeed())
		members = nil
		for _, s := range snaps.Items {
			for _, ref := range s.OwnerReferences {
				if ref.UID == vgs.UID {
					members = append(members, s.Name)
				}
			}
		}
		g2.Expect(members).To(HaveLen(2))
	}).WithContext(ctx).WithTimeout(timeout).Should(Succeed())
	return members
}

// groupMembers counts the management cluster's PmemSnapshots of group members.
func groupMembers(ctx context.Context) int {
	GinkgoHelper()
	snaps := &pmemv1.PmemSnapshotList{}
	Expect(mc.List(ctx, snaps)).To(Succeed())
	n := 0
	for _, s := range snaps.Items {
		if s.Spec.Group != nil {
			n++
		}
	}
	return n
}

var _ = Describe("Group snapshots", Label("snapshot", "groupsnapshot"), func() {
	It("count their members against the tenant's snapshot quota before any is cut, and themselves against its group snapshot quota", Label("tenancy"), func(ctx SpecContext) {
		ns := alpha.namespace(ctx)
		for _, claim := range []string{"a", "b"} {
			pvc := deploy.PVC(ns, claim, "", "64Mi", false)
			pvc.Labels = map[string]string{"app": "pair"}
			alpha.create(ctx, pvc)
			alpha.runPod(ctx, ns, "use-"+claim, claim, "vm-1", false)
		}
		By("a quota of no VolumeSnapshots in the cluster's management namespace, as in the issue")
		q := quota(ctx, alpha.Options.Namespace, "no-snapshots", "count/volumesnapshots.snapshot.storage.k8s.io", "0")

		By("a group snapshot of two claims is refused with the numbers, and nothing is cut")
		cut := groupMembers(ctx)
		vgs := alpha.newGroupSnapshot(ctx, ns, "pair", "pair")
		// What the quota counts as used is the namespace's other snapshots, which earlier
		// specs' deletions may still be taking away.
		refusal := `a group snapshot of 2 members does not fit ResourceQuota ` + alpha.Options.Namespace +
			`/no-snapshots: \d+ of 0 VolumeSnapshots used, room for 0; no member is cut`
		alpha.refused(ctx, vgs, MatchRegexp(refusal))
		Expect(groupMembers(ctx)).To(BeNumerically("<=", cut), "no member was cut")

		By("with room again, the sidecars' retry takes it")
		Expect(mc.Delete(ctx, q)).To(Succeed())
		Expect(alpha.readyGroup(ctx, vgs)).To(HaveLen(2))

		By("a quota of group snapshots (the tenants controller's counts them too) refuses the next one")
		q = quota(ctx, alpha.Options.Namespace, "no-groups", "count/volumegroupsnapshots.groupsnapshot.storage.k8s.io", "0")
		next := alpha.newGroupSnapshot(ctx, ns, "pair-again", "pair")
		alpha.refused(ctx, next, ContainSubstring("exceeded quota: no-groups"))
		Expect(mc.Delete(ctx, q)).To(Succeed())
		Expect(alpha.readyGroup(ctx, next)).To(HaveLen(2))
	})

	It("hold no VM of another cluster: a member an admin lent to another cluster's VM stops the group, and nothing is cut", Label("tenancy"), func(ctx SpecContext) {
		ns := alpha.namespace(ctx)
		for _, claim := range []string{"own", "lent"} {
			pvc := deploy.PVC(ns, claim, "", "64Mi", false)
			pvc.Labels = map[string]string{"app": "lent"}
			alpha.create(ctx, pvc)
			alpha.create(ctx, deploy.Pod(ns, "use-"+claim, claim, "vm-1", false))
		}
		pods := []*corev1.Pod{alpha.running(ctx, ns, "use-own"), alpha.running(ctx, ns, "use-lent")}
		Expect(alpha.c.Delete(ctx, pods[0])).To(Succeed())
		alpha.deletePod(ctx, pods[1])
		_, pv := alpha.bound(ctx, ns, "lent")
		lent := mgmtClaim(ctx, alpha, pv)

		By("the platform admin lends alpha's claim to cluster gamma, whose VM on host-a plugs it")
		shared := client.MergeFrom(lent.DeepCopy())
		metav1.SetMetaDataAnnotation(&lent.ObjectMeta, tenancy.SharedWithAnnotation, "gamma")
		Expect(mc.Patch(ctx, lent, shared)).To(Succeed())
		gammaVM := &vmv1.VirtualMachine{
			ObjectMeta: metav1.ObjectMeta{Namespace: alpha.Options.Namespace, Name: "vm-gamma", Labels: map[string]string{tenancy.CAPIClusterNameLabel: "gamma"}},
			Spec: vmv1.VirtualMachineSpec{Host: "host-a", PowerState: vmv1.PowerStateOn, Volumes: []vmv1.VirtualMachineVolume{
				{Name: lent.Name, PersistentVolumeClaim: vmv1.PersistentVolumeClaimVolumeSource{ClaimName: lent.Name}},
			}},
		}
		Expect(mc.Create(ctx, gammaVM)).To(Succeed())
		DeferCleanup(func(ctx SpecContext) {
			Expect(client.IgnoreNotFound(mc.Delete(ctx, gammaVM))).To(Succeed())
			gone(ctx, mc, gammaVM)
		})
		Eventually(func(g Gomega) {
			g.Expect(mc.Get(ctx, client.ObjectKeyFromObject(gammaVM), gammaVM)).To(Succeed())
			g.Expect(gammaVM.Status.Volumes).To(ContainElement(HaveField("Attached", BeTrue())))
		}).WithContext(ctx).WithTimeout(timeout).Should(Succeed())

		By("alpha's group snapshot of both claims is refused by the hold, naming gamma's VM")
		vgs := alpha.newGroupSnapshot(ctx, ns, "lent", "lent")
		refusal := fmt.Sprintf(`volume of claim %s/%s (guest cluster alpha) is plugged into VM %s/vm-gamma of cluster "gamma": `+
			`a group snapshot holds only the VMs of the cluster that owns its volumes`, lent.Namespace, lent.Name, lent.Namespace)
		Eventually(func(g Gomega) {
			snaps := &pmemv1.PmemSnapshotList{}
			g.Expect(mc.List(ctx, snaps)).To(Succeed())
			var reasons []string
			for _, s := range snaps.Items {
				if c := meta.FindStatusCondition(s.Status.Conditions, pmemv1.ReadyCondition); s.Spec.Group != nil && c != nil && strings.Contains(c.Message, refusal) {
					reasons = append(reasons, c.Reason)
				}
			}
			g.Expect(reasons).To(HaveEach(Equal("WritersNotHeld"))) // mgmt-csi's agent.WritersNotHeldReason
			g.Expect(reasons).To(HaveLen(2), "both members say why, neither is cut")
		}).WithContext(ctx).WithTimeout(timeout).Should(Succeed())

		By("once gamma's VM lets the claim go, the retry takes the group")
		unplug := client.MergeFrom(gammaVM.DeepCopy())
		gammaVM.Spec.Volumes = nil
		Expect(mc.Patch(ctx, gammaVM, unplug)).To(Succeed())
		Expect(alpha.readyGroup(ctx, vgs)).To(HaveLen(2))
	})

	// Of replicated volumes (the class the tenants controller installs for a replicated
	// management class): each member is cut on the host whose VM writes, from the volume's
	// replica there, while the VM is held; restored into replicated claims read on the other
	// host, the two show one instant.
	It("cut a writer's two replicated volumes at one instant, from their replicas on the writer's host", Label("replication"), func(ctx SpecContext) {
		class := replicatedGuestClass(ctx, nil)
		ns := alpha.namespace(ctx)
		var dirs [2]string
		for i, claim := range []string{"a", "b"} {
			pvc := deploy.PVC(ns, claim, class, "64Mi", false)
			pvc.Labels = map[string]string{"app": "counter"}
			alpha.create(ctx, pvc)
			pod := alpha.runPod(ctx, ns, "count-"+claim, claim, "vm-1", false) // on host-a
			_, pv := alpha.bound(ctx, ns, claim)
			dirs[i] = alpha.volumePath(pod, pv.Name)
		}
		w := startCounter(dirs)
		DeferCleanup(func() { w.finish() })
		w.advance(ctx, 10)
		snaps := alpha.groupSnapshot(ctx, ns, "group", "counter")
		last := w.finish()
		cut := &pmemv1.PmemSnapshotList{}
		Expect(mc.List(ctx, cut)).To(Succeed())
		var replicas []string
		for _, m := range cut.Items {
			if m.Spec.Group != nil && m.Spec.Group.Size == 2 && m.Spec.SourceReplica != "" && m.Spec.Node == "host-a" {
				replicas = append(replicas, m.Spec.SourceReplica)
			}
		}
		Expect(replicas).To(HaveLen(2), "both members cut on host-a, each from its volume's replica there")

		counts := map[string]uint64{}
		for i, snap := range snaps {
			claim := fmt.Sprintf("restored-%d", i)
			pvc := deploy.PVC(ns, claim, class, "64Mi", false)
			pvc.Spec.DataSource = &corev1.TypedLocalObjectReference{APIGroup: ptr.To(snapshotv1.GroupName), Kind: "VolumeSnapshot", Name: snap}
			alpha.create(ctx, pvc)
			pod := alpha.runPod(ctx, ns, "read-"+claim, claim, "vm-2", false) // on host-b
			_, pv := alpha.bound(ctx, ns, claim)
			name, n := alpha.readCounter(pod, pv.Name)
			counts[name] = n
		}
		GinkgoWriter.Printf("replicated group: a=%d b=%d (the counter stopped at %d)\n", counts["a"], counts["b"], last)
		Expect(counts).To(HaveLen(2))
		Expect(counts["a"]).To(BeNumerically(">", 0))
		Expect(counts["b"]).To(BeNumerically("<=", counts["a"]), "b is never ahead of a")
		Expect(counts["a"]-counts["b"]).To(BeNumerically("<=", 1), "a is at most one ahead of b")
	})

	It("cut a writer's two volumes at one instant, which two snapshots do not", func(ctx SpecContext) {
		ns := alpha.namespace(ctx)
		var dirs [2]string
		for i, claim := range []string{"a", "b"} {
			pvc := deploy.PVC(ns, claim, "", "64Mi", false)
			pvc.Labels = map[string]string{"app": "counter"}
			alpha.create(ctx, pvc)
			pod := alpha.runPod(ctx, ns, "count-"+claim, claim, "vm-1", false)
			_, pv := alpha.bound(ctx, ns, claim)
			dirs[i] = alpha.volumePath(pod, pv.Name)
		}
		w := startCounter(dirs)
		DeferCleanup(func() { w.finish() })

		By("taking three group snapshots while the counter runs")
		sources := map[string]string{} // restored claim → the snapshot it restores
		for i := range 3 {
			w.advance(ctx, 10)
			for j, member := range alpha.groupSnapshot(ctx, ns, fmt.Sprintf("group-%d", i), "counter") {
				sources[fmt.Sprintf("group-%d-%d", i, j)] = member
			}
		}
		By("and, as a control, a snapshot of a then one of b")
		w.advance(ctx, 10)
		alpha.readySnapshot(ctx, alpha.snapshot(ctx, ns, "only-a", "a"))
		w.advance(ctx, 2) // so that b's is cut after a count a's does not have
		alpha.readySnapshot(ctx, alpha.snapshot(ctx, ns, "only-b", "b"))
		sources["separate-a"], sources["separate-b"] = "only-a", "only-b"
		last := w.finish()

		By("restoring every snapshot, on the host of its source")
		for claim, snap := range sources {
			pvc := deploy.PVC(ns, claim, "", "64Mi", false)
			pvc.Spec.DataSource = &corev1.TypedLocalObjectReference{APIGroup: ptr.To(snapshotv1.GroupName), Kind: "VolumeSnapshot", Name: snap}
			alpha.create(ctx, pvc)
			alpha.create(ctx, deploy.Pod(ns, "read-"+claim, claim, "vm-3", false))
		}
		counts := map[string]map[string]uint64{} // group → volume name → count
		for claim := range sources {
			pod := alpha.running(ctx, ns, "read-"+claim)
			_, pv := alpha.bound(ctx, ns, claim)
			name, n := alpha.readCounter(pod, pv.Name)
			group := claim[:len(claim)-2] // group-<i>, or separate
			if counts[group] == nil {
				counts[group] = map[string]uint64{}
			}
			counts[group][name] = n
		}
		for group, c := range counts {
			GinkgoWriter.Printf("%s: a=%d b=%d (the counter stopped at %d)\n", group, c["a"], c["b"], last)
			Expect(c).To(HaveLen(2), "%s restores both volumes", group)
			if group == "separate" {
				Expect(c["b"]).To(BeNumerically(">", c["a"]), "two snapshots, one after the other, show b ahead of a: the check can fail")
				continue
			}
			Expect(c["a"]).To(BeNumerically(">", 0), group)
			Expect(c["b"]).To(BeNumerically("<=", c["a"]), "%s: b is never ahead of a", group)
			Expect(c["a"]-c["b"]).To(BeNumerically("<=", 1), "%s: a is at most one ahead of b", group)
		}

		By("reporting how long the writers were held")
		snaps := &pmemv1.PmemSnapshotList{}
		Expect(mc.List(ctx, snaps)).To(Succeed())
		held := 0
		for _, s := range snaps.Items {
			if s.Spec.Group == nil {
				continue
			}
			ready := meta.FindStatusCondition(s.Status.Conditions, pmemv1.ReadyCondition)
			Expect(ready).NotTo(BeNil())
			GinkgoWriter.Printf("%s (%s): %s\n", s.Name, s.Spec.Group.ID, ready.Message)
			if ready.Status == metav1.ConditionTrue && len(ready.Message) > 0 {
				Expect(ready.Message).To(ContainSubstring("while the writers of its volume were held for"))
				held++
			}
		}
		Expect(held).To(BeNumerically(">=", 6), "every member of the three groups was cut with its writers held")
	})
})
