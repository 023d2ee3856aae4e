package topology

import (
	"testing"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
)

func TestNodeHost(t *testing.T) {
	for _, tc := range []struct {
		name    string
		node    *corev1.Node
		want    string
		unknown bool
	}{
		{"labelled", &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "vm-1", Labels: map[string]string{Key: "host-a"}}}, "host-a", false},
		{"not labelled yet", &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "vm-1"}}, "", true},
		{"not registered yet", &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "vm-2"}}, "", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			host, err := NodeHost{Client: fake.NewClientset(tc.node), Node: "vm-1"}.HostOf(t.Context())
			if tc.unknown {
				g.Expect(err).To(MatchError(ErrHostUnknown))
				return
			}
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(host).To(Equal(tc.want))
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
	g.Expect(h.HostOf(t.Context())).To(Equal("host-a"))
}
