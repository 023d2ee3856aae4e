package tenants

import (
	"context"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	"sigs.k8s.io/controller-runtime/pkg/client"

	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/pkg/tenancy"
)

// TestParamsData: the contract's keys, per opted-in Cluster.
func TestParamsData(t *testing.T) {
	shared := func(name, with string) metav1.PartialObjectMetadata {
		m := metav1.PartialObjectMetadata{ObjectMeta: metav1.ObjectMeta{Name: name}}
		if with != "" {
			m.Annotations = map[string]string{tenancy.SharedWithAnnotation: with}
		}
		return m
	}
	// memberIn is a member snapshot in ns of the VolumeGroupSnapshot group.
	memberIn := func(ns, name, group string) metav1.PartialObjectMetadata {
		return metav1.PartialObjectMetadata{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, OwnerReferences: []metav1.OwnerReference{{
			APIVersion: "groupsnapshot.storage.k8s.io/v1", Kind: "VolumeGroupSnapshot", Name: group, UID: "uid-of-" + types.UID(group),
		}}}}
	}
	member := func(name, group string) metav1.PartialObjectMetadata { return memberIn("tenant-a", name, group) }
	// group is a VolumeGroupSnapshot of tenant-a labelled for the cluster of UID clusterUID.
	group := func(name, clusterUID string) metav1.PartialObjectMetadata {
		return metav1.PartialObjectMetadata{ObjectMeta: metav1.ObjectMeta{Namespace: "tenant-a", Name: name, UID: "uid-of-" + types.UID(name),
			Labels: map[string]string{tenancy.ClusterUIDLabel: clusterUID}}}
	}
	for _, tc := range []struct {
		name          string
		clusters      []paramsCluster
		namespace     map[string]string // the Namespace's annotations
		claims, snaps []metav1.PartialObjectMetadata
		groups        []metav1.PartialObjectMetadata
		vms           []vmv1.VirtualMachine
		want          map[string]string
	}{
		{
			name:     "no classes anywhere: none allowed",
			clusters: []paramsCluster{{name: "a", uid: "u-a"}},
			want: map[string]string{"a.uid": "u-a", "a.account": "", "a.storageClasses": "", "a.attributesClasses": "", "a.snapshotClasses": "", "a.groupSnapshotClasses": "",
				"a.hosts": "", "a.sharedClaims": "", "a.sharedSnapshots": "", "a.groupSnapshots": ""},
		},
		{
			name:     "the UID of the cluster's identity",
			clusters: []paramsCluster{{name: "a", uid: "u-a", account: "sa-a"}},
			want: map[string]string{"a.uid": "u-a", "a.account": "sa-a", "a.storageClasses": "", "a.attributesClasses": "", "a.snapshotClasses": "", "a.groupSnapshotClasses": "",
				"a.hosts": "", "a.sharedClaims": "", "a.sharedSnapshots": "", "a.groupSnapshots": ""},
		},
		{
			name:     "namespace classes, normalized",
			clusters: []paramsCluster{{name: "a", uid: "u-a"}},
			namespace: map[string]string{
				tenancy.StorageClassesAnnotation:       " silver,gold,, silver ",
				tenancy.AttributesClassesAnnotation:    "iops-high, , fast,fast ",
				tenancy.SnapshotClassesAnnotation:      "pmem-retain , pmem,",
				tenancy.GroupSnapshotClassesAnnotation: " pmem",
			},
			want: map[string]string{"a.uid": "u-a", "a.account": "", "a.storageClasses": "gold,silver", "a.attributesClasses": "fast,iops-high", "a.snapshotClasses": "pmem,pmem-retain", "a.groupSnapshotClasses": "pmem",
				"a.hosts": "", "a.sharedClaims": "", "a.sharedSnapshots": "", "a.groupSnapshots": ""},
		},
		{
			name: "the Cluster's classes win, even empty",
			clusters: []paramsCluster{
				{name: "a", uid: "u-a", annotations: map[string]string{
					tenancy.StorageClassesAnnotation: "bronze", tenancy.AttributesClassesAnnotation: "slow"}},
				{name: "b", uid: "u-b", annotations: map[string]string{
					tenancy.StorageClassesAnnotation: "", tenancy.AttributesClassesAnnotation: ""}},
			},
			namespace: map[string]string{tenancy.StorageClassesAnnotation: "gold", tenancy.AttributesClassesAnnotation: "fast"},
			want: map[string]string{
				"a.uid": "u-a", "a.account": "", "a.storageClasses": "bronze", "a.attributesClasses": "slow", "a.snapshotClasses": "", "a.groupSnapshotClasses": "",
				"a.hosts": "", "a.sharedClaims": "", "a.sharedSnapshots": "", "a.groupSnapshots": "",
				"b.uid": "u-b", "b.account": "", "b.storageClasses": "", "b.attributesClasses": "", "b.snapshotClasses": "", "b.groupSnapshotClasses": "",
				"b.hosts": "", "b.sharedClaims": "", "b.sharedSnapshots": "", "b.groupSnapshots": "",
			},
		},
		{
			name: "each allow-list falls back to the Namespace's on its own",
			clusters: []paramsCluster{
				{name: "a", uid: "u-a", annotations: map[string]string{tenancy.StorageClassesAnnotation: "bronze"}},
				{name: "b", uid: "u-b", annotations: map[string]string{tenancy.AttributesClassesAnnotation: "slow"}},
			},
			namespace: map[string]string{tenancy.StorageClassesAnnotation: "gold", tenancy.AttributesClassesAnnotation: "fast"},
			want: map[string]string{
				"a.uid": "u-a", "a.account": "", "a.storageClasses": "bronze", "a.attributesClasses": "fast", "a.snapshotClasses": "", "a.groupSnapshotClasses": "",
				"a.hosts": "", "a.sharedClaims": "", "a.sharedSnapshots": "", "a.groupSnapshots": "",
				"b.uid": "u-b", "b.account": "", "b.storageClasses": "gold", "b.attributesClasses": "slow", "b.snapshotClasses": "", "b.groupSnapshotClasses": "",
				"b.hosts": "", "b.sharedClaims": "", "b.sharedSnapshots": "", "b.groupSnapshots": "",
			},
		},
		{
			name:     "shared claims and snapshots by name, exact cluster names only",
			clusters: []paramsCluster{{name: "a", uid: "u-a"}, {name: "b", uid: "u-b"}},
			claims:   []metav1.PartialObjectMetadata{shared("p2", "a, b"), shared("p1", "a"), shared("p3", ""), shared("p4", "ab,c")},
			snaps:    []metav1.PartialObjectMetadata{shared("s1", "b")},
			want: map[string]string{
				"a.uid": "u-a", "a.account": "", "a.storageClasses": "", "a.attributesClasses": "", "a.snapshotClasses": "", "a.groupSnapshotClasses": "",
				"a.hosts": "", "a.sharedClaims": "p1,p2", "a.sharedSnapshots": "", "a.groupSnapshots": "",
				"b.uid": "u-b", "b.account": "", "b.storageClasses": "", "b.attributesClasses": "", "b.snapshotClasses": "", "b.groupSnapshotClasses": "",
				"b.hosts": "", "b.sharedClaims": "p2", "b.sharedSnapshots": "s1", "b.groupSnapshots": "",
			},
		},
		{
			name:     "the hosts of each cluster's VirtualMachines, placed ones only",
			clusters: []paramsCluster{{name: "a", uid: "u-a"}, {name: "b", uid: "u-b"}},
			vms: []vmv1.VirtualMachine{
				vmOn("a-1", "a", "host-b"), vmOn("a-2", "a", "host-a"), vmOn("a-3", "a", "host-b"),
				vmOn("a-4", "a", ""), vmOn("b-1", "b", "host-c"), vmOn("x-1", "", "host-d"),
			},
			want: map[string]string{
				"a.uid": "u-a", "a.account": "", "a.storageClasses": "", "a.attributesClasses": "", "a.snapshotClasses": "", "a.groupSnapshotClasses": "",
				"a.hosts": "host-a,host-b", "a.sharedClaims": "", "a.sharedSnapshots": "", "a.groupSnapshots": "",
				"b.uid": "u-b", "b.account": "", "b.storageClasses": "", "b.attributesClasses": "", "b.snapshotClasses": "", "b.groupSnapshotClasses": "",
				"b.hosts": "host-c", "b.sharedClaims": "", "b.sharedSnapshots": "", "b.groupSnapshots": "",
			},
		},
		{
			name:     "the members of each cluster's group snapshots, by the groups' labels, and only theirs",
			clusters: []paramsCluster{{name: "a", uid: "u-a"}, {name: "b", uid: "u-b"}},
			snaps: []metav1.PartialObjectMetadata{
				member("snapshot-a2", "u-a-g1"), member("snapshot-a1", "u-a-g2"), member("snapshot-b1", "u-b-g1"),
				member("snapshot-x1", "u-ab-g1"), member("snapshot-x2", "other-g1"), shared("s1", ""),
				memberIn("tenant-b", "snapshot-x3", "u-a-g1"),
				// A group named after a, labelled for b (an admin's, or written where the
				// policy is not enforced): its name tells nothing.
				member("snapshot-b2", "u-a-g3"),
				member("snapshot-x4", "u-a-gone"),
			},
			groups: []metav1.PartialObjectMetadata{
				group("u-a-g1", "u-a"), group("u-a-g2", "u-a"), group("u-b-g1", "u-b"), group("u-ab-g1", "u-ab"),
				group("other-g1", ""), group("u-a-g3", "u-b"),
			},
			want: map[string]string{
				"a.uid": "u-a", "a.account": "", "a.storageClasses": "", "a.attributesClasses": "", "a.snapshotClasses": "", "a.groupSnapshotClasses": "",
				"a.hosts": "", "a.sharedClaims": "", "a.sharedSnapshots": "", "a.groupSnapshots": "snapshot-a1,snapshot-a2",
				"b.uid": "u-b", "b.account": "", "b.storageClasses": "", "b.attributesClasses": "", "b.snapshotClasses": "", "b.groupSnapshotClasses": "",
				"b.hosts": "", "b.sharedClaims": "", "b.sharedSnapshots": "", "b.groupSnapshots": "snapshot-b1,snapshot-b2",
			},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			NewWithT(t).Expect(paramsData("tenant-a", tc.clusters, tc.namespace, tc.claims, tc.snaps, tc.groups, tc.vms)).To(Equal(tc.want))
		})
	}
}

