package hostloss

import (
	"testing"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/scheme"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"
	"sigs.k8s.io/controller-runtime/pkg/event"

	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
)

func node(name string, taints ...corev1.Taint) *corev1.Node {
	return &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}, Spec: corev1.NodeSpec{Taints: taints}}
}

var outOfService = corev1.Taint{Key: corev1.TaintNodeOutOfService, Value: "nodeshutdown", Effect: corev1.TaintEffectNoExecute}

func TestLost(t *testing.T) {
	tests := []struct {
		name         string
		cached, live []client.Object
		want         bool
	}{
		{name: "a host whose Node is there", cached: []client.Object{node("host-a")}, live: []client.Object{node("host-a")}},
		{name: "a host tainted out of service", cached: []client.Object{node("host-a", outOfService)}, want: true},
		{name: "a host only NoSchedule-tainted is not lost", cached: []client.Object{node("host-a", corev1.Taint{Key: corev1.TaintNodeUnreachable, Effect: corev1.TaintEffectNoSchedule})}},
		{name: "a Node the cache has not seen yet is confirmed with the API server", live: []client.Object{node("host-a")}},
		{name: "a host whose Node is gone", want: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			cached := fake.NewClientBuilder().WithScheme(scheme.Scheme).WithObjects(tt.cached...).Build()
			live := fake.NewClientBuilder().WithScheme(scheme.Scheme).WithObjects(tt.live...).Build()
			got, err := Lost(t.Context(), cached, live, "host-a")
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(got).To(Equal(tt.want))
		})
	}
}

func TestChangedLetsThroughWhatMakesAHostLost(t *testing.T) {
	g := NewWithT(t)
	p := Changed()
	g.Expect(p.Update(event.UpdateEvent{ObjectOld: node("host-a"), ObjectNew: node("host-a", outOfService)})).To(BeTrue(), "the taint comes")
	g.Expect(p.Update(event.UpdateEvent{ObjectOld: node("host-a", outOfService), ObjectNew: node("host-a", outOfService)})).To(BeFalse(), "still lost")
	g.Expect(p.Update(event.UpdateEvent{ObjectOld: node("host-a"), ObjectNew: node("host-a")})).To(BeFalse(), "a routine update")
	g.Expect(p.Delete(event.DeleteEvent{Object: node("host-a")})).To(BeTrue(), "the Node goes")
	g.Expect(p.Create(event.CreateEvent{Object: node("host-a")})).To(BeFalse())
}

var drain = corev1.Taint{Key: vmv1.DrainTaint, Effect: corev1.TaintEffectNoSchedule}

func TestStateOf(t *testing.T) {
	for _, tt := range []struct {
		name string
		node *corev1.Node
		want State
	}{
		{name: "a host", node: node("host-a"), want: Available},
		{name: "a drained host", node: node("host-a", drain), want: Drained},
		{name: "a drained host that is lost is lost", node: node("host-a", drain, outOfService), want: LostState},
		{name: "a host whose Node is gone", want: LostState},
	} {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			b := fake.NewClientBuilder().WithScheme(scheme.Scheme)
			if tt.node != nil {
				b = b.WithObjects(tt.node)
			}
			c := b.Build()
			got, err := StateOf(t.Context(), c, c, "host-a")
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(got).To(Equal(tt.want))
		})
	}
}

func TestStateChangedLetsThroughADrainAndALoss(t *testing.T) {
	g := NewWithT(t)
	p := StateChanged()
	g.Expect(p.Update(event.UpdateEvent{ObjectOld: node("host-a"), ObjectNew: node("host-a", drain)})).To(BeTrue(), "the drain starts")
	g.Expect(p.Update(event.UpdateEvent{ObjectOld: node("host-a", drain), ObjectNew: node("host-a")})).To(BeTrue(), "the drain ends")
	g.Expect(p.Update(event.UpdateEvent{ObjectOld: node("host-a"), ObjectNew: node("host-a", outOfService)})).To(BeTrue(), "the host is lost")
	g.Expect(p.Update(event.UpdateEvent{ObjectOld: node("host-a"), ObjectNew: node("host-a")})).To(BeFalse(), "a routine update")
	g.Expect(p.Delete(event.DeleteEvent{Object: node("host-a")})).To(BeTrue(), "the Node goes")
}
