package chain

import (
	"testing"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"

	pmemv1 "pvbridge.io/pkg/apis/pmem/v1alpha1"
	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/pkg/names"
)

const (
	mgmtNS = "tenant-a"
	handle = "c1-pv1"
)

// healthy returns the objects of a guest volume attached to vm-1: guest side, management side.
func healthy() ([]client.Object, []client.Object) {
	guest := []client.Object{
		&corev1.PersistentVolumeClaim{
			ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: "data"},
			Spec:       corev1.PersistentVolumeClaimSpec{VolumeName: "pv1"},
			Status:     corev1.PersistentVolumeClaimStatus{Phase: corev1.ClaimBound},
		},
		&corev1.PersistentVolume{
			ObjectMeta: metav1.ObjectMeta{Name: "pv1"},
			Spec: corev1.PersistentVolumeSpec{PersistentVolumeSource: corev1.PersistentVolumeSource{
				CSI: &corev1.CSIPersistentVolumeSource{Driver: names.GuestDriver, VolumeHandle: handle},
			}},
			Status: corev1.PersistentVolumeStatus{Phase: corev1.VolumeBound},
		},
		&storagev1.VolumeAttachment{
			ObjectMeta: metav1.ObjectMeta{Name: "csi-1"},
			Spec:       storagev1.VolumeAttachmentSpec{NodeName: "vm-1", Source: storagev1.VolumeAttachmentSource{PersistentVolumeName: ptr.To("pv1")}},
			Status:     storagev1.VolumeAttachmentStatus{Attached: true},
		},
	}
	mgmt := []client.Object{
		&corev1.PersistentVolumeClaim{
			ObjectMeta: metav1.ObjectMeta{Namespace: mgmtNS, Name: handle},
			Spec:       corev1.PersistentVolumeClaimSpec{VolumeName: "mpv1"},
			Status:     corev1.PersistentVolumeClaimStatus{Phase: corev1.ClaimBound},
		},
		&corev1.PersistentVolume{
			ObjectMeta: metav1.ObjectMeta{Name: "mpv1"},
			Spec: corev1.PersistentVolumeSpec{
				PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{Driver: names.PmemDriver, VolumeHandle: "pmem-1"}},
				NodeAffinity: &corev1.VolumeNodeAffinity{Required: &corev1.NodeSelector{NodeSelectorTerms: []corev1.NodeSelectorTerm{{
					MatchExpressions: []corev1.NodeSelectorRequirement{{Key: names.PmemTopologyKey, Operator: corev1.NodeSelectorOpIn, Values: []string{"host-a"}}},
				}}}},
			},
			Status: corev1.PersistentVolumeStatus{Phase: corev1.VolumeBound},
		},
		&pmemv1.PmemVolume{
			ObjectMeta: metav1.ObjectMeta{Name: "pmem-1"},
			Spec:       pmemv1.PmemVolumeSpec{Node: "host-a", VolumeID: "pmem-1"},
			Status: pmemv1.PmemVolumeStatus{Device: "/dev/loop3", Conditions: []metav1.Condition{{
				Type: pmemv1.ReadyCondition, Status: metav1.ConditionTrue, Reason: "Created",
			}}},
		},
		&vmv1.VirtualMachine{
			ObjectMeta: metav1.ObjectMeta{Namespace: mgmtNS, Name: "vm-1"},
			Spec: vmv1.VirtualMachineSpec{Volumes: []vmv1.VirtualMachineVolume{{
				Name: handle, PersistentVolumeClaim: vmv1.PersistentVolumeClaimVolumeSource{ClaimName: handle},
			}}},
			Status: vmv1.VirtualMachineStatus{Host: "host-a", Volumes: []vmv1.VirtualMachineVolumeStatus{{Name: handle, Attached: true, DiskSerial: "pvb0123"}}},
		},
		&storagev1.VolumeAttachment{
			ObjectMeta: metav1.ObjectMeta{Name: vmv1.AttachmentName(mgmtNS, "vm-1", handle)},
			Spec:       storagev1.VolumeAttachmentSpec{NodeName: "host-a", Attacher: names.PmemDriver},
			Status:     storagev1.VolumeAttachmentStatus{Attached: true},
		},
	}
	return guest, mgmt
}

