package capi_test

import (
	"context"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	eventsv1 "k8s.io/api/events/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pvbridge.io/e2e/cluster"
	"pvbridge.io/e2e/deploy"
	infrav1 "pvbridge.io/pkg/apis/infrastructure/v1alpha1"
	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/pkg/tenancy"
)

// topologyGuest is the guest the ClusterClass makes.
const topologyGuest = "beta"

// clusterClassMakesAGuest: the shipped ClusterClass and the topology flavor, rendered as
// clusterctl generate cluster --flavor topology renders them, make guest beta (one control plane
// machine, one worker) from a Cluster's topology: Cluster API's topology controller makes its
// PVBridgeCluster from the PVBridgeClusterTemplate with the endpoint variable, and its machine
// templates with the class's VirtualMachineClass and the node image of the version, whose
// capacity the provider reports; both machines run with Ready Nodes. The worker's
// VirtualMachine is deleted: its machine reports it (VirtualMachineDeleted, a Warning Event),
// gets no VM again, and the class's health check has Cluster API replace it. Then the guest is
// deleted and leaves no VM. The guest has no pvbridge storage (its Cluster does not opt in):
// alpha proves that.
func clusterClassMakesAGuest(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	mc := mgmtClient(g)
	ns := in.Options.Guest.Namespace

	version, etcdTag := guestVersion(ctx, g, mc)
	endpoint, err := lab.ControlPlaneEndpoint()
	g.Expect(err).NotTo(HaveOccurred())

	objs, err := deploy.ClusterTemplate(lab.Binaries().Repo, "clusterclass-pvbridge.yaml", map[string]string{"NAMESPACE": ns})
	g.Expect(err).NotTo(HaveOccurred())
	topology, err := deploy.ClusterTemplate(lab.Binaries().Repo, "cluster-template-topology.yaml", map[string]string{
		"CLUSTER_NAME": topologyGuest, "NAMESPACE": ns, "KUBERNETES_VERSION": version,
		"CONTROL_PLANE_MACHINE_COUNT": "1", "WORKER_MACHINE_COUNT": "1", "CONTROL_PLANE_ENDPOINT_IP": endpoint,
	})
	g.Expect(err).NotTo(HaveOccurred())
	objs = append(objs, topology...)
	g.Expect(deploy.LabCluster(objs, etcdTag)).To(Succeed())
	start := time.Now()
	for _, o := range objs {
		if o.GetKind() == "Cluster" {
			// Its machines on the local hosts (not host-q, whose VMs are QEMU's), the worker on host-a.
			labels := o.GetLabels()
			delete(labels, tenancy.EnabledLabel)
			o.SetLabels(labels)
			variables, _, _ := unstructured.NestedSlice(o.Object, "spec", "topology", "variables")
			variables = append(variables, map[string]any{"name": "hosts", "value": []any{"host-a", "host-b"}})
			g.Expect(unstructured.SetNestedSlice(o.Object, variables, "spec", "topology", "variables")).To(Succeed())
			pools, _, _ := unstructured.NestedSlice(o.Object, "spec", "topology", "workers", "machineDeployments")
			pools[0].(map[string]any)["failureDomain"] = "host-a"
			// The class's health check, with a shorter timeout for the test: 10 s of a Node whose
			// kubelet stopped reporting (not of a NotReady one: a new Node starts so).
			pools[0].(map[string]any)["healthCheck"] = map[string]any{"checks": map[string]any{"unhealthyNodeConditions": []any{
				map[string]any{"type": "Ready", "status": "Unknown", "timeoutSeconds": int64(10)},
			}}}
			g.Expect(unstructured.SetNestedSlice(o.Object, pools, "spec", "topology", "workers", "machineDeployments")).To(Succeed())
		}
		g.Expect(mc.Create(ctx, o)).To(Succeed(), "create %s %s", o.GetKind(), o.GetName())
	}

	// The topology's PVBridgeCluster has the endpoint and hosts of the Cluster's variables.
	g.Eventually(func(g Gomega) {
		ic := &infrav1.PVBridgeClusterList{}
		g.Expect(mc.List(ctx, ic, client.InNamespace(ns), client.MatchingLabels{"cluster.x-k8s.io/cluster-name": topologyGuest})).To(Succeed())
		g.Expect(ic.Items).To(HaveLen(1))
		g.Expect(ic.Items[0].Spec.ControlPlaneEndpoint).To(Equal(infrav1.APIEndpoint{Host: endpoint, Port: 6443}))
		g.Expect(ic.Items[0].Spec.FailureDomains).To(Equal([]infrav1.FailureDomain{{Name: "host-a"}, {Name: "host-b"}}))
	}).WithContext(ctx).WithTimeout(2 * time.Minute).Should(Succeed())

	// Both machines run, with Ready Nodes in the guest its kubeconfig Secret reaches.
	var guest kubernetes.Interface
	g.Eventually(func(g Gomega) {
		secret := &corev1.Secret{}
		g.Expect(mc.Get(ctx, client.ObjectKey{Namespace: ns, Name: topologyGuest + "-kubeconfig"}, secret)).To(Succeed())
		config, err := clientcmd.RESTConfigFromKubeConfig(secret.Data["value"])
		g.Expect(err).NotTo(HaveOccurred())
		guest, err = kubernetes.NewForConfig(config)
		g.Expect(err).NotTo(HaveOccurred())
	}).WithContext(ctx).WithTimeout(10 * time.Minute).Should(Succeed())
	// running waits until the guest's two machines run with Ready Nodes, the worker another
	// than gone, and returns the worker's name.
	running := func(gone string) string {
		var worker string
		g.Eventually(func(g Gomega) {
			worker = ""
			list := &unstructured.UnstructuredList{}
			list.SetGroupVersionKind(deploy.MachineGVK)
			g.Expect(mc.List(ctx, list, client.InNamespace(ns), client.MatchingLabels{"cluster.x-k8s.io/cluster-name": topologyGuest})).To(Succeed())
			g.Expect(list.Items).To(HaveLen(2))
			for _, m := range list.Items {
				g.Expect(m.GetDeletionTimestamp()).To(BeNil(), "Machine %s is being deleted", m.GetName())
				phase, _, _ := unstructured.NestedString(m.Object, "status", "phase")
				g.Expect(phase).To(Equal("Running"), "Machine %s", m.GetName())
				node, err := guest.CoreV1().Nodes().Get(ctx, m.GetName(), metav1.GetOptions{})
				g.Expect(err).NotTo(HaveOccurred())
				g.Expect(cluster.NodeReady(node)).To(BeTrue(), "Node %s", node.Name)
				g.Expect(node.Spec.ProviderID).To(Equal(infrav1.ProviderID(ns, m.GetName())))
				if _, cp := m.GetLabels()["cluster.x-k8s.io/control-plane"]; !cp {
					worker = m.GetName()
				}
			}
			g.Expect(worker).NotTo(BeElementOf("", gone), "the worker")
		}).WithContext(ctx).WithTimeout(25 * time.Minute).WithPolling(2 * time.Second).Should(Succeed())
		return worker
	}
	worker := running("")
	t.Logf("ClusterClass guest %s: its control plane machine and worker Running with Ready Nodes %.0f s after its Cluster's creation", topologyGuest, time.Since(start).Seconds())

	// The topology's machine templates: the class's VirtualMachineClass, the version's node image,
	// and their capacity (the lab's VirtualMachineClass small).
	small := &vmv1.VirtualMachineClass{}
	g.Expect(mc.Get(ctx, client.ObjectKey{Name: "small"}, small)).To(Succeed())
	templates := &infrav1.PVBridgeMachineTemplateList{}
	g.Expect(mc.List(ctx, templates, client.InNamespace(ns), client.MatchingLabels{"cluster.x-k8s.io/cluster-name": topologyGuest})).To(Succeed())
	g.Expect(templates.Items).To(HaveLen(2), "the control plane's and md-0's")
	for _, mt := range templates.Items {
		g.Expect(mt.Spec.Template.Spec.ClassName).To(Equal("small"), mt.Name)
		g.Expect(mt.Spec.Template.Spec.Image).To(Equal("node-"+version), mt.Name)
		g.Expect(mt.Status.Capacity.Cpu().Value()).To(BeEquivalentTo(small.Spec.CPUs), mt.Name)
		g.Expect(mt.Status.Capacity.Memory().Cmp(small.Spec.Memory)).To(BeZero(), mt.Name)
	}

	// The worker's VirtualMachine deleted behind Cluster API's back: its machine says so, gets no
	// VM again, and the class's health check has it replaced once its Node is unready.
	g.Expect(mc.Delete(ctx, &vmv1.VirtualMachine{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: worker}})).To(Succeed())
	start = time.Now()
	g.Eventually(func(g Gomega) {
		pm := &infrav1.PVBridgeMachine{}
		g.Expect(mc.Get(ctx, client.ObjectKey{Namespace: ns, Name: worker}, pm)).To(Succeed())
		g.Expect(meta.FindStatusCondition(pm.Status.Conditions, infrav1.ReadyCondition)).To(HaveField("Reason", infrav1.VirtualMachineDeletedReason))
		g.Expect(apierrors.IsNotFound(mc.Get(ctx, client.ObjectKey{Namespace: ns, Name: worker}, &vmv1.VirtualMachine{}))).To(BeTrue(), "no VM made again")
	}).WithContext(ctx).WithTimeout(2 * time.Minute).Should(Succeed())
	events := &eventsv1.EventList{}
	g.Expect(mc.List(ctx, events, client.InNamespace(ns))).To(Succeed())
	g.Expect(events.Items).To(ContainElement(And(HaveField("Reason", infrav1.VirtualMachineDeletedReason), HaveField("Regarding.Name", worker))))
	replacement := running(worker)
	t.Logf("worker %s of %s whose VM was deleted: reported, replaced by %s through the class's health check (10 s of an unknown Node), Running with a Ready Node %.0f s after the deletion",
		worker, topologyGuest, replacement, time.Since(start).Seconds())

	c := &unstructured.Unstructured{}
	c.SetGroupVersionKind(clusterGVK)
	c.SetNamespace(ns)
	c.SetName(topologyGuest)
	g.Expect(mc.Delete(ctx, c)).To(Succeed())
	start = time.Now()
	g.Eventually(func(g Gomega) {
		g.Expect(apierrors.IsNotFound(mc.Get(ctx, client.ObjectKeyFromObject(c), c))).To(BeTrue(), "Cluster %s", topologyGuest)
		vms := &vmv1.VirtualMachineList{}
		g.Expect(mc.List(ctx, vms, client.InNamespace(ns), client.MatchingLabels{tenancy.CAPIClusterNameLabel: topologyGuest})).To(Succeed())
		g.Expect(vms.Items).To(BeEmpty())
	}).WithContext(ctx).WithTimeout(10 * time.Minute).WithPolling(2 * time.Second).Should(Succeed())
	t.Logf("ClusterClass guest %s deleted, its VMs gone, %.0f s after", topologyGuest, time.Since(start).Seconds())
}

// guestVersion returns the Kubernetes version and etcd image tag of alpha's control plane, which
// the lab made.
func guestVersion(ctx context.Context, g Gomega, mc client.Client) (version, etcdTag string) {
	kcp := &unstructured.Unstructured{}
	kcp.SetGroupVersionKind(schema.GroupVersionKind{Group: "controlplane.cluster.x-k8s.io", Version: "v1beta2", Kind: "KubeadmControlPlane"})
	g.Expect(mc.Get(ctx, client.ObjectKey{Namespace: in.Options.Guest.Namespace, Name: in.Options.Guest.Name + "-control-plane"}, kcp)).To(Succeed())
	version, _, _ = unstructured.NestedString(kcp.Object, "spec", "version")
	etcdTag, _, _ = unstructured.NestedString(kcp.Object, "spec", "kubeadmConfigSpec", "clusterConfiguration", "etcd", "local", "imageTag")
	return version, etcdTag
}
