package suite_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pvbridge.io/e2e/deploy"
	pmemv1 "pvbridge.io/pkg/apis/pmem/v1alpha1"
	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/pkg/names"
	"pvbridge.io/pkg/qsd"
	"pvbridge.io/pkg/tenancy"
)

var _ = Describe("Replicated volumes", Label("replication"), func() {
	// A management claim of two replicas: served on either host through a target over both
	// replicas, so a pod finds its data on the other host; and, once one host's replica
	// server dies under a writer, the writes go on, that replica is faulted, never served
	// again, and replaced by one that the serving host copies the volume into.
	It("serves a volume on every host, goes on without a replica that missed writes, and rebuilds one", func(ctx SpecContext) {
		ns := mgmtNamespace(ctx)
		Expect(mc.Create(ctx, deploy.PVC(ns, "data", deploy.StorageClassPmemReplicated, "64Mi", false))).To(Succeed())

		By("a pod on host-a writes; a pod on host-b reads it from its own replica, once host-a let go of the volume")
		first := mgmtPod(ctx, ns, "first", "host-a")
		pv := boundMgmtPV(ctx, ns, "data")
		Expect(pv.Spec.NodeAffinity).To(BeNil(), "a replicated volume is bound to no host")
		replicas := replicasOf(ctx, pv.Spec.CSI.VolumeHandle)
		Expect(replicas).To(HaveLen(2))
		Expect([]string{replicas[0].Spec.Node, replicas[1].Spec.Node}).To(ConsistOf("host-a", "host-b"))
		Expect(writeSynced(filepath.Join(mgmtVolumePath(first, pv.Name), "data"), []byte("before"))).To(Succeed())
		deleteMgmtPod(ctx, first)
		second := mgmtPod(ctx, ns, "second", "host-b")
		Expect(os.ReadFile(filepath.Join(mgmtVolumePath(second, pv.Name), "data"))).To(BeEquivalentTo("before"))

		By("host-a's replica server dies; the writer on host-b goes on")
		server := qsd.Dir(filepath.Join(mgmtHost("host-a").RunDir, "server"))
		Expect(qsd.Kill(ctx, server)).To(Succeed())
		Expect(writeSynced(filepath.Join(mgmtVolumePath(second, pv.Name), "data"), []byte("after"))).To(Succeed())
		By("host-a's replica is faulted, the volume says so, and the replica is replaced: host-b, which serves the volume, copies the volume into the new one")
		var faulted string
		for _, r := range replicas {
			if r.Spec.Node == "host-a" {
				faulted = r.Name
			}
		}
		Eventually(func(g Gomega) {
			l := &corev1.EventList{}
			g.Expect(mc.List(ctx, l)).To(Succeed())
			g.Expect(l.Items).To(ContainElement(And(
				HaveField("InvolvedObject.Name", pv.Spec.CSI.VolumeHandle), HaveField("Reason", pmemv1.ReplicaFaultedReason),
				HaveField("Message", ContainSubstring(faulted)))), "a Warning Event names the faulted replica")
			var nodes []string
			for _, r := range replicasOf(ctx, pv.Spec.CSI.VolumeHandle) {
				g.Expect(r.Name).NotTo(Equal(faulted), "the faulted replica is replaced and deleted")
				g.Expect(r.Spec.Rebuild).To(Equal(r.Spec.Node == "host-a"), "host-a's new replica is one to rebuild")
				if r.Spec.Rebuild {
					g.Expect(meta.IsStatusConditionTrue(r.Status.Conditions, pmemv1.InSyncCondition)).To(BeTrue(), "rebuilt")
				}
				nodes = append(nodes, r.Spec.Node)
			}
			g.Expect(nodes).To(ConsistOf("host-a", "host-b"), "the only host without a live replica takes the new one")
			vol := &pmemv1.PmemVolume{}
			g.Expect(mc.Get(ctx, client.ObjectKey{Name: pv.Spec.CSI.VolumeHandle}, vol)).To(Succeed())
			g.Expect(meta.FindStatusCondition(vol.Status.Conditions, pmemv1.DegradedCondition)).To(HaveField("Status", metav1.ConditionFalse), "whole again")
		}).WithContext(ctx).WithTimeout(timeout).Should(Succeed())

		By("back on host-a, the pod reads the write the faulted replica missed, from the rebuilt one")
		deleteMgmtPod(ctx, second)
		third := mgmtPod(ctx, ns, "third", "host-a")
		Expect(os.ReadFile(filepath.Join(mgmtVolumePath(third, pv.Name), "data"))).To(BeEquivalentTo("after"))
	})

	// A replicated volume grows only while no node serves it (QEMU 7.2's quorum cannot resize,
	// and a replica's export keeps the size it was made with): asked to grow while a pod uses
	// it, the resize is refused, saying why, and retried; once the pod is gone each replica
	// grows and is exported again, and a pod on the other host finds its data on the larger
	// filesystem and fills it past the old size on both replicas.
	It("grows a replicated volume once no pod uses it", func(ctx SpecContext) {
		ns, first, pv := writtenReplicatedClaim(ctx, "first", "before")
		before := fsSize(mgmtVolumePath(first, pv.Name))
		pvc := &corev1.PersistentVolumeClaim{}
		Expect(mc.Get(ctx, client.ObjectKey{Namespace: ns, Name: "data"}, pvc)).To(Succeed())
		Expect(requestSize(ctx, mc, pvc, "128Mi")).To(Succeed())

		By("served on host-a: the resize is refused, saying why, and no replica grows")
		refusedWhileServed(ctx, ns, "data")
		for _, r := range replicasOf(ctx, pv.Spec.CSI.VolumeHandle) {
			Expect(r.Spec.Size.Cmp(resource.MustParse("64Mi"))).To(BeZero(), r.Name)
		}

		By("the pod gone, the replicas grow; a pod on host-b reads the data on the larger filesystem")
		deleteMgmtPod(ctx, first)
		grown(ctx, mc, pv, "128Mi")
		for _, r := range replicasOf(ctx, pv.Spec.CSI.VolumeHandle) {
			Expect(r.Status.AllocatedSize.Cmp(resource.MustParse("128Mi"))).To(BeNumerically(">=", 0), r.Name)
		}
		second := mgmtPod(ctx, ns, "second", "host-b")
		Expect(os.ReadFile(filepath.Join(mgmtVolumePath(second, pv.Name), "data"))).To(BeEquivalentTo("before"))
		Eventually(fsSize).WithArguments(mgmtVolumePath(second, pv.Name)).WithContext(ctx).WithTimeout(timeout).
			Should(BeNumerically(">", before+50<<20), "the filesystem grew")
		By("writes past the old size reach both replicas: none is faulted")
		Expect(writeSynced(filepath.Join(mgmtVolumePath(second, pv.Name), "more"), bytes.Repeat([]byte{'x'}, 80<<20))).To(Succeed())
		// A child's failed write is reported by the target's watch, within a second.
		Consistently(func(g Gomega) {
			for _, r := range replicasOf(ctx, pv.Spec.CSI.VolumeHandle) {
				g.Expect(r.Faulted()).To(BeFalse(), "%s: %v", r.Name, r.Status.Conditions)
			}
		}).WithContext(ctx).WithTimeout(5 * time.Second).Should(Succeed())
	})

	// A snapshot of a replicated volume is cut from one of its replicas; a replicated volume
	// restored from it starts with a replica made from the snapshot, on the snapshot's host,
	// and the other is rebuilt by the host that serves it. A clone is copied from a replica
	// the same way.
	It("snapshots a replicated volume, restores it into one served on another host, and clones it", func(ctx SpecContext) {
		ns, writer, pv := writtenReplicatedClaim(ctx, "writer", "before the snapshot")
		readySnapshot(ctx, mc, snapshotOf(ctx, mc, ns, "snap", "data", deploy.SnapshotClassPmem))
		Expect(writeSynced(filepath.Join(mgmtVolumePath(writer, pv.Name), "data"), []byte("after the snapshot"))).To(Succeed())

		By("restored into a replicated claim, read on host-b, which rebuilds the restored volume's other replica")
		restored := deploy.PVC(ns, "restored", deploy.StorageClassPmemReplicated, "64Mi", false)
		restored.Spec.DataSource = &corev1.TypedLocalObjectReference{APIGroup: ptr.To(snapshotv1.GroupName), Kind: "VolumeSnapshot", Name: "snap"}
		Expect(mc.Create(ctx, restored)).To(Succeed())
		reader := mgmtPodOf(ctx, ns, "reader", "restored", "host-b")
		rpv := boundMgmtPV(ctx, ns, "restored")
		Expect(os.ReadFile(filepath.Join(mgmtVolumePath(reader, rpv.Name), "data"))).To(BeEquivalentTo("before the snapshot"))
		expectReplicasOn(ctx, rpv.Spec.CSI.VolumeHandle, "host-a", "host-b")

		By("its rebuilt replica serves the same data on host-a")
		deleteMgmtPod(ctx, reader)
		again := mgmtPodOf(ctx, ns, "again", "restored", "host-a")
		Expect(os.ReadFile(filepath.Join(mgmtVolumePath(again, rpv.Name), "data"))).To(BeEquivalentTo("before the snapshot"))
		deleteMgmtPod(ctx, again)

		By("cloned while its pod runs, into a replicated claim read on host-b and into a claim of one replica on the node of the replica it is copied from")
		source := replicasOf(ctx, pv.Spec.CSI.VolumeHandle)
		slices.SortFunc(source, func(a, b pmemv1.PmemReplica) int { return strings.Compare(a.Name, b.Name) })
		for _, c := range []struct{ claim, class, node string }{
			{"clone", deploy.StorageClassPmemReplicated, "host-b"},
			{"plain", deploy.StorageClassPmem, source[0].Spec.Node},
		} {
			clone := deploy.PVC(ns, c.claim, c.class, "64Mi", false)
			clone.Spec.DataSource = &corev1.TypedLocalObjectReference{Kind: "PersistentVolumeClaim", Name: "data"}
			Expect(mc.Create(ctx, clone)).To(Succeed())
			pod := mgmtPodOf(ctx, ns, c.claim, c.claim, c.node)
			cpv := boundMgmtPV(ctx, ns, c.claim)
			Expect(os.ReadFile(filepath.Join(mgmtVolumePath(pod, cpv.Name), "data"))).To(BeEquivalentTo("after the snapshot"), c.claim)
			deleteMgmtPod(ctx, pod)
		}
		deleteMgmtPod(ctx, writer)
	})

	// A guest class of a replicated management class (parameter replicated, as the tenants
	// controller installs it): its guest PVs have no host topology, so a pod moves to a VM of
	// another host and finds its data there. Resized while that pod runs, the guest claim grows
	// once the pod is gone (its management claim says why it waits), and the next pod finds
	// the data on the larger filesystem.
	It("moves a guest pod with its volume to a VM of another host, and grows the volume once no pod uses it", func(ctx SpecContext) {
		// xfs: ext4 cannot grow while mounted without CAP_SYS_RESOURCE, which the lab lacks.
		replicatedGuestClass(ctx, map[string]string{"csi.storage.k8s.io/fstype": "xfs"})
		ns := alpha.namespace(ctx)
		alpha.create(ctx, deploy.PVC(ns, "data", "pvbridge-replicated", "320Mi", false))
		first := alpha.runPod(ctx, ns, "first", "data", "vm-1", false) // on host-a
		pvc, pv := alpha.bound(ctx, ns, "data")
		Expect(pv.Spec.NodeAffinity).To(BeNil(), "a guest volume of a replicated class is bound to no host")
		mpv := &corev1.PersistentVolume{}
		Expect(mc.Get(ctx, client.ObjectKey{Name: mgmtClaim(ctx, alpha, pv).Spec.VolumeName}, mpv)).To(Succeed())
		replicas := replicasOf(ctx, mpv.Spec.CSI.VolumeHandle)
		Expect(replicas).To(HaveLen(2))
		Expect([]string{replicas[0].Spec.Node, replicas[1].Spec.Node}).To(ConsistOf("host-a", "host-b"))
		sum := alpha.writeBlob(first, pv.Name, 5)

		By("the pod moves to vm-2, on host-b")
		alpha.deletePod(ctx, first)
		second := alpha.runPod(ctx, ns, "second", "data", "vm-2", false)
		Expect(alpha.readBlob(second, pv.Name)).To(Equal(sum))
		vol := &pmemv1.PmemVolume{}
		Expect(mc.Get(ctx, client.ObjectKey{Name: mpv.Spec.CSI.VolumeHandle}, vol)).To(Succeed())
		Expect(vol.Status.Target).To(Equal("host-b"), "host-b serves the volume now")

		By("resized while the pod runs, it grows once the pod is gone; a pod on vm-1 finds the data on the larger filesystem")
		Expect(requestSize(ctx, alpha.c, pvc, "512Mi")).To(Succeed())
		mclaim := mgmtClaim(ctx, alpha, pv)
		refusedWhileServed(ctx, mclaim.Namespace, mclaim.Name)
		before := fsSize(alpha.volumePath(second, pv.Name))
		alpha.deletePod(ctx, second)
		grown(ctx, alpha.c, pv, "512Mi")
		third := alpha.runPod(ctx, ns, "third", "data", "vm-1", false)
		Expect(alpha.readBlob(third, pv.Name)).To(Equal(sum))
		Eventually(fsSize).WithArguments(alpha.volumePath(third, pv.Name)).WithContext(ctx).WithTimeout(timeout).
			Should(BeNumerically(">", before+150<<20), "the filesystem in the guest grew")
	})
})

