package manifests

import (
	"context"
	"path/filepath"
	"strings"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/pkg/tenancy"
)

// The tenants of the policy test. Namespace tenant-a holds clusters a1 and a2 (a2 is a1's
// neighbour: same namespace, other cluster), a3, whose identity's UID is not recorded yet, and
// the identity of zz, a cluster that is not opted in; tenant-b holds b1; plain is a namespace without tenancy.
const (
	nsA     = "tenant-a"
	nsB     = "tenant-b"
	nsPlain = "plain"
	// nsBare is enforced but has no parameters (no tenants controller wrote them).
	nsBare = "tenant-bare"
	uidA1  = "0a1a1a1a-0000-4000-8000-000000000001"
	uidA2  = "0a2a2a2a-0000-4000-8000-000000000002"
	uidB1  = "0b1b1b1b-0000-4000-8000-000000000003"
	uidA3  = "0a3a3a3a-0000-4000-8000-000000000004"

	classAllowed = "pmem"
	classPremium = "pmem-premium"
	// VolumeAttributesClasses: a1 may name attrsAllowed, a2 both, b1 none.
	attrsAllowed = "iops-1000"
	attrsPremium = "iops-unlimited"
	// Snapshot classes (VolumeSnapshotClasses and VolumeGroupSnapshotClasses): a1 may name
	// classAllowed, a2 also snapClassRetain (an admin's Retain class), b1 none.
	snapClassRetain = "pmem-retain"

	// Objects of tenant-a, created by the admin: a1's and a2's claim and snapshot, and a claim
	// and a snapshot the admin shares with a1.
	ownClaim    = uidA1 + "-data"
	otherClaim  = uidA2 + "-data"
	sharedClaim = "shared-data"
	ownSnap     = uidA1 + "-snap"
	otherSnap   = uidA2 + "-snap"
	sharedSnap  = "shared-snap"
	ownVM       = "a1-vm"
	otherVM     = "a2-vm"
	// staleClaim was shared with a1 and attached to its VM, then unshared.
	staleClaim = "stale-data"
	hostA1     = "host-a"
	// tunedClaim is a1's claim of a VolumeAttributesClass a1's allow-list does not have (any
	// more): an admin's change, or an earlier list.
	tunedClaim = uidA1 + "-tuned"
	// groupedClaim is a1's claim labelled for a group snapshot that is being taken.
	groupedClaim = uidA1 + "-grouped"
	// a1's and a2's group snapshots, and a member snapshot of each (snapshot-controller names
	// them snapshot-<hash>); a1's member is in a1.groupSnapshots.
	ownGroup    = uidA1 + "-group"
	otherGroup  = uidA2 + "-group"
	ownMember   = "snapshot-0a1a1a1a"
	otherMember = "snapshot-0a2a2a2a"
	groupLabel  = "pvbridge.io/volume-group"
)

const (
	tenancyPolicy   = "ValidatingAdmissionPolicy 'pvbridge-guest-tenancy' with binding 'pvbridge-guest-tenancy' denied request: "
	namespacePolicy = "ValidatingAdmissionPolicy 'pvbridge-guest-namespace' with binding 'pvbridge-guest-namespace' denied request: "
	// paramsMissing is the apiserver's refusal when a Deny binding finds no parameters.
	paramsMissing = "no params found for policy binding with `Deny` parameterNotFoundAction"
)

func scheme(g Gomega) *runtime.Scheme {
	s := runtime.NewScheme()
	g.Expect(clientgoscheme.AddToScheme(s)).To(Succeed())
	g.Expect(vmv1.AddToScheme(s)).To(Succeed())
	return s
}

// accountUID is the UID of the ServiceAccount of a cluster's current guest identity.
func accountUID(cluster string) string { return "account-of-" + cluster }

// guestClient is a client that impersonates the guest identity of cluster in namespace, as the
// apiserver authenticates a token of its ServiceAccount (of UID uid).
func guestClient(g Gomega, namespace, cluster, uid string) client.Client {
	cfg := rest.CopyConfig(adminConfig)
	cfg.Impersonate = rest.ImpersonationConfig{
		UserName: "system:serviceaccount:" + namespace + ":" + cluster + "-pvbridge",
		UID:      uid,
		Groups:   []string{"system:serviceaccounts", "system:serviceaccounts:" + namespace, "system:authenticated"},
	}
	c, err := client.New(cfg, client.Options{Scheme: scheme(g)})
	g.Expect(err).NotTo(HaveOccurred())
	return c
}

func labelsFor(cluster, uid string) map[string]string {
	return tenancy.Cluster{Name: cluster, UID: uid}.Labels()
}

func claim(ns, name string, labels map[string]string, class string, source *corev1.TypedObjectReference) *corev1.PersistentVolumeClaim {
	pvc := &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, Labels: labels},
		Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			VolumeMode:  ptr.To(corev1.PersistentVolumeBlock),
			Resources: corev1.VolumeResourceRequirements{
				Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")},
			},
			DataSourceRef: source,
		},
	}
	if class != "" {
		pvc.Spec.StorageClassName = ptr.To(class)
	}
	return pvc
}

// withAttributesClass sets the VolumeAttributesClass of pvc.
func withAttributesClass(pvc *corev1.PersistentVolumeClaim, class string) *corev1.PersistentVolumeClaim {
	pvc.Spec.VolumeAttributesClassName = ptr.To(class)
	return pvc
}

// withAnnotations sets the annotations of u.
func withAnnotations(u *unstructured.Unstructured, annotations map[string]string) *unstructured.Unstructured {
	u.SetAnnotations(annotations)
	return u
}

// annotated sets an annotation of pvc.
func annotated(pvc *corev1.PersistentVolumeClaim, key, value string) *corev1.PersistentVolumeClaim {
	metav1.SetMetaDataAnnotation(&pvc.ObjectMeta, key, value)
	return pvc
}

func claimSource(name string) *corev1.TypedObjectReference {
	return &corev1.TypedObjectReference{Kind: "PersistentVolumeClaim", Name: name}
}

func snapshotSource(name string) *corev1.TypedObjectReference {
	return &corev1.TypedObjectReference{APIGroup: ptr.To("snapshot.storage.k8s.io"), Kind: "VolumeSnapshot", Name: name}
}

// groupSnapshot is a VolumeGroupSnapshot of source (its spec.source).
func groupSnapshot(ns, name string, labels map[string]string, source map[string]any) *unstructured.Unstructured {
	u := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "groupsnapshot.storage.k8s.io/v1",
		"kind":       "VolumeGroupSnapshot",
		"metadata":   map[string]any{"namespace": ns, "name": name},
		"spec":       map[string]any{"volumeGroupSnapshotClassName": "pmem", "source": source},
	}}
	u.SetLabels(labels)
	return u
}

// withSnapshotClass sets the class of a snapshot or group snapshot; "" removes it.
func withSnapshotClass(u *unstructured.Unstructured, class string) *unstructured.Unstructured {
	field := "volumeSnapshotClassName"
	if u.GetKind() == "VolumeGroupSnapshot" {
		field = "volumeGroupSnapshotClassName"
	}
	if class == "" {
		unstructured.RemoveNestedField(u.Object, "spec", field)
	} else {
		_ = unstructured.SetNestedField(u.Object, class, "spec", field)
	}
	return u
}

// selecting is a group snapshot's source that selects claims by labels, and by expressions.
func selecting(labels map[string]string, expressions ...map[string]any) map[string]any {
	matchLabels := map[string]any{}
	for k, v := range labels {
		matchLabels[k] = v
	}
	selector := map[string]any{"matchLabels": matchLabels}
	if len(expressions) > 0 {
		var list []any
		for _, e := range expressions {
			list = append(list, e)
		}
		selector["matchExpressions"] = list
	}
	return map[string]any{"selector": selector}
}

