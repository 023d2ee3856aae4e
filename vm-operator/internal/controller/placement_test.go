package controller

import (
	"context"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/tools/events"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	clientfake "sigs.k8s.io/controller-runtime/pkg/client/fake"
	"sigs.k8s.io/controller-runtime/pkg/client/interceptor"

	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
)

func newScheme(g Gomega) *runtime.Scheme {
	scheme := runtime.NewScheme()
	g.Expect(clientgoscheme.AddToScheme(scheme)).To(Succeed())
	g.Expect(vmv1.AddToScheme(scheme)).To(Succeed())
	return scheme
}

func newFakeClient(g Gomega, funcs *interceptor.Funcs, objs ...client.Object) client.WithWatch {
	b := clientfake.NewClientBuilder().WithScheme(newScheme(g)).WithObjects(objs...).
		WithStatusSubresource(&vmv1.VirtualMachine{}, &corev1.PersistentVolumeClaim{})
	if funcs != nil {
		b = b.WithInterceptorFuncs(*funcs)
	}
	return b.Build()
}

// drain returns the events recorded so far.
func drain(rec *events.FakeRecorder) []string {
	var out []string
	for {
		select {
		case e := <-rec.Events:
			out = append(out, e)
		default:
			return out
		}
	}
}

// ready is the Ready condition the host agent writes.
func ready(status metav1.ConditionStatus, reason string) metav1.Condition {
	return metav1.Condition{Type: vmv1.ReadyCondition, Status: status, Reason: reason, LastTransitionTime: metav1.Now()}
}

func TestLeastLoaded(t *testing.T) {
	tests := []struct {
		name           string
		nodes          []corev1.Node
		load           map[string]int
		want           string
		wantCandidates int
	}{
		{name: "no nodes, no host"},
		{
			name:  "the least-loaded node wins",
			nodes: []corev1.Node{*newNode("host-a"), *newNode("host-b"), *newNode("host-c")},
			load:  map[string]int{"host-a": 3, "host-b": 1, "host-c": 2},
			want:  "host-b", wantCandidates: 3,
		},
		{
			name:  "a tie goes to the first name",
			nodes: []corev1.Node{*newNode("host-c"), *newNode("host-b"), *newNode("host-a")},
			load:  map[string]int{"host-a": 2, "host-b": 1, "host-c": 1},
			want:  "host-b", wantCandidates: 3,
		},
		{
			name: "a node that is not Ready is no candidate",
			nodes: []corev1.Node{*newNode("host-a", func(n *corev1.Node) {
				n.Status.Conditions[0].Status = corev1.ConditionUnknown
			}), *newNode("host-b")},
			load: map[string]int{"host-b": 5},
			want: "host-b", wantCandidates: 1,
		},
		{
			name:  "a node without a Ready condition is no candidate",
			nodes: []corev1.Node{*newNode("host-a", func(n *corev1.Node) { n.Status.Conditions = nil })},
		},
		{
			name:  "a node labelled other than true is no candidate",
			nodes: []corev1.Node{*newNode("host-a", func(n *corev1.Node) { n.Labels[vmv1.HostLabel] = "false" })},
		},
		{
			name:  "a cordoned node is no candidate",
			nodes: []corev1.Node{*newNode("host-a", func(n *corev1.Node) { n.Spec.Unschedulable = true })},
		},
		{
			name: "a node being deleted is no candidate",
			nodes: []corev1.Node{*newNode("host-a", func(n *corev1.Node) {
				n.DeletionTimestamp = &metav1.Time{Time: time.Now()}
			})},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			host, candidates := leastLoaded(tt.nodes, tt.load)
			g.Expect(host).To(Equal(tt.want))
			g.Expect(candidates).To(Equal(tt.wantCandidates))
		})
	}
}