var _ = Describe("Host loss", Label("replication", "disruptive"), func() {
	// A pod on host-a appends numbered records to a replicated volume, each synced before the
	// test (outside the cluster) counts it as acknowledged; host-a loses its power. Declared
	// lost (the out-of-service taint), its volume is taken over by host-b, whose pod finds
	// every acknowledged record; host-a comes back as a new machine (an empty PMEM region)
	// and takes a new replica, which host-b rebuilds. The process lab's host-a also runs guest
	// VMs (vm-operator's, which every spec shares): they are not part of the loss.
	It("loses no acknowledged write when the host that serves a volume dies, and rebuilds its replica on the host's replacement", func(ctx SpecContext) {
		ns := mgmtNamespace(ctx)
		Expect(mc.Create(ctx, deploy.PVC(ns, "data", deploy.StorageClassPmemReplicated, "64Mi", false))).To(Succeed())
		writer := mgmtPod(ctx, ns, "writer", "host-a")
		pv := boundMgmtPV(ctx, ns, "data")
		id := pv.Spec.CSI.VolumeHandle
		var lostReplica string
		for _, r := range replicasOf(ctx, id) {
			if r.Spec.Node == "host-a" {
				lostReplica = r.Name
			}
		}
		Expect(lostReplica).NotTo(BeEmpty(), "a replica on host-a")
		log := filepath.Join(mgmtVolumePath(writer, pv.Name), "log")
		records := appendRecords(log)
		Eventually(records.acked).WithContext(ctx).WithTimeout(timeout).Should(BeNumerically(">=", 20))

		By("host-a loses its power while the pod writes")
		start := time.Now()
		Expect(mgmt.PowerOff("host-a")).To(Succeed())
		DeferCleanup(func(ctx SpecContext) { // whatever the spec's outcome, the lab gets its host back
			if mgmt.Host("host-a").Agent.Exited() {
				Expect(mgmt.ReplaceHost(ctx, "host-a")).To(Succeed())
			}
			outOfService(ctx, "host-a", false)
		}, NodeTimeout(timeout))
		Eventually(records.done).WithContext(ctx).WithTimeout(timeout).Should(BeClosed(), "the writer's next sync fails")
		acked := records.acked()
		GinkgoWriter.Printf("acknowledged before the loss: %d records (%v)\n", acked, records.err)

		By("declared lost, host-a's volume is taken over by host-b, whose pod finds every acknowledged record")
		outOfService(ctx, "host-a", true)
		Expect(mc.Delete(ctx, writer, client.GracePeriodSeconds(0))).To(Succeed()) // as an admin does on a dead node
		gone(ctx, mc, writer)
		after := mgmtPod(ctx, ns, "after", "host-b")
		log = filepath.Join(mgmtVolumePath(after, pv.Name), "log")
		expectRecords(log, acked)
		more := appendRecords(log)
		found := more.acked() // a record written but not yet synced may have made it too
		Eventually(more.acked).WithContext(ctx).WithTimeout(timeout).Should(BeNumerically(">", found))
		failover := time.Since(start)
		more.stop()
		AddReportEntry("failover", fmt.Sprintf("host-a powered off → host-b's pod writing again: %.1f s (%d records acknowledged before, %d found)", failover.Seconds(), acked, found))
		expectRecords(log, more.acked())
		vol := &pmemv1.PmemVolume{}
		Expect(mc.Get(ctx, client.ObjectKey{Name: id}, vol)).To(Succeed())
		Expect(vol.Status.Target).To(Equal("host-b"))
		Eventually(func(g Gomega) {
			g.Expect(mc.Get(ctx, client.ObjectKey{Name: id}, vol)).To(Succeed())
			g.Expect(meta.FindStatusCondition(vol.Status.Conditions, pmemv1.DegradedCondition)).To(And(
				HaveField("Status", metav1.ConditionTrue), HaveField("Message", ContainSubstring(lostReplica))),
				"degraded: no host but the lost one can take a new replica")
		}).WithContext(ctx).WithTimeout(timeout).Should(Succeed())

		By("host-a comes back as a new machine, takes a new replica and host-b rebuilds it")
		Expect(mgmt.ReplaceHost(ctx, "host-a")).To(Succeed())
		outOfService(ctx, "host-a", false)
		Eventually(func(g Gomega) {
			var nodes []string
			for _, r := range replicasOf(ctx, id) {
				g.Expect(r.Name).NotTo(Equal(lostReplica))
				if r.Spec.Rebuild {
					g.Expect(meta.IsStatusConditionTrue(r.Status.Conditions, pmemv1.InSyncCondition)).To(BeTrue(), "rebuilt")
				}
				nodes = append(nodes, r.Spec.Node)
			}
			g.Expect(nodes).To(ConsistOf("host-a", "host-b"))
			g.Expect(mc.Get(ctx, client.ObjectKey{Name: id}, vol)).To(Succeed())
			g.Expect(meta.FindStatusCondition(vol.Status.Conditions, pmemv1.DegradedCondition)).To(HaveField("Status", metav1.ConditionFalse), "whole again")
		}).WithContext(ctx).WithTimeout(timeout).Should(Succeed())

		By("a pod on the new host-a reads every record from its own, rebuilt, replica")
		deleteMgmtPod(ctx, after)
		back := mgmtPod(ctx, ns, "back", "host-a")
		expectRecords(filepath.Join(mgmtVolumePath(back, pv.Name), "log"), more.acked())
		deleteMgmtPod(ctx, back)
	})
})

