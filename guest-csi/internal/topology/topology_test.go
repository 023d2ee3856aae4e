package topology

import (
	"context"
	"testing"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
)

func TestNodeHost(t *testing.T) {
	node := func(name string, labels, annotations map[string]string) *corev1.Node {
		return &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels, Annotations: annotations}}
	}
	labelled := map[string]string{Key: "host-a"}
	for _, tc := range []struct {
		name    string
		node    *corev1.Node
		want    VM
		unknown bool
	}{
		{"labelled", node("vm-1", labelled, nil), VM{Host: "host-a"}, false},
		{"labelled and annotated with its slots", node("vm-1", labelled, map[string]string{MaxVolumesAnnotation: "7"}), VM{Host: "host-a", MaxVolumes: 7}, false},
		{"slots that are no number are no limit", node("vm-1", labelled, map[string]string{MaxVolumesAnnotation: "many"}), VM{Host: "host-a"}, false},
		{"slots that are not positive are no limit", node("vm-1", labelled, map[string]string{MaxVolumesAnnotation: "-1"}), VM{Host: "host-a"}, false},
		{"not labelled yet", node("vm-1", nil, map[string]string{MaxVolumesAnnotation: "7"}), VM{}, true},
		{"not registered yet", node("vm-2", nil, nil), VM{}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			vm, err := NodeHost{Client: fake.NewClientset(tc.node), Node: "vm-1"}.VMOf(t.Context())
			if tc.unknown {
				g.Expect(err).To(MatchError(ErrHostUnknown))
				return
			}
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(vm).To(Equal(tc.want))
		})
	}
}

func TestLabellerLabelsAndAnnotatesTheNode(t *testing.T) {
	for _, tc := range []struct {
		name            string
		labels, annots  map[string]string
		vm              VM
		wantLabels      map[string]string
		wantAnnotations map[string]string
	}{
		{
			name: "a new node gets its host and slots", vm: VM{Host: "host-a", MaxVolumes: 4},
			wantLabels: map[string]string{Key: "host-a"}, wantAnnotations: map[string]string{MaxVolumesAnnotation: "4"},
		},
		{
			name: "changed slots are rewritten", vm: VM{Host: "host-a", MaxVolumes: 2},
			labels: map[string]string{Key: "host-a"}, annots: map[string]string{MaxVolumesAnnotation: "4", "other": "kept"},
			wantLabels: map[string]string{Key: "host-a"}, wantAnnotations: map[string]string{MaxVolumesAnnotation: "2", "other": "kept"},
		},
		{
			name: "slots the VM no longer reports are removed", vm: VM{Host: "host-a"},
			labels: map[string]string{Key: "host-a"}, annots: map[string]string{MaxVolumesAnnotation: "4"},
			wantLabels: map[string]string{Key: "host-a"}, wantAnnotations: nil,
		},
		{
			name: "a VM without a host leaves the node alone", vm: VM{MaxVolumes: 4},
			wantLabels: nil, wantAnnotations: nil,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "vm-1", Labels: tc.labels, Annotations: tc.annots}}
			client := fake.NewClientset(node)
			l := NewLabeller(client, func(_ context.Context, vm string) (VM, error) {
				g.Expect(vm).To(Equal("vm-1"))
				return tc.vm, nil
			})
			g.Expect(l.label(t.Context(), node)).To(Succeed())
			got, err := client.CoreV1().Nodes().Get(t.Context(), "vm-1", metav1.GetOptions{})
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(got.Labels).To(Equal(tc.wantLabels))
			if tc.wantAnnotations == nil {
				g.Expect(got.Annotations).NotTo(HaveKey(MaxVolumesAnnotation))
			} else {
				g.Expect(got.Annotations).To(Equal(tc.wantAnnotations))
			}
		})
	}
}

// The node of a VM gone with its lost host is tainted out of service once it is not Ready, its
// other taints kept; a Ready node, or one whose host is not lost, is not.
func TestLabellerTaintsTheNodeOfAVMGoneWithItsHost(t *testing.T) {
	other := corev1.Taint{Key: "example.com/other", Effect: corev1.TaintEffectNoSchedule}
	unreachable := corev1.Taint{Key: corev1.TaintNodeUnreachable, Effect: corev1.TaintEffectNoExecute}
	for _, tc := range []struct {
		name       string
		ready      corev1.ConditionStatus
		taints     []corev1.Taint
		vm         VM
		wantTaints []corev1.Taint
	}{
		{name: "not Ready, its host lost", ready: corev1.ConditionUnknown, vm: VM{Host: "host-a", HostLost: true},
			wantTaints: []corev1.Taint{OutOfServiceTaint}},
		{name: "its other taints kept", ready: corev1.ConditionUnknown, taints: []corev1.Taint{other, unreachable}, vm: VM{Host: "host-a", HostLost: true},
			wantTaints: []corev1.Taint{other, unreachable, OutOfServiceTaint}},
		{name: "tainted already", ready: corev1.ConditionFalse, taints: []corev1.Taint{OutOfServiceTaint}, vm: VM{Host: "host-a", HostLost: true},
			wantTaints: []corev1.Taint{OutOfServiceTaint}},
		{name: "Ready: not tainted, whatever its host's state", ready: corev1.ConditionTrue, vm: VM{Host: "host-a", HostLost: true}},
		{name: "not Ready, its host not lost", ready: corev1.ConditionUnknown, taints: []corev1.Taint{unreachable}, vm: VM{Host: "host-a"},
			wantTaints: []corev1.Taint{unreachable}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			node := &corev1.Node{
				ObjectMeta: metav1.ObjectMeta{Name: "vm-1", ResourceVersion: "7", Labels: map[string]string{Key: "host-a"}},
				Spec:       corev1.NodeSpec{Taints: tc.taints},
				Status:     corev1.NodeStatus{Conditions: []corev1.NodeCondition{{Type: corev1.NodeReady, Status: tc.ready}}},
			}
			client := fake.NewClientset(node)
			l := NewLabeller(client, func(context.Context, string) (VM, error) { return tc.vm, nil })
			g.Expect(l.label(t.Context(), node)).To(Succeed())
			got, err := client.CoreV1().Nodes().Get(t.Context(), "vm-1", metav1.GetOptions{})
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(got.Spec.Taints).To(Equal(tc.wantTaints))
		})
	}
}

// The node plugin waits by watch until the controller has labelled its node.
func TestNodeHostWaitsForTheLabel(t *testing.T) {
	g := NewWithT(t)
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "vm-1"}}
	client := fake.NewClientset(node)
	h := NodeHost{Client: client, Node: "vm-1"}
	done := make(chan error, 1)
	go func() { done <- h.WaitForHost(t.Context()) }()
	g.Consistently(done).ShouldNot(Receive(), "no host yet")

	node.Labels = map[string]string{Key: "host-a"}
	_, err := client.CoreV1().Nodes().Update(t.Context(), node, metav1.UpdateOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	g.Eventually(done).Should(Receive(BeNil()))
	g.Expect(h.VMOf(t.Context())).To(Equal(VM{Host: "host-a"}))
}
