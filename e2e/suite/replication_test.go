package suite_test

import (
	"context"
	"os"
	"path/filepath"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pvbridge.io/e2e/deploy"
	pmemv1 "pvbridge.io/pkg/apis/pmem/v1alpha1"
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
		pvc := deploy.PVC(ns, "data", deploy.StorageClassPmemReplicated, "64Mi", false)
		Expect(mc.Create(ctx, pvc)).To(Succeed())

		By("a pod on host-a writes; a pod on host-b reads it from its own replica, once host-a let go of the volume")
		first := mgmtPod(ctx, ns, "first", "host-a")
		Expect(mc.Get(ctx, client.ObjectKeyFromObject(pvc), pvc)).To(Succeed())
		pv := &corev1.PersistentVolume{}
		Expect(mc.Get(ctx, client.ObjectKey{Name: pvc.Spec.VolumeName}, pv)).To(Succeed())
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

	// A guest class of a replicated management class (parameter replicated, as the tenants
	// controller installs it): its guest PVs have no host topology, so a pod moves to a VM of
	// another host and finds its data there.
	It("moves a guest pod with its volume to a VM of another host", func(ctx SpecContext) {
		allowClass(ctx, alpha, tenancy.StorageClassesAnnotation, tenancy.ParamStorageClasses, deploy.StorageClassPmemReplicated)
		storageClass(ctx, alpha.c, "pvbridge-replicated", names.GuestDriver, corev1.PersistentVolumeReclaimDelete,
			map[string]string{names.MgmtStorageClassParam: deploy.StorageClassPmemReplicated, names.ReplicatedParam: "true"})
		ns := alpha.namespace(ctx)
		alpha.create(ctx, deploy.PVC(ns, "data", "pvbridge-replicated", "64Mi", false))
		first := alpha.runPod(ctx, ns, "first", "data", "vm-1", false) // on host-a
		_, pv := alpha.bound(ctx, ns, "data")
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
	})
})

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
	pod := deploy.Pod(ns, name, "data", node, false)
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