var _ = Describe("Drain", Label("replication"), func() {
	// Three hosts (host-c joins for the spec). A pod on host-b writes to a volume of two
	// replicas; the other replica's host is drained: its replica moves to the third host while
	// the pod writes. Undrained, the host takes the replica that host-b, drained in turn, gives
	// up, while the pod still writes there (from the two remote replicas). Then the pod moves
	// to a host with a replica and finds every record; unused, the volume leaves a drained
	// host too.
	It("moves a volume's replicas off drained hosts while its pod writes, and takes a host back", func(ctx SpecContext) {
		Expect(mgmt.AddHost(ctx, lab, "host-c")).To(Succeed())
		DeferCleanup(func(ctx SpecContext) { // after the namespace's, which deletes the volume
			Expect(mgmt.RemoveHost(ctx, "host-c")).To(Succeed())
		}, NodeTimeout(timeout))
		ns := mgmtNamespace(ctx)
		Expect(mc.Create(ctx, deploy.PVC(ns, "data", deploy.StorageClassPmemReplicated, "64Mi", false))).To(Succeed())
		writer := mgmtPod(ctx, ns, "writer", "host-b")
		pv := boundMgmtPV(ctx, ns, "data")
		id := pv.Spec.CSI.VolumeHandle
		var x string // the host of the replica besides host-b's
		for _, r := range replicasOf(ctx, id) {
			if r.Spec.Node != "host-b" {
				x = r.Spec.Node
			}
		}
		y := map[string]string{"host-a": "host-c", "host-c": "host-a"}[x]
		Expect(y).NotTo(BeEmpty(), "a replica on host-b and one on host-a or host-c")
		records := appendRecords(filepath.Join(mgmtVolumePath(writer, pv.Name), "log"))
		// writing checks that the writer goes on: more records than when it was last asked.
		last := 0
		writing := func() {
			GinkgoHelper()
			Eventually(records.acked).WithContext(ctx).WithTimeout(timeout).Should(BeNumerically(">", last))
			Expect(records.done()).NotTo(BeClosed(), "the writer saw no error: %v", records.err)
			last = records.acked()
		}
		writing()

		By("drained, " + x + " gives its replica up to " + y + " while the pod writes")
		drain(ctx, x, true)
		expectReplicasOn(ctx, id, "host-b", y)
		writing()
		out, code := kubectlPvbridge(ctx, "hosts", "--kubeconfig="+mgmt.CP.Kubeconfig)
		Expect(code).To(Equal(0), "%s", out)
		Expect(out).To(MatchRegexp(`(?m)^%s +Ready,Drained +file +\S+ +\S+ +\d+ +0 `, x), "the drained host holds no replica")
		Expect(out).To(MatchRegexp(`(?m)^%s +Ready +file +\S+ +\S+ +\d+ +[1-9]\d* `, y), "its replacement holds one")

		By(x + ", undrained, takes host-b's replica while the pod on host-b writes from the two remote ones")
		drain(ctx, x, false)
		Expect(drain(ctx, "host-b", true)).To(MatchRegexp(`(?m)^replicas on host-b +0$`), "and it names the VMs that still run there")
		expectReplicasOn(ctx, id, x, y)
		writing()
		records.stop()
		vol := &pmemv1.PmemVolume{}
		Expect(mc.Get(ctx, client.ObjectKey{Name: id}, vol)).To(Succeed())
		Expect(vol.Status.Target).To(Equal("host-b"), "host-b still serves the volume")
		l := &corev1.EventList{}
		Expect(mc.List(ctx, l)).To(Succeed())
		Expect(l.Items).NotTo(ContainElement(And(HaveField("InvolvedObject.Name", id), HaveField("Type", corev1.EventTypeWarning))), "a drain degrades nothing")

		By("the pod moves to " + x + " and finds every record")
		deleteMgmtPod(ctx, writer)
		drain(ctx, "host-b", false)
		moved := mgmtPod(ctx, ns, "moved", x)
		expectRecords(filepath.Join(mgmtVolumePath(moved, pv.Name), "log"), records.acked())
		deleteMgmtPod(ctx, moved)

		By("no pod uses the volume: drained again, " + x + " gives its replica up to host-b, which serves the volume for the copy")
		drain(ctx, x, true)
		expectReplicasOn(ctx, id, "host-b", y)
		Eventually(func(g Gomega) {
			g.Expect(mc.Get(ctx, client.ObjectKey{Name: id}, vol)).To(Succeed())
			g.Expect(vol.Status.Target).To(BeEmpty(), "let go after the copy")
		}).WithContext(ctx).WithTimeout(timeout).Should(Succeed())
		final := mgmtPod(ctx, ns, "final", y)
		expectRecords(filepath.Join(mgmtVolumePath(final, pv.Name), "log"), records.acked())
		deleteMgmtPod(ctx, final)
	})
})

