package main

import (
	"testing"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	clientfake "sigs.k8s.io/controller-runtime/pkg/client/fake"

	pmemv1 "pvbridge.io/pkg/apis/pmem/v1alpha1"
	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
)

func fakeClient(t *testing.T, objs ...client.Object) client.Client {
	t.Helper()
	scheme, err := newScheme()
	if err != nil {
		t.Fatal(err)
	}
	return clientfake.NewClientBuilder().WithScheme(scheme).WithObjects(objs...).Build()
}

func node(name string, host, ready bool, taints ...string) *corev1.Node {
	n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{}}}
	if host {
		n.Labels[vmv1.HostLabel] = "true"
	}
	status := corev1.ConditionFalse
	if ready {
		status = corev1.ConditionTrue
	}
	n.Status.Conditions = []corev1.NodeCondition{{Type: corev1.NodeReady, Status: status}}
	for _, key := range taints {
		n.Spec.Taints = append(n.Spec.Taints, corev1.Taint{Key: key, Effect: corev1.TaintEffectNoSchedule})
	}
	return n
}

func TestListHosts(t *testing.T) {
	g := NewWithT(t)
	onNode := func(n string) map[string]string { return map[string]string{pmemv1.NodeLabel: n} }
	retired := &pmemv1.PmemReplica{ObjectMeta: metav1.ObjectMeta{Name: "r-old", Labels: onNode("host-b")}, Spec: pmemv1.PmemReplicaSpec{Node: "host-b"}}
	retired.Status.Conditions = []metav1.Condition{{Type: pmemv1.ReadyCondition, Status: metav1.ConditionFalse, Reason: pmemv1.RetiredReason, LastTransitionTime: metav1.Now()}}
	c := fakeClient(t,
		node("host-a", true, true),
		node("host-b", true, false, vmv1.DrainTaint),
		node("host-c", true, true, corev1.TaintNodeOutOfService),
		node("worker", false, true), // not a host: no label, no PmemNode
		&pmemv1.PmemNode{ObjectMeta: metav1.ObjectMeta{Name: "host-a"}, Status: pmemv1.PmemNodeStatus{
			Mode: pmemv1.ModeFile, Free: ptr.To(resource.MustParse("3Gi")), Total: ptr.To(resource.MustParse("4Gi"))}},
		&pmemv1.PmemNode{ObjectMeta: metav1.ObjectMeta{Name: "host-gone"}},
		&pmemv1.PmemVolume{ObjectMeta: metav1.ObjectMeta{Name: "v1", Labels: onNode("host-a")}},
		&pmemv1.PmemVolume{ObjectMeta: metav1.ObjectMeta{Name: "v2", Labels: onNode("host-a")}},
		&pmemv1.PmemVolume{ObjectMeta: metav1.ObjectMeta{Name: "replicated"}},
		&pmemv1.PmemReplica{ObjectMeta: metav1.ObjectMeta{Name: "r-live", Labels: onNode("host-b")}, Spec: pmemv1.PmemReplicaSpec{Node: "host-b"}},
		retired,
		&vmv1.VirtualMachine{ObjectMeta: metav1.ObjectMeta{Namespace: "t", Name: "vm-1"}, Status: vmv1.VirtualMachineStatus{
			Host: "host-a", MaxVolumes: ptr.To[int32](16),
			Volumes: []vmv1.VirtualMachineVolumeStatus{{Name: "a", Attached: true}, {Name: "b"}}}},
		&vmv1.VirtualMachine{ObjectMeta: metav1.ObjectMeta{Namespace: "t", Name: "vm-2"}, Status: vmv1.VirtualMachineStatus{
			Host: "host-a", MaxVolumes: ptr.To[int32](16), Volumes: []vmv1.VirtualMachineVolumeStatus{{Name: "a", Attached: true}}}},
		&vmv1.VirtualMachine{ObjectMeta: metav1.ObjectMeta{Namespace: "t", Name: "pending"}},
	)

	rows, err := listHosts(t.Context(), c)

	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(rows).To(Equal([]hostRow{
		{Name: "host-a", State: "Ready", PmemMode: "file", PmemFree: "3Gi", PmemTotal: "4Gi", Volumes: 2, VMs: 2, Disks: 2, Slots: 32},
		{Name: "host-b", State: "NotReady,Drained", Replicas: 1},
		{Name: "host-c", State: "Ready,Lost"},
		{Name: "host-gone", State: "NotFound"},
	}))
}

func TestReadVM(t *testing.T) {
	g := NewWithT(t)
	vm := &vmv1.VirtualMachine{
		ObjectMeta: metav1.ObjectMeta{Namespace: "tenant-a", Name: "vm-1"},
		Spec: vmv1.VirtualMachineSpec{Volumes: []vmv1.VirtualMachineVolume{
			{Name: "data", PersistentVolumeClaim: vmv1.PersistentVolumeClaimVolumeSource{ClaimName: "pvc-data"}},
			{Name: "logs", PersistentVolumeClaim: vmv1.PersistentVolumeClaimVolumeSource{ClaimName: "pvc-logs"}},
			{Name: "gone", PersistentVolumeClaim: vmv1.PersistentVolumeClaimVolumeSource{ClaimName: "pvc-gone"}},
		}},
		Status: vmv1.VirtualMachineStatus{Host: "host-a", Phase: vmv1.PhaseRunning, MaxVolumes: ptr.To[int32](16), Volumes: []vmv1.VirtualMachineVolumeStatus{
			{Name: "data", Attached: true, DiskSerial: "abc123"},
			{Name: "logs", Error: "no free slot"},
		}},
	}
	claim := func(name, pv string) *corev1.PersistentVolumeClaim {
		return &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Namespace: "tenant-a", Name: name}, Spec: corev1.PersistentVolumeClaimSpec{VolumeName: pv}}
	}
	va := func(name, pv, node string, attached bool) *storagev1.VolumeAttachment {
		return &storagev1.VolumeAttachment{ObjectMeta: metav1.ObjectMeta{Name: name},
			Spec:   storagev1.VolumeAttachmentSpec{NodeName: node, Source: storagev1.VolumeAttachmentSource{PersistentVolumeName: ptr.To(pv)}},
			Status: storagev1.VolumeAttachmentStatus{Attached: attached}}
	}
	c := fakeClient(t, vm, claim("pvc-data", "pv-data"), claim("pvc-logs", "pv-logs"),
		va("csi-data", "pv-data", "host-a", true), va("csi-data-elsewhere", "pv-data", "host-b", false), va("csi-logs", "pv-logs", "host-a", false))

	r, err := readVM(t.Context(), c, "tenant-a", "vm-1")

	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(r.Host).To(Equal("host-a"))
	g.Expect(r.Volumes).To(Equal([]vmVolume{
		{Name: "data", Claim: "pvc-data", PersistentVolume: "pv-data", VolumeAttachment: "csi-data", AttachmentAttached: true, HotPlugged: true, DiskSerial: "abc123"},
		{Name: "logs", Claim: "pvc-logs", PersistentVolume: "pv-logs", VolumeAttachment: "csi-logs", Error: "no free slot"},
		{Name: "gone", Claim: "pvc-gone", Error: "claim not found"},
	}))

	_, err = readVM(t.Context(), c, "tenant-a", "vm-9")
	g.Expect(err).To(MatchError(ContainSubstring("VirtualMachine tenant-a/vm-9")))
}