// TestParamsFollowAnnotations: the ConfigMap pvbridge-tenancy follows the Clusters' opt-in
// labels and annotations, the Namespace's annotations, the shared-with annotations of the
// namespace's PVCs and VolumeSnapshots and the members of group snapshots, and goes when no
// Cluster opts in any more.
func TestParamsFollowAnnotations(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	e := newTenantEnv(t, map[string]string{tenancy.StorageClassesAnnotation: "gold,silver", tenancy.AttributesClassesAnnotation: "slow, fast"})
	e.startManager(t, e.config())
	a := e.createCluster(t, "a", true, nil)
	b := e.createCluster(t, "b", true, map[string]string{tenancy.StorageClassesAnnotation: "bronze", tenancy.AttributesClassesAnnotation: ""})
	x := e.createCluster(t, "x", false, nil)
	p1, p2 := e.pvc("p1", nil, "a"), e.pvc("p2", nil, "a,b")
	s1 := e.snapshot("s1", nil, "b")
	// A group snapshot of a, and its member as snapshot-controller makes them.
	g1 := e.groupSnapshot(string(a.UID)+"-g", map[string]string{tenancy.ClusterUIDLabel: string(a.UID)})
	create(t, g1)
	m1 := e.snapshot("snapshot-m1", nil, "")
	m1.OwnerReferences = []metav1.OwnerReference{{APIVersion: "groupsnapshot.storage.k8s.io/v1", Kind: "VolumeGroupSnapshot", Name: g1.Name, UID: g1.UID}}
	create(t, p1, p2, e.pvc("p3", nil, ""), s1, e.snapshot("s2", nil, ""), m1)

	params := func(ctx context.Context) (map[string]string, error) {
		cm := &corev1.ConfigMap{}
		err := mgmtClient.Get(ctx, client.ObjectKey{Namespace: e.ns, Name: tenancy.ParamsConfigMap}, cm)
		return cm.Data, err
	}
	eventually(g, params).WithContext(ctx).Should(Equal(map[string]string{
		"a.uid": string(a.UID), "a.account": e.accountUID(t, "a"), "a.storageClasses": "gold,silver", "a.attributesClasses": "fast,slow", "a.snapshotClasses": "", "a.groupSnapshotClasses": "",
		"a.hosts": "", "a.sharedClaims": "p1,p2", "a.sharedSnapshots": "", "a.groupSnapshots": "snapshot-m1",
		"b.uid": string(b.UID), "b.account": e.accountUID(t, "b"), "b.storageClasses": "bronze", "b.attributesClasses": "", "b.snapshotClasses": "", "b.groupSnapshotClasses": "",
		"b.hosts": "", "b.sharedClaims": "p2", "b.sharedSnapshots": "s1", "b.groupSnapshots": "",
	}))

	annotate := func(obj client.Object, key string, value *string) {
		t.Helper()
		patch := client.MergeFrom(obj.DeepCopyObject().(client.Object))
		ann := obj.GetAnnotations()
		if ann == nil {
			ann = map[string]string{}
		}
		if value == nil {
			delete(ann, key)
		} else {
			ann[key] = *value
		}
		obj.SetAnnotations(ann)
		if err := mgmtClient.Patch(ctx, obj, patch); err != nil {
			t.Fatal(err)
		}
	}
	str := func(s string) *string { return &s }
	annotate(p1, tenancy.SharedWithAnnotation, str("b"))
	annotate(s1, tenancy.SharedWithAnnotation, nil)
	annotate(a, tenancy.StorageClassesAnnotation, str("platinum"))
	annotate(a, tenancy.AttributesClassesAnnotation, str("turbo"))
	annotate(b, tenancy.AttributesClassesAnnotation, nil)
	ns := &corev1.Namespace{}
	g.Expect(mgmtClient.Get(ctx, client.ObjectKey{Name: e.ns}, ns)).To(Succeed())
	annotate(ns, tenancy.StorageClassesAnnotation, str("iron"))
	annotate(ns, tenancy.AttributesClassesAnnotation, str("steady"))
	g.Expect(mgmtClient.Delete(ctx, p2)).To(Succeed())
	g.Expect(mgmtClient.Delete(ctx, m1)).To(Succeed())
	xPatch := client.MergeFrom(x.DeepCopy())
	x.Labels = map[string]string{tenancy.EnabledLabel: "true"}
	g.Expect(mgmtClient.Patch(ctx, x, xPatch)).To(Succeed())
	// envtest has no PVC protection controller; the PVC goes unless the admission plugin
	// added its finalizer, which is lifted here as kube-controller-manager would.
	liftFinalizers(t, p2)

	eventually(g, params).WithContext(ctx).Should(Equal(map[string]string{
		"a.uid": string(a.UID), "a.account": e.accountUID(t, "a"), "a.storageClasses": "platinum", "a.attributesClasses": "turbo", "a.snapshotClasses": "", "a.groupSnapshotClasses": "",
		"a.hosts": "", "a.sharedClaims": "", "a.sharedSnapshots": "", "a.groupSnapshots": "",
		"b.uid": string(b.UID), "b.account": e.accountUID(t, "b"), "b.storageClasses": "bronze", "b.attributesClasses": "steady", "b.snapshotClasses": "", "b.groupSnapshotClasses": "",
		"b.hosts": "", "b.sharedClaims": "p1", "b.sharedSnapshots": "", "b.groupSnapshots": "",
		"x.uid": string(x.UID), "x.account": e.accountUID(t, "x"), "x.storageClasses": "iron", "x.attributesClasses": "steady", "x.snapshotClasses": "", "x.groupSnapshotClasses": "",
		"x.hosts": "", "x.sharedClaims": "", "x.sharedSnapshots": "", "x.groupSnapshots": "",
	}))

	// Tampering is repaired.
	cm := &corev1.ConfigMap{}
	g.Expect(mgmtClient.Get(ctx, client.ObjectKey{Namespace: e.ns, Name: tenancy.ParamsConfigMap}, cm)).To(Succeed())
	cm.Data["b.storageClasses"] = "gold"
	g.Expect(mgmtClient.Update(ctx, cm)).To(Succeed())
	eventually(g, params).WithContext(ctx).Should(HaveKeyWithValue("b.storageClasses", "bronze"))

	for _, c := range []*clusterv1.Cluster{a, b, x} {
		patch := client.MergeFrom(c.DeepCopy())
		delete(c.Labels, tenancy.EnabledLabel)
		g.Expect(mgmtClient.Patch(ctx, c, patch)).To(Succeed())
	}
	eventually(g, func(ctx context.Context) bool {
		_, err := params(ctx)
		return apierrors.IsNotFound(err)
	}).WithContext(ctx).Should(BeTrue(), "no opted-in Cluster left: no parameters, the policy denies")
}