// drain drains management host node with the operator CLI, `kubectl pvbridge drain-host`,
// which waits until the host holds no replica, or undoes the drain; it returns what the CLI
// printed. A drain is undone after the spec, whatever its outcome.
func drain(ctx context.Context, node string, on bool) string {
	GinkgoHelper()
	args := []string{"drain-host", node, "--kubeconfig=" + mgmt.CP.Kubeconfig, "--wait=" + timeout.String()}
	if !on {
		args = append(args, "--undo")
	} else {
		DeferCleanup(func(ctx SpecContext) { taint(ctx, node, corev1.Taint{Key: vmv1.DrainTaint}, false) })
	}
	out, code := kubectlPvbridge(ctx, args...)
	Expect(code).To(Equal(0), "%s", out)
	return out
}

// expectReplicasOn waits until volume id has its replicas, each with the data, on nodes and no
// other, and is not degraded.
func expectReplicasOn(ctx context.Context, id string, nodes ...string) {
	GinkgoHelper()
	Eventually(func(g Gomega) {
		var on []string
		for _, r := range replicasOf(ctx, id) {
			g.Expect(r.HasData()).To(BeTrue(), "replica %s on %s: rebuilt", r.Name, r.Spec.Node)
			on = append(on, r.Spec.Node)
		}
		g.Expect(on).To(ConsistOf(nodes))
		vol := &pmemv1.PmemVolume{}
		g.Expect(mc.Get(ctx, client.ObjectKey{Name: id}, vol)).To(Succeed())
		g.Expect(meta.FindStatusCondition(vol.Status.Conditions, pmemv1.DegradedCondition)).To(HaveField("Status", metav1.ConditionFalse))
	}).WithContext(ctx).WithTimeout(timeout).Should(Succeed())
}

