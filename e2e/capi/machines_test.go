package capi_test

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pvbridge.io/e2e/deploy"
	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/pkg/names"
)

// The Machine lifecycle steps work on a pool of workers of their own: a MachineDeployment whose
// Machines are all on one management host (its failure domain), as a platform spreads workers
// across hosts with one MachineDeployment per host. PMEM is local to a host, so a pod with
// volumes can only move to another worker of its volumes' host: a pool on one host is where
// Cluster API's drain, scale-down and replacement can move it.
const (
	poolHost  = "host-b"
	poolLabel = "node.cluster.x-k8s.io/pool" // a label Cluster API keeps on the Machine's Node
)

var (
	mdGVK       = schema.GroupVersionKind{Group: "cluster.x-k8s.io", Version: "v1beta2", Kind: "MachineDeployment"}
	clusterGVK  = schema.GroupVersionKind{Group: "cluster.x-k8s.io", Version: "v1beta2", Kind: "Cluster"}
	templateGVK = schema.GroupVersionKind{Group: "infrastructure.cluster.x-k8s.io", Version: "v1alpha1", Kind: "PVBridgeMachineTemplate"}
	// dbNamespace holds the StatefulSet db on the pool, which every lifecycle step moves.
	dbNamespace string
)

// machineHealthCheckWatchesTheWorkers: the template's MachineHealthCheck covers the workers of
// md-0 (not the steps' pool, nor the QEMU worker's) and finds each healthy.
func machineHealthCheckWatchesTheWorkers(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	mc := mgmtClient(g)
	mhc := &unstructured.Unstructured{}
	mhc.SetGroupVersionKind(schema.GroupVersionKind{Group: "cluster.x-k8s.io", Version: "v1beta2", Kind: "MachineHealthCheck"})
	g.Eventually(func(g Gomega) {
		g.Expect(mc.Get(ctx, client.ObjectKey{Namespace: in.Options.Guest.Namespace, Name: in.Options.Guest.Name + "-md-0"}, mhc)).To(Succeed())
		expected, _, _ := unstructured.NestedInt64(mhc.Object, "status", "expectedMachines")
		healthy, _, _ := unstructured.NestedInt64(mhc.Object, "status", "currentHealthy")
		g.Expect(expected).To(BeEquivalentTo(in.Options.Workers))
		g.Expect(healthy).To(Equal(expected))
	}).WithContext(ctx).WithTimeout(2 * time.Minute).Should(Succeed())
}

// poolName is the pool's MachineDeployment.
func poolName() string { return in.Options.Guest.Name + "-pool-b" }

