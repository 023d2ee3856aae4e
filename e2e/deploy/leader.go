package deploy

import (
	"context"
	"fmt"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"
)

// DeleteLeader deletes the pod, of the two Running pods selector picks in namespace, that holds
// the leader election Lease lease, and waits until another pod holds it: the standby, which
// tries every 2 s, unless the deleted pod's replacement started first. It returns the deleted
// pod's name. A pod's hostname, the first part of controller-runtime's holder identity, is its
// name.
func DeleteLeader(ctx context.Context, c kubernetes.Interface, namespace, lease, selector string) (string, error) {
	var leader string
	var last error
	err := wait.PollUntilContextTimeout(ctx, time.Second, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		leader, last = leaderPod(ctx, c, namespace, lease, selector)
		return last == nil, nil
	})
	if err != nil {
		return "", fmt.Errorf("the leader of %s: %w (%w)", lease, err, last)
	}
	if err := c.CoreV1().Pods(namespace).Delete(ctx, leader, metav1.DeleteOptions{}); err != nil {
		return "", err
	}
	var holder string
	err = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		holder, last = holderOf(ctx, c, namespace, lease)
		return last == nil && holder != "" && !strings.HasPrefix(holder, leader+"_"), nil
	})
	if err != nil {
		return "", fmt.Errorf("no other pod took Lease %s over from %s (held by %q): %w", lease, leader, holder, err)
	}
	return leader, nil
}

// leaderPod returns the name of the pod that holds lease, once selector picks two Running pods.
func leaderPod(ctx context.Context, c kubernetes.Interface, namespace, lease, selector string) (string, error) {
	pods, err := c.CoreV1().Pods(namespace).List(ctx, metav1.ListOptions{LabelSelector: selector})
	if err != nil {
		return "", err
	}
	if len(pods.Items) != 2 {
		return "", fmt.Errorf("%d pods %s, not the 2 replicas the manifests run", len(pods.Items), selector)
	}
	holder, err := holderOf(ctx, c, namespace, lease)
	if err != nil {
		return "", err
	}
	leader := ""
	for _, p := range pods.Items {
		if p.Status.Phase != corev1.PodRunning {
			return "", fmt.Errorf("pod %s is %s", p.Name, p.Status.Phase)
		}
		if strings.HasPrefix(holder, p.Name+"_") {
			leader = p.Name
		}
	}
	if leader == "" {
		return "", fmt.Errorf("lease %s is held by %q, none of the pods", lease, holder)
	}
	return leader, nil
}

// holderOf returns the holder of Lease name.
func holderOf(ctx context.Context, c kubernetes.Interface, namespace, name string) (string, error) {
	l, err := c.CoordinationV1().Leases(namespace).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return "", err
	}
	return ptr.Deref(l.Spec.HolderIdentity, ""), nil
}