// records appends numbered lines to a file, each synced before it counts as acknowledged.
type records struct {
	n    atomic.Int64
	quit chan struct{}
	end  chan struct{}
	err  error // why it ended, once end is closed
}

// appendRecords appends records to the file at path until a write or sync fails, or stop: first
// it counts the whole records the file has, and cuts a torn one off its end, as a database
// recovers its log; then it goes on from there.
func appendRecords(path string) *records {
	GinkgoHelper()
	data, err := os.ReadFile(path)
	if !os.IsNotExist(err) {
		Expect(err).NotTo(HaveOccurred())
	}
	whole := bytes.LastIndexByte(data, '\n') + 1
	from := bytes.Count(data[:whole], []byte("\n"))
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE, 0o644)
	Expect(err).NotTo(HaveOccurred())
	Expect(f.Truncate(int64(whole))).To(Succeed())
	_, err = f.Seek(int64(whole), io.SeekStart)
	Expect(err).NotTo(HaveOccurred())
	r := &records{quit: make(chan struct{}), end: make(chan struct{})}
	r.n.Store(int64(from))
	go func() {
		defer close(r.end)
		defer f.Close()
		// A paced writer: a synced write costs the targets CPU that the machine shares.
		pace := time.NewTicker(20 * time.Millisecond)
		defer pace.Stop()
		for i := from; ; i++ {
			if _, err := fmt.Fprintf(f, "%d\n", i); err != nil {
				r.err = err
				return
			}
			if err := f.Sync(); err != nil {
				r.err = err
				return
			}
			r.n.Store(int64(i + 1))
			select {
			case <-r.quit:
				return
			case <-pace.C:
			}
		}
	}()
	return r
}

