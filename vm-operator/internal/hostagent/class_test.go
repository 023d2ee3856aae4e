package hostagent

import (
	"testing"

	. "github.com/onsi/gomega"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/vm-operator/internal/hypervisor"
)

func TestVMStartsWithItsClassSize(t *testing.T) {
	small := &vmv1.VirtualMachineClass{
		ObjectMeta: metav1.ObjectMeta{Name: "small"},
		Spec:       vmv1.VirtualMachineClassSpec{CPUs: 2, Memory: resource.MustParse("1Gi"), MaxVolumes: ptr.To[int32](8)},
	}
	resources := func(cpu, memory string) *vmv1.VirtualMachineResources {
		r := &vmv1.VirtualMachineResources{}
		if cpu != "" {
			r.CPU = ptr.To(resource.MustParse(cpu))
		}
		if memory != "" {
			r.Memory = ptr.To(resource.MustParse(memory))
		}
		return r
	}
	tests := []struct {
		name    string
		vm      func(vm *vmv1.VirtualMachine)
		running bool
		want    *hypervisor.VM // the size it starts with; nil: not started
		reason  string         // the Ready condition's reason when not started
		message string
	}{
		{
			name: "without a class, the size of its spec, rounded up",
			vm:   func(vm *vmv1.VirtualMachine) { vm.Spec.Resources = resources("2", "300M") },
			want: &hypervisor.VM{CPUs: 2, MemoryMiB: 287},
		},
		{
			name: "with a class, the class's size",
			vm:   func(vm *vmv1.VirtualMachine) { vm.Spec.ClassName = "small" },
			want: &hypervisor.VM{CPUs: 2, MemoryMiB: 1024, Slots: 8},
		},
		{
			name: "less than its class where its spec asks for less",
			vm: func(vm *vmv1.VirtualMachine) {
				vm.Spec.ClassName, vm.Spec.Resources, vm.Spec.MaxVolumes = "small", resources("1", "256Mi"), ptr.To[int32](4)
			},
			want: &hypervisor.VM{CPUs: 1, MemoryMiB: 256, Slots: 4},
		},
		{
			name: "not at all when its spec asks for more than its class",
			vm: func(vm *vmv1.VirtualMachine) {
				vm.Spec.ClassName, vm.Spec.Resources, vm.Spec.MaxVolumes = "small", resources("4", "2Gi"), ptr.To[int32](16)
			},
			reason: vmv1.ClassExceededReason,
			message: "the VirtualMachine asks for more than VirtualMachineClass small gives: 4 CPUs (the class: 2), " +
				"2048 MiB of memory (the class: 1024 MiB), 16 volumes (the class: 8)",
		},
		{
			name:    "not at all while its class does not exist",
			vm:      func(vm *vmv1.VirtualMachine) { vm.Spec.ClassName = "large" },
			reason:  vmv1.ClassNotFoundReason,
			message: "VirtualMachineClass large does not exist; the VirtualMachine starts once it does",
		},
		{
			name:    "a VM that runs keeps running when its class is gone",
			vm:      func(vm *vmv1.VirtualMachine) { vm.Spec.ClassName = "large" },
			running: true, reason: vmv1.PoweredOnReason,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			vm := virtualMachine(nil, nil)
			tt.vm(vm)
			c := newClient(g, vm, false)
			g.Expect(c.Create(t.Context(), small.DeepCopy())).To(Succeed())
			h := newFakeHypervisor()
			h.on[vm.Name] = tt.running
			r := &Reconciler{Client: c, Node: "host-a", Hypervisor: h, CSI: &fakeCSI{}, StateDir: t.TempDir()}
			_, err := r.Reconcile(t.Context(), ctrl.Request{NamespacedName: client.ObjectKeyFromObject(vm)})
			g.Expect(err).NotTo(HaveOccurred())

			started, ok := h.started[vm.Name]
			if tt.want != nil {
				g.Expect(ok).To(BeTrue(), "started")
				g.Expect([]int{started.CPUs, started.MemoryMiB, started.Slots}).To(Equal([]int{tt.want.CPUs, tt.want.MemoryMiB, tt.want.Slots}))
				return
			}
			g.Expect(ok).To(BeFalse(), "started")
			g.Expect(h.on[vm.Name]).To(Equal(tt.running))
			got := &vmv1.VirtualMachine{}
			g.Expect(c.Get(t.Context(), client.ObjectKeyFromObject(vm), got)).To(Succeed())
			ready := meta.FindStatusCondition(got.Status.Conditions, vmv1.ReadyCondition)
			g.Expect(ready).NotTo(BeNil())
			g.Expect(ready.Reason).To(Equal(tt.reason))
			if tt.message != "" {
				g.Expect(ready.Message).To(Equal(tt.message))
			}
		})
	}
}

func TestVMsOfClassAreTheVMsThatNameIt(t *testing.T) {
	g := NewWithT(t)
	vm := virtualMachine(nil, nil)
	vm.Spec.ClassName = "small"
	c := newClient(g, vm, false)
	r := &Reconciler{Client: c, Node: "host-a"}
	g.Expect(r.vmsOfClass(t.Context(), &vmv1.VirtualMachineClass{ObjectMeta: metav1.ObjectMeta{Name: "small"}})).
		To(ConsistOf(ctrl.Request{NamespacedName: client.ObjectKeyFromObject(vm)}))
	g.Expect(r.vmsOfClass(t.Context(), &vmv1.VirtualMachineClass{ObjectMeta: metav1.ObjectMeta{Name: "large"}})).To(BeEmpty())
}
