package vmoperator_test

import (
	"testing"
	"time"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pvbridge.io/e2e/cluster"
	"pvbridge.io/e2e/deploy"
	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
)

// TestClusterAPIMakesAGuestCluster: Cluster API's own controllers (core, kubeadm bootstrap and
// control plane) and pvbridge's provider make a guest cluster from the shipped cluster
// template (adapted to the lab: deploy.LabCluster): a KubeadmControlPlane of one machine and a
// MachineDeployment of one worker become VirtualMachines with bootstrap data, which the host
// agents power on and the lab's VMMs boot; kubeadm init and join make the guest, whose Nodes,
// with their provider IDs, are Ready, read with the kubeconfig Secret Cluster API wrote. Deleting
// the Cluster deletes every Machine and VirtualMachine.
func TestClusterAPIMakesAGuestCluster(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	ns := namespace(t)

	_, err := deploy.StartClusterAPI(ctx, lab, mgmt.CP)
	g.Expect(err).NotTo(HaveOccurred())
	archives, version, etcdTag, err := cluster.KubeadmImageArchives(ctx, lab)
	g.Expect(err).NotTo(HaveOccurred())
	for _, host := range []string{"host-a", "host-b"} {
		vmm := lab.StartVMM(cluster.VMMOptions{Root: vmop.VMRoots[host], Images: archives, DeviceRoot: deploy.VMDeviceRoot})
		t.Cleanup(func() { g.Expect(vmm.Stop()).To(Succeed()) })
	}
	endpoint, err := lab.ControlPlaneEndpoint()
	g.Expect(err).NotTo(HaveOccurred())

	objs, err := deploy.ClusterTemplate(lab.Binaries().Repo, map[string]string{
		"CLUSTER_NAME": "alpha", "NAMESPACE": ns, "KUBERNETES_VERSION": version,
		"CONTROL_PLANE_MACHINE_COUNT": "1", "WORKER_MACHINE_COUNT": "1", "CONTROL_PLANE_ENDPOINT_IP": endpoint,
	})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(deploy.LabCluster(objs, etcdTag)).To(Succeed())
	start := time.Now()
	for _, o := range objs {
		g.Expect(c.Create(ctx, o)).To(Succeed(), "%s %s", o.GetKind(), o.GetName())
	}

	// The guest, through the kubeconfig Secret Cluster API wrote.
	var guest kubernetes.Interface
	g.Eventually(func(g Gomega) {
		secret := &corev1.Secret{}
		g.Expect(c.Get(ctx, client.ObjectKey{Namespace: ns, Name: "alpha-kubeconfig"}, secret)).To(Succeed())
		config, err := clientcmd.RESTConfigFromKubeConfig(secret.Data["value"])
		g.Expect(err).NotTo(HaveOccurred())
		guest, err = kubernetes.NewForConfig(config)
		g.Expect(err).NotTo(HaveOccurred())
	}).WithContext(ctx).WithTimeout(timeout).Should(Succeed())
	machines := &unstructured.UnstructuredList{}
	machines.SetGroupVersionKind(schema.GroupVersionKind{Group: "cluster.x-k8s.io", Version: "v1beta2", Kind: "MachineList"})
	g.Eventually(func(g Gomega) {
		g.Expect(c.List(ctx, machines, client.InNamespace(ns))).To(Succeed())
		g.Expect(machines.Items).To(HaveLen(2))
		for _, m := range machines.Items {
			phase, _, _ := unstructured.NestedString(m.Object, "status", "phase")
			g.Expect(phase).To(Equal("Running"), "machine %s", m.GetName())
			node, err := guest.CoreV1().Nodes().Get(ctx, m.GetName(), metav1.GetOptions{})
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(cluster.NodeReady(node)).To(BeTrue(), "node %s: %v", node.Name, node.Status.Conditions)
			g.Expect(node.Spec.ProviderID).To(Equal("pvbridge://" + ns + "/" + m.GetName()))
		}
	}).WithContext(ctx).WithTimeout(15 * time.Minute).WithPolling(2 * time.Second).Should(Succeed())
	t.Logf("guest cluster made by Cluster API: both Machines Running with their Nodes Ready %.0f s after the template was applied", time.Since(start).Seconds())

	capiCluster := &unstructured.Unstructured{}
	capiCluster.SetGroupVersionKind(schema.GroupVersionKind{Group: "cluster.x-k8s.io", Version: "v1beta2", Kind: "Cluster"})
	capiCluster.SetNamespace(ns)
	capiCluster.SetName("alpha")
	g.Expect(c.Delete(ctx, capiCluster)).To(Succeed())
	g.Eventually(func(g Gomega) {
		g.Expect(c.List(ctx, machines, client.InNamespace(ns))).To(Succeed())
		g.Expect(machines.Items).To(BeEmpty())
		vms := &vmv1.VirtualMachineList{}
		g.Expect(c.List(ctx, vms, client.InNamespace(ns))).To(Succeed())
		g.Expect(vms.Items).To(BeEmpty())
	}).WithContext(ctx).WithTimeout(5 * time.Minute).WithPolling(time.Second).Should(Succeed())
}
