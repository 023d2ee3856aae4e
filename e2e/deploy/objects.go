package deploy

import (
	"context"
	"fmt"
	"path/filepath"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pvbridge.io/e2e/cluster"
	"pvbridge.io/pkg/names"
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

// ImportedPV returns a guest PV named name for management PVC handle, as an operator imports a
// volume (static provisioning): pre-bound to claim, of its size and class, ext4, reclaim policy
// Delete (which only releases the management PVC), on the VMs of host when host is set. The
// caller names the PV in claim.Spec.VolumeName.
func ImportedPV(name, handle, host string, claim *corev1.PersistentVolumeClaim) *corev1.PersistentVolume {
	pv := &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: corev1.PersistentVolumeSpec{
			Capacity:                      corev1.ResourceList{corev1.ResourceStorage: claim.Spec.Resources.Requests[corev1.ResourceStorage]},
			AccessModes:                   []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			PersistentVolumeReclaimPolicy: corev1.PersistentVolumeReclaimDelete,
			StorageClassName:              ptr.Deref(claim.Spec.StorageClassName, ""),
			ClaimRef:                      &corev1.ObjectReference{Namespace: claim.Namespace, Name: claim.Name},
			PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{
				Driver: names.GuestDriver, VolumeHandle: handle, FSType: "ext4",
			}},
		},
	}
	if host != "" {
		pv.Spec.NodeAffinity = &corev1.VolumeNodeAffinity{Required: &corev1.NodeSelector{NodeSelectorTerms: []corev1.NodeSelectorTerm{{
			MatchExpressions: []corev1.NodeSelectorRequirement{{Key: names.GuestTopologyKey, Operator: corev1.NodeSelectorOpIn, Values: []string{host}}},
		}}}}
	}
	return pv
}

// Pod returns a pod that uses claim, mounted at /data (or as the device /dev/data for a block
// claim), on node when node is set (through the scheduler, with a node selector). Pods in the
// lab run no processes; the kubelet still stages and publishes their volumes.
func Pod(ns, name, claim, node string, block bool) *corev1.Pod {
	// The lab's nodes have busybox imported and reach no registry.
	// In a real container it sleeps until deleted; the fake runtime runs no command.
	c := corev1.Container{Name: "app", Image: "busybox", ImagePullPolicy: corev1.PullIfNotPresent, Command: []string{"sleep", "infinity"}}
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

// StatefulSet returns a StatefulSet of replicas pods, each with its own claim "data-<name>-<i>"
// of size in the default class, mounted at /data, started in parallel. Its pods are ordinary
// ones: their service account token is mounted.
func StatefulSet(ns, name string, replicas int32, size string) *appsv1.StatefulSet {
	labels := map[string]string{"app": name}
	claim := PVC("", "data", "", size, false)
	return &appsv1.StatefulSet{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec: appsv1.StatefulSetSpec{
			Replicas:            ptr.To(replicas),
			ServiceName:         name,
			PodManagementPolicy: appsv1.ParallelPodManagement,
			Selector:            &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec: corev1.PodSpec{
					TerminationGracePeriodSeconds: ptr.To[int64](0),
					Containers: []corev1.Container{{
						Name: "app", Image: "busybox", ImagePullPolicy: corev1.PullIfNotPresent, Command: []string{"sleep", "infinity"},
						VolumeMounts: []corev1.VolumeMount{{Name: "data", MountPath: "/data"}},
					}},
				},
			},
			VolumeClaimTemplates: []corev1.PersistentVolumeClaim{{ObjectMeta: metav1.ObjectMeta{Name: "data"}, Spec: claim.Spec}},
		},
	}
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

// CreateNamespace creates a namespace for one test and returns once it takes pods: its
// default ServiceAccount, which the apiserver's admission looks up for every pod and
// kube-controller-manager makes after the namespace (a loaded machine's took seconds, and a
// pod created before it was refused).
func CreateNamespace(ctx context.Context, c kubernetes.Interface, prefix string) (string, error) {
	ns, err := c.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{GenerateName: prefix + "-"}}, metav1.CreateOptions{})
	if err != nil {
		return "", fmt.Errorf("create namespace: %w", err)
	}
	err = wait.PollUntilContextTimeout(ctx, 50*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		_, err := c.CoreV1().ServiceAccounts(ns.Name).Get(ctx, "default", metav1.GetOptions{})
		return err == nil, client.IgnoreNotFound(err)
	})
	if err != nil {
		return "", fmt.Errorf("the default ServiceAccount of namespace %s: %w", ns.Name, err)
	}
	return ns.Name, nil
}
