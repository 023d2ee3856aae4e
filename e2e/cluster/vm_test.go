package cluster

import (
	"context"
	"os/exec"
	"strings"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
)

// TestVMsBootAKubeadmCluster boots two lab VMs with the user data Cluster API's kubeadm
// bootstrap provider writes: a control plane machine (a kubeadm configuration file, then
// `kubeadm init` and the bootstrap-success sentinel), whose control plane runs as static pods
// of the VM's kubelet in real containers, and a worker that joins it with a bootstrap token.
// Both Nodes are Ready; a pod on the worker reaches a pod on the control plane VM across the
// VMs' pod networks, and its logs are read through the guest apiserver from the worker's
// kubelet; stopping a VM removes its link.
func TestVMsBootAKubeadmCluster(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	lab := newTestLab(t)

	archives, version, etcdTag, err := KubeadmImageArchives(ctx, lab)
	g.Expect(err).NotTo(HaveOccurred())

	start := time.Now()
	vm, err := lab.StartVM(ctx, "cp-0", VMOptions{
		Images:   archives,
		UserData: []byte(KubeadmInitUserData(version, etcdTag)),
		MetaData: []byte("instance-id: 6b0e3f1c\nlocal-hostname: cp-0\nprovider-id: pvbridge://tenant-a/cp-0\n"),
	})
	g.Expect(err).NotTo(HaveOccurred())
	bootCtx, cancel := context.WithTimeout(ctx, 10*time.Minute)
	defer cancel()
	g.Expect(vm.WaitBooted(bootCtx)).To(Succeed())
	g.Expect(vm.HostPath("/run/cluster-api/bootstrap-success.complete")).To(BeAnExistingFile())

	config, err := clientcmd.BuildConfigFromFlags("", vm.HostPath("/etc/kubernetes/admin.conf"))
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(config.Host).To(Equal("https://" + vm.Address + ":6443"))
	c, err := kubernetes.NewForConfig(config)
	g.Expect(err).NotTo(HaveOccurred())

	g.Eventually(func(g Gomega) {
		node, err := c.CoreV1().Nodes().Get(ctx, "cp-0", metav1.GetOptions{})
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(NodeReady(node)).To(BeTrue(), "node conditions: %v", node.Status.Conditions)
		g.Expect(node.Spec.ProviderID).To(Equal("pvbridge://tenant-a/cp-0"))
		g.Expect(node.Status.Addresses).To(ContainElement(corev1.NodeAddress{Type: corev1.NodeInternalIP, Address: vm.Address}))
		for _, component := range []string{"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler"} {
			pod, err := c.CoreV1().Pods("kube-system").Get(ctx, component+"-cp-0", metav1.GetOptions{})
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(pod.Status.Phase).To(Equal(corev1.PodRunning), component)
		}
		// The controller manager's work, which a pod needs.
		_, err = c.CoreV1().ServiceAccounts("default").Get(ctx, "default", metav1.GetOptions{})
		g.Expect(err).NotTo(HaveOccurred())
	}).WithContext(ctx).WithTimeout(5 * time.Minute).WithPolling(time.Second).Should(Succeed())

	t.Logf("control plane VM: user data run, Node Ready and control plane running %.1f s after boot", time.Since(start).Seconds())

	// A worker joins with the token of the init configuration and the hash of the cluster's CA,
	// as Cluster API's join data has them.
	caHash, err := CACertHash(vm.HostPath("/etc/kubernetes/pki/ca.crt"))
	g.Expect(err).NotTo(HaveOccurred())
	start = time.Now()
	worker, err := lab.StartVM(ctx, "md-0", VMOptions{
		Images:   archives,
		UserData: []byte(KubeadmJoinUserData(vm.Address+":6443", caHash)),
		MetaData: []byte("instance-id: 0c4d1e9a\nlocal-hostname: md-0\nprovider-id: pvbridge://tenant-a/md-0\n"),
	})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(worker.WaitBooted(bootCtx)).To(Succeed())
	g.Eventually(func(g Gomega) {
		node, err := c.CoreV1().Nodes().Get(ctx, "md-0", metav1.GetOptions{})
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(NodeReady(node)).To(BeTrue(), "node conditions: %v", node.Status.Conditions)
		g.Expect(node.Spec.ProviderID).To(Equal("pvbridge://tenant-a/md-0"))
	}).WithContext(ctx).WithTimeout(5 * time.Minute).WithPolling(time.Second).Should(Succeed())
	t.Logf("worker VM: joined and Node Ready %.1f s after boot", time.Since(start).Seconds())

	// Pods in each VM's pod network; the worker's reaches the control plane VM's, and its logs
	// come through the guest's apiserver from the worker's kubelet.
	g.Expect(runBusybox(ctx, c, "cp-0", "server", `while true; do echo "pong from $(hostname)" | nc -l -p 8080; done`)).To(Succeed())
	server, err := c.CoreV1().Pods("default").Get(ctx, "server", metav1.GetOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(server.Status.PodIP).To(HavePrefix(strings.TrimSuffix(vm.PodSubnet, "0/24")))
	g.Expect(runBusybox(ctx, c, "md-0", "client", `while true; do nc -w 2 `+server.Status.PodIP+` 8080; sleep 1; done`)).To(Succeed())
	g.Eventually(func(g Gomega) {
		pod, err := c.CoreV1().Pods("default").Get(ctx, "client", metav1.GetOptions{})
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(pod.Status.PodIP).To(HavePrefix(strings.TrimSuffix(worker.PodSubnet, "0/24")))
		logs, err := c.CoreV1().Pods("default").GetLogs("client", &corev1.PodLogOptions{}).DoRaw(ctx)
		g.Expect(err).NotTo(HaveOccurred(), string(logs))
		g.Expect(string(logs)).To(ContainSubstring("pong from server"))
	}).WithContext(ctx).WithTimeout(2 * time.Minute).Should(Succeed())

	link := worker.network.Bridge
	g.Expect(worker.Stop()).To(Succeed())
	g.Expect(exec.Command("ip", "link", "show", link).Run()).To(HaveOccurred(), "link %s left behind", link)
	g.Expect(worker.namespace.Exited()).To(BeTrue())
	link = vm.network.Bridge
	g.Expect(vm.Stop()).To(Succeed())
	g.Expect(exec.Command("ip", "link", "show", link).Run()).To(HaveOccurred(), "link %s left behind", link)
	g.Expect(vm.namespace.Exited()).To(BeTrue())
}
