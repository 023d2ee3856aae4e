package capi_test

import (
	"context"
	"fmt"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	groupsnapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumegroupsnapshot/v1"
	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pvbridge.io/e2e/deploy"
	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/pkg/cgroups"
	"pvbridge.io/pkg/names"
	"pvbridge.io/pkg/qos"
	"pvbridge.io/pkg/tenancy"
)

// qemuHost runs pvbridge's host agent as shipped: its VMs are QEMU VMs booting the node image.
const qemuHost = "host-q"

// qemuPoolName is the MachineDeployment of the QEMU host's workers.
func qemuPoolName() string { return in.Options.Guest.Name + "-pool-q" }

// qemuTaint keeps the pods of the other track's steps off the QEMU worker.
var qemuTaint = corev1.Taint{Key: deploy.LabHypervisorLabel, Value: "qemu", Effect: corev1.TaintEffectNoSchedule}

// qemuWorkerRunsAStatefulSet: a pool of one worker on the QEMU host (deploy.CreateQEMUPool),
// tainted, beside the other track's steps. Its VM boots the node image under QEMU (TCG on this
// machine), cloud-init runs Cluster API's `kubeadm join`, and the Node is Ready with the
// Machine's providerID, its address from the VM's guest agent, the pool's taint and the shipped
// guest-csi node plugin. A StatefulSet pod on it appends to a PMEM volume hot-plugged into the
// VM (a virtio disk the guest's udev names by its serial) while the host agent is restarted and
// a group snapshot taken, a VolumeAttributesClass limits its throughput, the volume grows
// online, and the pod is deleted: its successor reads the data back and appends on. The pool is
// deleted: Cluster API drains the Node, the volume is unplugged, the VM powered off and deleted,
// and no QEMU is left on the host.
func qemuWorkerRunsAStatefulSet(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	mc := mgmtClient(g)
	start := time.Now()
	g.Expect(in.CreateQEMUPool(ctx, qemuPoolName(), 1, qemuTaint)).To(Succeed())
	worker := waitPool(ctx, g, mc, qemuPoolName(), 1, qemuTaint)[0]
	t.Logf("QEMU worker %s: MachineDeployment created → Machine Running, Node Ready with guest-csi in %.0f s (TCG, beside the other track)",
		worker, time.Since(start).Seconds())

	vm := &vmv1.VirtualMachine{}
	g.Expect(mc.Get(ctx, client.ObjectKey{Namespace: in.Options.Guest.Namespace, Name: worker}, vm)).To(Succeed())
	g.Expect(vm.Status.Host).To(Equal(qemuHost))
	node, err := in.Guest.Client().CoreV1().Nodes().Get(ctx, worker, metav1.GetOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	m := machine(worker)
	g.Expect(mc.Get(ctx, client.ObjectKeyFromObject(m), m)).To(Succeed())
	providerID, _, _ := unstructured.NestedString(m.Object, "spec", "providerID")
	g.Expect(node.Spec.ProviderID).To(And(Not(BeEmpty()), Equal(providerID)))
	g.Expect(node.Labels).To(HaveKeyWithValue(deploy.LabHypervisorLabel, "qemu"))
	g.Expect(vm.Status.Addresses).NotTo(BeEmpty())
	g.Expect(node.Status.Addresses).To(ContainElement(corev1.NodeAddress{Type: corev1.NodeInternalIP, Address: vm.Status.Addresses[0]}),
		"the kubelet's address is the one the VM's guest agent reports")

	ns, err := deploy.CreateNamespace(ctx, in.Guest.Client(), "qemu")
	g.Expect(err).NotTo(HaveOccurred())
	sts := deploy.StatefulSet(ns, "q", 1, "64Mi")
	onQEMUWorker(&sts.Spec.Template.Spec, map[string]string{poolLabel: qemuPoolName()})
	sts.Spec.Template.Spec.Containers[0].Command = []string{"sh", "-c", appendLog}
	start = time.Now()
	_, err = in.Guest.Client().AppsV1().StatefulSets(ns).Create(ctx, sts, metav1.CreateOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	pods := waitPodsRunning(ctx, g, ns, "q", 1)
	t.Logf("a StatefulSet pod with a new volume Running on the QEMU worker %.0f s after its creation", time.Since(start).Seconds())
	writeNames(ctx, g, ns, pods)
	// The volume is a virtio disk of the VM, which the guest's udev names by its serial.
	g.Expect(kubectl(ctx, "exec", "-n", ns, pods[0].Name, "--", "sh", "-c", "grep ' /data ' /proc/mounts | cut -d' ' -f1")).To(MatchRegexp(`^/dev/vd[a-z]+\n$`))
	g.Eventually(lastAck).WithContext(ctx).WithArguments(pods[0]).WithTimeout(2 * time.Minute).Should(BeNumerically(">=", 3))

	hostAgentRestartedWhileThePodWrites(t, g, pods[0])
	groupSnapshotWhileThePodWrites(t, g, pods[0])
	attributesClassLimitsTheWriter(t, g, pods[0])

	// Online expansion in the real guest: the claim grows, and so do the management volume, the
	// VM's disk (the host agent's block_resize) and the pod's ext4 (guest-csi's node expansion).
	before, err := fsKiB(ctx, ns, pods[0].Name)
	g.Expect(err).NotTo(HaveOccurred())
	claims := in.Guest.Client().CoreV1().PersistentVolumeClaims(ns)
	pvc, err := claims.Get(ctx, "data-"+pods[0].Name, metav1.GetOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	pvc.Spec.Resources.Requests[corev1.ResourceStorage] = resource.MustParse("128Mi")
	start = time.Now()
	_, err = claims.Update(ctx, pvc, metav1.UpdateOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	g.Eventually(fsKiB).WithArguments(ctx, ns, pods[0].Name).WithContext(ctx).WithTimeout(10*time.Minute).WithPolling(2*time.Second).
		Should(BeNumerically(">", before+40<<10), "the filesystem the pod sees grew")
	t.Logf("online expansion 64 → 128 MiB: the pod's ext4 in the QEMU guest grew %.0f s after the claim's update", time.Since(start).Seconds())

	g.Expect(in.Guest.Client().CoreV1().Pods(ns).Delete(ctx, pods[0].Name, metav1.DeleteOptions{})).To(Succeed())
	start = time.Now()
	g.Eventually(func() []any { return uids(waitPodsRunning(ctx, g, ns, "q", 1)) }).WithContext(ctx).
		WithTimeout(10 * time.Minute).WithPolling(time.Second).ShouldNot(ContainElement(pods[0].UID))
	back := waitPodsRunning(ctx, g, ns, "q", 1)
	readNamesBack(ctx, g, back)
	t.Logf("the pod deleted: its successor Running on the QEMU worker with its data %.0f s after", time.Since(start).Seconds())
	acked, err := lastAck(ctx, back[0])
	g.Expect(err).NotTo(HaveOccurred())
	g.Eventually(lastAck).WithContext(ctx).WithArguments(back[0]).WithTimeout(2*time.Minute).Should(BeNumerically(">", acked), "the successor appends to the log")
	g.Expect(logLines(ctx, g, ns, back[0].Name)).To(BeNumerically(">", acked))

	g.Expect(vmProcesses(g)).To(HaveLen(1), "the VM's QEMU, in its cgroup outside the host agent's")
	start = time.Now()
	md := &unstructured.Unstructured{}
	md.SetGroupVersionKind(mdGVK)
	md.SetNamespace(in.Options.Guest.Namespace)
	md.SetName(qemuPoolName())
	g.Expect(mc.Delete(ctx, md)).To(Succeed())
	waitGone(ctx, g, mc, worker)
	g.Expect(vmProcesses(g)).To(BeEmpty(), "QEMU processes left on %s", qemuHost)
	t.Logf("the pool deleted: the QEMU worker drained, its volume unplugged, its VM powered off and deleted %.0f s after", time.Since(start).Seconds())
	g.Expect(in.Guest.Client().AppsV1().StatefulSets(ns).Delete(ctx, "q", metav1.DeleteOptions{})).To(Succeed())
}

// vmProcesses lists the processes of the QEMU host's VM cgroups (the lab's --qemu-cgroup-parent).
func vmProcesses(g Gomega) []int {
	const root = "/sys/fs/cgroup"
	hierarchies, err := cgroups.Hierarchies(root)
	g.Expect(err).NotTo(HaveOccurred())
	parent := lab.Cgroup("vms-" + qemuHost)
	vms := map[string]bool{}
	for _, h := range hierarchies {
		dirs, _ := filepath.Glob(filepath.Join(h, parent, "*", "cgroup.procs"))
		for _, d := range dirs {
			vms[filepath.Base(filepath.Dir(d))] = true
		}
	}
	var pids []int
	for vm := range vms {
		p, err := cgroups.Pids(root, filepath.Join(parent, vm))
		g.Expect(err).NotTo(HaveOccurred())
		pids = append(pids, p...)
	}
	return pids
}

// appendLog is a writer's command: it appends numbered lines to /data/log, from the number of
// lines it finds, each synced before it says so ("ack <n>", lastAck), and exits at the first
// write or sync that fails (the container's restart count tells).
const appendLog = `n=$(wc -l < /data/log 2>/dev/null || echo 0)
while echo $n >> /data/log && sync; do echo ack $n; n=$((n+1)); sleep 0.2; done
exit 1`

// onQEMUWorker puts a pod on the QEMU pool's worker: nodeSelector, and the pool's taint tolerated.
func onQEMUWorker(spec *corev1.PodSpec, nodeSelector map[string]string) {
	spec.NodeSelector = nodeSelector
	spec.Tolerations = []corev1.Toleration{{Key: qemuTaint.Key, Value: qemuTaint.Value, Effect: qemuTaint.Effect}}
}

// hostAgentRestartedWhileThePodWrites: the QEMU host's agent pod is deleted while writer
// appends to its volume, and the DaemonSet starts another. The VM's QEMU is the same process
// throughout (it is in its own cgroup, outside the agent's container), the new agent adopts it
// by its QMP socket, and the writer never fails a write (its container never restarts) and
// goes on.
func hostAgentRestartedWhileThePodWrites(t *testing.T, g Gomega, writer corev1.Pod) {
	ctx := t.Context()
	agents := in.Mgmt.Client().CoreV1().Pods(deploy.InstallNamespace)
	agentOnHost := func(g Gomega) corev1.Pod {
		list, err := agents.List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/component=host-agent", FieldSelector: "spec.nodeName=" + qemuHost})
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(list.Items).To(HaveLen(1))
		return list.Items[0]
	}
	old := agentOnHost(g)
	qemus := vmProcesses(g)
	g.Expect(qemus).To(HaveLen(1))
	start := time.Now()
	g.Expect(agents.Delete(ctx, old.Name, metav1.DeleteOptions{})).To(Succeed())
	g.Eventually(func(g Gomega) {
		agent := agentOnHost(g)
		g.Expect(agent.UID).NotTo(Equal(old.UID))
		g.Expect(agent.Status.Conditions).To(ContainElement(And(HaveField("Type", corev1.PodReady), HaveField("Status", corev1.ConditionTrue))), "host agent %s", agent.Name)
	}).WithContext(ctx).WithTimeout(5 * time.Minute).WithPolling(time.Second).Should(Succeed())
	acked, err := lastAck(ctx, writer)
	g.Expect(err).NotTo(HaveOccurred())
	g.Eventually(lastAck).WithContext(ctx).WithArguments(writer).WithTimeout(2*time.Minute).Should(BeNumerically(">=", acked+3), "the writer goes on")
	g.Expect(vmProcesses(g)).To(Equal(qemus), "the VM's QEMU, the same process")
	g.Expect(restarts(ctx, g, writer)).To(BeZero(), "the writer's container exits at its first failed write")
	t.Logf("the QEMU host's agent restarted while a pod wrote: the new agent Ready %.0f s after, the VM's QEMU the same process, the writer's %d+ writes without an error", time.Since(start).Seconds(), acked+1)
}

// groupSnapshotWhileThePodWrites: a VolumeGroupSnapshot of the writer's claim in the guest,
// taken while it appends: the management host pauses the whole VM for the cut (the qemu
// driver's Freeze). The copy, restored to a claim of its own and mounted in a pod on the worker,
// holds every line the writer acknowledged before the snapshot was asked for, each line whole and
// in order, and the writer never failed a write.
func groupSnapshotWhileThePodWrites(t *testing.T, g Gomega, writer corev1.Pod) {
	ctx := t.Context()
	ns := writer.Namespace
	gc := guestClient(g)
	acked, err := lastAck(ctx, writer)
	g.Expect(err).NotTo(HaveOccurred())
	start := time.Now()
	vgs := &groupsnapshotv1.VolumeGroupSnapshot{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "q"},
		Spec: groupsnapshotv1.VolumeGroupSnapshotSpec{
			Source:                       groupsnapshotv1.VolumeGroupSnapshotSource{Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": "q"}}},
			VolumeGroupSnapshotClassName: ptr.To(deploy.SnapshotClassGuest),
		},
	}
	g.Expect(gc.Create(ctx, vgs)).To(Succeed())
	var member string
	g.Eventually(func(g Gomega) {
		g.Expect(gc.Get(ctx, client.ObjectKeyFromObject(vgs), vgs)).To(Succeed())
		g.Expect(vgs.Status).NotTo(BeNil())
		g.Expect(vgs.Status.ReadyToUse).To(HaveValue(BeTrue()), "error: %v", vgs.Status.Error) // one the controller retries
		snaps := &snapshotv1.VolumeSnapshotList{}
		g.Expect(gc.List(ctx, snaps, client.InNamespace(ns))).To(Succeed())
		members := slices.DeleteFunc(snaps.Items, func(s snapshotv1.VolumeSnapshot) bool {
			return !slices.ContainsFunc(s.OwnerReferences, func(ref metav1.OwnerReference) bool { return ref.UID == vgs.UID })
		})
		g.Expect(members).To(HaveLen(1))
		member = members[0].Name
	}).WithContext(ctx).WithTimeout(5 * time.Minute).WithPolling(time.Second).Should(Succeed())
	t.Logf("a group snapshot of the writer's volume ready %.0f s after it was asked for", time.Since(start).Seconds())

	restored := deploy.PVC(ns, "restored", "", "64Mi", false)
	restored.Spec.DataSource = &corev1.TypedLocalObjectReference{APIGroup: ptr.To(snapshotv1.GroupName), Kind: "VolumeSnapshot", Name: member}
	pod := deploy.Pod(ns, "restored", "restored", "", false)
	onQEMUWorker(&pod.Spec, writer.Spec.NodeSelector) // the copy is on the writer's host
	c := in.Guest.Client()
	start = time.Now()
	_, err = c.CoreV1().PersistentVolumeClaims(ns).Create(ctx, restored, metav1.CreateOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	_, err = c.CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	g.Eventually(func(g Gomega) corev1.PodPhase {
		p, err := c.CoreV1().Pods(ns).Get(ctx, pod.Name, metav1.GetOptions{})
		g.Expect(err).NotTo(HaveOccurred())
		return p.Status.Phase
	}).WithContext(ctx).WithTimeout(10 * time.Minute).WithPolling(time.Second).Should(Equal(corev1.PodRunning))
	lines := logLines(ctx, g, ns, pod.Name)
	g.Expect(lines).To(BeNumerically(">", acked), "every line acknowledged before the snapshot")
	t.Logf("the copy restored and mounted in a pod on the QEMU worker %.0f s after: %d whole lines in order, %d acknowledged before the snapshot", time.Since(start).Seconds(), lines, acked+1)
	g.Expect(restarts(ctx, g, writer)).To(BeZero(), "the writer's container exits at its first failed write")

	g.Expect(c.CoreV1().Pods(ns).Delete(ctx, pod.Name, metav1.DeleteOptions{})).To(Succeed())
	g.Expect(c.CoreV1().PersistentVolumeClaims(ns).Delete(ctx, restored.Name, metav1.DeleteOptions{})).To(Succeed())
	g.Expect(gc.Delete(ctx, vgs)).To(Succeed())
}

// attributesClassLimitsTheWriter: the writer's claim changes to a VolumeAttributesClass of
// 4 MiB/s (a guest class naming a management one the platform admin allows the cluster), which
// the host agent sets on the VM's disk (QEMU's block_set_io_throttle): a 16 MiB write synced
// in the pod takes at least the 4 s the limit allows, against what it took before.
func attributesClassLimitsTheWriter(t *testing.T, g Gomega, writer corev1.Pod) {
	ctx := t.Context()
	mc := mgmtClient(g)
	const mgmtClass, guestClass = "pmem-4mi", "limited-4mi"
	g.Expect(mc.Create(ctx, &storagev1.VolumeAttributesClass{
		ObjectMeta: metav1.ObjectMeta{Name: mgmtClass}, DriverName: names.PmemDriver,
		Parameters: map[string]string{qos.MaxBytesPerSecondParam: "4Mi"},
	})).To(Succeed())
	allowClass(ctx, g, mc, tenancy.AttributesClassesAnnotation, tenancy.ParamAttributesClasses, mgmtClass)
	_, err := in.Guest.Client().StorageV1().VolumeAttributesClasses().Create(ctx, &storagev1.VolumeAttributesClass{
		ObjectMeta: metav1.ObjectMeta{Name: guestClass}, DriverName: names.GuestDriver,
		Parameters: map[string]string{names.MgmtVolumeAttributesClassParam: mgmtClass},
	}, metav1.CreateOptions{})
	g.Expect(err).NotTo(HaveOccurred())

	// 16 MiB written and synced, as dd (busybox's in the pod, GNU's on the host) times it.
	const write = "dd if=/dev/zero of=%[1]s bs=1M count=16 conv=fsync 2>&1; rm %[1]s"
	seconds := func(out []byte, err error) float64 {
		g.Expect(err).NotTo(HaveOccurred(), "dd: %s", out)
		m := regexp.MustCompile(`copied, ([0-9.]+) s`).FindSubmatch(out)
		g.Expect(m).NotTo(BeNil(), "dd: %s", out)
		s, err := strconv.ParseFloat(string(m[1]), 64)
		g.Expect(err).NotTo(HaveOccurred())
		return s
	}
	inPod := func() float64 {
		out, err := kubectl(ctx, "exec", "-n", writer.Namespace, writer.Name, "--", "sh", "-c", fmt.Sprintf(write, "/data/dd"))
		return seconds([]byte(out), err)
	}
	// The same back end from the host: the filesystem of host-q's emulated PMEM.
	onHost := seconds(in.Hosts[qemuHost].Command(ctx, "sh", "-c", fmt.Sprintf(write, filepath.Join(deploy.PmemDir, "host-write"))).CombinedOutput())
	before := inPod()
	claims := in.Guest.Client().CoreV1().PersistentVolumeClaims(writer.Namespace)
	claim := "data-" + writer.Name // the StatefulSet's
	_, err = claims.Patch(ctx, claim, types.MergePatchType, []byte(`{"spec":{"volumeAttributesClassName":"`+guestClass+`"}}`), metav1.PatchOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	start := time.Now()
	g.Eventually(func(g Gomega) {
		pvc, err := claims.Get(ctx, claim, metav1.GetOptions{})
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(pvc.Status.CurrentVolumeAttributesClassName).To(HaveValue(Equal(guestClass)))
		g.Expect(pvc.Status.ModifyVolumeStatus).To(BeNil())
	}).WithContext(ctx).WithTimeout(5 * time.Minute).WithPolling(time.Second).Should(Succeed())
	modified := time.Since(start)
	after := inPod()
	g.Expect(after).To(BeNumerically(">=", 3.5), "16 MiB at 4 MiB/s (QEMU's throttle lets a first tenth of a second's worth through at once)")
	t.Logf("VolumeAttributesClass of 4 MiB/s: the claim's class changed in %.0f s; 16 MiB written and synced in the pod in %.2f s before (%.1f MiB/s), %.2f s after (%.1f MiB/s); on the host, in the back end's filesystem, %.2f s (%.1f MiB/s)",
		modified.Seconds(), before, 16/before, after, 16/after, onHost, 16/onHost)
}

// allowClass adds class to the classes the guest may name (annotation on its Cluster, e.g.
// tenancy.AttributesClassesAnnotation) and waits until the tenants controller has written it
// into the namespace's parameters (param, e.g. tenancy.ParamAttributesClasses).
func allowClass(ctx context.Context, g Gomega, mc client.Client, annotation, param, class string) {
	ns, name := in.Options.Guest.Namespace, in.Options.Guest.Name
	capiCluster := &unstructured.Unstructured{}
	capiCluster.SetGroupVersionKind(clusterGVK)
	g.Expect(mc.Get(ctx, client.ObjectKey{Namespace: ns, Name: name}, capiCluster)).To(Succeed())
	patch := client.MergeFrom(capiCluster.DeepCopy())
	annotations := capiCluster.GetAnnotations()
	annotations[annotation] = strings.Trim(annotations[annotation]+","+class, ",")
	capiCluster.SetAnnotations(annotations)
	g.Expect(mc.Patch(ctx, capiCluster, patch)).To(Succeed())
	g.Eventually(func(g Gomega) {
		params := &corev1.ConfigMap{}
		g.Expect(mc.Get(ctx, client.ObjectKey{Namespace: ns, Name: tenancy.ParamsConfigMap}, params)).To(Succeed())
		g.Expect(strings.Split(params.Data[name+param], ",")).To(ContainElement(class))
	}).WithContext(ctx).WithTimeout(2 * time.Minute).WithPolling(time.Second).Should(Succeed())
}

// logLines reads the log that appendLog writes in pod's /data and returns how many lines it
// has, each checked to be the number of its line (whole, in order, none lost).
func logLines(ctx context.Context, g Gomega, ns, pod string) int {
	out, err := kubectl(ctx, "exec", "-n", ns, pod, "--", "cat", "/data/log")
	g.Expect(err).NotTo(HaveOccurred())
	lines := strings.Split(strings.TrimSuffix(out, "\n"), "\n")
	for i, l := range lines {
		g.Expect(l).To(Equal(strconv.Itoa(i)), "line %d of %s's log", i, pod)
	}
	return len(lines)
}

// restarts is how many times the containers of pod were restarted.
func restarts(ctx context.Context, g Gomega, pod corev1.Pod) int32 {
	p, err := in.Guest.Client().CoreV1().Pods(pod.Namespace).Get(ctx, pod.Name, metav1.GetOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(p.UID).To(Equal(pod.UID))
	var n int32
	for _, c := range p.Status.ContainerStatuses {
		n += c.RestartCount
	}
	return n
}
