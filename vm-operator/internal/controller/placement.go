package controller

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"sync"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/events"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/pkg/hostloss"
)

// Event reasons of placement, besides the Placed condition's reasons.
const (
	// placedEvent: the VirtualMachine got its host.
	placedEvent = "Placed"
	// specHostIgnoredEvent: spec.host was set after the VirtualMachine was placed elsewhere.
	specHostIgnoredEvent = "SpecHostIgnored"
)

// PlacementReconciler gives every VirtualMachine a host (status.host) and a unique ID
// (status.uniqueID), reports it in the Placed condition, and keeps status.phase. A VirtualMachine
// whose host is declared lost is Ready False (HostLostReason): its host agent cannot say so.
//
// The host is spec.host when set, otherwise the candidate host running the fewest
// VirtualMachines, ties broken by name; a candidate is a Ready, schedulable Node labelled
// vm.pvbridge.io/host=true. status.host never changes once set: a VirtualMachine does not
// migrate, its volumes live on its host. The phase is derived from the placement and the host
// agent's Ready condition (vmPhase), so it has this one writer.
type PlacementReconciler struct {
	Client client.Client
	// APIReader confirms a host's loss that the cache does not show (hostloss.Lost).
	APIReader client.Reader
	Recorder  events.EventRecorder

	// mu guards assumed.
	mu sync.Mutex
	// assumed maps the VirtualMachines placed by this process to their host until the cache
	// shows it, so that placements in quick succession count each other (kube-scheduler's
	// assume cache does the same).
	assumed map[types.UID]string
}

// +kubebuilder:rbac:groups=vm.pvbridge.io,resources=virtualmachines,verbs=get;list;watch
// +kubebuilder:rbac:groups=vm.pvbridge.io,resources=virtualmachines/status,verbs=get;update;patch
// +kubebuilder:rbac:groups="",resources=nodes,verbs=get;list;watch
// +kubebuilder:rbac:groups=events.k8s.io,resources=events,verbs=create;patch

// SetupWithManager registers the reconciler. It runs one reconcile at a time: placements are
// decisions against each other, and taking them in turn keeps the balance exact.
func (r *PlacementReconciler) SetupWithManager(mgr ctrl.Manager) error {
	return ctrl.NewControllerManagedBy(mgr).
		For(&vmv1.VirtualMachine{}).
		Named("vm-placement").
		Watches(&corev1.Node{}, handler.EnqueueRequestsFromMapFunc(r.unplacedVMs),
			builder.WithPredicates(candidacyChanged())).
		Watches(&corev1.Node{}, handler.EnqueueRequestsFromMapFunc(r.vmsOnHost),
			builder.WithPredicates(hostloss.StateChanged())).
		WithOptions(controller.Options{MaxConcurrentReconciles: 1}).
		Complete(r)
}

