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

	"pvbridge.io/e2e/cluster"
	"pvbridge.io/e2e/deploy"
)

// demoLab is what the demo needs of a lab.
type demoLab struct {
	mgmt, guest *cluster.ControlPlane
	// guestNodes are keyed by VM name.
	guestNodes map[string]*cluster.Node
	// containers: the pods run in real containers (and kubectl exec works).
	containers bool
	// vm is the guest node of the demo's pod; capi: the guest was made by Cluster API.
	vm   string
	capi bool
	// registry is the address of the registry the guest's VMs pull from, if any.
	registry string
}

// demo gives a pod of the guest cluster a volume through both layers: a guest PVC (default
// StorageClass), mirrored into the management cluster, provisioned from the PMEM of the host
// of VM d.vm, hot-plugged into the VM and mounted there; it writes to it and shows the objects
// involved.
func demo(ctx context.Context, d demoLab, kubectl string) error {
	const ns = "demo"
	vm := d.vm
	c := d.guest.Client()
	fmt.Printf("\ndemo: a PVC and a pod on %s in the guest cluster (default StorageClass %s)\n", vm, deploy.StorageClassGuest)
	if _, err := c.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		return err
	}
	if _, err := c.CoreV1().PersistentVolumeClaims(ns).Create(ctx, deploy.PVC(ns, "data", "", "256Mi", false), metav1.CreateOptions{}); err != nil {
		return err
	}
	if _, err := c.CoreV1().Pods(ns).Create(ctx, deploy.Pod(ns, "app", "data", vm, false), metav1.CreateOptions{}); err != nil {
		return err
	}
	start := time.Now()
	var pod *corev1.Pod
	err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 3*time.Minute, true, func(ctx context.Context) (bool, error) {
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
	if d.containers {
		cmd := exec.CommandContext(ctx, kubectl, "--kubeconfig", d.guest.Kubeconfig, "exec", "-n", ns, "app", "--",
			"sh", "-c", "echo hello from pvbridge > /data/hello.txt && df -h /data")
		cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
		if err := cmd.Run(); err != nil {
			return err
		}
		fmt.Println("demo: wrote /data/hello.txt in the pod's container (kubectl exec)")
	} else {
		// The fake runtime runs no container: write where the container would see its /data.
		path := filepath.Join(deploy.PodVolumePath(d.guestNodes[vm], pod.UID, pvc.Spec.VolumeName, false), "hello.txt")
		if err := os.WriteFile(path, []byte("hello from pvbridge\n"), 0o644); err != nil {
			return err
		}
		fmt.Printf("demo: wrote %s (the pod's /data)\n", path)
	}
	for _, step := range []struct {
		title, kubeconfig string
		args              []string
	}{
		{"guest cluster: the PVC, its PV and the VolumeAttachment to " + vm, d.guest.Kubeconfig, []string{"get", "pvc,pv,volumeattachments", "-A"}},
		{"management cluster: the mirrored PVC, its PMEM volume and the attachment to its host", d.mgmt.Kubeconfig, []string{"get", "pvc,volumeattachments,pmemvolumes", "-A"}},
		{"management cluster: " + vm + "'s volumes", d.mgmt.Kubeconfig, []string{"get", "virtualmachine", "-n", guest.Namespace, vm, "-o", "jsonpath={.status.volumes}"}},
		{capiTitle(d), d.mgmt.Kubeconfig, []string{"get", "clusters,machines", "-A"}},
	} {
		if step.title == "" {
			continue
		}
		fmt.Printf("\n%s:\n", step.title)
		cmd := exec.CommandContext(ctx, kubectl, append([]string{"--kubeconfig", step.kubeconfig}, step.args...)...)
		cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
		if err := cmd.Run(); err != nil {
			return err
		}
	}
	fmt.Println()
	return nil
}

// capiTitle titles the Cluster API objects of a guest made by Cluster API, or is empty.
func capiTitle(d demoLab) string {
	if !d.capi {
		return ""
	}
	return "management cluster: the guest's Cluster and Machines (Cluster API)"
}