func TestPlacementReconciler(t *testing.T) {
	placedOn := func(name, host string) *vmv1.VirtualMachine { return newVM(name, onHost(host)) }
	tests := []struct {
		name       string
		vm         *vmv1.VirtualMachine
		objs       []client.Object
		wantHost   string
		wantPhase  vmv1.Phase
		wantStatus metav1.ConditionStatus
		wantReason string
		wantMsg    string
		wantEvents []string
		wantReady  string // the Ready condition's reason, when the test sets it
		noReady    bool   // the Ready condition is removed
	}{
		{
			name: "spec.host pins the VirtualMachine, even to a host that is not a candidate",
			vm:   newVM("vm-1", func(vm *vmv1.VirtualMachine) { vm.Spec.Host = "host-z" }),
			objs: []client.Object{newNode("host-a")},
			// The host agent of host-z takes it up when it comes.
			wantHost: "host-z", wantPhase: vmv1.PhasePending,
			wantStatus: metav1.ConditionTrue, wantReason: vmv1.HostAssignedReason, wantMsg: "placed on host host-z, as spec.host asks",
			wantEvents: []string{"Normal Placed placed on host host-z, as spec.host asks"},
		},
		{
			name: "the least-loaded candidate is chosen, counting VirtualMachines of every namespace",
			vm:   newVM("vm-1"),
			objs: []client.Object{
				newNode("host-a"), newNode("host-b"), newNode("host-c"),
				placedOn("x1", "host-a"), placedOn("x2", "host-a"), placedOn("x3", "host-c"),
				func() client.Object { vm := placedOn("x4", "host-b"); vm.Namespace = "tenant-b"; return vm }(),
			},
			wantHost: "host-b", wantPhase: vmv1.PhasePending,
			wantStatus: metav1.ConditionTrue, wantReason: vmv1.HostAssignedReason,
			wantMsg:    "placed on host host-b, the least loaded of 3 candidate hosts",
			wantEvents: []string{"Normal Placed placed on host host-b, the least loaded of 3 candidate hosts"},
		},
		{
			name:      "without a candidate the VirtualMachine waits, and says why",
			vm:        newVM("vm-1"),
			objs:      []client.Object{newNode("host-a", func(n *corev1.Node) { n.Spec.Unschedulable = true })},
			wantPhase: vmv1.PhasePending, wantStatus: metav1.ConditionFalse, wantReason: vmv1.NoHostAvailableReason,
			wantMsg:    "no Ready, schedulable Node is labelled vm.pvbridge.io/host=true",
			wantEvents: []string{"Warning NoHostAvailable no Ready, schedulable Node is labelled vm.pvbridge.io/host=true"},
		},
		{
			name: "a placed VirtualMachine never moves",
			vm: newVM("vm-1", onHost("host-a"), func(vm *vmv1.VirtualMachine) {
				vm.Status.Phase = vmv1.PhaseRunning
				vm.Status.Conditions = []metav1.Condition{{
					Type: vmv1.PlacedCondition, Status: metav1.ConditionTrue, Reason: vmv1.HostAssignedReason,
					Message: "placed on host host-a, the least loaded of 2 candidate hosts", LastTransitionTime: metav1.Now(),
				}, ready(metav1.ConditionTrue, vmv1.PoweredOnReason)}
			}),
			objs:     []client.Object{newNode("host-a"), newNode("host-b"), placedOn("x1", "host-a")},
			wantHost: "host-a", wantPhase: vmv1.PhaseRunning,
			wantStatus: metav1.ConditionTrue, wantReason: vmv1.HostAssignedReason,
			wantMsg: "placed on host host-a, the least loaded of 2 candidate hosts",
		},
		{
			name: "spec.host set after placement is ignored, with a warning",
			vm: newVM("vm-1", onHost("host-a"), func(vm *vmv1.VirtualMachine) {
				vm.Spec.Host = "host-b"
				vm.Status.Conditions = []metav1.Condition{ready(metav1.ConditionTrue, vmv1.PoweredOffReason)}
			}),
			objs:     []client.Object{newNode("host-a")},
			wantHost: "host-a", wantPhase: vmv1.PhaseStopped,
			wantStatus: metav1.ConditionTrue, wantReason: vmv1.HostAssignedReason,
			wantMsg:    "placed on host host-a; spec.host host-b is ignored: a VirtualMachine never moves to another host",
			wantEvents: []string{"Warning SpecHostIgnored placed on host host-a; spec.host host-b is ignored: a VirtualMachine never moves to another host"},
		},
		{
			name: "a VirtualMachine whose host is declared lost is Ready False and Failed: its agent cannot say so",
			vm: newVM("vm-1", onHost("host-a"), func(vm *vmv1.VirtualMachine) {
				vm.Status.Conditions = []metav1.Condition{ready(metav1.ConditionTrue, vmv1.PoweredOnReason)}
			}),
			objs: []client.Object{newNode("host-a", func(n *corev1.Node) {
				n.Spec.Taints = []corev1.Taint{{Key: corev1.TaintNodeOutOfService, Value: "nodeshutdown", Effect: corev1.TaintEffectNoExecute}}
			})},
			wantHost: "host-a", wantPhase: vmv1.PhaseFailed,
			wantStatus: metav1.ConditionTrue, wantReason: vmv1.HostAssignedReason, wantMsg: "placed on host host-a",
			wantReady: vmv1.HostLostReason,
		},
		{
			name: "a lost host taken back: its agent reports afresh",
			vm: newVM("vm-1", onHost("host-a"), func(vm *vmv1.VirtualMachine) {
				vm.Status.Conditions = []metav1.Condition{ready(metav1.ConditionFalse, vmv1.HostLostReason)}
			}),
			objs:     []client.Object{newNode("host-a")},
			wantHost: "host-a", wantPhase: vmv1.PhasePending,
			wantStatus: metav1.ConditionTrue, wantReason: vmv1.HostAssignedReason, wantMsg: "placed on host host-a",
			noReady: true,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			ctx := t.Context()
			c := newFakeClient(g, nil, append(tt.objs, tt.vm)...)
			rec := events.NewFakeRecorder(10)
			r := &PlacementReconciler{Client: c, APIReader: c, Recorder: rec}

			res, err := r.Reconcile(ctx, ctrl.Request{NamespacedName: client.ObjectKeyFromObject(tt.vm)})
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(res).To(Equal(ctrl.Result{}))

			got := &vmv1.VirtualMachine{}
			g.Expect(c.Get(ctx, client.ObjectKeyFromObject(tt.vm), got)).To(Succeed())
			g.Expect(got.Status.Host).To(Equal(tt.wantHost))
			g.Expect(got.Status.UniqueID).To(Equal(string(tt.vm.UID)))
			g.Expect(got.Status.Phase).To(Equal(tt.wantPhase))
			placed := meta.FindStatusCondition(got.Status.Conditions, vmv1.PlacedCondition)
			g.Expect(placed).NotTo(BeNil())
			g.Expect(placed.Status).To(Equal(tt.wantStatus))
			g.Expect(placed.Reason).To(Equal(tt.wantReason))
			g.Expect(placed.Message).To(Equal(tt.wantMsg))
			if tt.noReady {
				g.Expect(meta.FindStatusCondition(got.Status.Conditions, vmv1.ReadyCondition)).To(BeNil())
			}
			if tt.wantReady != "" {
				g.Expect(meta.FindStatusCondition(got.Status.Conditions, vmv1.ReadyCondition)).To(And(
					HaveField("Status", metav1.ConditionFalse), HaveField("Reason", tt.wantReady)))
			}
			g.Expect(drain(rec)).To(Equal(tt.wantEvents))

			// A second pass changes nothing and tells nothing.
			before := got.ResourceVersion
			_, err = r.Reconcile(ctx, ctrl.Request{NamespacedName: client.ObjectKeyFromObject(tt.vm)})
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(c.Get(ctx, client.ObjectKeyFromObject(tt.vm), got)).To(Succeed())
			g.Expect(got.ResourceVersion).To(Equal(before))
			g.Expect(drain(rec)).To(BeEmpty())
		})
	}
}

