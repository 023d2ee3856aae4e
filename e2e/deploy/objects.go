package deploy

import (
	"context"
	"fmt"
	"path/filepath"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"

	"pvbridge.io/e2e/cluster"
)

// PVC returns a claim of size in namespace ns. block makes it a raw block volume.
func PVC(ns, name, storageClass, size string, block bool) *corev1.PersistentVolumeClaim {
	pvc := &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			Resources:   corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse(size)}},
		},
	}
	if storageClass != "" { // "" is the default class
		pvc.Spec.StorageClassName = ptr.To(storageClass)
	}
	if block {
		pvc.Spec.VolumeMode = ptr.To(corev1.PersistentVolumeBlock)
	}
	return pvc
}

// Pod returns a pod that uses claim, mounted at /data (or as the device /dev/data for a block
// claim), on node when node is set (through the scheduler, with a node selector). Pods in the
// lab run no processes; the kubelet still stages and publishes their volumes.
func Pod(ns, name, claim, node string, block bool) *corev1.Pod {
	c := corev1.Container{Name: "app", Image: "busybox"}
	if block {
		c.VolumeDevices = []corev1.VolumeDevice{{Name: "data", DevicePath: "/dev/data"}}
	} else {
		c.VolumeMounts = []corev1.VolumeMount{{Name: "data", MountPath: "/data"}}
	}
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec: corev1.PodSpec{
			// No service account token: it would be a tmpfs mount per pod on the host.
			AutomountServiceAccountToken:  ptr.To(false),
			TerminationGracePeriodSeconds: ptr.To[int64](0),
			Containers:                    []corev1.Container{c},
			Volumes: []corev1.Volume{{Name: "data", VolumeSource: corev1.VolumeSource{
				PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: claim},
			}}},
		},
	}
	if node != "" {
		pod.Spec.NodeSelector = map[string]string{corev1.LabelHostname: node}
	}
	return pod
}

// PodVolumePath is where the kubelet of node published a pod's volume: the mount point of a
// filesystem volume or the device file of a block volume, as seen from the host (the lab runs
// no container, so this is what a container would see).
func PodVolumePath(node *cluster.Node, podUID types.UID, pvName string, block bool) string {
	if block {
		return filepath.Join(node.KubeletDir, "pods", string(podUID), "volumeDevices", "kubernetes.io~csi", pvName)
	}
	return filepath.Join(node.KubeletDir, "pods", string(podUID), "volumes", "kubernetes.io~csi", pvName, "mount")
}

// CreateNamespace creates a namespace for one test.
func CreateNamespace(ctx context.Context, c kubernetes.Interface, prefix string) (string, error) {
	ns, err := c.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{GenerateName: prefix + "-"}}, metav1.CreateOptions{})
	if err != nil {
		return "", fmt.Errorf("create namespace: %w", err)
	}
	return ns.Name, nil
}
