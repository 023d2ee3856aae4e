package agent

import (
	"errors"
	"testing"

	. "github.com/onsi/gomega"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	clientfake "sigs.k8s.io/controller-runtime/pkg/client/fake"

	"pvbridge.io/mgmt-csi/internal/pmem/fake"
	pmemv1 "pvbridge.io/pkg/apis/pmem/v1alpha1"
)

// TestNodeReporterPublishesCapacity: the PmemNode's status and the node's PMEM gauges say what
// the back end has; a back end that cannot tell marks the node not Ready and keeps the last
// figures.
func TestNodeReporterPublishesCapacity(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	scheme := runtime.NewScheme()
	g.Expect(pmemv1.AddToScheme(scheme)).To(Succeed())
	c := clientfake.NewClientBuilder().WithScheme(scheme).WithStatusSubresource(&pmemv1.PmemNode{}).Build()
	b := fake.New(fake.Options{Capacity: 100 * mi})
	r := &NodeReporter{Client: c, Backend: b, Node: "host-metrics"}

	_, err := b.CreateVolume(ctx, "vol-1", 30*mi, nil)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(r.refresh(ctx)).To(Succeed())
	node := &pmemv1.PmemNode{}
	g.Expect(c.Get(ctx, client.ObjectKey{Name: "host-metrics"}, node)).To(Succeed())
	g.Expect(node.Status.Total.Value()).To(Equal(100 * mi))
	g.Expect(node.Status.Free.Value()).To(Equal(70 * mi))
	g.Expect(meta.IsStatusConditionTrue(node.Status.Conditions, pmemv1.ReadyCondition)).To(BeTrue())
	g.Expect(testutil.ToFloat64(pmemTotalBytes.WithLabelValues("host-metrics"))).To(Equal(float64(100 * mi)))
	g.Expect(testutil.ToFloat64(pmemFreeBytes.WithLabelValues("host-metrics"))).To(Equal(float64(70 * mi)))

	b.InjectError(fake.Capacity, errors.New("region gone"))
	g.Expect(r.refresh(ctx)).To(Succeed())
	g.Expect(c.Get(ctx, client.ObjectKey{Name: "host-metrics"}, node)).To(Succeed())
	g.Expect(meta.IsStatusConditionTrue(node.Status.Conditions, pmemv1.ReadyCondition)).To(BeFalse())
	g.Expect(testutil.ToFloat64(pmemFreeBytes.WithLabelValues("host-metrics"))).To(Equal(float64(70 * mi)))
}
