package tenants

import (
	"context"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"github.com/onsi/gomega/types"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pvbridge.io/pkg/tenancy"
)

func TestSnapshotQuotaOfEnforcedNamespace(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	e := newTenantEnv(t, nil)
	cfg := e.config()
	cfg.SnapshotQuota = 3
	e.startManager(t, cfg)
	key := client.ObjectKey{Namespace: e.ns, Name: SnapshotQuota}
	quota := func(ctx context.Context) (*corev1.ResourceQuota, error) {
		q := &corev1.ResourceQuota{}
		return q, mgmtClient.Get(ctx, key, q)
	}
	hard := func(n int64) types.GomegaMatcher {
		return HaveField("Spec.Hard", HaveKeyWithValue(snapshotCount, WithTransform(func(q resource.Quantity) int64 { return q.Value() }, Equal(n))))
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
	q.Spec.Hard[snapshotCount] = resource.MustParse("10")
	g.Expect(mgmtClient.Update(ctx, q)).To(Succeed())
	g.Consistently(quota).WithContext(ctx).WithTimeout(time.Second).Should(hard(10), "the admin's change stays")

	g.Expect(mgmtClient.Delete(ctx, q)).To(Succeed())
	eventually(g, quota).WithContext(ctx).Should(hard(3), "a deleted quota comes back")
}
