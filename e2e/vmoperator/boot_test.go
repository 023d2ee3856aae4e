package vmoperator_test

import (
	"context"
	"os/exec"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pvbridge.io/e2e/cluster"
	"pvbridge.io/e2e/deploy"
	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
)

// TestAVMWithBootstrapDataBootsIt: a VirtualMachine with Cluster API's kubeadm init data in
// its bootstrap Secret is powered on by its host agent (local hypervisor), whose VM the lab's
// VMM boots: kubeadm makes the guest's control plane in it and its Node is Ready. The volume in
// the VM's spec is hot-plugged into that running VM, where its disk appears by serial. Deleting
// the VirtualMachine detaches the volume, powers the VM off and the VMM stops it.
func TestAVMWithBootstrapDataBootsIt(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	ns := namespace(t)

	archives, version, etcdTag, err := cluster.KubeadmImageArchives(ctx, lab)
	g.Expect(err).NotTo(HaveOccurred())
	registry, err := lab.StartRegistry(ctx)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(registry.Push(ctx, archives...)).To(Succeed())
	vmm := lab.StartVMM(cluster.VMMOptions{Root: vmop.VMRoots["host-a"], Registry: registry, DeviceRoot: deploy.VMDeviceRoot})
	t.Cleanup(func() { g.Expect(vmm.Stop()).To(Succeed()) })

	blockClaim(ctx, g, ns, "data", "host-a")
	g.Expect(c.Create(ctx, &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "cp-0-bootstrap"},
		Data:       map[string][]byte{"value": []byte(cluster.KubeadmInitUserData(version, etcdTag))},
	})).To(Succeed())
	vm := virtualMachine(ns, "cp-0", "host-a", "data")
	vm.Spec.Bootstrap = &vmv1.VirtualMachineBootstrap{DataSecretName: "cp-0-bootstrap"}
	g.Expect(c.Create(ctx, vm)).To(Succeed())

	var booted *cluster.VM
	g.Eventually(func(g Gomega) {
		booted, err = vmm.VM(ns, "cp-0")
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(booted).NotTo(BeNil())
	}).WithContext(ctx).WithTimeout(timeout).Should(Succeed())
	bootCtx, cancel := context.WithTimeout(ctx, 10*time.Minute)
	defer cancel()
	g.Expect(booted.WaitBooted(bootCtx)).To(Succeed())

	config, err := clientcmd.BuildConfigFromFlags("", booted.HostPath("/etc/kubernetes/admin.conf"))
	g.Expect(err).NotTo(HaveOccurred())
	guest, err := kubernetes.NewForConfig(config)
	g.Expect(err).NotTo(HaveOccurred())
	g.Eventually(func(g Gomega) {
		node, err := guest.CoreV1().Nodes().Get(ctx, "cp-0", metav1.GetOptions{})
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(cluster.NodeReady(node)).To(BeTrue(), "node conditions: %v", node.Status.Conditions)
		g.Expect(node.Spec.ProviderID).To(Equal("pvbridge://" + ns + "/cp-0"))
	}).WithContext(ctx).WithTimeout(5 * time.Minute).WithPolling(time.Second).Should(Succeed())

	// The volume is hot-plugged into the running VM: its disk is in the VM's device tree.
	serial := volumeStatus(ctx, g, vm, "data", attached).DiskSerial
	g.Eventually(func() error {
		return booted.Command(ctx, "test", "-b", deploy.VMDeviceRoot+"/dev/disk/by-id/virtio-"+serial).Run()
	}).WithContext(ctx).WithTimeout(timeout).Should(Succeed())

	link := booted.Address
	g.Expect(c.Delete(ctx, vm)).To(Succeed())
	g.Eventually(func(g Gomega) {
		err := c.Get(ctx, client.ObjectKeyFromObject(vm), vm)
		g.Expect(err).To(HaveOccurred())
		running, err := vmm.VM(ns, "cp-0")
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(running).To(BeNil())
	}).WithContext(ctx).WithTimeout(timeout).Should(Succeed())
	g.Expect(exec.Command("ip", "route", "get", link).Output()).NotTo(ContainSubstring("pvbvm"), "the VM's link is gone")
}
