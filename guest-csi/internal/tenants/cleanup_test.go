package tenants

import (
	"context"
	"testing"

	. "github.com/onsi/gomega"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pvbridge.io/pkg/tenancy"
)

// TestCleanupAfterDeletedCluster: a deleted Cluster's management volumes are deleted only once
// its VirtualMachines are gone; the volumes shared with it are released (only its name leaves
// their shared-with annotation); a second cluster's objects and those of an earlier cluster of
// the same name are untouched; then its capacity access goes and the Cluster with it.
func TestCleanupAfterDeletedCluster(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	e := newTenantEnv(t, nil)
	e.startManager(t, e.config())
	a := e.createCluster(t, "a", true, nil)
	b := e.createCluster(t, "b", true, nil)
	for _, c := range []*clusterv1.Cluster{a, b} {
		eventually(g, func(ctx context.Context) ([]string, error) {
			err := mgmtClient.Get(ctx, client.ObjectKeyFromObject(c), c)
			return c.Finalizers, err
		}).WithContext(ctx).Should(ContainElement(CleanupFinalizer))
		eventually(g, func(ctx context.Context) error {
			return mgmtClient.Get(ctx, client.ObjectKey{Namespace: e.capacityNS, Name: capacityName(c)}, &rbacv1.RoleBinding{})
		}).WithContext(ctx).Should(Succeed())
	}

	ownedBy := func(c *clusterv1.Cluster) map[string]string {
		return map[string]string{tenancy.ClusterNameLabel: c.Name, tenancy.ClusterUIDLabel: string(c.UID)}
	}
	earlierA := map[string]string{tenancy.ClusterNameLabel: "a", tenancy.ClusterUIDLabel: "uid-of-an-earlier-a"}
	vmA, vmB := e.vm("a-0", "a"), e.vm("b-0", "b")
	aOwned, aSnap, aGroup := e.pvc("a-owned", ownedBy(a), ""), e.snapshot("a-snap", ownedBy(a), ""), e.groupSnapshot("a-group", ownedBy(a))
	sharedAB, sharedA := e.pvc("shared-ab", nil, "a, b"), e.pvc("shared-a", nil, "a")
	sharedSnap := e.snapshot("shared-snap", nil, "a")
	// Untouched: the other cluster's volume and VM, a volume of an earlier cluster named a.
	untouched := []client.Object{
		vmB, e.pvc("b-owned", ownedBy(b), ""), e.snapshot("b-snap", ownedBy(b), ""), e.groupSnapshot("b-group", ownedBy(b)),
		e.pvc("earlier-a", earlierA, ""), e.pvc("b-shared-with-b", ownedBy(b), "b"),
	}
	create(t, append([]client.Object{vmA, aOwned, aSnap, aGroup, sharedAB, sharedA, sharedSnap}, untouched...)...)
	versions := map[string]string{}
	for _, obj := range untouched {
		versions[obj.GetName()] = obj.GetResourceVersion()
	}

	g.Expect(mgmtClient.Delete(ctx, a)).To(Succeed())
	eventually(g, func(ctx context.Context) ([]string, error) { return eventReasons(ctx, a) }).
		WithContext(ctx).Should(ContainElement(eventWaitingVMs))
	g.Expect(mgmtClient.Get(ctx, client.ObjectKeyFromObject(aOwned), aOwned)).To(Succeed())
	g.Expect(aOwned.DeletionTimestamp).To(BeNil(), "no volume is deleted while a VM of the cluster remains")
	g.Expect(mgmtClient.Get(ctx, client.ObjectKeyFromObject(a), a)).To(Succeed(), "the Cluster waits for its cleanup")

	g.Expect(mgmtClient.Delete(ctx, vmA)).To(Succeed())
	// Once the controller has deleted a's volumes, the finalizers envtest leaves on them (PVC
	// protection) are lifted, as kube-controller-manager would.
	eventually(g, func(ctx context.Context) bool {
		for _, obj := range []client.Object{aOwned, aSnap, aGroup} {
			err := mgmtClient.Get(ctx, client.ObjectKeyFromObject(obj), obj)
			if err == nil && obj.GetDeletionTimestamp() != nil {
				liftFinalizers(t, obj)
			}
		}
		return apierrors.IsNotFound(mgmtClient.Get(ctx, client.ObjectKeyFromObject(a), a))
	}).WithContext(ctx).Should(BeTrue(), "the Cluster goes once its cleanup is done")

	for _, obj := range []client.Object{aOwned, aSnap, aGroup} {
		err := mgmtClient.Get(ctx, client.ObjectKeyFromObject(obj), obj)
		g.Expect(apierrors.IsNotFound(err)).To(BeTrue(), "%s is deleted: %v", obj.GetName(), err)
	}
	for _, tc := range []struct {
		obj    client.Object
		shared string
	}{{sharedAB, "b"}, {sharedA, ""}, {sharedSnap, ""}} {
		g.Expect(mgmtClient.Get(ctx, client.ObjectKeyFromObject(tc.obj), tc.obj)).To(Succeed(), "%s is released, not deleted", tc.obj.GetName())
		g.Expect(tc.obj.GetDeletionTimestamp()).To(BeNil())
		if tc.shared == "" {
			g.Expect(tc.obj.GetAnnotations()).NotTo(HaveKey(tenancy.SharedWithAnnotation), tc.obj.GetName())
		} else {
			g.Expect(tc.obj.GetAnnotations()).To(HaveKeyWithValue(tenancy.SharedWithAnnotation, tc.shared), tc.obj.GetName())
		}
	}
	for _, obj := range untouched {
		g.Expect(mgmtClient.Get(ctx, client.ObjectKeyFromObject(obj), obj)).To(Succeed())
		g.Expect(obj.GetResourceVersion()).To(Equal(versions[obj.GetName()]), "%s is untouched", obj.GetName())
	}
	err := mgmtClient.Get(ctx, client.ObjectKey{Namespace: e.capacityNS, Name: capacityName(a)}, &rbacv1.RoleBinding{})
	g.Expect(apierrors.IsNotFound(err)).To(BeTrue(), "a's capacity access is gone: %v", err)
	g.Expect(mgmtClient.Get(ctx, client.ObjectKey{Namespace: e.capacityNS, Name: capacityName(b)}, &rbacv1.RoleBinding{})).To(Succeed())
	g.Expect(mgmtClient.Get(ctx, client.ObjectKeyFromObject(b), b)).To(Succeed())
	g.Expect(b.Finalizers).To(ContainElement(CleanupFinalizer))
	eventually(g, func(ctx context.Context) ([]string, error) { return eventReasons(ctx, a) }).WithContext(ctx).
		Should(ContainElements(eventDeleting, eventReleased, eventCleanedUp))
}

// TestCleanupLeavesClustersThatNeverOptedIn: a Cluster without the label gets no finalizer
// and is deleted at once.
func TestCleanupLeavesClustersThatNeverOptedIn(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	e := newTenantEnv(t, nil)
	e.startManager(t, e.config())
	in := e.createCluster(t, "in", true, nil)
	out := e.createCluster(t, "out", false, nil)
	eventually(g, func(ctx context.Context) ([]string, error) {
		err := mgmtClient.Get(ctx, client.ObjectKeyFromObject(in), in)
		return in.Finalizers, err
	}).WithContext(ctx).Should(ContainElement(CleanupFinalizer))
	g.Expect(mgmtClient.Get(ctx, client.ObjectKeyFromObject(out), out)).To(Succeed())
	g.Expect(out.Finalizers).To(BeEmpty())
	g.Expect(mgmtClient.Delete(ctx, out)).To(Succeed())
	err := mgmtClient.Get(ctx, client.ObjectKeyFromObject(out), &clusterv1.Cluster{})
	g.Expect(apierrors.IsNotFound(err)).To(BeTrue(), "%v", err)
}
