package capi_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pvbridge.io/e2e/deploy"
	infrav1 "pvbridge.io/pkg/apis/infrastructure/v1alpha1"
	pmemv1 "pvbridge.io/pkg/apis/pmem/v1alpha1"
	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/pkg/names"
	"pvbridge.io/pkg/tenancy"
)

// The host that the host-loss step adds and powers off, and its pool of one worker.
const lostHost = "host-c"

func lostPoolName() string { return in.Options.Guest.Name + "-pool-c" }

// hostLostWhileAPodWrites: host-c joins the management cluster, and a pool of one worker without
// a failure domain lands there (the least loaded host; the lab's QEMU host, whose VMs boot for
// minutes under TCG, is cordoned for the step), with a MachineHealthCheck that remediates a
// worker whose Node is not Ready for 30 s. A pod on that worker appends numbered lines, each
// synced before it says so, to a volume of a guest class of the replicated management class.
// host-c loses its power: its VMs, kubelet, containers, replica server and target, and PMEM are
// gone at once. The admin declares it lost (the out-of-service taint on its Node): vm-operator
// says the worker's VM went with it, and guest-csi taints the guest Node out of service, so that
// the guest detaches its volume at once. The MachineHealthCheck has the worker's Machine
// deleted, which no longer waits for the dead host's agent; the MachineDeployment's new worker
// runs on another host, and the pod runs again there with every line it acknowledged, from the
// surviving replica.
func hostLostWhileAPodWrites(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	mc := mgmtClient(g)
	c := in.Guest.Client()

	setUnschedulable(ctx, g, mc, qemuHost, true)
	t.Cleanup(func() { setUnschedulable(context.WithoutCancel(ctx), g, mc, qemuHost, false) })
	start := time.Now()
	host, err := in.AddHost(ctx, lab, lostHost)
	g.Expect(err).NotTo(HaveOccurred())
	t.Logf("%s joined: pvbridge's DaemonSets ready on it %.0f s after", lostHost, time.Since(start).Seconds())

	allowClass(ctx, g, mc, tenancy.StorageClassesAnnotation, tenancy.ParamStorageClasses, deploy.StorageClassPmemReplicated)
	class := &storagev1.StorageClass{
		ObjectMeta:        metav1.ObjectMeta{Name: "replicated"},
		Provisioner:       names.GuestDriver,
		Parameters:        map[string]string{names.MgmtStorageClassParam: deploy.StorageClassPmemReplicated, names.ReplicatedParam: "true"},
		ReclaimPolicy:     ptr.To(corev1.PersistentVolumeReclaimDelete),
		VolumeBindingMode: ptr.To(storagev1.VolumeBindingWaitForFirstConsumer),
	}
	_, err = c.StorageV1().StorageClasses().Create(ctx, class, metav1.CreateOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	t.Cleanup(func() {
		_ = c.StorageV1().StorageClasses().Delete(context.WithoutCancel(ctx), class.Name, metav1.DeleteOptions{})
	})

	md := machineDeployment(ctx, g, mc, 1)
	md.SetName(lostPoolName())
	g.Expect(unstructured.SetNestedField(md.Object, lostPoolName(), "spec", "template", "metadata", "labels", poolLabel)).To(Succeed())
	unstructured.RemoveNestedField(md.Object, "spec", "template", "spec", "failureDomain")
	g.Expect(mc.Create(ctx, md)).To(Succeed())
	mhc := &unstructured.Unstructured{Object: map[string]any{
		"spec": map[string]any{
			"clusterName": in.Options.Guest.Name,
			"selector":    map[string]any{"matchLabels": map[string]any{"cluster.x-k8s.io/deployment-name": lostPoolName()}},
			"checks": map[string]any{
				"nodeStartupTimeoutSeconds": int64(1800),
				"unhealthyNodeConditions": []any{
					map[string]any{"type": "Ready", "status": "Unknown", "timeoutSeconds": int64(30)},
					map[string]any{"type": "Ready", "status": "False", "timeoutSeconds": int64(30)},
				},
			},
		},
	}}
	mhc.SetGroupVersionKind(schema.GroupVersionKind{Group: "cluster.x-k8s.io", Version: "v1beta2", Kind: "MachineHealthCheck"})
	mhc.SetNamespace(in.Options.Guest.Namespace)
	mhc.SetName(lostPoolName())
	g.Expect(mc.Create(ctx, mhc)).To(Succeed())
	t.Cleanup(func() {
		ctx := context.WithoutCancel(ctx)
		_ = mc.Delete(ctx, mhc)
		_ = mc.Delete(ctx, md)
	})
	g.Eventually(func(g Gomega) []string { return failureDomains(ctx, g, mc) }).WithContext(ctx).WithTimeout(time.Minute).Should(ContainElement(lostHost))
	victim := waitPool(ctx, g, mc, lostPoolName(), 1)[0]
	g.Expect(vmHost(ctx, g, mc, victim)).To(Equal(lostHost), "the least loaded host")

	ns := guestNamespace(t, g, "hostloss")
	sts := ackingWriter(ns, lostPoolName())
	sts.Spec.VolumeClaimTemplates[0].Spec.StorageClassName = ptr.To(class.Name)
	_, err = c.AppsV1().StatefulSets(ns).Create(ctx, sts, metav1.CreateOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	writer := waitPodsRunning(ctx, g, ns, "log", 1)[0]
	g.Eventually(lastAck).WithContext(ctx).WithArguments(writer).WithTimeout(time.Minute).Should(BeNumerically(">=", 10))
	replicas := mgmtReplicas(ctx, g, mc, ns, "data-log-0")
	g.Expect(replicas).To(ContainElement(lostHost), "a replica next to the writer")
	g.Expect(replicas).To(HaveLen(2))

	start = time.Now()
	acked, err := lastAck(ctx, writer)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(host.PowerOff()).To(Succeed())
	// What the pod acknowledged: its log, until the worker's kubelet no longer answers.
	g.Eventually(func() error {
		n, err := lastAck(ctx, writer)
		acked = max(acked, n)
		return err
	}).WithContext(ctx).WithTimeout(time.Minute).WithPolling(200 * time.Millisecond).Should(HaveOccurred())
	t.Logf("%s powered off: %d lines acknowledged before", lostHost, acked+1)
	outOfService := fmt.Sprintf(`{"spec":{"taints":[{"key":%q,"value":"nodeshutdown","effect":"NoExecute"}]}}`, corev1.TaintNodeOutOfService)
	g.Expect(mc.Patch(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: lostHost}}, client.RawPatch(types.MergePatchType, []byte(outOfService)))).To(Succeed())

	g.Eventually(func(g Gomega) []string { return failureDomains(ctx, g, mc) }).WithContext(ctx).WithTimeout(time.Minute).
		ShouldNot(ContainElement(lostHost), "a lost host is no failure domain")
	t.Cleanup(func() { // the admin removes the dead host for good
		_ = mc.Delete(context.WithoutCancel(ctx), &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: lostHost}})
	})
	// The VM went with its host, says vm-operator; so guest-csi taints its guest Node out of
	// service once it is not Ready, and the guest detaches its volume at once.
	g.Eventually(func(g Gomega) {
		vm := &vmv1.VirtualMachine{}
		g.Expect(mc.Get(ctx, client.ObjectKey{Namespace: in.Options.Guest.Namespace, Name: victim}, vm)).To(Succeed())
		g.Expect(meta.FindStatusCondition(vm.Status.Conditions, vmv1.ReadyCondition)).To(HaveField("Reason", vmv1.HostLostReason))
		node, err := c.CoreV1().Nodes().Get(ctx, victim, metav1.GetOptions{})
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(node.Spec.Taints).To(ContainElement(HaveField("Key", corev1.TaintNodeOutOfService)))
	}).WithContext(ctx).WithTimeout(2 * time.Minute).WithPolling(time.Second).Should(Succeed())
	waitGone(ctx, g, mc, victim)
	back := waitPodsRunning(ctx, g, ns, "log", 1)[0]
	g.Expect(back.UID).NotTo(Equal(writer.UID))
	g.Eventually(lastAck).WithContext(ctx).WithArguments(back).WithTimeout(2 * time.Minute).Should(BeNumerically(">", acked))
	replacement := waitPool(ctx, g, mc, lostPoolName(), 1)[0]
	g.Expect(vmHost(ctx, g, mc, replacement)).NotTo(Equal(lostHost))
	t.Logf("%s lost while a pod wrote: the MachineHealthCheck replaced worker %s by %s on %s, the pod writing again there %.0f s after the power-off",
		lostHost, victim, replacement, vmHost(ctx, g, mc, replacement), time.Since(start).Seconds())

	expectAcknowledged(ctx, g, back, acked)
}

