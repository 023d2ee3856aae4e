package tenants

import (
	"context"
	"strings"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"github.com/onsi/gomega/types"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pvbridge.io/pkg/tenancy"
)

func TestSnapshotQuotaOfEnforcedNamespace(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	e := newTenantEnv(t, nil)
	cfg := e.config()
	cfg.SnapshotQuota, cfg.GroupSnapshotQuota = 3, 2
	e.startManager(t, cfg)
	key := client.ObjectKey{Namespace: e.ns, Name: SnapshotQuota}
	quota := func(ctx context.Context) (*corev1.ResourceQuota, error) {
		q := &corev1.ResourceQuota{}
		return q, mgmtClient.Get(ctx, key, q)
	}
	hard := func(n int64) types.GomegaMatcher {
		count := func(n int64) types.GomegaMatcher {
			return WithTransform(func(q resource.Quantity) int64 { return q.Value() }, Equal(n))
		}
		return HaveField("Spec.Hard", And(HaveKeyWithValue(corev1.ResourceName(tenancy.SnapshotCountResource), count(n)), HaveKeyWithValue(groupSnapshotCount, count(2))))
	}

	g.Consistently(func(ctx context.Context) bool {
		_, err := quota(ctx)
		return apierrors.IsNotFound(err)
	}).WithContext(ctx).WithTimeout(time.Second).Should(BeTrue(), "a namespace that is not enforced gets no quota")

	ns := &corev1.Namespace{}
	g.Expect(mgmtClient.Get(ctx, client.ObjectKey{Name: e.ns}, ns)).To(Succeed())
	patch := client.MergeFrom(ns.DeepCopy())
	ns.Labels = map[string]string{tenancy.TenancyNamespaceLabel: tenancy.TenancyEnforced}
	g.Expect(mgmtClient.Patch(ctx, ns, patch)).To(Succeed())
	eventually(g, quota).WithContext(ctx).Should(hard(3), "an enforced namespace gets the quota")

	q, err := quota(ctx)
	g.Expect(err).NotTo(HaveOccurred())
	q.Spec.Hard[tenancy.SnapshotCountResource] = resource.MustParse("10")
	g.Expect(mgmtClient.Update(ctx, q)).To(Succeed())
	g.Consistently(quota).WithContext(ctx).WithTimeout(time.Second).Should(hard(10), "the admin's change stays")

	g.Expect(mgmtClient.Delete(ctx, q)).To(Succeed())
	eventually(g, quota).WithContext(ctx).Should(hard(3), "a deleted quota comes back")
}

// TestQuotaUsageOfEnforcedNamespace: each resource of a quota in an enforced namespace is
// reported as used over hard, from the usage in its status, and no longer once the quota goes.
func TestQuotaUsageOfEnforcedNamespace(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	e := newTenantEnv(t, nil)
	e.startManager(t, e.config())
	storage := corev1.ResourceRequestsStorage
	quota := &corev1.ResourceQuota{
		ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "storage"},
		Spec:       corev1.ResourceQuotaSpec{Hard: corev1.ResourceList{storage: resource.MustParse("10Gi")}},
	}
	g.Expect(mgmtClient.Create(ctx, quota)).To(Succeed())
	// kube-controller-manager's part, which this test's apiserver runs without.
	setUsed := func(used string) {
		quota.Status = corev1.ResourceQuotaStatus{Hard: quota.Spec.Hard, Used: corev1.ResourceList{storage: resource.MustParse(used)}}
		g.Expect(mgmtClient.Status().Update(ctx, quota)).To(Succeed())
	}
	setUsed("5Gi")
	ratios := func() map[string]float64 { return seriesOf(g, quotaUsedRatio, e.ns) }

	g.Consistently(ratios).WithTimeout(time.Second).Should(BeEmpty(), "a namespace that is not enforced")
	ns := &corev1.Namespace{}
	g.Expect(mgmtClient.Get(ctx, client.ObjectKey{Name: e.ns}, ns)).To(Succeed())
	patch := client.MergeFrom(ns.DeepCopy())
	ns.Labels = map[string]string{tenancy.TenancyNamespaceLabel: tenancy.TenancyEnforced}
	g.Expect(mgmtClient.Patch(ctx, ns, patch)).To(Succeed())
	eventually(g, ratios).Should(Equal(map[string]float64{"requests.storage/storage": 0.5}), "once it is enforced")

	setUsed("10Gi")
	eventually(g, ratios).Should(Equal(map[string]float64{"requests.storage/storage": 1}), "exhausted")

	g.Expect(mgmtClient.Delete(ctx, quota)).To(Succeed())
	eventually(g, ratios).Should(BeEmpty(), "a deleted quota")
}

// seriesOf is the series of c in namespace: the values of their other labels, in the order of
// the labels' names, joined by "/" → value.
func seriesOf(g Gomega, c prometheus.Collector, namespace string) map[string]float64 {
	ch := make(chan prometheus.Metric)
	go func() { c.Collect(ch); close(ch) }()
	out := map[string]float64{}
	for m := range ch {
		d := &dto.Metric{}
		g.Expect(m.Write(d)).To(Succeed())
		var key []string
		ns := ""
		for _, p := range d.GetLabel() { // sorted by name
			if p.GetName() == "namespace" {
				ns = p.GetValue()
			} else {
				key = append(key, p.GetValue())
			}
		}
		if ns == namespace {
			out[strings.Join(key, "/")] = d.GetGauge().GetValue()
		}
	}
	return out
}
