package hostagent

import (
	"context"
	"fmt"
	"strings"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/vm-operator/internal/hypervisor"
)

// sized gives ref the size of vm's VirtualMachineClass (spec.className), but where vm asks for
// less (spec.resources, spec.maxVolumes). It returns the Ready condition that keeps vm from
// starting when its class does not exist or when vm asks for more than the class gives, and
// nil when vm names no class (ref keeps what vmRef made of spec) or fits it.
func (r *Reconciler) sized(ctx context.Context, vm *vmv1.VirtualMachine, ref *hypervisor.VM) (*metav1.Condition, error) {
	if vm.Spec.ClassName == "" {
		return nil, nil
	}
	class := &vmv1.VirtualMachineClass{}
	switch err := r.Client.Get(ctx, client.ObjectKey{Name: vm.Spec.ClassName}, class); {
	case apierrors.IsNotFound(err):
		return readyCondition(vm, metav1.ConditionFalse, vmv1.ClassNotFoundReason,
			fmt.Sprintf("VirtualMachineClass %s does not exist; the VirtualMachine starts once it does", vm.Spec.ClassName)), nil
	case err != nil:
		return nil, fmt.Errorf("read VirtualMachineClass %s: %w", vm.Spec.ClassName, err)
	}
	if over := classSize(class, ref); len(over) > 0 {
		return readyCondition(vm, metav1.ConditionFalse, vmv1.ClassExceededReason,
			fmt.Sprintf("the VirtualMachine asks for more than VirtualMachineClass %s gives: %s", class.Name, strings.Join(over, ", "))), nil
	}
	return nil, nil
}

// classSize sets ref's size from class, keeping what ref has from the VM's spec where it is
// less, and returns what the spec asks for beyond the class. ref's size from spec is rounded up
// (vmRef), as the class's memory is, so that a VM never boots smaller than either says.
func classSize(class *vmv1.VirtualMachineClass, ref *hypervisor.VM) []string {
	var over []string
	fit := func(asked *int, limit int, format string) {
		switch {
		case *asked > limit:
			over = append(over, fmt.Sprintf(format, *asked, limit))
		case *asked == 0:
			*asked = limit
		}
	}
	fit(&ref.CPUs, int(class.Spec.CPUs), "%d CPUs (the class: %d)")
	fit(&ref.MemoryMiB, mib(class.Spec.Memory.Value()), "%d MiB of memory (the class: %d MiB)")
	if slots := int(ptr.Deref(class.Spec.MaxVolumes, 0)); slots > 0 {
		fit(&ref.Slots, slots, "%d volumes (the class: %d)")
	}
	return over
}

// mib is bytes in MiB, rounded up.
func mib(bytes int64) int { return int((bytes + 1<<20 - 1) >> 20) }

// vmsOfClass maps a VirtualMachineClass to the VMs on this host that name it: one that waits for
// its class starts once the class exists.
func (r *Reconciler) vmsOfClass(ctx context.Context, obj client.Object) []reconcile.Request {
	return r.vmsWhere(ctx, func(vm *vmv1.VirtualMachine) bool { return vm.Spec.ClassName == obj.GetName() })
}