// scaleDownMovesVolumes: a pool of two workers on host-b, a StatefulSet db of 3 with a volume
// each on it; the pool is scaled down by one, the worker to go being one with volumes
// (Cluster API's delete-machine annotation). Cluster API drains its Node, waits for its volumes
// to be detached and deletes the Machine; the provider powers the VM off and deletes it. The
// pods come back on the other worker with their data, and neither cluster keeps anything of
// the deleted worker.
func scaleDownMovesVolumes(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	mc := mgmtClient(g)
	g.Expect(mc.Create(ctx, machineDeployment(ctx, g, mc, 2))).To(Succeed())
	start := time.Now()
	waitPool(ctx, g, mc, poolName(), 2)
	t.Logf("pool of 2 workers on %s: both Machines Running with guest-csi on their Nodes %.0f s after the MachineDeployment's creation", poolHost, time.Since(start).Seconds())

	var err error
	dbNamespace, err = deploy.CreateNamespace(ctx, in.Guest.Client(), "db")
	g.Expect(err).NotTo(HaveOccurred())
	sts := deploy.StatefulSet(dbNamespace, "db", 3, "64Mi")
	sts.Spec.Template.Spec.NodeSelector = map[string]string{poolLabel: poolName()}
	_, err = in.Guest.Client().AppsV1().StatefulSets(dbNamespace).Create(ctx, sts, metav1.CreateOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	pods := waitPodsRunning(ctx, g, dbNamespace, "db", 3)
	writeNames(ctx, g, dbNamespace, pods)

	victim := pods[0].Spec.NodeName
	attached := guestAttachments(ctx, g, victim)
	patch := client.RawPatch(types.MergePatchType, []byte(`{"metadata":{"annotations":{"cluster.x-k8s.io/delete-machine":""}}}`))
	g.Expect(mc.Patch(ctx, machine(victim), patch)).To(Succeed())
	start = time.Now()
	g.Expect(mc.Patch(ctx, pool(), client.RawPatch(types.MergePatchType, []byte(`{"spec":{"replicas":1}}`)))).To(Succeed())
	waitGone(ctx, g, mc, victim)
	readNamesBack(ctx, g, waitPodsRunning(ctx, g, dbNamespace, "db", 3))
	t.Logf("scale-down: worker %s with %d volumes drained and deleted, its pods Running on the other worker with their data %.0f s after", victim, len(attached), time.Since(start).Seconds())
	g.Expect(waitPool(ctx, g, mc, poolName(), 1)).NotTo(ContainElement(victim))
}

// rollingReplacementMovesVolumes changes the pool's machine template, the way Cluster API
// rolls Machines out: a new worker joins, the old one is drained and deleted; the pods and
// their volumes move to the new worker with their data.
func rollingReplacementMovesVolumes(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	mc := mgmtClient(g)
	old := waitPool(ctx, g, mc, poolName(), 1)
	attached := guestAttachments(ctx, g, old[0])

	template := &unstructured.Unstructured{}
	template.SetGroupVersionKind(templateGVK)
	g.Expect(mc.Get(ctx, client.ObjectKey{Namespace: in.Options.Guest.Namespace, Name: in.Options.Guest.Name + "-md-0"}, template)).To(Succeed())
	next := &unstructured.Unstructured{Object: map[string]any{"spec": template.Object["spec"]}}
	next.SetGroupVersionKind(templateGVK)
	next.SetNamespace(template.GetNamespace())
	next.SetName(poolName() + "-v2")
	g.Expect(mc.Create(ctx, next)).To(Succeed())
	start := time.Now()
	patch := fmt.Sprintf(`{"spec":{"template":{"spec":{"infrastructureRef":{"name":%q}}}}}`, next.GetName())
	g.Expect(mc.Patch(ctx, pool(), client.RawPatch(types.MergePatchType, []byte(patch)))).To(Succeed())

	for _, name := range old {
		waitGone(ctx, g, mc, name)
	}
	workers := waitPool(ctx, g, mc, poolName(), 1)
	pods := waitPodsRunning(ctx, g, dbNamespace, "db", 3)
	readNamesBack(ctx, g, pods)
	for _, p := range pods {
		g.Expect(p.Spec.NodeName).To(Equal(workers[0]), "pod %s", p.Name)
	}
	t.Logf("rolling replacement: worker %s with %d volumes replaced by %s, its pods Running there with their data %.0f s after the template change", old[0], len(attached), workers[0], time.Since(start).Seconds())
}

// workerDeletedWhileAPodWrites: a pod on the pool appends numbered lines to its volume, each
// synced before the pod says so ("ack <n>"); its worker's Machine is deleted by hand. Cluster API
// drains it (the pod killed at once: no grace period), the MachineSet makes a new worker, the
// pod comes back there and goes on from the lines it finds; every line it acknowledged is there.
func workerDeletedWhileAPodWrites(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	mc := mgmtClient(g)
	c := in.Guest.Client()
	victim := waitPool(ctx, g, mc, poolName(), 1)[0]

	_, err := c.AppsV1().StatefulSets(dbNamespace).Create(ctx, ackingWriter(dbNamespace, poolName()), metav1.CreateOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	writer := waitPodsRunning(ctx, g, dbNamespace, "log", 1)[0]
	g.Eventually(lastAck).WithContext(ctx).WithArguments(writer).WithTimeout(time.Minute).Should(BeNumerically(">=", 10))

	start := time.Now()
	g.Expect(mc.Delete(ctx, machine(victim))).To(Succeed())
	// What the pod acknowledged until it was killed: its log, read until it is gone.
	acked := -1
	g.Eventually(func() error {
		n, err := lastAck(ctx, writer)
		acked = max(acked, n)
		return err
	}).WithContext(ctx).WithTimeout(5 * time.Minute).WithPolling(200 * time.Millisecond).Should(HaveOccurred())
	waitGone(ctx, g, mc, victim)
	back := waitPodsRunning(ctx, g, dbNamespace, "log", 1)[0]
	g.Expect(back.UID).NotTo(Equal(writer.UID))
	g.Eventually(lastAck).WithContext(ctx).WithArguments(back).WithTimeout(time.Minute).Should(BeNumerically(">", acked))
	t.Logf("worker %s deleted while a pod wrote: the pod writing again on %s %.0f s after, %d acknowledged lines before", victim, back.Spec.NodeName, time.Since(start).Seconds(), acked+1)

	expectAcknowledged(ctx, g, back, acked)
	readNamesBack(ctx, g, waitPodsRunning(ctx, g, dbNamespace, "db", 3))
}

// ackingWriter is a StatefulSet "log" of one pod on pool that appends numbered lines to its
// volume's /data/log, each synced before it says so in its log ("ack <n>", lastAck), going on
// from the lines it finds.
func ackingWriter(ns, pool string) *appsv1.StatefulSet {
	sts := deploy.StatefulSet(ns, "log", 1, "64Mi")
	sts.Spec.Template.Spec.NodeSelector = map[string]string{poolLabel: pool}
	sts.Spec.Template.Spec.Containers[0].Command = []string{"sh", "-c", `
n=$(wc -l < /data/log 2>/dev/null || echo 0)
while true; do echo $n >> /data/log && sync && echo ack $n; n=$((n+1)); sleep 0.2; done`}
	return sts
}

// expectAcknowledged checks that the log of ackingWriter's pod holds every line up to acked,
// and more: none acknowledged was lost, and the pod wrote on.
func expectAcknowledged(ctx context.Context, g Gomega, pod corev1.Pod, acked int) {
	out, err := kubectl(ctx, "exec", "-n", pod.Namespace, pod.Name, "--", "cat", "/data/log")
	g.Expect(err).NotTo(HaveOccurred())
	lines := strings.Split(out, "\n")
	g.Expect(len(lines)).To(BeNumerically(">", acked+1))
	for i := 0; i <= acked; i++ {
		g.Expect(lines[i]).To(Equal(strconv.Itoa(i)), "line %d of the log: an acknowledged write lost", i)
	}
}

// lastAck is the last line the writer pod acknowledged, from its log: -1 before the first.
func lastAck(ctx context.Context, pod corev1.Pod) (int, error) {
	out, err := in.Guest.Client().CoreV1().Pods(pod.Namespace).GetLogs(pod.Name, &corev1.PodLogOptions{TailLines: ptr.To[int64](1)}).DoRaw(ctx)
	if err != nil {
		return -1, err
	}
	current, err := in.Guest.Client().CoreV1().Pods(pod.Namespace).Get(ctx, pod.Name, metav1.GetOptions{})
	if err != nil || current.UID != pod.UID {
		return -1, fmt.Errorf("pod %s is gone (%w)", pod.Name, err)
	}
	n, ok := strings.CutPrefix(strings.TrimSpace(string(out)), "ack ")
	if !ok {
		return -1, nil
	}
	return strconv.Atoi(n)
}

// machineDeployment is the pool: replicas workers on poolHost made from the template's
// bootstrap and machine templates, their Nodes labelled with the pool's name.
func machineDeployment(ctx context.Context, g Gomega, mc client.Client, replicas int64) *unstructured.Unstructured {
	md0 := &unstructured.Unstructured{}
	md0.SetGroupVersionKind(mdGVK)
	g.Expect(mc.Get(ctx, client.ObjectKey{Namespace: in.Options.Guest.Namespace, Name: in.Options.Guest.Name + "-md-0"}, md0)).To(Succeed())
	spec, _, err := unstructured.NestedMap(md0.Object, "spec", "template", "spec")
	g.Expect(err).NotTo(HaveOccurred())
	spec["failureDomain"] = poolHost
	md := pool()
	md.Object["spec"] = map[string]any{
		"clusterName": in.Options.Guest.Name,
		"replicas":    replicas,
		"selector":    map[string]any{"matchLabels": map[string]any{}},
		"template": map[string]any{
			"metadata": map[string]any{"labels": map[string]any{poolLabel: poolName()}},
			"spec":     spec,
		},
	}
	return md
}

func pool() *unstructured.Unstructured {
	md := &unstructured.Unstructured{}
	md.SetGroupVersionKind(mdGVK)
	md.SetNamespace(in.Options.Guest.Namespace)
	md.SetName(poolName())
	return md
}

func machine(name string) *unstructured.Unstructured {
	m := &unstructured.Unstructured{}
	m.SetGroupVersionKind(deploy.MachineGVK)
	m.SetNamespace(in.Options.Guest.Namespace)
	m.SetName(name)
	return m
}

// machines lists the guest's Machines, those of MachineDeployment deployment if it is set.
func machines(ctx context.Context, g Gomega, mc client.Client, deployment string) []unstructured.Unstructured {
	list := &unstructured.UnstructuredList{}
	list.SetGroupVersionKind(deploy.MachineGVK)
	opts := []client.ListOption{client.InNamespace(in.Options.Guest.Namespace)}
	if deployment != "" {
		opts = append(opts, client.MatchingLabels{"cluster.x-k8s.io/deployment-name": deployment})
	}
	g.Expect(mc.List(ctx, list, opts...)).To(Succeed())
	return list.Items
}

// waitPool waits until the pool is n Machines, none being deleted, all Running with a Ready
// Node that has the pool's label, the pool's taints and no other (none of the kubelet's
// not-ready ones) and guest-csi registered, and returns their names (their Nodes' and VMs').
// Its bound is the QEMU worker's boot under TCG beside the other track on a loaded machine (885 s
// in a fresh `make test`).
func waitPool(ctx context.Context, g Gomega, mc client.Client, pool string, n int, taints ...corev1.Taint) []string {
	var workers []string
	g.Eventually(func(g Gomega) {
		workers = nil
		items := machines(ctx, g, mc, pool)
		g.Expect(items).To(HaveLen(n))
		for _, m := range items {
			g.Expect(m.GetDeletionTimestamp()).To(BeNil(), "Machine %s is being deleted", m.GetName())
			phase, _, _ := unstructured.NestedString(m.Object, "status", "phase")
			g.Expect(phase).To(Equal("Running"), "Machine %s", m.GetName())
			node, err := in.Guest.Client().CoreV1().Nodes().Get(ctx, m.GetName(), metav1.GetOptions{})
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(node.Labels).To(HaveKeyWithValue(poolLabel, pool))
			g.Expect(node.Spec.Taints).To(ConsistOf(taints), "Node %s", node.Name)
			csiNode, err := in.Guest.Client().StorageV1().CSINodes().Get(ctx, node.Name, metav1.GetOptions{})
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(csiNode.Spec.Drivers).To(ContainElement(HaveField("Name", names.GuestDriver)), "guest-csi on %s", node.Name)
			workers = append(workers, m.GetName())
		}
	}).WithContext(ctx).WithTimeout(25 * time.Minute).WithPolling(2 * time.Second).Should(Succeed())
	return slices.Sorted(slices.Values(workers))
}

// waitGone waits until nothing is left of worker name in either cluster: its Machine,
// VirtualMachine, running VM and the management VolumeAttachments of its volumes, its guest
// Node and the guest VolumeAttachments to it.
func waitGone(ctx context.Context, g Gomega, mc client.Client, name string) {
	ns := in.Options.Guest.Namespace
	g.Eventually(func(g Gomega) {
		g.Expect(apierrors.IsNotFound(mc.Get(ctx, client.ObjectKeyFromObject(machine(name)), machine(name)))).To(BeTrue(), "Machine %s", name)
		g.Expect(apierrors.IsNotFound(mc.Get(ctx, client.ObjectKey{Namespace: ns, Name: name}, &vmv1.VirtualMachine{}))).To(BeTrue(), "VirtualMachine %s", name)
		for host, vmm := range in.VMMs {
			vm, err := vmm.VM(ns, name)
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(vm).To(BeNil(), "VM %s runs on %s", name, host)
		}
		vas := &storagev1.VolumeAttachmentList{}
		g.Expect(mc.List(ctx, vas, client.MatchingLabels{vmv1.VMNamespaceLabel: vmv1.LabelValue(ns), vmv1.VMNameLabel: vmv1.LabelValue(name)})).To(Succeed())
		g.Expect(vas.Items).To(BeEmpty(), "management VolumeAttachments of VM %s", name)
		_, err := in.Guest.Client().CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
		g.Expect(apierrors.IsNotFound(err)).To(BeTrue(), "guest Node %s (%v)", name, err)
		g.Expect(guestAttachments(ctx, g, name)).To(BeEmpty(), "guest VolumeAttachments to %s", name)
	}).WithContext(ctx).WithTimeout(10 * time.Minute).WithPolling(2 * time.Second).Should(Succeed())
}

// guestAttachments are the guest's VolumeAttachments to node.
func guestAttachments(ctx context.Context, g Gomega, node string) []storagev1.VolumeAttachment {
	list, err := in.Guest.Client().StorageV1().VolumeAttachments().List(ctx, metav1.ListOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	return slices.DeleteFunc(list.Items, func(va storagev1.VolumeAttachment) bool { return va.Spec.NodeName != node })
}
