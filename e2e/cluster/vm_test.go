package cluster

import (
	"context"
	"os/exec"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/crane"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	. "github.com/onsi/gomega"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/utils/ptr"
)

// TestVMsBootAKubeadmCluster boots two lab VMs with the user data Cluster API's kubeadm
// bootstrap provider writes: a control plane machine (a kubeadm configuration file, then
// `kubeadm init` and the bootstrap-success sentinel), whose control plane runs as static pods
// of the VM's kubelet in real containers, and a worker that joins it with a bootstrap token.
// The VMs pull every image from the lab's registry. Both Nodes are Ready; a pod on the worker
// reaches a pod on the control plane VM across the VMs' pod networks, and its logs are read
// through the guest apiserver from the worker's kubelet. The guest behaves as a cluster kubeadm
// made for a tenant's ordinary workloads: kubeadm's kube-proxy programs the Service rules of
// every VM and its CoreDNS answers, so the pods of a StatefulSet with `image: busybox` (latest,
// so pulled Always) resolve each other's names through its headless Service and the
// `kubernetes` Service's; an image a user pushed to the registry runs by its name. Stopping a
// VM removes its link.
func TestVMsBootAKubeadmCluster(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	lab := newTestLab(t)

	archives, version, etcdTag, err := KubeadmImageArchives(ctx, lab)
	g.Expect(err).NotTo(HaveOccurred())
	registry, err := lab.StartRegistry(ctx)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(registry.Push(ctx, archives...)).To(Succeed())

	start := time.Now()
	vm, err := lab.StartVM(ctx, "cp-0", VMOptions{
		Registry: registry,
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
		Registry: registry,
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

	// kubeadm's addons: kube-proxy on each VM, in the VM's network namespace, and CoreDNS.
	g.Eventually(func(g Gomega) {
		proxy, err := c.AppsV1().DaemonSets("kube-system").Get(ctx, "kube-proxy", metav1.GetOptions{})
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(proxy.Status.NumberReady).To(BeEquivalentTo(2))
		dns, err := c.AppsV1().Deployments("kube-system").Get(ctx, "coredns", metav1.GetOptions{})
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(dns.Status.ReadyReplicas).To(BeEquivalentTo(2))
		rules, err := worker.Command(ctx, "iptables", "-t", "nat", "-S", "KUBE-SERVICES").CombinedOutput()
		g.Expect(err).NotTo(HaveOccurred(), string(rules))
		g.Expect(string(rules)).To(ContainSubstring("-d 10.112.0.10/32 -p udp"))
	}).WithContext(ctx).WithTimeout(5 * time.Minute).WithPolling(time.Second).Should(Succeed())
	t.Logf("kube-proxy and CoreDNS ready %.1f s after the worker's boot", time.Since(start).Seconds())

	// A tenant's StatefulSet as a new user writes it: `image: busybox`, a headless Service.
	web := map[string]string{"app": "web"}
	_, err = c.CoreV1().Services("default").Create(ctx, &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "web"},
		Spec:       corev1.ServiceSpec{ClusterIP: corev1.ClusterIPNone, Selector: web, Ports: []corev1.ServicePort{{Name: "web", Port: 80}}},
	}, metav1.CreateOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	start = time.Now()
	_, err = c.AppsV1().StatefulSets("default").Create(ctx, &appsv1.StatefulSet{
		ObjectMeta: metav1.ObjectMeta{Name: "web"},
		Spec: appsv1.StatefulSetSpec{
			ServiceName: "web", Replicas: ptr.To[int32](2), Selector: &metav1.LabelSelector{MatchLabels: web},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: web},
				Spec: corev1.PodSpec{
					TerminationGracePeriodSeconds: ptr.To[int64](1),
					Containers: []corev1.Container{{
						Name: "app", Image: "busybox",
						Command: []string{"sh", "-c", `while true; do nslookup web-0.web.default.svc.cluster.local; nslookup kubernetes.default.svc.cluster.local; sleep 2; done`},
					}},
				},
			},
		},
	}, metav1.CreateOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	g.Eventually(func(g Gomega) {
		web0, err := c.CoreV1().Pods("default").Get(ctx, "web-0", metav1.GetOptions{})
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(web0.Spec.Containers[0].ImagePullPolicy).To(Equal(corev1.PullAlways))
		g.Expect(web0.Status.PodIP).NotTo(BeEmpty())
		logs, err := c.CoreV1().Pods("default").GetLogs("web-1", &corev1.PodLogOptions{}).DoRaw(ctx)
		g.Expect(err).NotTo(HaveOccurred(), string(logs))
		g.Expect(string(logs)).To(And(
			MatchRegexp(`Server:\s+10\.112\.0\.10\b`),
			MatchRegexp(`Name:\s+web-0\.web\.default\.svc\.cluster\.local\s+Address:\s+%s\b`, regexp.QuoteMeta(web0.Status.PodIP)),
			MatchRegexp(`Name:\s+kubernetes\.default\.svc\.cluster\.local\s+Address:\s+10\.112\.0\.1\b`),
		))
	}).WithContext(ctx).WithTimeout(5 * time.Minute).WithPolling(time.Second).Should(Succeed())
	t.Logf("StatefulSet: web-1 resolved web-0 by name %.1f s after its creation", time.Since(start).Seconds())

	// A user pushes an image of their own, as with `crane append`, and runs it by its name.
	base, err := crane.Pull(registry.Address+"/docker.io/library/busybox:latest", crane.Insecure)
	g.Expect(err).NotTo(HaveOccurred())
	layer, err := crane.Layer(map[string][]byte{"hello.txt": []byte("hello from a pushed image\n")})
	g.Expect(err).NotTo(HaveOccurred())
	img, err := mutate.AppendLayers(base, layer)
	g.Expect(err).NotTo(HaveOccurred())
	ref := registry.Address + "/tenant/hello:v1"
	g.Expect(crane.Push(img, ref, crane.Insecure)).To(Succeed())
	start = time.Now()
	_, err = c.CoreV1().Pods("default").Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "hello"},
		Spec: corev1.PodSpec{
			RestartPolicy: corev1.RestartPolicyNever,
			Containers:    []corev1.Container{{Name: "app", Image: ref, Command: []string{"cat", "/hello.txt"}}},
		},
	}, metav1.CreateOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	g.Eventually(func(g Gomega) {
		pod, err := c.CoreV1().Pods("default").Get(ctx, "hello", metav1.GetOptions{})
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(pod.Status.Phase).To(Equal(corev1.PodSucceeded), "pod status: %v", pod.Status)
		logs, err := c.CoreV1().Pods("default").GetLogs("hello", &corev1.PodLogOptions{}).DoRaw(ctx)
		g.Expect(err).NotTo(HaveOccurred(), string(logs))
		g.Expect(string(logs)).To(Equal("hello from a pushed image\n"))
	}).WithContext(ctx).WithTimeout(2 * time.Minute).WithPolling(time.Second).Should(Succeed())
	t.Logf("the pushed image ran to completion %.1f s after its pod's creation", time.Since(start).Seconds())

	link := worker.network.Bridge
	g.Expect(worker.Stop()).To(Succeed())
	g.Expect(exec.Command("ip", "link", "show", link).Run()).To(HaveOccurred(), "link %s left behind", link)
	g.Expect(worker.namespace.Exited()).To(BeTrue())
	link = vm.network.Bridge
	g.Expect(vm.Stop()).To(Succeed())
	g.Expect(exec.Command("ip", "link", "show", link).Run()).To(HaveOccurred(), "link %s left behind", link)
	g.Expect(vm.namespace.Exited()).To(BeTrue())
}