func TestPlacementLeavesADeletedVirtualMachineAlone(t *testing.T) {
	g := NewWithT(t)
	vm := newVM("vm-1", deleted)
	c := newFakeClient(g, nil, vm, newNode("host-a"))
	r := &PlacementReconciler{Client: c, APIReader: c, Recorder: events.NewFakeRecorder(10)}
	_, err := r.Reconcile(t.Context(), ctrl.Request{NamespacedName: client.ObjectKeyFromObject(vm)})
	g.Expect(err).NotTo(HaveOccurred())
	got := &vmv1.VirtualMachine{}
	g.Expect(c.Get(t.Context(), client.ObjectKeyFromObject(vm), got)).To(Succeed())
	g.Expect(got.Status).To(Equal(vmv1.VirtualMachineStatus{}))
}

func TestPlacementCountsItsOwnPlacementsBeforeTheCacheShowsThem(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	// A cache that has seen no placement yet: every listed VirtualMachine is unplaced.
	stale := interceptor.Funcs{List: func(ctx context.Context, c client.WithWatch, list client.ObjectList, opts ...client.ListOption) error {
		if err := c.List(ctx, list, opts...); err != nil {
			return err
		}
		if vms, ok := list.(*vmv1.VirtualMachineList); ok {
			for i := range vms.Items {
				vms.Items[i].Status.Host = ""
			}
		}
		return nil
	}}
	c := newFakeClient(g, &stale, newNode("host-a"), newNode("host-b"), newVM("vm-1"), newVM("vm-2"))
	r := &PlacementReconciler{Client: c, APIReader: c, Recorder: events.NewFakeRecorder(10)}

	hosts := map[string]bool{}
	for _, name := range []string{"vm-1", "vm-2"} {
		key := client.ObjectKey{Namespace: testNamespace, Name: name}
		_, err := r.Reconcile(ctx, ctrl.Request{NamespacedName: key})
		g.Expect(err).NotTo(HaveOccurred())
		vm := &vmv1.VirtualMachine{}
		g.Expect(c.Get(ctx, key, vm)).To(Succeed())
		hosts[vm.Status.Host] = true
	}
	g.Expect(hosts).To(Equal(map[string]bool{"host-a": true, "host-b": true}))
}

func TestPlacementRetriesALostStatusRace(t *testing.T) {
	g := NewWithT(t)
	conflict := interceptor.Funcs{SubResourcePatch: func(context.Context, client.Client, string, client.Object, client.Patch, ...client.SubResourcePatchOption) error {
		return apierrors.NewConflict(schema.GroupResource{Group: vmv1.GroupVersion.Group, Resource: "virtualmachines"}, "vm-1", nil)
	}}
	vm := newVM("vm-1")
	rec := events.NewFakeRecorder(10)
	r := &PlacementReconciler{Client: newFakeClient(g, &conflict, vm, newNode("host-a")), Recorder: rec}
	res, err := r.Reconcile(t.Context(), ctrl.Request{NamespacedName: client.ObjectKeyFromObject(vm)})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(res.RequeueAfter).To(Equal(conflictRetry))
	g.Expect(drain(rec)).To(BeEmpty(), "no event for a placement that was not written")
	g.Expect(r.assumed).To(BeEmpty())
}
