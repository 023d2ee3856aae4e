package vmstatus

import (
	"errors"
	"net/http"
	"testing"

	. "github.com/onsi/gomega"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"

	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
)

func TestPatch(t *testing.T) {
	placed := metav1.Condition{Type: vmv1.PlacedCondition, Status: metav1.ConditionTrue, Reason: "Placed"}
	ready := metav1.Condition{Type: vmv1.ReadyCondition, Status: metav1.ConditionTrue, Reason: vmv1.PoweredOnReason}
	a, b := vmv1.VirtualMachineVolumeStatus{Name: "a"}, vmv1.VirtualMachineVolumeStatus{Name: "b", Attached: true, DiskSerial: "s"}
	tests := []struct {
		name      string
		base, vm  vmv1.VirtualMachineStatus
		wantType  types.PatchType // empty: no patch
		wantPatch string
	}{
		{
			name: "nothing changed",
			base: vmv1.VirtualMachineStatus{Volumes: []vmv1.VirtualMachineVolumeStatus{a, b}},
			vm:   vmv1.VirtualMachineStatus{Volumes: []vmv1.VirtualMachineVolumeStatus{a, b}},
		},
		{
			name: "only the order of entries changed",
			base: vmv1.VirtualMachineStatus{Volumes: []vmv1.VirtualMachineVolumeStatus{b, a}},
			vm:   vmv1.VirtualMachineStatus{Volumes: []vmv1.VirtualMachineVolumeStatus{a, b}},
		},
		{
			name:     "an entry appended to a list that exists, and a condition set",
			base:     vmv1.VirtualMachineStatus{Volumes: []vmv1.VirtualMachineVolumeStatus{a}, Conditions: []metav1.Condition{placed}},
			vm:       vmv1.VirtualMachineStatus{Volumes: []vmv1.VirtualMachineVolumeStatus{a, b}, Conditions: []metav1.Condition{placed, ready}},
			wantType: types.JSONPatchType,
			wantPatch: `[{"op":"add","path":"/status/volumes/-","value":{"name":"b","attached":true,"diskSerial":"s"}},
				{"op":"add","path":"/status/conditions/-","value":{"type":"Ready","status":"True","lastTransitionTime":null,"reason":"PoweredOn","message":""}}]`,
		},
		{
			name:     "a compare and swap tests the entry as read",
			base:     vmv1.VirtualMachineStatus{Volumes: []vmv1.VirtualMachineVolumeStatus{a, b}},
			vm:       vmv1.VirtualMachineStatus{Volumes: []vmv1.VirtualMachineVolumeStatus{b}},
			wantType: types.JSONPatchType,
			wantPatch: `[{"op":"test","path":"/status/volumes/0","value":{"name":"a"}},
				{"op":"remove","path":"/status/volumes/0"}]`,
		},
		{
			name:      "the first entry of a list read empty: the whole list under the resourceVersion",
			base:      vmv1.VirtualMachineStatus{Host: "h"},
			vm:        vmv1.VirtualMachineStatus{Host: "h", Volumes: []vmv1.VirtualMachineVolumeStatus{a}},
			wantType:  types.MergePatchType,
			wantPatch: `{"metadata":{"resourceVersion":"7"},"status":{"volumes":[{"name":"a"}]}}`,
		},
		{
			name:      "another field: the merge patch",
			base:      vmv1.VirtualMachineStatus{Volumes: []vmv1.VirtualMachineVolumeStatus{a}},
			vm:        vmv1.VirtualMachineStatus{Volumes: []vmv1.VirtualMachineVolumeStatus{a}, Phase: vmv1.PhaseRunning},
			wantType:  types.MergePatchType,
			wantPatch: `{"metadata":{"resourceVersion":"7"},"status":{"phase":"Running"}}`,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			base := &vmv1.VirtualMachine{ObjectMeta: metav1.ObjectMeta{ResourceVersion: "7"}, Status: tt.base}
			vm := base.DeepCopy()
			vm.Status = tt.vm
			patch, err := Patch(base, vm)
			g.Expect(err).NotTo(HaveOccurred())
			if tt.wantType == "" {
				g.Expect(patch).To(BeNil())
				return
			}
			g.Expect(patch.Type()).To(Equal(tt.wantType))
			data, err := patch.Data(vm)
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(data).To(MatchJSON(tt.wantPatch))
		})
	}
}

func TestStale(t *testing.T) {
	g := NewWithT(t)
	gr := schema.GroupResource{Group: vmv1.GroupVersion.Group, Resource: "virtualmachines"}
	g.Expect(Stale(apierrors.NewConflict(gr, "vm-1", errors.New("modified")))).To(BeTrue(), "the merge patch's resourceVersion")
	g.Expect(Stale(apierrors.NewGenericServerResponse(http.StatusUnprocessableEntity, "PATCH", gr, "vm-1", "testing value /status/volumes/0/name failed", 0, false))).
		To(BeTrue(), "a JSON patch's test")
	g.Expect(Stale(apierrors.NewNotFound(gr, "vm-1"))).To(BeFalse())
}