// failureDomains are the names of the guest's failure domains, as its PVBridgeCluster reports
// them.
func failureDomains(ctx context.Context, g Gomega, mc client.Client) []string {
	ic := &infrav1.PVBridgeCluster{}
	g.Expect(mc.Get(ctx, client.ObjectKey{Namespace: in.Options.Guest.Namespace, Name: in.Options.Guest.Name}, ic)).To(Succeed())
	var names []string
	for _, fd := range ic.Status.FailureDomains {
		names = append(names, fd.Name)
	}
	return names
}

// setUnschedulable cordons or uncordons management Node name.
func setUnschedulable(ctx context.Context, g Gomega, mc client.Client, name string, on bool) {
	patch := fmt.Sprintf(`{"spec":{"unschedulable":%t}}`, on)
	g.Expect(mc.Patch(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}}, client.RawPatch(types.MergePatchType, []byte(patch)))).To(Succeed())
}

// vmHost is the host of the VirtualMachine of worker name.
func vmHost(ctx context.Context, g Gomega, mc client.Client, name string) string {
	vm := &vmv1.VirtualMachine{}
	g.Expect(mc.Get(ctx, client.ObjectKey{Namespace: in.Options.Guest.Namespace, Name: name}, vm)).To(Succeed())
	return vm.Status.Host
}

// mgmtReplicas returns the hosts of the replicas of the management volume of guest claim
// ns/claim.
func mgmtReplicas(ctx context.Context, g Gomega, mc client.Client, ns, claim string) []string {
	pvc, err := in.Guest.Client().CoreV1().PersistentVolumeClaims(ns).Get(ctx, claim, metav1.GetOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	pv, err := in.Guest.Client().CoreV1().PersistentVolumes().Get(ctx, pvc.Spec.VolumeName, metav1.GetOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	mpvc := &corev1.PersistentVolumeClaim{}
	g.Expect(mc.Get(ctx, client.ObjectKey{Namespace: in.Options.Guest.Namespace, Name: pv.Spec.CSI.VolumeHandle}, mpvc)).To(Succeed())
	mpv := &corev1.PersistentVolume{}
	g.Expect(mc.Get(ctx, client.ObjectKey{Name: mpvc.Spec.VolumeName}, mpv)).To(Succeed())
	list := &pmemv1.PmemReplicaList{}
	g.Expect(mc.List(ctx, list, client.MatchingLabels{pmemv1.VolumeLabel: mpv.Spec.CSI.VolumeHandle})).To(Succeed())
	var hosts []string
	for _, r := range list.Items {
		hosts = append(hosts, r.Spec.Node)
	}
	return hosts
}
