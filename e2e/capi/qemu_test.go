package capi_test

import (
	"path/filepath"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pvbridge.io/e2e/deploy"
	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/pkg/cgroups"
)

// qemuHost runs pvbridge's host agent as shipped: its VMs are QEMU VMs booting the node image.
const qemuHost = "host-q"

// qemuPoolName is the MachineDeployment of the QEMU host's workers.
func qemuPoolName() string { return in.Options.Guest.Name + "-pool-q" }

var (
	// qemuTaint keeps the pods of the steps the QEMU worker boots beside off it.
	qemuTaint = corev1.Taint{Key: deploy.LabHypervisorLabel, Value: "qemu", Effect: corev1.TaintEffectNoSchedule}
	// qemuPoolCreated is when qemuWorkerCreated created the pool.
	qemuPoolCreated time.Time
)

// qemuWorkerCreated creates a pool of one worker on the QEMU host (deploy.CreateQEMUPool),
// tainted, which boots beside the steps up to qemuWorkerRunsAStatefulSet.
func qemuWorkerCreated(t *testing.T) {
	qemuPoolCreated = time.Now()
	NewWithT(t).Expect(in.CreateQEMUPool(t.Context(), qemuPoolName(), 1, qemuTaint)).To(Succeed())
}

// qemuWorkerRunsAStatefulSet: the QEMU pool's worker (qemuWorkerCreated). Its VM boots the node
// image under QEMU (TCG on this machine), cloud-init runs Cluster API's `kubeadm join`, and the
// Node is Ready with the Machine's providerID, its address from the VM's guest agent, the
// pool's taint and the shipped guest-csi node plugin. A StatefulSet pod on it writes to a PMEM
// volume hot-plugged into the VM (a virtio disk the guest's udev names by its serial), the
// volume grows online, and the pod is deleted: its successor reads the data back. The pool is
// deleted: Cluster API drains the Node, the volume is unplugged, the VM powered off and deleted,
// and no QEMU is left on the host.
func qemuWorkerRunsAStatefulSet(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	mc := mgmtClient(g)
	start := time.Now()
	worker := waitPool(ctx, g, mc, qemuPoolName(), 1, qemuTaint)[0]
	t.Logf("QEMU worker %s: MachineDeployment created → Machine Running, Node Ready with guest-csi in %.0f s (TCG, beside the steps between; %.0f s of them in this step)",
		worker, time.Since(qemuPoolCreated).Seconds(), time.Since(start).Seconds())

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
	sts.Spec.Template.Spec.NodeSelector = map[string]string{poolLabel: qemuPoolName()}
	sts.Spec.Template.Spec.Tolerations = []corev1.Toleration{{Key: qemuTaint.Key, Value: qemuTaint.Value, Effect: qemuTaint.Effect}}
	start = time.Now()
	_, err = in.Guest.Client().AppsV1().StatefulSets(ns).Create(ctx, sts, metav1.CreateOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	pods := waitPodsRunning(ctx, g, ns, "q", 1)
	t.Logf("a StatefulSet pod with a new volume Running on the QEMU worker %.0f s after its creation", time.Since(start).Seconds())
	writeNames(ctx, g, ns, pods)
	// The volume is a virtio disk of the VM, which the guest's udev names by its serial.
	g.Expect(kubectl(ctx, "exec", "-n", ns, pods[0].Name, "--", "sh", "-c", "grep ' /data ' /proc/mounts | cut -d' ' -f1")).To(MatchRegexp(`^/dev/vd[a-z]+\n$`))

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
	readNamesBack(ctx, g, waitPodsRunning(ctx, g, ns, "q", 1))
	t.Logf("the pod deleted: its successor Running on the QEMU worker with its data %.0f s after", time.Since(start).Seconds())

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
