package controller

import (
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"

	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/pkg/names"
)

// Builders of the objects the tests feed the reconcilers. Each takes optional mutators.

const testNamespace = "tenant-a"

func volume(name, claim string) vmv1.VirtualMachineVolume {
	return vmv1.VirtualMachineVolume{Name: name, PersistentVolumeClaim: vmv1.PersistentVolumeClaimVolumeSource{ClaimName: claim}}
}

func newVM(name string, mutate ...func(*vmv1.VirtualMachine)) *vmv1.VirtualMachine {
	vm := &vmv1.VirtualMachine{
		ObjectMeta: metav1.ObjectMeta{Namespace: testNamespace, Name: name, UID: types.UID("uid-" + name), Generation: 1},
		Spec:       vmv1.VirtualMachineSpec{PowerState: vmv1.PowerStateOn},
	}
	for _, m := range mutate {
		m(vm)
	}
	return vm
}

func withVolumes(vols ...vmv1.VirtualMachineVolume) func(*vmv1.VirtualMachine) {
	return func(vm *vmv1.VirtualMachine) { vm.Spec.Volumes = vols }
}

func withStatusVolumes(entries ...vmv1.VirtualMachineVolumeStatus) func(*vmv1.VirtualMachine) {
	return func(vm *vmv1.VirtualMachine) { vm.Status.Volumes = entries }
}

func onHost(host string) func(*vmv1.VirtualMachine) {
	return func(vm *vmv1.VirtualMachine) { vm.Status.Host = host }
}

func withFinalizer(vm *vmv1.VirtualMachine) { vm.Finalizers = []string{vmv1.VolumesFinalizer} }

func deleted(vm *vmv1.VirtualMachine) {
	vm.DeletionTimestamp = &metav1.Time{Time: time.Now()}
	if len(vm.Finalizers) == 0 {
		vm.Finalizers = []string{vmv1.VolumesFinalizer}
	}
}

func newPVC(name, pv string, mutate ...func(*corev1.PersistentVolumeClaim)) *corev1.PersistentVolumeClaim {
	c := &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Namespace: testNamespace, Name: name},
		Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			VolumeMode:  ptr.To(corev1.PersistentVolumeBlock),
			VolumeName:  pv,
			Resources:   corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("64Mi")}},
		},
		Status: corev1.PersistentVolumeClaimStatus{Phase: corev1.ClaimBound},
	}
	if pv == "" {
		c.Status.Phase = corev1.ClaimPending
	}
	for _, m := range mutate {
		m(c)
	}
	return c
}

// newPV is a Block PMEM volume on host.
func newPV(name, host string, mutate ...func(*corev1.PersistentVolume)) *corev1.PersistentVolume {
	pv := &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: corev1.PersistentVolumeSpec{
			Capacity:    corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("64Mi")},
			AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			VolumeMode:  ptr.To(corev1.PersistentVolumeBlock),
			PersistentVolumeSource: corev1.PersistentVolumeSource{
				CSI: &corev1.CSIPersistentVolumeSource{Driver: names.PmemDriver, VolumeHandle: "handle-" + name},
			},
			NodeAffinity: &corev1.VolumeNodeAffinity{Required: &corev1.NodeSelector{
				NodeSelectorTerms: []corev1.NodeSelectorTerm{{MatchExpressions: []corev1.NodeSelectorRequirement{
					{Key: names.PmemTopologyKey, Operator: corev1.NodeSelectorOpIn, Values: []string{host}},
				}}},
			}},
		},
	}
	for _, m := range mutate {
		m(pv)
	}
	return pv
}

// newVA is the VolumeAttachment the controller makes for volume of the VirtualMachine vmName.
func newVA(vmName, volumeName, pv, host string, mutate ...func(*storagev1.VolumeAttachment)) *storagev1.VolumeAttachment {
	va := &storagev1.VolumeAttachment{
		ObjectMeta: metav1.ObjectMeta{
			Name: vmv1.AttachmentName(testNamespace, vmName, volumeName),
			UID:  types.UID("uid-" + vmv1.AttachmentName(testNamespace, vmName, volumeName)),
			Labels: map[string]string{
				vmv1.VMNamespaceLabel: testNamespace, vmv1.VMNameLabel: vmName,
			},
			Annotations: map[string]string{vmv1.VolumeAnnotation: volumeName},
		},
		Spec: storagev1.VolumeAttachmentSpec{
			Attacher: names.PmemDriver, NodeName: host,
			Source: storagev1.VolumeAttachmentSource{PersistentVolumeName: ptr.To(pv)},
		},
	}
	for _, m := range mutate {
		m(va)
	}
	return va
}

func attached(va *storagev1.VolumeAttachment) { va.Status.Attached = true }

func attachError(msg string) func(*storagev1.VolumeAttachment) {
	return func(va *storagev1.VolumeAttachment) { va.Status.AttachError = &storagev1.VolumeError{Message: msg} }
}

func newNode(name string, mutate ...func(*corev1.Node)) *corev1.Node {
	n := &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{vmv1.HostLabel: "true"}},
		Status: corev1.NodeStatus{Conditions: []corev1.NodeCondition{
			{Type: corev1.NodeReady, Status: corev1.ConditionTrue},
		}},
	}
	for _, m := range mutate {
		m(n)
	}
	return n
}
