package capi

import (
	"context"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	apiequality "k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	infrav1 "pvbridge.io/pkg/apis/infrastructure/v1alpha1"
	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
)

// MachineTemplateReconciler reports the capacity of the machines of each PVBridgeMachineTemplate
// (status.capacity, what the cluster autoscaler scales a MachineDeployment up from zero with).
type MachineTemplateReconciler struct {
	Client client.Client
	// Filter picks the templates of this provider instance.
	Filter WatchFilter
}

// +kubebuilder:rbac:groups=infrastructure.cluster.x-k8s.io,resources=pvbridgemachinetemplates,verbs=get;list;watch
// +kubebuilder:rbac:groups=infrastructure.cluster.x-k8s.io,resources=pvbridgemachinetemplates/status,verbs=get;patch
// +kubebuilder:rbac:groups=vm.pvbridge.io,resources=virtualmachineclasses,verbs=get;list;watch

// SetupWithManager registers the reconciler: a template is reconciled when it or its class changes.
func (r *MachineTemplateReconciler) SetupWithManager(mgr ctrl.Manager) error {
	return ctrl.NewControllerManagedBy(mgr).
		For(&infrav1.PVBridgeMachineTemplate{}).
		Named("pvbridgemachinetemplate").
		Watches(&vmv1.VirtualMachineClass{}, handler.EnqueueRequestsFromMapFunc(r.templatesOfClass)).
		Complete(r)
}

// templatesOfClass maps a VirtualMachineClass to the templates that name it.
func (r *MachineTemplateReconciler) templatesOfClass(ctx context.Context, class client.Object) []reconcile.Request {
	list := &infrav1.PVBridgeMachineTemplateList{}
	if err := r.Client.List(ctx, list); err != nil {
		ctrl.LoggerFrom(ctx).Error(err, "List PVBridgeMachineTemplates")
		return nil
	}
	var reqs []reconcile.Request
	for i := range list.Items {
		if list.Items[i].Spec.Template.Spec.ClassName == class.GetName() {
			reqs = append(reqs, reconcile.Request{NamespacedName: client.ObjectKeyFromObject(&list.Items[i])})
		}
	}
	return reqs
}

// Reconcile writes a template's capacity.
func (r *MachineTemplateReconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	mt := &infrav1.PVBridgeMachineTemplate{}
	if err := r.Client.Get(ctx, req.NamespacedName, mt); err != nil || !r.Filter.Matches(mt) {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	var class *vmv1.VirtualMachineClass
	if name := mt.Spec.Template.Spec.ClassName; name != "" {
		class = &vmv1.VirtualMachineClass{}
		if err := r.Client.Get(ctx, client.ObjectKey{Name: name}, class); err != nil {
			if !apierrors.IsNotFound(err) {
				return ctrl.Result{}, fmt.Errorf("get VirtualMachineClass %s: %w", name, err)
			}
			class = nil
		}
	}
	capacity := machineCapacity(class, mt.Spec.Template.Spec.Resources)
	if apiequality.Semantic.DeepEqual(capacity, mt.Status.Capacity) {
		return ctrl.Result{}, nil
	}
	base := mt.DeepCopy()
	mt.Status.Capacity = capacity
	return ctrl.Result{}, patchObject(ctx, r.Client, base, mt)
}

// machineCapacity is the cpu and memory of a machine of class with resources: each of resources
// where set (vm-operator allows only less than the class), else the class's; nil without a
// class (none named, or it does not exist: such a machine does not start).
func machineCapacity(class *vmv1.VirtualMachineClass, res *infrav1.MachineResources) corev1.ResourceList {
	if class == nil {
		return nil
	}
	capacity := corev1.ResourceList{
		corev1.ResourceCPU:    *resource.NewQuantity(int64(class.Spec.CPUs), resource.DecimalSI),
		corev1.ResourceMemory: class.Spec.Memory.DeepCopy(),
	}
	if res != nil && res.CPU != nil {
		capacity[corev1.ResourceCPU] = res.CPU.DeepCopy()
	}
	if res != nil && res.Memory != nil {
		capacity[corev1.ResourceMemory] = res.Memory.DeepCopy()
	}
	return capacity
}