// Reconcile places one VirtualMachine.
func (r *PlacementReconciler) Reconcile(ctx context.Context, req ctrl.Request) (res ctrl.Result, reterr error) {
	vm := &vmv1.VirtualMachine{}
	if err := r.Client.Get(ctx, req.NamespacedName, vm); err != nil {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	if !vm.DeletionTimestamp.IsZero() {
		// A VirtualMachine on its way out is not placed; its host stays until it is gone.
		return ctrl.Result{}, nil
	}
	base := vm.DeepCopy()
	defer func() {
		if finishStatus(ctx, r.Client, base, vm, &res, &reterr) {
			r.recordPlacement(ctx, base, vm)
		}
	}()
	return ctrl.Result{}, r.reconcileNormal(ctx, vm)
}

func (r *PlacementReconciler) reconcileNormal(ctx context.Context, vm *vmv1.VirtualMachine) error {
	vm.Status.UniqueID = string(vm.UID)
	placed := metav1.Condition{
		// No observedGeneration: every edit of spec.volumes would rewrite the condition.
		Type: vmv1.PlacedCondition, Status: metav1.ConditionTrue, Reason: vmv1.HostAssignedReason,
	}
	switch {
	case vm.Status.Host != "":
		placed.Message = fmt.Sprintf("placed on host %s", vm.Status.Host)
		if old := meta.FindStatusCondition(vm.Status.Conditions, vmv1.PlacedCondition); old != nil && old.Status == metav1.ConditionTrue {
			placed.Message = old.Message // keep how it was placed
		}
		if vm.Spec.Host != "" && vm.Spec.Host != vm.Status.Host {
			placed.Message = fmt.Sprintf("placed on host %s; spec.host %s is ignored: a VirtualMachine never moves to another host",
				vm.Status.Host, vm.Spec.Host)
		}
	case vm.Spec.Host != "":
		vm.Status.Host = vm.Spec.Host
		placed.Message = fmt.Sprintf("placed on host %s, as spec.host asks", vm.Status.Host)
	default:
		host, candidates, err := r.pickHost(ctx)
		if err != nil {
			return err
		}
		if host == "" {
			placed.Status, placed.Reason = metav1.ConditionFalse, vmv1.NoHostAvailableReason
			placed.Message = fmt.Sprintf("no Ready, schedulable Node is labelled %s=true", vmv1.HostLabel)
		} else {
			vm.Status.Host = host
			placed.Message = fmt.Sprintf("placed on host %s, the least loaded of %d candidate hosts", host, candidates)
		}
	}
	meta.SetStatusCondition(&vm.Status.Conditions, placed)
	// A VirtualMachine that its host's agent took up (it reported Ready) goes with a lost host;
	// one placed on a host whose Node is not there yet waits for it.
	if ready := meta.FindStatusCondition(vm.Status.Conditions, vmv1.ReadyCondition); vm.Status.Host != "" && ready != nil {
		lost, err := hostloss.Lost(ctx, r.Client, r.APIReader, vm.Status.Host)
		if err != nil {
			return err
		}
		switch {
		case lost:
			// What the host agent last reported went with it; the agent leaves the VM alone now.
			meta.SetStatusCondition(&vm.Status.Conditions, metav1.Condition{
				Type: vmv1.ReadyCondition, Status: metav1.ConditionFalse, Reason: vmv1.HostLostReason, ObservedGeneration: vm.Generation,
				Message: fmt.Sprintf("host %s is declared lost: the VirtualMachine went with it", vm.Status.Host),
			})
		case ready.Reason == vmv1.HostLostReason:
			// The declaration was taken back: the host's agent reports afresh.
			meta.RemoveStatusCondition(&vm.Status.Conditions, vmv1.ReadyCondition)
		}
	}
	vm.Status.Phase = vmPhase(vm.Status)
	return nil
}

// vmsOnHost maps a host whose loss is declared, or taken back, to its VirtualMachines.
func (r *PlacementReconciler) vmsOnHost(ctx context.Context, node client.Object) []reconcile.Request {
	var reqs []reconcile.Request
	for _, vm := range hostloss.VMsOn(ctx, r.Client, node.GetName()) {
		reqs = append(reqs, reconcile.Request{NamespacedName: client.ObjectKeyFromObject(vm)})
	}
	return reqs
}

// pickHost returns the least-loaded candidate host and how many candidates there were; "" when
// there is none.
func (r *PlacementReconciler) pickHost(ctx context.Context) (string, int, error) {
	nodes := &corev1.NodeList{}
	if err := r.Client.List(ctx, nodes, client.MatchingLabels{vmv1.HostLabel: "true"}); err != nil {
		return "", 0, fmt.Errorf("list host Nodes: %w", err)
	}
	vms := &vmv1.VirtualMachineList{}
	if err := r.Client.List(ctx, vms); err != nil {
		return "", 0, fmt.Errorf("list VirtualMachines: %w", err)
	}
	host, candidates := leastLoaded(nodes.Items, r.load(vms.Items))
	return host, candidates, nil
}

// load counts the VirtualMachines per host, including the placements this process made that
// the cache does not show yet, and forgets those it shows.
func (r *PlacementReconciler) load(vms []vmv1.VirtualMachine) map[string]int {
	r.mu.Lock()
	defer r.mu.Unlock()
	load := map[string]int{}
	listed := make(map[types.UID]bool, len(vms))
	for i := range vms {
		vm := &vms[i]
		listed[vm.UID] = true
		host := vm.Status.Host
		if host != "" {
			delete(r.assumed, vm.UID)
		} else {
			host = r.assumed[vm.UID]
		}
		if host != "" {
			load[host]++
		}
	}
	for uid := range r.assumed {
		if !listed[uid] {
			delete(r.assumed, uid)
		}
	}
	return load
}

func (r *PlacementReconciler) assume(uid types.UID, host string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.assumed == nil {
		r.assumed = map[types.UID]string{}
	}
	r.assumed[uid] = host
}

// leastLoaded returns the candidate among nodes with the lowest load, ties broken by name, and
// the number of candidates.
func leastLoaded(nodes []corev1.Node, load map[string]int) (string, int) {
	var candidates []string
	for i := range nodes {
		if vmv1.HostTakesNewVMs(&nodes[i]) {
			candidates = append(candidates, nodes[i].Name)
		}
	}
	if len(candidates) == 0 {
		return "", 0
	}
	best := slices.MinFunc(candidates, func(a, b string) int {
		return cmp.Or(cmp.Compare(load[a], load[b]), cmp.Compare(a, b))
	})
	return best, len(candidates)
}

// recordPlacement remembers a placement just written and tells it in an Event.
func (r *PlacementReconciler) recordPlacement(ctx context.Context, base, vm *vmv1.VirtualMachine) {
	before := meta.FindStatusCondition(base.Status.Conditions, vmv1.PlacedCondition)
	after := meta.FindStatusCondition(vm.Status.Conditions, vmv1.PlacedCondition)
	if base.Status.Host == "" && vm.Status.Host != "" {
		r.assume(vm.UID, vm.Status.Host)
		ctrl.LoggerFrom(ctx).Info("Placed VirtualMachine", "host", vm.Status.Host)
	}
	if after == nil || (before != nil && before.Status == after.Status && before.Reason == after.Reason && before.Message == after.Message) {
		return
	}
	switch {
	case after.Status == metav1.ConditionFalse:
		r.Recorder.Eventf(vm, nil, corev1.EventTypeWarning, after.Reason, "Place", "%s", after.Message)
	case base.Status.Host == "":
		r.Recorder.Eventf(vm, nil, corev1.EventTypeNormal, placedEvent, "Place", "%s", after.Message)
	case vm.Spec.Host != "" && vm.Spec.Host != vm.Status.Host:
		r.Recorder.Eventf(vm, nil, corev1.EventTypeWarning, specHostIgnoredEvent, "Place", "%s", after.Message)
	}
}

// unplacedVMs maps a change of a host Node to the VirtualMachines still waiting for a host.
func (r *PlacementReconciler) unplacedVMs(ctx context.Context, _ client.Object) []reconcile.Request {
	vms := &vmv1.VirtualMachineList{}
	if err := r.Client.List(ctx, vms); err != nil {
		ctrl.LoggerFrom(ctx).Error(err, "Cannot list VirtualMachines waiting for a host")
		return nil
	}
	var reqs []reconcile.Request
	for i := range vms.Items {
		if vm := &vms.Items[i]; vm.Status.Host == "" && vm.DeletionTimestamp.IsZero() {
			reqs = append(reqs, reconcile.Request{NamespacedName: client.ObjectKeyFromObject(vm)})
		}
	}
	return reqs
}

// candidacyChanged lets through the Node events that can change where a VirtualMachine may go,
// not the routine status updates of every Node.
func candidacyChanged() predicate.Predicate {
	return predicate.Funcs{
		UpdateFunc: func(e event.UpdateEvent) bool {
			oldNode, ok1 := e.ObjectOld.(*corev1.Node)
			newNode, ok2 := e.ObjectNew.(*corev1.Node)
			return !ok1 || !ok2 || vmv1.HostTakesNewVMs(oldNode) != vmv1.HostTakesNewVMs(newNode)
		},
		GenericFunc: func(event.GenericEvent) bool { return false },
	}
}