// acked is how many records are acknowledged: records 0 to acked()-1.
func (r *records) acked() int { return int(r.n.Load()) }

// done is closed once the writer ended.
func (r *records) done() <-chan struct{} { return r.end }

// stop ends the writer and waits for it.
func (r *records) stop() {
	close(r.quit)
	<-r.end
}

// expectRecords checks that the file at path starts with records 0 to n-1, each whole, in order.
func expectRecords(path string, n int) {
	GinkgoHelper()
	data, err := os.ReadFile(path)
	Expect(err).NotTo(HaveOccurred())
	lines := strings.Split(string(data), "\n")
	Expect(len(lines)).To(BeNumerically(">", n), "acknowledged records lost")
	for i := range n {
		Expect(lines[i]).To(Equal(strconv.Itoa(i)), "record %d", i)
	}
}

// outOfService sets or removes Kubernetes' non-graceful shutdown taint of a Node: the mark of
// a host lost for good (vmv1.HostLost).
func outOfService(ctx context.Context, node string, on bool) {
	GinkgoHelper()
	taint(ctx, node, corev1.Taint{Key: corev1.TaintNodeOutOfService, Value: "nodeshutdown", Effect: corev1.TaintEffectNoExecute}, on)
}

// taint sets t on a Node, or removes the taints of its key.
func taint(ctx context.Context, node string, t corev1.Taint, on bool) {
	GinkgoHelper()
	n := &corev1.Node{}
	Expect(mc.Get(ctx, client.ObjectKey{Name: node}, n)).To(Succeed())
	patch := client.MergeFrom(n.DeepCopy())
	n.Spec.Taints = slices.DeleteFunc(n.Spec.Taints, func(o corev1.Taint) bool { return o.Key == t.Key })
	if on {
		n.Spec.Taints = append(n.Spec.Taints, t)
	}
	Expect(mc.Patch(ctx, n, patch)).To(Succeed())
}