// member is a member snapshot of group, as snapshot-controller makes it: unlabelled, owned by
// the group.
func member(ns, name, group, sourceClaim string) *unstructured.Unstructured {
	u := snapshot(ns, name, nil, sourceClaim)
	u.SetOwnerReferences([]metav1.OwnerReference{{
		APIVersion: "groupsnapshot.storage.k8s.io/v1", Kind: "VolumeGroupSnapshot", Name: group, UID: types.UID("uid-of-" + group),
	}})
	return u
}

func snapshot(ns, name string, labels map[string]string, sourceClaim string) *unstructured.Unstructured {
	u := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "snapshot.storage.k8s.io/v1",
		"kind":       "VolumeSnapshot",
		"metadata":   map[string]any{"namespace": ns, "name": name},
		"spec": map[string]any{
			"volumeSnapshotClassName": "pmem",
			"source":                  map[string]any{"persistentVolumeClaimName": sourceClaim},
		},
	}}
	u.SetLabels(labels)
	return u
}

// setUpTenants applies the admission policies of manifests/base/admission for real and creates
// the tenants: namespaces, the pvbridge-tenancy ConfigMaps the tenants controller would write,
// the guest identities bound to tenancy.GuestRules, and the objects the cases act on.
func setUpTenants(ctx context.Context, g Gomega) {
	_, err := runKubectl(ctx, nil, "apply", "--server-side", "--field-manager=pvbridge-manifests-test",
		"-k", filepath.Join(manifestsDir, "base", "admission"))
	g.Expect(err).NotTo(HaveOccurred())

	admin, err := client.New(adminConfig, client.Options{Scheme: scheme(g)})
	g.Expect(err).NotTo(HaveOccurred())
	enforced := map[string]string{"pvbridge.io/tenancy": "enforced"}
	objs := []client.Object{
		&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: nsA, Labels: enforced}},
		&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: nsB, Labels: enforced}},
		&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: nsPlain}},
		&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: nsBare, Labels: enforced}},
		&corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: nsA, Name: "pvbridge-tenancy"}, Data: map[string]string{
			"a1.uid": uidA1, "a1.account": accountUID("a1"), "a1.storageClasses": classAllowed, "a1.attributesClasses": attrsAllowed,
			"a1.snapshotClasses": classAllowed, "a1.groupSnapshotClasses": classAllowed,
			"a1.hosts": hostA1, "a1.sharedClaims": sharedClaim, "a1.sharedSnapshots": sharedSnap, "a1.groupSnapshots": ownMember,
			"a2.uid": uidA2, "a2.account": accountUID("a2"), "a2.storageClasses": classAllowed + "," + classPremium,
			"a2.attributesClasses": attrsAllowed + "," + attrsPremium,
			"a2.snapshotClasses":   classAllowed + "," + snapClassRetain, "a2.groupSnapshotClasses": classAllowed + "," + snapClassRetain,
			// a3's identity is not recorded yet.
			"a3.uid": uidA3, "a3.storageClasses": classAllowed,
		}},
		&corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: nsB, Name: "pvbridge-tenancy"}, Data: map[string]string{
			// b1 may name no VolumeAttributesClass and no snapshot class: no keys, as without
			// the annotations.
			"b1.uid": uidB1, "b1.account": accountUID("b1"), "b1.storageClasses": classAllowed,
		}},
	}
	for _, name := range []string{classAllowed, classPremium} {
		objs = append(objs, &storagev1.StorageClass{
			ObjectMeta: metav1.ObjectMeta{Name: name}, Provisioner: "pmem.csi.pvbridge.io",
			AllowVolumeExpansion: ptr.To(true),
		})
	}
	for name, iops := range map[string]string{attrsAllowed: "1000", attrsPremium: "0"} {
		objs = append(objs, &storagev1.VolumeAttributesClass{
			ObjectMeta: metav1.ObjectMeta{Name: name}, DriverName: "pmem.csi.pvbridge.io",
			Parameters: map[string]string{"maxIOPS": iops},
		})
	}
	// Identities, each bound to the guest Role. b1 is also bound in tenant-a: RBAC would let it
	// write there, the namespace policy does not. p1 is a guest identity of plain.
	for _, ns := range []string{nsA, nsB, nsPlain, nsBare} {
		objs = append(objs, &rbacv1.Role{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "pvbridge-guest"}, Rules: tenancy.GuestRules})
	}
	for _, id := range []struct{ ns, cluster, bindIn string }{
		{nsA, "a1", nsA}, {nsA, "a2", nsA}, {nsA, "a3", nsA}, {nsA, "zz", nsA}, {nsB, "b1", nsB}, {nsB, "b1", nsA}, {nsPlain, "p1", nsPlain}, {nsBare, "c1", nsBare},
	} {
		account := id.cluster + "-pvbridge"
		objs = append(objs, &rbacv1.RoleBinding{
			ObjectMeta: metav1.ObjectMeta{Namespace: id.bindIn, Name: id.ns + "-" + account},
			Subjects:   []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Namespace: id.ns, Name: account}},
			RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: "pvbridge-guest"},
		})
		if id.ns == id.bindIn {
			objs = append(objs, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Namespace: id.ns, Name: account}})
		}
	}
	shared := map[string]string{tenancy.SharedWithAnnotation: "a1"}
	sharedClaimObj := claim(nsA, sharedClaim, nil, classAllowed, nil)
	sharedClaimObj.Annotations = shared
	sharedSnapObj := snapshot(nsA, sharedSnap, nil, sharedClaim)
	sharedSnapObj.SetAnnotations(shared)
	grouped := claim(nsA, groupedClaim, labelsFor("a1", uidA1), classAllowed, nil)
	grouped.Labels[groupLabel] = "group-in-progress"
	claims := []*corev1.PersistentVolumeClaim{
		claim(nsA, ownClaim, labelsFor("a1", uidA1), classAllowed, nil),
		grouped,
		claim(nsA, otherClaim, labelsFor("a2", uidA2), classAllowed, nil),
		sharedClaimObj,
		withAttributesClass(claim(nsA, tunedClaim, labelsFor("a1", uidA1), classAllowed, nil), attrsPremium),
	}
	for _, c := range claims {
		objs = append(objs, c)
	}
	objs = append(objs,
		snapshot(nsA, ownSnap, labelsFor("a1", uidA1), ownClaim),
		snapshot(nsA, otherSnap, labelsFor("a2", uidA2), otherClaim),
		sharedSnapObj,
		groupSnapshot(nsA, ownGroup, labelsFor("a1", uidA1), selecting(map[string]string{tenancy.ClusterUIDLabel: uidA1, groupLabel: "g"})),
		groupSnapshot(nsA, otherGroup, labelsFor("a2", uidA2), selecting(map[string]string{tenancy.ClusterUIDLabel: uidA2, groupLabel: "g"})),
		member(nsA, ownMember, ownGroup, ownClaim),
		member(nsA, otherMember, otherGroup, otherClaim),
		&vmv1.VirtualMachine{
			ObjectMeta: metav1.ObjectMeta{Namespace: nsA, Name: ownVM, Labels: map[string]string{tenancy.CAPIClusterNameLabel: "a1"}},
			Spec: vmv1.VirtualMachineSpec{PowerState: vmv1.PowerStateOn, Volumes: []vmv1.VirtualMachineVolume{
				{Name: ownClaim, PersistentVolumeClaim: vmv1.PersistentVolumeClaimVolumeSource{ClaimName: ownClaim}},
				{Name: staleClaim, PersistentVolumeClaim: vmv1.PersistentVolumeClaimVolumeSource{ClaimName: staleClaim}},
			}},
		},
		&vmv1.VirtualMachine{
			ObjectMeta: metav1.ObjectMeta{Namespace: nsA, Name: otherVM, Labels: map[string]string{tenancy.CAPIClusterNameLabel: "a2"}},
			Spec:       vmv1.VirtualMachineSpec{PowerState: vmv1.PowerStateOn},
		},
	)
	for _, obj := range objs {
		g.Expect(admin.Create(ctx, obj)).To(Succeed(), "create %T %s", obj, obj.GetName())
	}
	// Bound claims: only a bound claim may be expanded (the apiserver's own validation, before
	// admission policies run).
	for _, c := range claims {
		c.Status.Phase = corev1.ClaimBound
		c.Status.Capacity = corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")}
		g.Expect(admin.Status().Update(ctx, c)).To(Succeed())
	}

	// The policies are active once a request each refuses is refused, by them and for the
	// reason (the apiserver loads policies, bindings, parameters and RBAC asynchronously).
	// Dry runs: the probes leave nothing behind.
	a1 := guestClient(g, nsA, "a1", accountUID("a1"))
	g.Eventually(func() error {
		return a1.Create(ctx, claim(nsA, uidA1+"-probe", labelsFor("a2", uidA2), classAllowed, nil), client.DryRunAll)
	}).WithTimeout(time.Minute).Should(MatchError(ContainSubstring(tenancyPolicy + "PersistentVolumeClaim tenant-a/" + uidA1 + "-probe must be labelled")))
	b1 := guestClient(g, nsB, "b1", accountUID("b1"))
	g.Eventually(func() error {
		return b1.Create(ctx, claim(nsA, uidB1+"-probe", labelsFor("b1", uidB1), classAllowed, nil), client.DryRunAll)
	}).WithTimeout(time.Minute).Should(MatchError(ContainSubstring(namespacePolicy)))
}