func TestTrace(t *testing.T) {
	scheme := runtime.NewScheme()
	for _, add := range []func(*runtime.Scheme) error{clientgoscheme.AddToScheme, vmv1.AddToScheme, pmemv1.AddToScheme} {
		if err := add(scheme); err != nil {
			t.Fatal(err)
		}
	}
	for _, tt := range []struct {
		name string
		// change breaks the healthy chain; nil leaves it healthy.
		change    func(guest, mgmt []client.Object)
		wantStuck string
		wantWhy   string
	}{
		{name: "a healthy volume is done at every step"},
		{
			name: "a refused attach is held by the guest VolumeAttachment, with guest-csi's reason",
			change: func(guest, mgmt []client.Object) {
				va := guest[2].(*storagev1.VolumeAttachment)
				va.Status = storagev1.VolumeAttachmentStatus{AttachError: &storagev1.VolumeError{Message: "management PVC x was not created for cluster alpha and is not shared with it"}}
				vm := mgmt[3].(*vmv1.VirtualMachine)
				vm.Spec.Volumes, vm.Status.Volumes = nil, nil
			},
			wantStuck: "guest VolumeAttachment csi-1 (node vm-1)",
			wantWhy:   "is not shared with it",
		},
		{
			name: "a hot-plug error is held by the VirtualMachine, with vm-operator's reason",
			change: func(_, mgmt []client.Object) {
				mgmt[3].(*vmv1.VirtualMachine).Status.Volumes[0] = vmv1.VirtualMachineVolumeStatus{Name: handle, Error: "hot-plug: no room on the bus"}
			},
			wantStuck: "VirtualMachine tenant-a/vm-1",
			wantWhy:   "status.volumes: hot-plug: no room on the bus",
		},
		{
			name: "a volume without room is held by its PmemVolume",
			change: func(_, mgmt []client.Object) {
				mgmt[2].(*pmemv1.PmemVolume).Status.Conditions[0] = metav1.Condition{Type: pmemv1.ReadyCondition, Status: metav1.ConditionFalse,
					Reason: pmemv1.InsufficientCapacityReason, Message: "64Mi left"}
			},
			wantStuck: "PmemVolume pmem-1",
			wantWhy:   "host host-a: InsufficientCapacity: 64Mi left",
		},
		{
			name: "a management PVC that is gone fails the chain there",
			change: func(_, mgmt []client.Object) {
				mgmt[0].SetName("other")
			},
			wantStuck: "management PVC tenant-a/c1-pv1",
			wantWhy:   "not found",
		},
	} {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			guest, mgmt := healthy()
			if tt.change != nil {
				tt.change(guest, mgmt)
			}
			tr := &Tracer{
				Guest:         fake.NewClientBuilder().WithScheme(scheme).WithObjects(guest...).Build(),
				Mgmt:          fake.NewClientBuilder().WithScheme(scheme).WithObjects(mgmt...).Build(),
				MgmtNamespace: mgmtNS,
			}
			steps, err := tr.PVC(t.Context(), "default", "data")
			g.Expect(err).NotTo(HaveOccurred())
			stuck := Stuck(steps)
			if tt.wantStuck == "" {
				g.Expect(stuck).To(BeNil(), "%+v", steps)
				g.Expect(steps).To(HaveEach(HaveField("State", Done)))
				g.Expect(steps).To(HaveLen(8), "PVC, PV, management PVC, PV, PmemVolume, guest VolumeAttachment, VM, management VolumeAttachment")
				return
			}
			g.Expect(stuck).NotTo(BeNil(), "%+v", steps)
			g.Expect(stuck.Object).To(Equal(tt.wantStuck), "%+v", steps)
			g.Expect(stuck.Why).To(ContainSubstring(tt.wantWhy))
		})
	}
}

func TestReplicatedVolumeStep(t *testing.T) {
	ready := &metav1.Condition{Type: pmemv1.ReadyCondition, Status: metav1.ConditionTrue}
	vol := func(target string, degraded bool) *pmemv1.PmemVolume {
		v := &pmemv1.PmemVolume{ObjectMeta: metav1.ObjectMeta{Name: "pvc-1"}, Spec: pmemv1.PmemVolumeSpec{Replicas: 2}, Status: pmemv1.PmemVolumeStatus{Target: target}}
		if degraded {
			v.Status.Conditions = []metav1.Condition{{Type: pmemv1.DegradedCondition, Status: metav1.ConditionTrue, Message: "1 of 2 replicas faulted: pvc-1-r0 on node host-a"}}
		}
		return v
	}
	for _, tc := range []struct {
		name   string
		vol    *pmemv1.PmemVolume
		ready  *metav1.Condition
		state  State
		detail string
		why    string
	}{
		{name: "replicas being made", vol: vol("", false), state: Waiting, why: "its 2 replicas are not all made yet (kubectl get pmemreplicas -l pmem.pvbridge.io/volume=pvc-1)"},
		{name: "ready, staged nowhere", vol: vol("", false), ready: ready, state: Done, detail: "Ready: 2 replicas"},
		{name: "ready, served by a host", vol: vol("host-b", false), ready: ready, state: Done, detail: "Ready: 2 replicas, served by host host-b"},
		{
			name: "degraded", vol: vol("host-b", true), ready: ready, state: Done,
			detail: "Ready: 2 replicas, served by host host-b; degraded: 1 of 2 replicas faulted: pvc-1-r0 on node host-a",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			got := replicatedStep(Step{Object: "PmemVolume pvc-1"}, tc.vol, tc.ready)
			g.Expect(got.State).To(Equal(tc.state))
			g.Expect(got.Detail).To(Equal(tc.detail))
			g.Expect(got.Why).To(Equal(tc.why))
		})
	}
}
