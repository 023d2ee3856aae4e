package capi

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"
	"sigs.k8s.io/controller-runtime/pkg/recorder"

	infrav1 "pvbridge.io/pkg/apis/infrastructure/v1alpha1"
	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/pkg/hostloss"
	"pvbridge.io/pkg/tenancy"
)

// MachineReconciler reconciles PVBridgeMachines: one VirtualMachine each, of the same namespace
// and name (the guest Node's), owned by the PVBridgeMachine.
type MachineReconciler struct {
	Client client.Client
	// APIReader reads a deleted machine's VirtualMachine from the API server, not the cache:
	// powering a VM off is decided on its volumes, and the cache may not yet show one just
	// plugged. Client when nil.
	APIReader client.Reader
	Recorder  recorder.EventRecorder
	// VolumeDetachTimeout bounds how long a deleted machine waits for its VM's volumes to
	// detach before the VM is powered off and deleted anyway; zero waits for ever.
	VolumeDetachTimeout time.Duration
	// Filter picks the PVBridgeMachines of this provider instance.
	Filter WatchFilter

	// now is the clock (time.Now when nil).
	now func() time.Time
}

// +kubebuilder:rbac:groups=infrastructure.cluster.x-k8s.io,resources=pvbridgemachines,verbs=get;list;watch;patch;update
// +kubebuilder:rbac:groups=infrastructure.cluster.x-k8s.io,resources=pvbridgemachines/status,verbs=get;patch
// The VirtualMachine's owner reference blocks the PVBridgeMachine's deletion (OwnerReferencesPermissionEnforcement).
// +kubebuilder:rbac:groups=infrastructure.cluster.x-k8s.io,resources=pvbridgemachines/finalizers,verbs=update
// +kubebuilder:rbac:groups=cluster.x-k8s.io,resources=machines;clusters,verbs=get;list;watch
// +kubebuilder:rbac:groups=vm.pvbridge.io,resources=virtualmachines,verbs=get;list;watch;create;patch;delete
// +kubebuilder:rbac:groups="",resources=nodes,verbs=get;list;watch
// +kubebuilder:rbac:groups=events.k8s.io,resources=events,verbs=create;patch

// SetupWithManager registers the reconciler: a PVBridgeMachine is reconciled when it, its
// VirtualMachine, its Machine or its Cluster changes, or its VirtualMachine's host is lost.
func (r *MachineReconciler) SetupWithManager(mgr ctrl.Manager) error {
	return ctrl.NewControllerManagedBy(mgr).
		For(&infrav1.PVBridgeMachine{}).
		Named("pvbridgemachine").
		Owns(&vmv1.VirtualMachine{}).
		Watches(&clusterv1.Machine{}, handler.EnqueueRequestsFromMapFunc(infraMachineOf)).
		Watches(&clusterv1.Cluster{}, handler.EnqueueRequestsFromMapFunc(r.machinesOfCluster)).
		Watches(&corev1.Node{}, handler.EnqueueRequestsFromMapFunc(r.machinesOnHost), builder.WithPredicates(hostloss.Changed())).
		Complete(r)
}

// infraMachineOf maps a Machine to its PVBridgeMachine.
func infraMachineOf(_ context.Context, obj client.Object) []reconcile.Request {
	m, ok := obj.(*clusterv1.Machine)
	if !ok || m.Spec.InfrastructureRef.Kind != "PVBridgeMachine" || m.Spec.InfrastructureRef.APIGroup != infrav1.GroupVersion.Group {
		return nil
	}
	return []reconcile.Request{{NamespacedName: client.ObjectKey{Namespace: m.Namespace, Name: m.Spec.InfrastructureRef.Name}}}
}

// machinesOnHost maps a host to the PVBridgeMachines of its VirtualMachines.
func (r *MachineReconciler) machinesOnHost(ctx context.Context, node client.Object) []reconcile.Request {
	var reqs []reconcile.Request
	for _, vm := range hostloss.VMsOn(ctx, r.Client, node.GetName()) {
		if owner := metav1.GetControllerOf(vm); owner != nil && owner.Kind == "PVBridgeMachine" {
			reqs = append(reqs, reconcile.Request{NamespacedName: client.ObjectKey{Namespace: vm.Namespace, Name: owner.Name}})
		}
	}
	return reqs
}

