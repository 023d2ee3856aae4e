package capi_test

import (
	"context"
	"fmt"
	"os/exec"
	"strings"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"pvbridge.io/e2e/deploy"
)

// TestStatefulSetKeepsItsDataOnAClusterAPIGuest: a StatefulSet of 3 with a volume each on the
// guest that Cluster API made; each pod writes its name to its volume; every pod is deleted and
// comes back, and each reads its own data back in its container.
func TestStatefulSetKeepsItsDataOnAClusterAPIGuest(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	c := in.Guest.Client()
	ns, err := deploy.CreateNamespace(ctx, c, "sts")
	g.Expect(err).NotTo(HaveOccurred())

	start := time.Now()
	_, err = c.AppsV1().StatefulSets(ns).Create(ctx, deploy.StatefulSet(ns, "web", 3, "64Mi"), metav1.CreateOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	pods := waitPodsRunning(ctx, g, ns, 3)
	t.Logf("StatefulSet of 3: every pod Running with its volume %.0f s after its creation", time.Since(start).Seconds())
	for _, p := range pods {
		g.Expect(kubectl(ctx, "exec", "-n", ns, p.Name, "--", "sh", "-c", "echo "+p.Name+" > /data/name && sync")).To(BeEmpty())
	}

	g.Expect(c.CoreV1().Pods(ns).DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{LabelSelector: "app=web"})).To(Succeed())
	g.Eventually(func(g Gomega) {
		list, err := c.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: "app=web"})
		g.Expect(err).NotTo(HaveOccurred())
		for _, p := range list.Items {
			g.Expect(p.UID).NotTo(BeElementOf(uids(pods)), "pod %s not recreated yet", p.Name)
		}
	}).WithContext(ctx).WithTimeout(2 * time.Minute).Should(Succeed())
	for _, p := range waitPodsRunning(ctx, g, ns, 3) {
		g.Expect(kubectl(ctx, "exec", "-n", ns, p.Name, "--", "cat", "/data/name")).To(Equal(p.Name + "\n"))
	}
}

// waitPodsRunning waits until n pods of app=web run in ns, and returns them.
func waitPodsRunning(ctx context.Context, g Gomega, ns string, n int) []corev1.Pod {
	var pods []corev1.Pod
	g.Eventually(func(g Gomega) {
		list, err := in.Guest.Client().CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: "app=web"})
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(list.Items).To(HaveLen(n))
		for _, p := range list.Items {
			g.Expect(p.Status.Phase).To(Equal(corev1.PodRunning), "pod %s", p.Name)
		}
		pods = list.Items
	}).WithContext(ctx).WithTimeout(5 * time.Minute).WithPolling(time.Second).Should(Succeed())
	return pods
}

func uids(pods []corev1.Pod) []any {
	var u []any
	for _, p := range pods {
		u = append(u, p.UID)
	}
	return u
}

// kubectl runs kubectl against the guest and returns its output.
func kubectl(ctx context.Context, args ...string) (string, error) {
	bin, err := lab.Binaries().Tool("kubectl")
	if err != nil {
		return "", err
	}
	out, err := exec.CommandContext(ctx, bin, append([]string{"--kubeconfig", in.Guest.Kubeconfig}, args...)...).CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("kubectl %s: %w: %s", strings.Join(args, " "), err, out)
	}
	return string(out), nil
}