// boundMgmtPV returns the PV bound to management claim ns/name.
func boundMgmtPV(ctx context.Context, ns, name string) *corev1.PersistentVolume {
	GinkgoHelper()
	pvc := &corev1.PersistentVolumeClaim{}
	Expect(mc.Get(ctx, client.ObjectKey{Namespace: ns, Name: name}, pvc)).To(Succeed())
	pv := &corev1.PersistentVolume{}
	Expect(mc.Get(ctx, client.ObjectKey{Name: pvc.Spec.VolumeName}, pv)).To(Succeed())
	return pv
}

// replicasOf lists the PmemReplicas of volume id.
func replicasOf(ctx context.Context, id string) []pmemv1.PmemReplica {
	GinkgoHelper()
	list := &pmemv1.PmemReplicaList{}
	Expect(mc.List(ctx, list, client.MatchingLabels{pmemv1.VolumeLabel: id})).To(Succeed())
	return list.Items
}

// mgmtPod runs a pod of claim "data" on management host node and waits until it runs.
func mgmtPod(ctx context.Context, ns, name, node string) *corev1.Pod {
	GinkgoHelper()
	return mgmtPodOf(ctx, ns, name, "data", node)
}

// replicatedGuestClass is the guest class of guest alpha that the tenants controller would
// install for the replicated management class, which it allows alpha: its parameter
// replicated, and the more parameters given.
func replicatedGuestClass(ctx context.Context, more map[string]string) string {
	GinkgoHelper()
	const name = "pvbridge-replicated"
	allowClass(ctx, alpha, tenancy.StorageClassesAnnotation, tenancy.ParamStorageClasses, deploy.StorageClassPmemReplicated)
	params := map[string]string{names.MgmtStorageClassParam: deploy.StorageClassPmemReplicated, names.ReplicatedParam: "true"}
	maps.Copy(params, more)
	storageClass(ctx, alpha.c, name, names.GuestDriver, corev1.PersistentVolumeReclaimDelete, params)
	return name
}