// machinesOfCluster maps a Cluster to its PVBridgeMachines (Cluster API labels them with it):
// the Cluster's infrastructure, pause and failure domains gate them.
func (r *MachineReconciler) machinesOfCluster(ctx context.Context, obj client.Object) []reconcile.Request {
	list := &infrav1.PVBridgeMachineList{}
	if err := r.Client.List(ctx, list, client.InNamespace(obj.GetNamespace()),
		client.MatchingLabels{clusterv1.ClusterNameLabel: obj.GetName()}); err != nil {
		ctrl.LoggerFrom(ctx).Error(err, "List PVBridgeMachines of a Cluster")
		return nil
	}
	reqs := make([]reconcile.Request, 0, len(list.Items))
	for i := range list.Items {
		reqs = append(reqs, reconcile.Request{NamespacedName: client.ObjectKeyFromObject(&list.Items[i])})
	}
	return reqs
}

func (r *MachineReconciler) clock() time.Time {
	if r.now != nil {
		return r.now()
	}
	return time.Now()
}

// Reconcile follows the contract's workflow: owner Machine and Cluster, pause, finalizer, then
// the VirtualMachine's creation or deletion, with one status write at the end.
func (r *MachineReconciler) Reconcile(ctx context.Context, req ctrl.Request) (_ ctrl.Result, reterr error) {
	pm := &infrav1.PVBridgeMachine{}
	if err := r.Client.Get(ctx, req.NamespacedName, pm); err != nil || !r.Filter.Matches(pm) {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	deleting := !pm.DeletionTimestamp.IsZero()
	machine := &clusterv1.Machine{}
	hasMachine, err := getOwned(ctx, r.Client, pm.Namespace, ownerOfKind(pm, "Machine"), machine)
	if err != nil {
		return ctrl.Result{}, err
	}
	if !hasMachine && !deleting {
		// Cluster API sets the owner reference; the Machine's watch brings us back.
		return ctrl.Result{}, nil
	}
	clusterName := pm.Labels[clusterv1.ClusterNameLabel]
	if hasMachine {
		clusterName = machine.Spec.ClusterName
	}
	cluster := &clusterv1.Cluster{}
	hasCluster, err := getOwned(ctx, r.Client, pm.Namespace, clusterName, cluster)
	if err != nil {
		return ctrl.Result{}, err
	}
	if !hasCluster {
		if !deleting {
			return ctrl.Result{}, nil
		}
		cluster = nil
	}
	log := ctrl.LoggerFrom(ctx).WithValues("cluster", klog.KRef(pm.Namespace, clusterName))
	ctx = ctrl.LoggerInto(ctx, log)

	paused := isPaused(cluster, pm)
	if !deleting && !paused && !controllerutil.ContainsFinalizer(pm, infrav1.MachineFinalizer) {
		// The finalizer in its own write, before anything is created.
		base := pm.DeepCopy()
		controllerutil.AddFinalizer(pm, infrav1.MachineFinalizer)
		return ctrl.Result{}, patchObject(ctx, r.Client, base, pm)
	}

	base := pm.DeepCopy()
	defer func() {
		if err := patchObject(ctx, r.Client, base, pm); err != nil {
			reterr = errors.Join(reterr, err)
		}
	}()
	pausedCondition(&pm.Status.Conditions, pm.Generation, paused)
	if paused {
		return ctrl.Result{}, nil
	}
	if deleting {
		// As Cluster API's machine controller, which neither drains the Node nor waits for its
		// volumes while the Cluster is deleted: the guest that would detach them is going too.
		clusterGoing := cluster == nil || !cluster.DeletionTimestamp.IsZero()
		return r.reconcileDelete(ctx, pm, clusterGoing)
	}
	return r.reconcileNormal(ctx, cluster, machine, pm)
}

// reconcileNormal creates the machine's VirtualMachine once the Cluster's infrastructure is
// provisioned and the Machine has its bootstrap data, and reports it provisioned once it runs.
// The gates are those of the creation: a VM that exists is reported whatever the Cluster's
// failure domains became since.
func (r *MachineReconciler) reconcileNormal(ctx context.Context, cluster *clusterv1.Cluster, machine *clusterv1.Machine, pm *infrav1.PVBridgeMachine) (ctrl.Result, error) {
	vm := &vmv1.VirtualMachine{}
	err := r.Client.Get(ctx, client.ObjectKeyFromObject(pm), vm)
	switch {
	case err == nil && !metav1.IsControlledBy(vm, pm):
		notReady(pm, infrav1.VirtualMachineConflictReason,
			fmt.Sprintf("VirtualMachine %s exists and is not this PVBridgeMachine's", vm.Name))
		return ctrl.Result{}, nil
	case err == nil:
		machineStatus(pm, vm)
		return ctrl.Result{}, nil
	case !apierrors.IsNotFound(err):
		return ctrl.Result{}, fmt.Errorf("get VirtualMachine %s: %w", klog.KObj(pm), err)
	case pm.Spec.ProviderID != "":
		// Provisioned once: its guest went with it. A VM made again from the same bootstrap
		// data would join with an expired token under a stale Node, so the machine is reported
		// failed for Cluster API to replace, as its own providers do.
		if c := meta.FindStatusCondition(pm.Status.Conditions, infrav1.ReadyCondition); c == nil || c.Reason != infrav1.VirtualMachineDeletedReason {
			r.event(pm, corev1.EventTypeWarning, infrav1.VirtualMachineDeletedReason,
				"VirtualMachine %s of this provisioned machine was deleted; it is not re-created: the Machine must be replaced", pm.Name)
		}
		notReady(pm, infrav1.VirtualMachineDeletedReason, fmt.Sprintf(
			"VirtualMachine %s does not exist anymore: delete the Machine (a MachineHealthCheck does when its Node stays unready) for Cluster API to replace it", pm.Name))
		return ctrl.Result{}, nil
	}

	if !ptr.Deref(cluster.Status.Initialization.InfrastructureProvisioned, false) {
		notReady(pm, infrav1.WaitingForClusterInfrastructureReason, "the Cluster's infrastructure is not provisioned yet")
		return ctrl.Result{}, nil
	}
	dataSecret := ptr.Deref(machine.Spec.Bootstrap.DataSecretName, "")
	if dataSecret == "" {
		notReady(pm, infrav1.WaitingForBootstrapDataReason, "the Machine has no bootstrap data secret yet")
		return ctrl.Result{}, nil
	}
	host := machine.Spec.FailureDomain
	if host != "" && !slices.ContainsFunc(cluster.Status.FailureDomains, func(fd clusterv1.FailureDomain) bool { return fd.Name == host }) {
		notReady(pm, infrav1.FailureDomainUnknownReason,
			fmt.Sprintf("failure domain %q is not one of the Cluster's (its hosts)", host))
		return ctrl.Result{}, nil
	}
	vm = newVirtualMachine(pm, machine.Spec.ClusterName, host, dataSecret)
	if err := r.Client.Create(ctx, vm, client.FieldOwner(fieldManager)); err != nil {
		if apierrors.IsAlreadyExists(err) {
			// Created by an earlier reconcile that the cache has not seen yet: its event
			// brings us back.
			return ctrl.Result{}, nil
		}
		return ctrl.Result{}, fmt.Errorf("create VirtualMachine %s: %w", klog.KObj(vm), err)
	}
	ctrl.LoggerFrom(ctx).Info("Created the VirtualMachine", "vm", klog.KObj(vm), "host", host)
	r.event(pm, corev1.EventTypeNormal, "VirtualMachineCreated", "Created VirtualMachine %s", vm.Name)
	machineStatus(pm, vm)
	return ctrl.Result{}, nil
}

// newVirtualMachine is the VirtualMachine of pm: same namespace and name, labelled with its
// cluster (what the tenancy rules and guest-csi key on) and machine, owned by pm, on host if
// given, booting the Machine's bootstrap data.
func newVirtualMachine(pm *infrav1.PVBridgeMachine, clusterName, host, dataSecret string) *vmv1.VirtualMachine {
	vm := &vmv1.VirtualMachine{
		ObjectMeta: metav1.ObjectMeta{
			Namespace: pm.Namespace,
			Name:      pm.Name,
			Labels:    map[string]string{tenancy.CAPIClusterNameLabel: clusterName},
		},
		Spec: vmv1.VirtualMachineSpec{
			ClassName:  pm.Spec.ClassName,
			Image:      pm.Spec.Image,
			Host:       host,
			PowerState: vmv1.PowerStateOn,
			Bootstrap:  &vmv1.VirtualMachineBootstrap{DataSecretName: dataSecret},
		},
	}
	if len(validation.IsValidLabelValue(pm.Name)) == 0 {
		vm.Labels[infrav1.MachineLabel] = pm.Name
	}
	if res := pm.Spec.Resources; res != nil {
		vm.Spec.Resources = &vmv1.VirtualMachineResources{CPU: res.CPU, Memory: res.Memory}
	}
	vm.OwnerReferences = []metav1.OwnerReference{*metav1.NewControllerRef(pm, infrav1.GroupVersion.WithKind("PVBridgeMachine"))}
	return vm
}

// machineStatus sets pm's contract fields from its VirtualMachine: once it runs, the provider
// ID, provisioned, the addresses and the failure domain (its host); Ready follows whether it runs.
func machineStatus(pm *infrav1.PVBridgeMachine, vm *vmv1.VirtualMachine) {
	if vm.Status.Host != "" {
		pm.Status.FailureDomain = vm.Status.Host
	}
	if vm.Status.Phase != vmv1.PhaseRunning {
		msg := fmt.Sprintf("VirtualMachine %s is %s", vm.Name, phaseOrPending(vm.Status.Phase))
		for _, t := range []string{vmv1.ReadyCondition, vmv1.PlacedCondition} {
			if c := meta.FindStatusCondition(vm.Status.Conditions, t); c != nil && c.Status != metav1.ConditionTrue && c.Message != "" {
				msg += ": " + c.Message
				break
			}
		}
		notReady(pm, infrav1.VirtualMachineNotRunningReason, msg)
		return
	}
	pm.Spec.ProviderID = infrav1.ProviderID(pm.Namespace, pm.Name)
	pm.Status.Initialization.Provisioned = ptr.To(true)
	pm.Status.Addresses = []infrav1.MachineAddress{
		{Type: infrav1.MachineHostName, Address: pm.Name},
		{Type: infrav1.MachineInternalDNS, Address: pm.Name},
	}
	for _, ip := range vm.Status.Addresses {
		pm.Status.Addresses = append(pm.Status.Addresses, infrav1.MachineAddress{Type: infrav1.MachineInternalIP, Address: ip})
	}
	setCondition(&pm.Status.Conditions, pm.Generation, infrav1.VirtualMachineProvisionedCondition, metav1.ConditionTrue, infrav1.ProvisionedReason, "")
	setCondition(&pm.Status.Conditions, pm.Generation, infrav1.ReadyCondition, metav1.ConditionTrue, infrav1.ProvisionedReason, "")
}

func phaseOrPending(p vmv1.Phase) vmv1.Phase {
	if p == "" {
		return vmv1.PhasePending
	}
	return p
}

// notReady reports, in Ready and VirtualMachineProvisioned, what the machine waits for.
func notReady(pm *infrav1.PVBridgeMachine, reason, message string) {
	setCondition(&pm.Status.Conditions, pm.Generation, infrav1.VirtualMachineProvisionedCondition, metav1.ConditionFalse, reason, message)
	setCondition(&pm.Status.Conditions, pm.Generation, infrav1.ReadyCondition, metav1.ConditionFalse, reason, message)
}

func (r *MachineReconciler) event(pm *infrav1.PVBridgeMachine, eventType, reason, format string, args ...any) {
	if r.Recorder != nil {
		r.Recorder.Eventf(pm, nil, eventType, reason, reason, format, args...)
	}
}