// action is a request of a case, sent with client.DryRunAll: admission runs in full, nothing is
// stored, so the cases do not depend on each other.
type action func(ctx context.Context, c client.Client) error

func create(obj client.Object) action {
	return func(ctx context.Context, c client.Client) error {
		return c.Create(ctx, obj.DeepCopyObject().(client.Object), client.DryRunAll)
	}
}

func remove(obj client.Object) action {
	return func(ctx context.Context, c client.Client) error {
		return c.Delete(ctx, obj, client.DryRunAll)
	}
}

// patch reads obj (as the guest: it may read its namespace), changes it and sends the change as
// a merge patch, as guest-csi does.
func patch[T client.Object](obj T, change func(T)) action {
	return func(ctx context.Context, c client.Client) error {
		if err := c.Get(ctx, client.ObjectKeyFromObject(obj), obj); err != nil {
			return err
		}
		base := obj.DeepCopyObject().(client.Object)
		change(obj)
		return c.Patch(ctx, obj, client.MergeFrom(base), client.DryRunAll)
	}
}

func claimKey(name string) *corev1.PersistentVolumeClaim {
	return &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Namespace: nsA, Name: name}}
}

func snapshotKey(name string) *unstructured.Unstructured {
	return snapshot(nsA, name, nil, "")
}

func vmKey(name string) *vmv1.VirtualMachine {
	return &vmv1.VirtualMachine{ObjectMeta: metav1.ObjectMeta{Namespace: nsA, Name: name}}
}

func expand(pvc *corev1.PersistentVolumeClaim) {
	pvc.Spec.Resources.Requests[corev1.ResourceStorage] = resource.MustParse("2Gi")
}

func attach(claim string) func(*vmv1.VirtualMachine) {
	return func(vm *vmv1.VirtualMachine) {
		vm.Spec.Volumes = append(vm.Spec.Volumes, vmv1.VirtualMachineVolume{
			Name: claim, PersistentVolumeClaim: vmv1.PersistentVolumeClaimVolumeSource{ClaimName: claim},
		})
	}
}