// TestParamsOfEnforcedNamespace: an enforced namespace always has parameters, even with no
// Cluster opted in (the policy denies every write it matches without them); they name the hosts
// of each cluster's VirtualMachines; a deleted ConfigMap stays until nothing needs it; in a
// deleted namespace they stay until its claims are gone.
func TestParamsOfEnforcedNamespace(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	e := newTenantEnv(t, nil)
	ns := &corev1.Namespace{}
	g.Expect(mgmtClient.Get(ctx, client.ObjectKey{Name: e.ns}, ns)).To(Succeed())
	setLabel := func(value *string) {
		t.Helper()
		patch := client.MergeFrom(ns.DeepCopy())
		if value == nil {
			delete(ns.Labels, tenancy.TenancyNamespaceLabel)
		} else {
			ns.Labels = map[string]string{tenancy.TenancyNamespaceLabel: *value}
		}
		g.Expect(mgmtClient.Patch(ctx, ns, patch)).To(Succeed())
	}
	enforced := tenancy.TenancyEnforced
	setLabel(&enforced)
	e.startManager(t, e.config())
	key := client.ObjectKey{Namespace: e.ns, Name: tenancy.ParamsConfigMap}
	params := func(ctx context.Context) (*corev1.ConfigMap, error) {
		cm := &corev1.ConfigMap{}
		return cm, mgmtClient.Get(ctx, key, cm)
	}
	eventually(g, params).WithContext(ctx).Should(And(
		HaveField("Data", BeEmpty()), HaveField("Finalizers", ConsistOf(ParamsFinalizer))), "no Cluster opts in: empty parameters")

	a := e.createCluster(t, "a", true, nil)
	vm := e.vm("vm-a", "a")
	create(t, vm)
	vm.Status.Host = "host-a"
	g.Expect(mgmtClient.Status().Update(ctx, vm)).To(Succeed())
	eventually(g, params).WithContext(ctx).Should(HaveField("Data", Equal(map[string]string{
		"a.uid": string(a.UID), "a.account": e.accountUID(t, "a"), "a.storageClasses": "", "a.attributesClasses": "", "a.snapshotClasses": "", "a.groupSnapshotClasses": "",
		"a.hosts": "host-a", "a.sharedClaims": "", "a.sharedSnapshots": "", "a.groupSnapshots": "",
	})))

	cm, err := params(ctx)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(mgmtClient.Delete(ctx, cm)).To(Succeed())
	g.Consistently(params).WithContext(ctx).WithTimeout(time.Second).Should(HaveField("Data", HaveKeyWithValue("a.hosts", "host-a")),
		"deleted while the namespace is enforced: held by the finalizer, still read by the policy")

	setLabel(nil)
	patch := client.MergeFrom(a.DeepCopy())
	delete(a.Labels, tenancy.EnabledLabel)
	g.Expect(mgmtClient.Patch(ctx, a, patch)).To(Succeed())
	eventually(g, func(ctx context.Context) bool {
		_, err := params(ctx)
		return apierrors.IsNotFound(err)
	}).WithContext(ctx).Should(BeTrue(), "neither enforced nor opted in: the finalizer is released, the parameters go")

	setLabel(&enforced)
	eventually(g, params).WithContext(ctx).Should(HaveField("Finalizers", ConsistOf(ParamsFinalizer)))
	pvc := e.pvc("p1", nil, "")
	create(t, pvc)
	g.Expect(mgmtClient.Delete(ctx, ns)).To(Succeed())
	g.Consistently(params).WithContext(ctx).WithTimeout(3*drainRetry).Should(HaveField("Finalizers", ConsistOf(ParamsFinalizer)),
		"the namespace is deleted but still has a claim, whose deletion passes the policy only with parameters")
	g.Expect(mgmtClient.Delete(ctx, pvc)).To(Succeed())
	liftFinalizers(t, pvc)
	g.Expect(mgmtClient.Delete(ctx, vm)).To(Succeed())
	eventually(g, params).WithContext(ctx).Should(HaveField("Finalizers", BeEmpty()), "nothing left to guard: released")
}