// refusedWhileServed waits until management claim ns/name has an Event of its resize refused
// while a node serves its replicated volume.
func refusedWhileServed(ctx context.Context, ns, name string) {
	GinkgoHelper()
	Eventually(events).WithContext(ctx).WithArguments(mc, ns, name).WithTimeout(timeout).
		Should(ContainElement(And(HavePrefix("VolumeResizeFailed: "), ContainSubstring("grows only while no node serves it"))))
}

// grown waits until pv of c's cluster has size.
func grown(ctx context.Context, c client.Client, pv *corev1.PersistentVolume, size string) {
	GinkgoHelper()
	Eventually(func(g Gomega) {
		g.Expect(c.Get(ctx, client.ObjectKeyFromObject(pv), pv)).To(Succeed())
		g.Expect(pv.Spec.Capacity.Storage().Cmp(resource.MustParse(size))).To(BeNumerically(">=", 0))
	}).WithContext(ctx).WithTimeout(timeout).Should(Succeed())
}

// writtenReplicatedClaim makes claim data of the replicated class in a new namespace and a pod
// of it on host-a, which writes content to the volume's file data, synced; it returns the
// namespace, the pod and the claim's PV.
func writtenReplicatedClaim(ctx context.Context, pod, content string) (string, *corev1.Pod, *corev1.PersistentVolume) {
	GinkgoHelper()
	ns := mgmtNamespace(ctx)
	Expect(mc.Create(ctx, deploy.PVC(ns, "data", deploy.StorageClassPmemReplicated, "64Mi", false))).To(Succeed())
	p := mgmtPod(ctx, ns, pod, "host-a")
	pv := boundMgmtPV(ctx, ns, "data")
	Expect(writeSynced(filepath.Join(mgmtVolumePath(p, pv.Name), "data"), []byte(content))).To(Succeed())
	return ns, p, pv
}

// mgmtPodOf runs a pod of claim on management host node and waits until it runs.
func mgmtPodOf(ctx context.Context, ns, name, claim, node string) *corev1.Pod {
	GinkgoHelper()
	pod := deploy.Pod(ns, name, claim, node, false)
	Expect(mc.Create(ctx, pod)).To(Succeed())
	Eventually(func(g Gomega) {
		g.Expect(mc.Get(ctx, client.ObjectKeyFromObject(pod), pod)).To(Succeed())
		g.Expect(pod.Status.Phase).To(Equal(corev1.PodRunning))
	}).WithContext(ctx).WithTimeout(timeout).Should(Succeed())
	return pod
}

// deleteMgmtPod deletes a management pod and waits until it is gone, its volume unstaged.
func deleteMgmtPod(ctx context.Context, pod *corev1.Pod) {
	GinkgoHelper()
	Expect(mc.Delete(ctx, pod)).To(Succeed())
	gone(ctx, mc, pod)
}

// mgmtVolumePath is where kubelet mounted the volume of PV pv for a management pod.
func mgmtVolumePath(pod *corev1.Pod, pv string) string {
	return deploy.PodVolumePath(mgmtHost(pod.Spec.NodeName).Node, pod.UID, pv, false)
}