// TestGuestTenancyPolicy sends every cross-tenant write a guest identity could try, and the same
// writes within its own rights, through the real apiserver with the policies of
// manifests/base/admission and the guest Role (tenancy.GuestRules): the first are refused with
// the reason (by the policy, or by RBAC where RBAC already forbids the verb), the second pass.
func TestGuestTenancyPolicy(t *testing.T) {
	ctx := t.Context()
	setUpTenants(ctx, NewWithT(t))

	// Messages name the object, the cluster and what is not allowed.
	what := func(kind, name string) string { return kind + " " + nsA + "/" + name }
	a1Labels := func(kind, name, cluster, uid string) string {
		return tenancyPolicy + what(kind, name) + " must be labelled pvbridge.io/cluster=a1 and pvbridge.io/cluster-uid=" + uidA1 +
			" for guest cluster a1, not pvbridge.io/cluster=" + cluster + " and pvbridge.io/cluster-uid=" + uid
	}
	notA1s := func(kind, name, owner, verb string) string {
		return tenancyPolicy + what(kind, name) + " belongs to " + owner + ", not to guest cluster a1 (uid " + uidA1 + "): it may not " + verb + " it"
	}
	a2 := "cluster a2 (pvbridge.io/cluster-uid=" + uidA2 + ")"
	neitherOwnedNorShared := " is neither owned by guest cluster a1 (named " + uidA1 + "-…) nor shared with it (annotation pvbridge.io/shared-with)"
	ownGroupSelection := selecting(map[string]string{tenancy.ClusterUIDLabel: uidA1, groupLabel: "nightly"})
	groupRefused := tenancyPolicy + what("VolumeGroupSnapshot", uidA1+"-new-group") + " must select its claims by exactly the labels pvbridge.io/cluster-uid=" +
		uidA1 + " and pvbridge.io/volume-group (spec.source.selector.matchLabels, no matchExpressions): guest cluster a1 " +
		"takes group snapshots only of its own claims, never of a pre-provisioned VolumeGroupSnapshotContent"
	newClaim := uidA1 + "-new"

	tests := []struct {
		name string
		// as is the guest identity, namespace/cluster; "" is the admin.
		as   string
		do   action
		want string // "" for allowed
	}{
		// Claims.
		{name: "create a claim labelled for its cluster, named after it, of an allowed class", as: "tenant-a/a1",
			do: create(claim(nsA, newClaim, labelsFor("a1", uidA1), classAllowed, nil))},
		{name: "create a claim labelled for another cluster", as: "tenant-a/a1",
			do:   create(claim(nsA, newClaim, labelsFor("a2", uidA2), classAllowed, nil)),
			want: a1Labels("PersistentVolumeClaim", newClaim, "a2", uidA2)},
		{name: "create a claim with the UID label of another cluster", as: "tenant-a/a1",
			do:   create(claim(nsA, newClaim, labelsFor("a1", uidA2), classAllowed, nil)),
			want: a1Labels("PersistentVolumeClaim", newClaim, "a1", uidA2)},
		{name: "create a claim named after another cluster", as: "tenant-a/a1",
			do:   create(claim(nsA, uidA2+"-new", labelsFor("a1", uidA1), classAllowed, nil)),
			want: tenancyPolicy + "guest cluster a1 may create only objects named " + uidA1 + "-…, not " + what("PersistentVolumeClaim", uidA2+"-new")},
		{name: "create a claim of a class outside the cluster's allow-list", as: "tenant-a/a1",
			do:   create(claim(nsA, newClaim, labelsFor("a1", uidA1), classPremium, nil)),
			want: tenancyPolicy + what("PersistentVolumeClaim", newClaim) + " names StorageClass pmem-premium, which guest cluster a1 may not use: it may use pmem"},
		{name: "create a claim of no class", as: "tenant-a/a1",
			do:   create(claim(nsA, newClaim, labelsFor("a1", uidA1), "", nil)),
			want: tenancyPolicy + what("PersistentVolumeClaim", newClaim) + " names no StorageClass, which guest cluster a1 may not use: it may use pmem"},
		{name: "create a claim of a class in the allow-list of the cluster that asks", as: "tenant-a/a2",
			do: create(claim(nsA, uidA2+"-new", labelsFor("a2", uidA2), classPremium, nil))},

		// VolumeAttributesClasses: set on create or changed only to a class of the list.
		{name: "create a claim of an allowed VolumeAttributesClass", as: "tenant-a/a1",
			do: create(withAttributesClass(claim(nsA, newClaim, labelsFor("a1", uidA1), classAllowed, nil), attrsAllowed))},
		{name: "create a claim of a VolumeAttributesClass outside the cluster's allow-list", as: "tenant-a/a1",
			do: create(withAttributesClass(claim(nsA, newClaim, labelsFor("a1", uidA1), classAllowed, nil), attrsPremium)),
			want: tenancyPolicy + what("PersistentVolumeClaim", newClaim) + " names VolumeAttributesClass " + attrsPremium +
				", which guest cluster a1 may not use: it may use " + attrsAllowed},
		{name: "create a claim of a VolumeAttributesClass in the allow-list of the cluster that asks", as: "tenant-a/a2",
			do: create(withAttributesClass(claim(nsA, uidA2+"-new", labelsFor("a2", uidA2), classAllowed, nil), attrsPremium))},
		{name: "create a claim of a VolumeAttributesClass without an allow-list", as: "tenant-b/b1",
			do: create(withAttributesClass(claim(nsB, uidB1+"-new", labelsFor("b1", uidB1), classAllowed, nil), attrsAllowed)),
			want: tenancyPolicy + "PersistentVolumeClaim " + nsB + "/" + uidB1 + "-new names VolumeAttributesClass " + attrsAllowed +
				", which guest cluster b1 may not use: it may use none (annotation pvbridge.io/attributes-classes on its Cluster or Namespace)"},
		{name: "create a claim of no VolumeAttributesClass without an allow-list", as: "tenant-b/b1",
			do: create(claim(nsB, uidB1+"-new", labelsFor("b1", uidB1), classAllowed, nil))},
		{name: "create a claim of an empty VolumeAttributesClass name", as: "tenant-b/b1",
			do: create(withAttributesClass(claim(nsB, uidB1+"-new", labelsFor("b1", uidB1), classAllowed, nil), ""))},
		{name: "change its claim to an allowed VolumeAttributesClass", as: "tenant-a/a1",
			do: patch(claimKey(ownClaim), func(pvc *corev1.PersistentVolumeClaim) { withAttributesClass(pvc, attrsAllowed) })},
		{name: "change its claim to a VolumeAttributesClass outside the cluster's allow-list", as: "tenant-a/a1",
			do: patch(claimKey(ownClaim), func(pvc *corev1.PersistentVolumeClaim) { withAttributesClass(pvc, attrsPremium) }),
			want: tenancyPolicy + what("PersistentVolumeClaim", ownClaim) + " names VolumeAttributesClass " + attrsPremium +
				", which guest cluster a1 may not use: it may use " + attrsAllowed},
		{name: "change its claim from a class outside the allow-list to an allowed one", as: "tenant-a/a1",
			do: patch(claimKey(tunedClaim), func(pvc *corev1.PersistentVolumeClaim) { withAttributesClass(pvc, attrsAllowed) })},
		{name: "expand its claim that keeps a VolumeAttributesClass no longer in its allow-list", as: "tenant-a/a1",
			do: patch(claimKey(tunedClaim), expand)},

		{name: "bind a claim to a volume of its choosing", as: "tenant-a/a1",
			do: create(func() *corev1.PersistentVolumeClaim {
				pvc := claim(nsA, newClaim, labelsFor("a1", uidA1), classAllowed, nil)
				pvc.Spec.VolumeName = "pv-of-another-tenant"
				return pvc
			}()),
			want: tenancyPolicy + "guest cluster a1 may not bind " + what("PersistentVolumeClaim", newClaim) +
				" to a PersistentVolume of its choosing (spec.volumeName, spec.selector): its claims are provisioned"},
		{name: "select the volumes a claim may bind to", as: "tenant-a/a1",
			do: create(func() *corev1.PersistentVolumeClaim {
				pvc := claim(nsA, newClaim, labelsFor("a1", uidA1), classAllowed, nil)
				pvc.Spec.Selector = &metav1.LabelSelector{MatchLabels: map[string]string{"tenant": "b"}}
				return pvc
			}()),
			want: tenancyPolicy + "guest cluster a1 may not bind " + what("PersistentVolumeClaim", newClaim) +
				" to a PersistentVolume of its choosing (spec.volumeName, spec.selector): its claims are provisioned"},
		{name: "clone its own claim", as: "tenant-a/a1",
			do: create(claim(nsA, newClaim, labelsFor("a1", uidA1), classAllowed, claimSource(ownClaim)))},
		{name: "clone a claim shared with it", as: "tenant-a/a1",
			do: create(claim(nsA, newClaim, labelsFor("a1", uidA1), classAllowed, claimSource(sharedClaim)))},
		{name: "clone a claim of another cluster", as: "tenant-a/a1",
			do:   create(claim(nsA, newClaim, labelsFor("a1", uidA1), classAllowed, claimSource(otherClaim))),
			want: tenancyPolicy + what("PersistentVolumeClaim", newClaim) + ": its data source PersistentVolumeClaim " + nsA + "/" + otherClaim + neitherOwnedNorShared},
		{name: "restore its own snapshot", as: "tenant-a/a1",
			do: create(claim(nsA, newClaim, labelsFor("a1", uidA1), classAllowed, snapshotSource(ownSnap)))},
		{name: "restore a snapshot shared with it", as: "tenant-a/a1",
			do: create(claim(nsA, newClaim, labelsFor("a1", uidA1), classAllowed, snapshotSource(sharedSnap)))},
		{name: "restore a snapshot of another cluster", as: "tenant-a/a1",
			do:   create(claim(nsA, newClaim, labelsFor("a1", uidA1), classAllowed, snapshotSource(otherSnap))),
			want: tenancyPolicy + what("PersistentVolumeClaim", newClaim) + ": its data source VolumeSnapshot " + nsA + "/" + otherSnap + neitherOwnedNorShared},
		{name: "expand its own claim", as: "tenant-a/a1", do: patch(claimKey(ownClaim), expand)},
		{name: "expand a claim of another cluster", as: "tenant-a/a1",
			do: patch(claimKey(otherClaim), expand), want: notA1s("PersistentVolumeClaim", otherClaim, a2, "change")},
		{name: "expand a claim shared with it", as: "tenant-a/a1",
			do: patch(claimKey(sharedClaim), expand), want: notA1s("PersistentVolumeClaim", sharedClaim, "no guest cluster", "change")},
		{name: "delete its own claim", as: "tenant-a/a1", do: remove(claimKey(ownClaim))},
		{name: "delete a claim of another cluster", as: "tenant-a/a1",
			do: remove(claimKey(otherClaim)), want: notA1s("PersistentVolumeClaim", otherClaim, a2, "delete")},
		{name: "delete a claim shared with it", as: "tenant-a/a1",
			do: remove(claimKey(sharedClaim)), want: notA1s("PersistentVolumeClaim", sharedClaim, "no guest cluster", "delete")},
		{name: "relabel its own claim for another cluster", as: "tenant-a/a1",
			do:   patch(claimKey(ownClaim), func(pvc *corev1.PersistentVolumeClaim) { pvc.Labels = labelsFor("a2", uidA2) }),
			want: a1Labels("PersistentVolumeClaim", ownClaim, "a2", uidA2)},
		{name: "relabel a claim of another cluster as its own", as: "tenant-a/a1",
			do:   patch(claimKey(otherClaim), func(pvc *corev1.PersistentVolumeClaim) { pvc.Labels = labelsFor("a1", uidA1) }),
			want: notA1s("PersistentVolumeClaim", otherClaim, a2, "change")},
		{name: "add a label to its own claim", as: "tenant-a/a1",
			do: patch(claimKey(ownClaim), func(pvc *corev1.PersistentVolumeClaim) { pvc.Labels["team"] = "x" }),
			want: tenancyPolicy + "guest cluster a1 may not change the labels of " + what("PersistentVolumeClaim", ownClaim) +
				" (team): it changes only pvbridge.io/volume-group, of its claims"},

		// The label of a group snapshot's members: the one label a guest sets on its claims.
		{name: "label its own claim for a group snapshot", as: "tenant-a/a1",
			do: patch(claimKey(ownClaim), func(pvc *corev1.PersistentVolumeClaim) { pvc.Labels[groupLabel] = strings.Repeat("g", 63) })},
		{name: "move its own claim to another group snapshot", as: "tenant-a/a1",
			do: patch(claimKey(groupedClaim), func(pvc *corev1.PersistentVolumeClaim) { pvc.Labels[groupLabel] = "another-group" })},
		{name: "take the group snapshot label from its own claim", as: "tenant-a/a1",
			do: patch(claimKey(groupedClaim), func(pvc *corev1.PersistentVolumeClaim) { delete(pvc.Labels, groupLabel) })},
		{name: "label its own claim for a group snapshot and with a label of its own", as: "tenant-a/a1",
			do: patch(claimKey(ownClaim), func(pvc *corev1.PersistentVolumeClaim) {
				pvc.Labels[groupLabel] = "g"
				pvc.Labels["team"] = "x"
			}),
			want: tenancyPolicy + "guest cluster a1 may not change the labels of " + what("PersistentVolumeClaim", ownClaim) + " (team)"},
		{name: "label a claim of another cluster for its group snapshot", as: "tenant-a/a1",
			do:   patch(claimKey(otherClaim), func(pvc *corev1.PersistentVolumeClaim) { pvc.Labels = map[string]string{groupLabel: "g"} }),
			want: notA1s("PersistentVolumeClaim", otherClaim, a2, "change")},
		{name: "label a claim shared with it for its group snapshot", as: "tenant-a/a1",
			do:   patch(claimKey(sharedClaim), func(pvc *corev1.PersistentVolumeClaim) { pvc.Labels = map[string]string{groupLabel: "g"} }),
			want: notA1s("PersistentVolumeClaim", sharedClaim, "no guest cluster", "change")},
		// RBAC: a guest changes no snapshot (and the policy would refuse the label).
		{name: "label its own snapshot for a group snapshot", as: "tenant-a/a1",
			do: patch(snapshotKey(ownSnap), func(snap *unstructured.Unstructured) {
				snap.SetLabels(map[string]string{tenancy.ClusterNameLabel: "a1", tenancy.ClusterUIDLabel: uidA1, groupLabel: "g"})
			}),
			want: `volumesnapshots.snapshot.storage.k8s.io "` + ownSnap + `" is forbidden: User "system:serviceaccount:tenant-a:a1-pvbridge" cannot patch resource "volumesnapshots"`},

		// Annotations: the class is the spec field only, sharing is an admin's act, a claim is
		// provisioned on a host of the cluster's VMs.
		{name: "name an allowed class but another one in the beta class annotation", as: "tenant-a/a1",
			do:   create(annotated(claim(nsA, newClaim, labelsFor("a1", uidA1), classAllowed, nil), "volume.beta.kubernetes.io/storage-class", classPremium)),
			want: tenancyPolicy + "guest cluster a1 may not set, change or remove annotation volume.beta.kubernetes.io/storage-class of " + what("PersistentVolumeClaim", newClaim)},
		{name: "bind to any volume without a class through an empty class annotation", as: "tenant-a/a1",
			do:   create(annotated(claim(nsA, newClaim, labelsFor("a1", uidA1), classAllowed, nil), "volume.beta.kubernetes.io/storage-class", "")),
			want: tenancyPolicy + "guest cluster a1 may not set, change or remove annotation volume.beta.kubernetes.io/storage-class of " + what("PersistentVolumeClaim", newClaim)},
		{name: "share its own claim", as: "tenant-a/a1",
			do: patch(claimKey(ownClaim), func(pvc *corev1.PersistentVolumeClaim) {
				metav1.SetMetaDataAnnotation(&pvc.ObjectMeta, tenancy.SharedWithAnnotation, "a2")
			}),
			want: tenancyPolicy + "guest cluster a1 may not set, change or remove annotation pvbridge.io/shared-with of " + what("PersistentVolumeClaim", ownClaim)},
		{name: "create a claim with a storage provisioner annotation", as: "tenant-a/a1",
			do:   create(annotated(claim(nsA, newClaim, labelsFor("a1", uidA1), classAllowed, nil), "volume.kubernetes.io/storage-provisioner", "x")),
			want: tenancyPolicy + "guest cluster a1 may not set, change or remove annotation volume.kubernetes.io/storage-provisioner of " + what("PersistentVolumeClaim", newClaim)},
		{name: "create a snapshot shared with another cluster", as: "tenant-a/a1",
			do: create(func() *unstructured.Unstructured {
				snap := snapshot(nsA, newClaim, labelsFor("a1", uidA1), ownClaim)
				snap.SetAnnotations(map[string]string{tenancy.SharedWithAnnotation: "a2"})
				return snap
			}()),
			want: tenancyPolicy + "guest cluster a1 may not set, change or remove annotation pvbridge.io/shared-with of " + what("VolumeSnapshot", newClaim)},
		{name: "create a claim with every annotation guest-csi writes, on a host of its VMs", as: "tenant-a/a1",
			do: create(func() *corev1.PersistentVolumeClaim {
				pvc := claim(nsA, newClaim, labelsFor("a1", uidA1), classAllowed, nil)
				pvc.Annotations = map[string]string{
					tenancy.CSINameAnnotation: "pvc-x", tenancy.GuestPVCAnnotation: "default/data", tenancy.GuestPVAnnotation: "pvc-x",
					tenancy.GuestLabelsAnnotation: "{}", "volume.kubernetes.io/selected-node": hostA1,
				}
				return pvc
			}())},
		{name: "create a claim with guest labels at their bound", as: "tenant-a/a1",
			do: create(annotated(claim(nsA, newClaim, labelsFor("a1", uidA1), classAllowed, nil),
				tenancy.GuestLabelsAnnotation, strings.Repeat("x", tenancy.MaxGuestLabelsLength)))},
		{name: "create a claim with guest labels of 200 000 characters", as: "tenant-a/a1",
			do: create(annotated(claim(nsA, newClaim, labelsFor("a1", uidA1), classAllowed, nil),
				tenancy.GuestLabelsAnnotation, strings.Repeat("x", 200_000))),
			want: tenancyPolicy + "guest cluster a1 may not write annotation pvbridge.io/guest-labels (200000 characters) of " +
				what("PersistentVolumeClaim", newClaim) + ": pvbridge.io/guest-labels is at most 4096 characters, the others 512"},
		{name: "grow the guest labels of its own claim", as: "tenant-a/a1",
			do: patch(claimKey(ownClaim), func(pvc *corev1.PersistentVolumeClaim) {
				metav1.SetMetaDataAnnotation(&pvc.ObjectMeta, tenancy.GuestLabelsAnnotation, strings.Repeat("x", tenancy.MaxGuestLabelsLength+1))
			}),
			want: tenancyPolicy + "guest cluster a1 may not write annotation pvbridge.io/guest-labels (4097 characters) of " + what("PersistentVolumeClaim", ownClaim)},
		{name: "create a snapshot with a guest snapshot name over its bound", as: "tenant-a/a1",
			do: create(func() *unstructured.Unstructured {
				snap := snapshot(nsA, newClaim, labelsFor("a1", uidA1), ownClaim)
				snap.SetAnnotations(map[string]string{tenancy.GuestSnapshotAnnotation: strings.Repeat("s", tenancy.MaxAnnotationLength+1)})
				return snap
			}()),
			want: tenancyPolicy + "guest cluster a1 may not write annotation pvbridge.io/guest-snapshot (513 characters) of " + what("VolumeSnapshot", newClaim)},
		{name: "create a claim with a label of its own", as: "tenant-a/a1",
			do: create(func() *corev1.PersistentVolumeClaim {
				pvc := claim(nsA, newClaim, labelsFor("a1", uidA1), classAllowed, nil)
				pvc.Labels["team"] = "x"
				return pvc
			}()),
			want: tenancyPolicy + "guest cluster a1 may not label " + what("PersistentVolumeClaim", newClaim) + " team: it sets only pvbridge.io/cluster and pvbridge.io/cluster-uid"},

		// Finalizers and owners: a finalizer of the guest's choosing would hold its Cluster's
		// cleanup forever; an ownerReference with blockOwnerDeletion, another Cluster's deletion.
		{name: "create a claim with a finalizer of its choosing", as: "tenant-a/a1",
			do: create(func() *corev1.PersistentVolumeClaim {
				pvc := claim(nsA, newClaim, labelsFor("a1", uidA1), classAllowed, nil)
				pvc.Finalizers = []string{"x.example/hold"}
				return pvc
			}()),
			want: tenancyPolicy + "guest cluster a1 may not set, change or remove finalizer x.example/hold of " +
				what("PersistentVolumeClaim", newClaim) + ": finalizers and owners belong to the management cluster"},
		{name: "add a finalizer to its own claim", as: "tenant-a/a1",
			do: patch(claimKey(ownClaim), func(pvc *corev1.PersistentVolumeClaim) {
				pvc.Finalizers = append(pvc.Finalizers, "x.example/hold")
			}),
			want: tenancyPolicy + "guest cluster a1 may not set, change or remove finalizer x.example/hold of " + what("PersistentVolumeClaim", ownClaim)},
		{name: "remove the apiserver's protection finalizer from its own claim", as: "tenant-a/a1",
			do:   patch(claimKey(ownClaim), func(pvc *corev1.PersistentVolumeClaim) { pvc.Finalizers = nil }),
			want: tenancyPolicy + "guest cluster a1 may not set, change or remove finalizer kubernetes.io/pvc-protection of " + what("PersistentVolumeClaim", ownClaim)},
		{name: "create a snapshot with the claims' protection finalizer", as: "tenant-a/a1",
			do: create(func() *unstructured.Unstructured {
				snap := snapshot(nsA, newClaim, labelsFor("a1", uidA1), ownClaim)
				snap.SetFinalizers([]string{"kubernetes.io/pvc-protection"})
				return snap
			}()),
			want: tenancyPolicy + "guest cluster a1 may not set, change or remove finalizer kubernetes.io/pvc-protection of " + what("VolumeSnapshot", newClaim)},
		{name: "make another cluster's Cluster the owner of its claim, blocking that Cluster's deletion", as: "tenant-a/a1",
			do: create(func() *corev1.PersistentVolumeClaim {
				pvc := claim(nsA, newClaim, labelsFor("a1", uidA1), classAllowed, nil)
				pvc.OwnerReferences = []metav1.OwnerReference{{
					APIVersion: "cluster.x-k8s.io/v1beta2", Kind: "Cluster", Name: "a2", UID: uidA2, BlockOwnerDeletion: ptr.To(true),
				}}
				return pvc
			}()),
			want: tenancyPolicy + "guest cluster a1 may not set, change or remove metadata.ownerReferences of " + what("PersistentVolumeClaim", newClaim)},
		{name: "create a snapshot with an owner", as: "tenant-a/a1",
			do: create(func() *unstructured.Unstructured {
				snap := snapshot(nsA, newClaim, labelsFor("a1", uidA1), ownClaim)
				snap.SetOwnerReferences([]metav1.OwnerReference{{APIVersion: "v1", Kind: "ConfigMap", Name: "x", UID: uidA2}})
				return snap
			}()),
			want: tenancyPolicy + "guest cluster a1 may not set, change or remove metadata.ownerReferences of " + what("VolumeSnapshot", newClaim)},

		{name: "provision a claim on a host where it runs no VM", as: "tenant-a/a1",
			do: create(annotated(claim(nsA, newClaim, labelsFor("a1", uidA1), classAllowed, nil), "volume.kubernetes.io/selected-node", "host-b")),
			want: tenancyPolicy + what("PersistentVolumeClaim", newClaim) + " selects host host-b (annotation volume.kubernetes.io/selected-node), " +
				"where guest cluster a1 runs no VirtualMachine: it may select " + hostA1},

		// Snapshots.
		{name: "snapshot its own claim", as: "tenant-a/a1",
			do: create(snapshot(nsA, newClaim, labelsFor("a1", uidA1), ownClaim))},
		{name: "snapshot a claim shared with it", as: "tenant-a/a1",
			do: create(snapshot(nsA, newClaim, labelsFor("a1", uidA1), sharedClaim))},
		{name: "snapshot a claim of another cluster", as: "tenant-a/a1",
			do:   create(snapshot(nsA, newClaim, labelsFor("a1", uidA1), otherClaim)),
			want: tenancyPolicy + what("VolumeSnapshot", newClaim) + ": its source PersistentVolumeClaim " + nsA + "/" + otherClaim + neitherOwnedNorShared},
		{name: "create a snapshot labelled for another cluster", as: "tenant-a/a1",
			do:   create(snapshot(nsA, newClaim, labelsFor("a2", uidA2), ownClaim)),
			want: a1Labels("VolumeSnapshot", newClaim, "a2", uidA2)},
		{name: "snapshot into a class outside the cluster's allow-list", as: "tenant-a/a1",
			do: create(withSnapshotClass(snapshot(nsA, newClaim, labelsFor("a1", uidA1), ownClaim), snapClassRetain)),
			want: tenancyPolicy + what("VolumeSnapshot", newClaim) + " names VolumeSnapshotClass " + snapClassRetain +
				", which guest cluster a1 may not use: it may use " + classAllowed},
		{name: "snapshot into no class (the management default)", as: "tenant-a/a1",
			do:   create(withSnapshotClass(snapshot(nsA, newClaim, labelsFor("a1", uidA1), ownClaim), "")),
			want: tenancyPolicy + what("VolumeSnapshot", newClaim) + " names no VolumeSnapshotClass, which guest cluster a1 may not use: it may use " + classAllowed},
		{name: "snapshot into a class in the allow-list of the cluster that asks", as: "tenant-a/a2",
			do: create(withSnapshotClass(snapshot(nsA, uidA2+"-new", labelsFor("a2", uidA2), otherClaim), snapClassRetain))},
		{name: "snapshot without an allow-list", as: "tenant-b/b1",
			do: create(snapshot(nsB, uidB1+"-new", labelsFor("b1", uidB1), uidB1+"-data")),
			want: tenancyPolicy + "VolumeSnapshot " + nsB + "/" + uidB1 + "-new names VolumeSnapshotClass " + classAllowed +
				", which guest cluster b1 may not use: it may use none (annotation pvbridge.io/snapshot-classes on its Cluster or Namespace)"},
		{name: "change its snapshot to a class outside the allow-list", as: "tenant-a/a1",
			do:   patch(snapshotKey(ownSnap), func(u *unstructured.Unstructured) { withSnapshotClass(u, snapClassRetain) }),
			want: `User "system:serviceaccount:tenant-a:a1-pvbridge" cannot patch resource "volumesnapshots"`},
		{name: "delete its own snapshot", as: "tenant-a/a1", do: remove(snapshotKey(ownSnap))},
		{name: "delete a snapshot of another cluster", as: "tenant-a/a1",
			do: remove(snapshotKey(otherSnap)), want: notA1s("VolumeSnapshot", otherSnap, a2, "delete")},
		{name: "delete a snapshot shared with it", as: "tenant-a/a1",
			do: remove(snapshotKey(sharedSnap)), want: notA1s("VolumeSnapshot", sharedSnap, "no guest cluster", "delete")},

		// Group snapshots: of the cluster's own claims, selected by their labels.
		{name: "take a group snapshot of its claims", as: "tenant-a/a1",
			do: create(withAnnotations(groupSnapshot(nsA, uidA1+"-new-group", labelsFor("a1", uidA1), ownGroupSelection),
				map[string]string{tenancy.CSINameAnnotation: "groupsnapshot-x", tenancy.GuestSnapshotAnnotation: "default/nightly"}))},
		{name: "take a group snapshot of another cluster's claims", as: "tenant-a/a1",
			do:   create(groupSnapshot(nsA, uidA1+"-new-group", labelsFor("a1", uidA1), selecting(map[string]string{tenancy.ClusterUIDLabel: uidA2, groupLabel: "g"}))),
			want: groupRefused},
		{name: "take a group snapshot that selects by its group label only", as: "tenant-a/a1",
			do:   create(groupSnapshot(nsA, uidA1+"-new-group", labelsFor("a1", uidA1), selecting(map[string]string{groupLabel: "g"}))),
			want: groupRefused},
		{name: "take a group snapshot that selects by one more label", as: "tenant-a/a1",
			do: create(groupSnapshot(nsA, uidA1+"-new-group", labelsFor("a1", uidA1),
				selecting(map[string]string{tenancy.ClusterUIDLabel: uidA1, groupLabel: "g", "app": "db"}))),
			want: groupRefused},
		{name: "take a group snapshot that also selects by expressions", as: "tenant-a/a1",
			do: create(groupSnapshot(nsA, uidA1+"-new-group", labelsFor("a1", uidA1), selecting(
				map[string]string{tenancy.ClusterUIDLabel: uidA1, groupLabel: "g"},
				map[string]any{"key": tenancy.ClusterUIDLabel, "operator": "In", "values": []any{uidA1, uidA2}}))),
			want: groupRefused},
		{name: "take a group snapshot of a pre-provisioned content", as: "tenant-a/a1",
			do: create(groupSnapshot(nsA, uidA1+"-new-group", labelsFor("a1", uidA1),
				map[string]any{"volumeGroupSnapshotContentName": "groupsnapcontent-of-another-tenant"})),
			want: groupRefused},
		{name: "create a group snapshot labelled for another cluster", as: "tenant-a/a1",
			do:   create(groupSnapshot(nsA, uidA1+"-new-group", labelsFor("a2", uidA2), ownGroupSelection)),
			want: a1Labels("VolumeGroupSnapshot", uidA1+"-new-group", "a2", uidA2)},
		{name: "create a group snapshot named after another cluster", as: "tenant-a/a1",
			do:   create(groupSnapshot(nsA, uidA2+"-new-group", labelsFor("a1", uidA1), ownGroupSelection)),
			want: tenancyPolicy + "guest cluster a1 may create only objects named " + uidA1 + "-…, not " + what("VolumeGroupSnapshot", uidA2+"-new-group")},
		{name: "create a group snapshot shared with another cluster", as: "tenant-a/a1",
			do: create(withAnnotations(groupSnapshot(nsA, uidA1+"-new-group", labelsFor("a1", uidA1), ownGroupSelection),
				map[string]string{tenancy.SharedWithAnnotation: "a2"})),
			want: tenancyPolicy + "guest cluster a1 may not set, change or remove annotation pvbridge.io/shared-with of " + what("VolumeGroupSnapshot", uidA1+"-new-group")},
		{name: "take a group snapshot into a class outside the cluster's allow-list", as: "tenant-a/a1",
			do: create(withSnapshotClass(groupSnapshot(nsA, uidA1+"-new-group", labelsFor("a1", uidA1), ownGroupSelection), snapClassRetain)),
			want: tenancyPolicy + what("VolumeGroupSnapshot", uidA1+"-new-group") + " names VolumeGroupSnapshotClass " + snapClassRetain +
				", which guest cluster a1 may not use: it may use " + classAllowed},
		{name: "take a group snapshot into no class (the management default)", as: "tenant-a/a1",
			do: create(withSnapshotClass(groupSnapshot(nsA, uidA1+"-new-group", labelsFor("a1", uidA1), ownGroupSelection), "")),
			want: tenancyPolicy + what("VolumeGroupSnapshot", uidA1+"-new-group") +
				" names no VolumeGroupSnapshotClass, which guest cluster a1 may not use: it may use " + classAllowed},
		{name: "take a group snapshot without an allow-list", as: "tenant-b/b1",
			do: create(groupSnapshot(nsB, uidB1+"-new-group", labelsFor("b1", uidB1), selecting(map[string]string{tenancy.ClusterUIDLabel: uidB1, groupLabel: "g"}))),
			want: tenancyPolicy + "VolumeGroupSnapshot " + nsB + "/" + uidB1 + "-new-group names VolumeGroupSnapshotClass " + classAllowed +
				", which guest cluster b1 may not use: it may use none (annotation pvbridge.io/group-snapshot-classes on its Cluster or Namespace)"},
		{name: "delete its own group snapshot", as: "tenant-a/a1", do: remove(groupSnapshot(nsA, ownGroup, nil, nil))},
		{name: "delete a group snapshot of another cluster", as: "tenant-a/a1",
			do: remove(groupSnapshot(nsA, otherGroup, nil, nil)), want: notA1s("VolumeGroupSnapshot", otherGroup, a2, "delete")},
		{name: "restore a member of its group snapshot", as: "tenant-a/a1",
			do: create(claim(nsA, newClaim, labelsFor("a1", uidA1), classAllowed, snapshotSource(ownMember)))},
		{name: "restore a member of another cluster's group snapshot", as: "tenant-a/a1",
			do: create(claim(nsA, newClaim, labelsFor("a1", uidA1), classAllowed, snapshotSource(otherMember))),
			want: tenancyPolicy + what("PersistentVolumeClaim", newClaim) + ": its data source VolumeSnapshot " + nsA + "/" + otherMember +
				neitherOwnedNorShared + " nor a member of its group snapshots"},

		// VirtualMachines.
		{name: "attach its own claim to its VM", as: "tenant-a/a1", do: patch(vmKey(ownVM), attach(uidA1+"-data2"))},
		{name: "attach a claim shared with it to its VM", as: "tenant-a/a1", do: patch(vmKey(ownVM), attach(sharedClaim))},
		{name: "attach a claim of another cluster to its VM", as: "tenant-a/a1",
			do: patch(vmKey(ownVM), attach(otherClaim)),
			want: tenancyPolicy + "guest cluster a1 may attach to " + what("VirtualMachine", ownVM) + " only claims it owns (named " + uidA1 +
				"-…) or that are shared with it (annotation pvbridge.io/shared-with), not " + otherClaim},
		{name: "attach its own claim to the VM of another cluster", as: "tenant-a/a1",
			do:   patch(vmKey(otherVM), attach(uidA1+"-data2")),
			want: tenancyPolicy + what("VirtualMachine", otherVM) + " belongs to cluster a2 (label cluster.x-k8s.io/cluster-name), not to guest cluster a1"},
		{name: "name a VM's volume entry after another cluster's claim", as: "tenant-a/a1",
			do: patch(vmKey(ownVM), func(vm *vmv1.VirtualMachine) {
				vm.Spec.Volumes = append(vm.Spec.Volumes, vmv1.VirtualMachineVolume{
					Name: otherClaim, PersistentVolumeClaim: vmv1.PersistentVolumeClaimVolumeSource{ClaimName: uidA1 + "-data2"},
				})
			}),
			want: tenancyPolicy + "guest cluster a1 must name each spec.volumes entry of " + what("VirtualMachine", ownVM) +
				" after its claim (persistentVolumeClaim.claimName), not " + otherClaim},
		{name: "re-point a stale entry to a claim no longer shared", as: "tenant-a/a1",
			// One patch removes the entry and adds another for the same claim: the claim was in the
			// old spec, but not under this name.
			do: patch(vmKey(ownVM), func(vm *vmv1.VirtualMachine) {
				vm.Spec.Volumes = []vmv1.VirtualMachineVolume{vm.Spec.Volumes[0], {
					Name: uidA1 + "-v2", PersistentVolumeClaim: vmv1.PersistentVolumeClaimVolumeSource{ClaimName: staleClaim},
				}}
			}),
			want: tenancyPolicy + "guest cluster a1 must name each spec.volumes entry of " + what("VirtualMachine", ownVM) +
				" after its claim (persistentVolumeClaim.claimName), not " + uidA1 + "-v2"},
		{name: "attach its own claim beside a stale entry it keeps", as: "tenant-a/a1", do: patch(vmKey(ownVM), attach(uidA1+"-data2"))},
		{name: "detach a volume from its VM", as: "tenant-a/a1",
			do: patch(vmKey(ownVM), func(vm *vmv1.VirtualMachine) { vm.Spec.Volumes = nil })},
		{name: "power off its VM", as: "tenant-a/a1",
			do:   patch(vmKey(ownVM), func(vm *vmv1.VirtualMachine) { vm.Spec.PowerState = vmv1.PowerStateOff }),
			want: tenancyPolicy + "guest cluster a1 may change only spec.volumes of " + what("VirtualMachine", ownVM) + ", not spec.powerState"},
		{name: "point its VM at another bootstrap secret", as: "tenant-a/a1",
			do: patch(vmKey(ownVM), func(vm *vmv1.VirtualMachine) {
				vm.Spec.Bootstrap = &vmv1.VirtualMachineBootstrap{DataSecretName: "another-clusters-bootstrap"}
			}),
			want: tenancyPolicy + "guest cluster a1 may change only spec.volumes of " + what("VirtualMachine", ownVM) + ", not spec.bootstrap"},
		{name: "give its VM more hot-plug slots", as: "tenant-a/a1",
			do:   patch(vmKey(ownVM), func(vm *vmv1.VirtualMachine) { vm.Spec.MaxVolumes = ptr.To[int32](64) }),
			want: tenancyPolicy + "guest cluster a1 may change only spec.volumes of " + what("VirtualMachine", ownVM) + ", not spec.maxVolumes"},
		{name: "relabel its VM", as: "tenant-a/a1",
			do:   patch(vmKey(ownVM), func(vm *vmv1.VirtualMachine) { vm.Labels[tenancy.CAPIClusterNameLabel] = "a2" }),
			want: tenancyPolicy + "guest cluster a1 may change only spec.volumes of " + what("VirtualMachine", ownVM) + ", not metadata.labels"},
		{name: "create a VM", as: "tenant-a/a1",
			do: create(&vmv1.VirtualMachine{
				ObjectMeta: metav1.ObjectMeta{Namespace: nsA, Name: "a1-vm2", Labels: map[string]string{tenancy.CAPIClusterNameLabel: "a1"}},
			}),
			want: `virtualmachines.vm.pvbridge.io is forbidden: User "system:serviceaccount:tenant-a:a1-pvbridge" cannot create resource "virtualmachines"`},

		// Identities and namespaces.
		{name: "write in the namespace of another tenant where RBAC lets it", as: "tenant-b/b1",
			do:   create(claim(nsA, uidB1+"-new", labelsFor("b1", uidB1), classAllowed, nil)),
			want: namespacePolicy + "guest identity system:serviceaccount:tenant-b:b1-pvbridge may write only in its own namespace tenant-b, not in " + nsA},
		{name: "take a group snapshot in the namespace of another tenant where RBAC lets it", as: "tenant-b/b1",
			do: create(groupSnapshot(nsA, uidB1+"-new-group", labelsFor("b1", uidB1),
				selecting(map[string]string{tenancy.ClusterUIDLabel: uidA2, groupLabel: "g"}))),
			want: namespacePolicy + "guest identity system:serviceaccount:tenant-b:b1-pvbridge may write only in its own namespace tenant-b, not in " + nsA},
		{name: "delete a group snapshot in the namespace of another tenant where RBAC lets it", as: "tenant-b/b1",
			do:   remove(groupSnapshot(nsA, otherGroup, nil, nil)),
			want: namespacePolicy + "guest identity system:serviceaccount:tenant-b:b1-pvbridge may write only in its own namespace tenant-b, not in " + nsA},
		{name: "take a group snapshot in its namespace when tenancy is not enforced there", as: "plain/p1",
			do: create(groupSnapshot(nsPlain, "p1-new-group", nil, selecting(map[string]string{groupLabel: "g"}))),
			want: namespacePolicy + "namespace plain is not labelled pvbridge.io/tenancy=enforced, so pvbridge's tenancy policy does not guard it: " +
				"guest identity system:serviceaccount:plain:p1-pvbridge may not write there"},
		{name: "write in its namespace when tenancy is not enforced there", as: "plain/p1",
			do: create(claim(nsPlain, "p1-new", nil, classAllowed, nil)),
			want: namespacePolicy + "namespace plain is not labelled pvbridge.io/tenancy=enforced, so pvbridge's tenancy policy does not guard it: " +
				"guest identity system:serviceaccount:plain:p1-pvbridge may not write there"},
		{name: "write in the namespace of another tenant", as: "tenant-a/a1",
			do:   create(claim(nsB, newClaim, labelsFor("a1", uidA1), classAllowed, nil)),
			want: `persistentvolumeclaims is forbidden: User "system:serviceaccount:tenant-a:a1-pvbridge" cannot create resource "persistentvolumeclaims" in API group "" in the namespace "tenant-b"`},
		{name: "write as a cluster that is not opted in", as: "tenant-a/zz",
			do: create(claim(nsA, "zz-new", nil, classAllowed, nil)),
			want: tenancyPolicy + "guest cluster zz is not opted in to pvbridge in namespace tenant-a (no zz.uid in ConfigMap pvbridge-tenancy; " +
				"label its Cluster pvbridge.io/enabled=true): " + what("PersistentVolumeClaim", "zz-new") + " refused"},
		{name: "write with a token of an earlier account of the cluster's identity", as: "tenant-a/a1@uid-of-an-earlier-account",
			do: create(claim(nsA, newClaim, labelsFor("a1", uidA1), classAllowed, nil)),
			want: tenancyPolicy + "the token of system:serviceaccount:tenant-a:a1-pvbridge was issued for ServiceAccount uid uid-of-an-earlier-account, " +
				"not for the current identity of guest cluster a1 (uid " + accountUID("a1") + "): an earlier account of that name: " +
				what("PersistentVolumeClaim", newClaim) + " refused"},
		{name: "write before the cluster's identity is recorded", as: "tenant-a/a3",
			do: create(claim(nsA, uidA3+"-new", labelsFor("a3", uidA3), classAllowed, nil)),
			want: tenancyPolicy + "guest cluster a3 has no identity recorded yet (no a3.account in ConfigMap pvbridge-tenancy): " +
				what("PersistentVolumeClaim", uidA3+"-new") + " refused"},
		{name: "write in an enforced namespace without parameters", as: nsBare + "/c1",
			do: create(claim(nsBare, "c1-new", nil, classAllowed, nil)), want: paramsMissing},
		{name: "even the admin writes nothing guarded in an enforced namespace without parameters", as: "",
			do: create(claim(nsBare, "admin-new", nil, classAllowed, nil)), want: paramsMissing},
		{name: "the platform admin is not bound by the policy", as: "",
			do: create(claim(nsA, "admin-new", nil, classPremium, claimSource(otherClaim)))},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			c, err := client.New(adminConfig, client.Options{Scheme: scheme(g)})
			g.Expect(err).NotTo(HaveOccurred())
			if ns, cluster, ok := strings.Cut(tt.as, "/"); ok {
				cluster, uid, stale := strings.Cut(cluster, "@")
				if !stale {
					uid = accountUID(cluster)
				}
				c = guestClient(g, ns, cluster, uid)
			}
			err = tt.do(t.Context(), c)
			if tt.want == "" {
				g.Expect(err).NotTo(HaveOccurred())
				return
			}
			g.Expect(err).To(MatchError(ContainSubstring(tt.want)))
		})
	}
}
