package capi

import (
	"testing"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/utils/ptr"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	infrav1 "pvbridge.io/pkg/apis/infrastructure/v1alpha1"
)

func TestClusterReconcile(t *testing.T) {
	tests := []struct {
		name            string
		prepare         func(f *fixtures)
		wantProvisioned bool
		wantDomains     []infrav1.FailureDomain
		wantReason      string
		wantPaused      bool
	}{{
		name:            "the management hosts are the failure domains",
		wantProvisioned: true, wantReason: infrav1.ProvisionedReason,
		wantDomains: []infrav1.FailureDomain{{Name: "host-a", ControlPlane: ptr.To(true)}, {Name: "host-c", ControlPlane: ptr.To(true)}},
	}, {
		name: "the spec's failure domains replace the hosts",
		prepare: func(f *fixtures) {
			f.ic.Spec.FailureDomains = []infrav1.FailureDomain{{Name: "host-z", ControlPlane: ptr.To(false)}, {Name: "host-b"}}
		},
		wantProvisioned: true, wantReason: infrav1.ProvisionedReason,
		wantDomains: []infrav1.FailureDomain{{Name: "host-b", ControlPlane: ptr.To(true)}, {Name: "host-z", ControlPlane: ptr.To(false)}},
	}, {
		name:        "without a control plane endpoint it is not provisioned",
		prepare:     func(f *fixtures) { f.ic.Spec.ControlPlaneEndpoint = infrav1.APIEndpoint{} },
		wantReason:  infrav1.WaitingForControlPlaneEndpointReason,
		wantDomains: []infrav1.FailureDomain{{Name: "host-a", ControlPlane: ptr.To(true)}, {Name: "host-c", ControlPlane: ptr.To(true)}},
	}, {
		name: "an endpoint set on the Cluster by someone else provisions it",
		prepare: func(f *fixtures) {
			f.ic.Spec.ControlPlaneEndpoint = infrav1.APIEndpoint{}
			f.cluster.Spec.ControlPlaneEndpoint = clusterv1.APIEndpoint{Host: "guest-1.kamaji.example", Port: 443}
		},
		wantProvisioned: true, wantReason: infrav1.ProvisionedReason,
		wantDomains: []infrav1.FailureDomain{{Name: "host-a", ControlPlane: ptr.To(true)}, {Name: "host-c", ControlPlane: ptr.To(true)}},
	}, {
		name:    "an externally managed one is left alone",
		prepare: func(f *fixtures) { f.ic.Annotations = map[string]string{clusterv1.ManagedByAnnotation: "kamaji"} },
	}, {
		name:       "a paused Cluster pauses it",
		prepare:    func(f *fixtures) { f.cluster.Spec.Paused = ptr.To(true) },
		wantPaused: true,
	}, {
		name:    "without a Cluster owner it waits for Cluster API",
		prepare: func(f *fixtures) { f.ic.OwnerReferences = nil },
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			f := newFixtures()
			if tt.prepare != nil {
				tt.prepare(f)
			}
			// Hosts that cannot take a new VM are no failure domain: cordoned, NotReady, lost.
			cordoned := host("host-cordoned", true, func(n *corev1.Node) { n.Spec.Unschedulable = true })
			notReady := host("host-not-ready", true, func(n *corev1.Node) { n.Status.Conditions[0].Status = corev1.ConditionUnknown })
			lost := host("host-lost", true, func(n *corev1.Node) {
				n.Status.Conditions[0].Status = corev1.ConditionUnknown
				n.Spec.Taints = []corev1.Taint{{Key: corev1.TaintNodeOutOfService, Value: "nodeshutdown", Effect: corev1.TaintEffectNoExecute}}
			})
			c := newClient(t, append(f.objects(), host("host-a", true), host("host-c", true), host("not-a-host", false), cordoned, notReady, lost)...)
			r := &ClusterReconciler{Client: c}

			_, err := r.Reconcile(t.Context(), ctrl.Request{NamespacedName: client.ObjectKeyFromObject(f.ic)})

			g.Expect(err).NotTo(HaveOccurred())
			ic := get(t, c, &infrav1.PVBridgeCluster{ObjectMeta: f.ic.ObjectMeta})
			g.Expect(ic.Status.FailureDomains).To(Equal(tt.wantDomains))
			g.Expect(ptr.Deref(ic.Status.Initialization.Provisioned, false)).To(Equal(tt.wantProvisioned))
			if tt.wantReason != "" {
				ready := meta.FindStatusCondition(ic.Status.Conditions, infrav1.ReadyCondition)
				g.Expect(ready).NotTo(BeNil())
				g.Expect(ready.Reason).To(Equal(tt.wantReason))
			}
			g.Expect(meta.IsStatusConditionTrue(ic.Status.Conditions, infrav1.PausedCondition)).To(Equal(tt.wantPaused))
			if _, managed := ic.Annotations[clusterv1.ManagedByAnnotation]; managed {
				g.Expect(ic.Annotations).To(Equal(f.ic.Annotations), "an externally managed one is not written")
			} else if len(ic.OwnerReferences) > 0 {
				g.Expect(ic.Annotations).To(HaveKey(infrav1.BlockMoveAnnotation), "clusterctl move is blocked, paused or not")
			}
		})
	}
}

func TestWatchesMapToTheInfrastructureObjects(t *testing.T) {
	g := NewWithT(t)
	f := newFixtures()
	g.Expect(infraClusterOf(t.Context(), f.cluster)).To(ConsistOf(ctrl.Request{NamespacedName: client.ObjectKeyFromObject(f.ic)}))
	g.Expect(infraMachineOf(t.Context(), f.machine)).To(ConsistOf(ctrl.Request{NamespacedName: client.ObjectKeyFromObject(f.pm)}))
	f.machine.Spec.InfrastructureRef.Kind = "DockerMachine"
	g.Expect(infraMachineOf(t.Context(), f.machine)).To(BeEmpty())
	other := &clusterv1.Cluster{}
	g.Expect(infraClusterOf(t.Context(), other)).To(BeEmpty())

	c := newClient(t, f.objects()...)
	r := &MachineReconciler{Client: c}
	g.Expect(r.machinesOfCluster(t.Context(), f.cluster)).To(ConsistOf(ctrl.Request{NamespacedName: client.ObjectKeyFromObject(f.pm)}))
}
