package containers_test

import (
	"context"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pvbridge.io/e2e/deploy"
	pmemv1 "pvbridge.io/pkg/apis/pmem/v1alpha1"
	"pvbridge.io/pkg/qsd"
)

// TestReplicatedVolumeInRealContainers: the shipped node agents, in their containers, keep a
// volume of the shipped class pmem-replicated on both hosts. A pod on host-a appends synced
// records; every node agent's pod is deleted while it writes: the daemons that serve the
// volume (host-a's target, both hosts' replica servers) outlive their agents' containers, the
// writes go on, and no replica is faulted. Then a pod on host-b finds every record.
func TestReplicatedVolumeInRealContainers(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	mc := in.Mgmt.Client()
	cc, err := deploy.MgmtClient(in.Mgmt)
	g.Expect(err).NotTo(HaveOccurred())
	ns, err := deploy.CreateNamespace(ctx, mc, "replicated")
	g.Expect(err).NotTo(HaveOccurred())
	cleanupAfter(t, func(ctx context.Context) error {
		return mc.CoreV1().Namespaces().Delete(ctx, ns, metav1.DeleteOptions{})
	})

	_, err = mc.CoreV1().PersistentVolumeClaims(ns).Create(ctx, deploy.PVC(ns, "data", "pmem-replicated", "64Mi", false), metav1.CreateOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	writer := deploy.Pod(ns, "writer", "data", "host-a", false)
	// Each record synced before the next; the first failed write ends the pod.
	writer.Spec.Containers[0].Command = []string{"sh", "-c",
		"i=0; while i=$((i+1)) && echo $i >> /data/log && sync /data/log; do sleep 0.05; done; echo write $i failed; exit 1"}
	writer.Spec.RestartPolicy = corev1.RestartPolicyNever
	_, err = mc.CoreV1().Pods(ns).Create(ctx, writer, metav1.CreateOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	waitRunning(ctx, g, mc, ns, "writer")
	pvc, err := mc.CoreV1().PersistentVolumeClaims(ns).Get(ctx, "data", metav1.GetOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	pv, err := mc.CoreV1().PersistentVolumes().Get(ctx, pvc.Spec.VolumeName, metav1.GetOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	id := pv.Spec.CSI.VolumeHandle
	replicas := &pmemv1.PmemReplicaList{}
	g.Expect(cc.List(ctx, replicas, client.MatchingLabels{pmemv1.VolumeLabel: id})).To(Succeed())
	var hosts []string
	for _, r := range replicas.Items {
		hosts = append(hosts, r.Spec.Node)
		node, err := mc.CoreV1().Nodes().Get(ctx, r.Spec.Node, metav1.GetOptions{})
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(node.Status.Addresses).To(ContainElement(HaveField("Address", strings.Split(r.Status.Address, ":")[0])), "exported on its host's address")
	}
	g.Expect(hosts).To(ConsistOf("host-a", "host-b"))

	// records counts the lines of the log, read in host-a's namespace from the writer's mount.
	wp, err := mc.CoreV1().Pods(ns).Get(ctx, "writer", metav1.GetOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	records := func(g Gomega) int {
		n, err := syncedRecords(ctx, in.Hosts["host-a"], wp.UID, pv.Name)
		g.Expect(err).NotTo(HaveOccurred())
		return n
	}
	g.Eventually(records).WithContext(ctx).WithTimeout(time.Minute).Should(BeNumerically(">=", 20))
	daemons := map[string]qsd.Dir{
		"host-a's target":         qsd.Dir(in.Hosts["host-a"].HostPath(filepath.Join("/run/pvbridge/mgmt-csi/t", id))),
		"host-a's replica server": qsd.Dir(in.Hosts["host-a"].HostPath("/run/pvbridge/mgmt-csi/server")),
		"host-b's replica server": qsd.Dir(in.Hosts["host-b"].HostPath("/run/pvbridge/mgmt-csi/server")),
	}
	pids := map[string]int{}
	for name, d := range daemons {
		pid, err := qsd.Pid(d)
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(pid).NotTo(BeZero(), name)
		pids[name] = pid
	}

	t.Log("every node agent's pod deleted while the pod writes")
	agents := metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=mgmt-csi,app.kubernetes.io/component=node"}
	old, err := mc.CoreV1().Pods(deploy.InstallNamespace).List(ctx, agents)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(old.Items).To(HaveLen(2))
	start := time.Now()
	g.Expect(mc.CoreV1().Pods(deploy.InstallNamespace).DeleteCollection(ctx, metav1.DeleteOptions{}, agents)).To(Succeed())
	g.Eventually(func(g Gomega) {
		pods, err := mc.CoreV1().Pods(deploy.InstallNamespace).List(ctx, agents)
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(pods.Items).To(HaveLen(2))
		for _, p := range pods.Items {
			g.Expect(slices.ContainsFunc(old.Items, func(o corev1.Pod) bool { return o.UID == p.UID })).To(BeFalse(), "pod %s replaced", p.Name)
			g.Expect(p.Status.Conditions).To(ContainElement(And(HaveField("Type", corev1.PodReady), HaveField("Status", corev1.ConditionTrue))), "pod %s ready", p.Name)
		}
	}).WithContext(ctx).WithTimeout(3 * time.Minute).Should(Succeed())
	t.Logf("both node agents replaced and ready %.1f s after their deletion", time.Since(start).Seconds())
	before := records(g)
	g.Eventually(records).WithContext(ctx).WithTimeout(time.Minute).Should(BeNumerically(">", before), "the pod goes on writing")
	for name, d := range daemons {
		g.Expect(qsd.Pid(d)).To(Equal(pids[name]), "%s outlived its agent", name)
	}
	p, err := mc.CoreV1().Pods(ns).Get(ctx, "writer", metav1.GetOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(p.Status.Phase).To(Equal(corev1.PodRunning), "no write failed")
	vol := &pmemv1.PmemVolume{}
	g.Expect(cc.Get(ctx, client.ObjectKey{Name: id}, vol)).To(Succeed())
	g.Expect(meta.IsStatusConditionTrue(vol.Status.Conditions, pmemv1.DegradedCondition)).To(BeFalse(), "no replica faulted")
	events, err := mc.CoreV1().Events("").List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=" + id})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(events.Items).NotTo(ContainElement(HaveField("Type", corev1.EventTypeWarning)))

	t.Log("the writer stopped, a pod on host-b reads every record")
	written := records(g)
	g.Expect(mc.CoreV1().Pods(ns).Delete(ctx, "writer", metav1.DeleteOptions{})).To(Succeed())
	expectRecords(g, runToCompletion(ctx, g, mc, ns, "reader", "host-b", "cat /data/log"), written)
}
