package driver

import (
	"testing"

	. "github.com/onsi/gomega"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
)

// An edit whose caller stopped waiting is still queued or being written; the next edit of the
// same volume must follow it, not return at once.
func TestEditing(t *testing.T) {
	g := NewWithT(t)
	vm1, vm2 := client.ObjectKey{Namespace: "ns", Name: "vm-1"}, client.ObjectKey{Namespace: "ns", Name: "vm-2"}
	e := &volumeEdits{
		queues:  map[client.ObjectKey]*volumeBatch{vm1: {add: []string{"queued"}, remove: []string{"leaving"}}},
		writing: map[client.ObjectKey]*volumeBatch{vm1: {add: []string{"in-flight"}}},
	}
	g.Expect(e.editing(vm1, "queued")).To(BeTrue())
	g.Expect(e.editing(vm1, "in-flight")).To(BeTrue())
	g.Expect(e.editing(vm1, "leaving")).To(BeTrue())
	g.Expect(e.editing(vm1, "other")).To(BeFalse())
	g.Expect(e.editing(vm2, "queued")).To(BeFalse(), "another VM's edits")
	g.Expect((&volumeEdits{}).editing(vm1, "queued")).To(BeFalse())
}

func TestFull(t *testing.T) {
	vm := func(slots *int32, spec []string, status ...vmv1.VirtualMachineVolumeStatus) *vmv1.VirtualMachine {
		vm := &vmv1.VirtualMachine{Status: vmv1.VirtualMachineStatus{MaxVolumes: slots, Volumes: status}}
		for _, name := range spec {
			vm.Spec.Volumes = append(vm.Spec.Volumes, vmv1.VirtualMachineVolume{Name: name})
		}
		return vm
	}
	attached := func(name string) vmv1.VirtualMachineVolumeStatus {
		return vmv1.VirtualMachineVolumeStatus{Name: name, Attached: true, DiskSerial: "s-" + name}
	}
	tests := []struct {
		name string
		vm   *vmv1.VirtualMachine
		want bool
	}{
		{name: "a VM that reports no slots has no limit", vm: vm(nil, []string{"a", "b", "c"}), want: false},
		{name: "free slots", vm: vm(ptr.To[int32](3), []string{"a", "b"}, attached("a")), want: false},
		{name: "every slot holds an entry", vm: vm(ptr.To[int32](2), []string{"a", "b"}), want: true},
		{
			name: "a disk being detached still holds its slot",
			vm:   vm(ptr.To[int32](2), []string{"a"}, attached("a"), attached("leaving")), want: true,
		},
		{
			name: "an error of a volume no longer in spec holds no slot",
			vm:   vm(ptr.To[int32](2), []string{"a"}, attached("a"), vmv1.VirtualMachineVolumeStatus{Name: "gone", Error: "PVC missing"}), want: false,
		},
		{name: "a VM of no slots is full", vm: vm(ptr.To[int32](0), nil), want: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			NewWithT(t).Expect(full(tt.vm)).To(Equal(tt.want))
		})
	}
}
