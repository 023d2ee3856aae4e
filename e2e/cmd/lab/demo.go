package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	"pvbridge.io/e2e/deploy"
)

// demo provisions a PMEM volume for a pod on host-b of the management cluster, writes to it
// and shows the objects involved.
func demo(ctx context.Context, m *deploy.Management, kubectl string) error {
	const ns = "demo"
	cp, c := m.CP, m.CP.Client()
	fmt.Println("\ndemo: a PVC and a pod on host-b in the management cluster (StorageClass pmem)")
	if _, err := c.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		return err
	}
	if _, err := c.CoreV1().PersistentVolumeClaims(ns).Create(ctx, deploy.PVC(ns, "data", deploy.StorageClassPmem, "256Mi", false), metav1.CreateOptions{}); err != nil {
		return err
	}
	if _, err := c.CoreV1().Pods(ns).Create(ctx, deploy.Pod(ns, "app", "data", "host-b", false), metav1.CreateOptions{}); err != nil {
		return err
	}
	start := time.Now()
	var pod *corev1.Pod
	err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		var err error
		pod, err = c.CoreV1().Pods(ns).Get(ctx, "app", metav1.GetOptions{})
		return err == nil && pod.Status.Phase == corev1.PodRunning, nil
	})
	if err != nil {
		return fmt.Errorf("pod app is not running: %w", err)
	}
	pvc, err := c.CoreV1().PersistentVolumeClaims(ns).Get(ctx, "data", metav1.GetOptions{})
	if err != nil {
		return err
	}
	fmt.Printf("demo: pod running with its volume mounted after %.1fs\n", time.Since(start).Seconds())
	path := deploy.PodVolumePath(m.Hosts[1].Node, pod.UID, pvc.Spec.VolumeName, false)
	if err := os.WriteFile(filepath.Join(path, "hello.txt"), []byte("hello from pvbridge\n"), 0o644); err != nil {
		return err
	}
	fmt.Printf("demo: wrote %s (the pod's /data)\n\n", filepath.Join(path, "hello.txt"))
	cmd := exec.CommandContext(ctx, kubectl, "--kubeconfig", cp.Kubeconfig, "get", "pvc,pv,pmemvolumes,pmemnodes", "-A", "-o", "wide")
	cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
	return cmd.Run()
}