// liftFinalizers removes the finalizers of obj, if it still exists: what the controllers
// envtest does not run would do once their work is done.
func liftFinalizers(t *testing.T, obj client.Object) {
	t.Helper()
	patch := client.RawPatch("application/merge-patch+json", []byte(`{"metadata":{"finalizers":null}}`))
	if err := mgmtClient.Patch(t.Context(), obj, patch); err != nil && !apierrors.IsNotFound(err) {
		t.Fatal(err)
	}
}

// vmOn is a VirtualMachine of cluster placed on host ("" for not yet placed).
func vmOn(name, cluster, host string) vmv1.VirtualMachine {
	vm := vmv1.VirtualMachine{ObjectMeta: metav1.ObjectMeta{Name: name}, Status: vmv1.VirtualMachineStatus{Host: host}}
	if cluster != "" {
		vm.Labels = map[string]string{tenancy.CAPIClusterNameLabel: cluster}
	}
	return vm
}

// TestIdentityUID: the parameters record the UID of the account the Cluster controls, never
// that of an account of the same name left by an earlier Cluster.
func TestIdentityUID(t *testing.T) {
	cluster := &clusterv1.Cluster{ObjectMeta: metav1.ObjectMeta{Name: "a", UID: "u-a"}}
	account := func(name, uid, ownerUID string) corev1.ServiceAccount {
		sa := corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: name, UID: types.UID(uid)}}
		if ownerUID != "" {
			sa.OwnerReferences = []metav1.OwnerReference{{
				APIVersion: clusterv1.GroupVersion.String(), Kind: "Cluster", Name: "a", UID: types.UID(ownerUID), Controller: ptr.To(true),
			}}
		}
		return sa
	}
	for _, tc := range []struct {
		name     string
		accounts []corev1.ServiceAccount
		want     string
	}{
		{name: "none yet", want: ""},
		{name: "its own", accounts: []corev1.ServiceAccount{account("b-pvbridge", "sa-b", "u-b"), account("a-pvbridge", "sa-a", "u-a")}, want: "sa-a"},
		{name: "an earlier Cluster's of the same name", accounts: []corev1.ServiceAccount{account("a-pvbridge", "sa-old", "u-earlier")}, want: ""},
		{name: "one nobody controls", accounts: []corev1.ServiceAccount{account("a-pvbridge", "sa-x", "")}, want: ""},
		{name: "another name", accounts: []corev1.ServiceAccount{account("a-other", "sa-y", "u-a")}, want: ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			NewWithT(t).Expect(identityUID(cluster, tc.accounts)).To(Equal(tc.want))
		})
	}
}
