package tenants

import (
	"context"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"github.com/prometheus/client_golang/prometheus/testutil"
	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/tools/events"
	clocktesting "k8s.io/utils/clock/testing"
	"k8s.io/utils/ptr"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/pkg/tenancy"
)

// TestCredentialsGrantGuestRulesOnly: an opted-in Cluster gets its ServiceAccount, Roles and
// RoleBindings, owned by the Cluster where ownership is possible, and the guest cluster a
// kubeconfig that works as that identity: what tenancy.GuestRules and CapacityRules allow
// succeeds against the management apiserver, the rest is Forbidden. A Cluster that does not
// opt in gets nothing.
func TestCredentialsGrantGuestRulesOnly(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	e := newTenantEnv(t, nil)
	e.startManager(t, e.config())
	other := e.createCluster(t, "other", false, nil)
	e.createKubeconfigSecret(t, other)
	c := e.createCluster(t, "alpha", true, nil)
	e.createKubeconfigSecret(t, c)

	var secret *corev1.Secret
	eventually(g, func() error {
		var err error
		secret, err = e.guestSecret(ctx)
		return err
	}).Should(Succeed())
	kubeconfig := secret.Data[GuestSecretKey]
	cfg, err := clientcmd.Load(kubeconfig)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(cfg.Contexts[cfg.CurrentContext].Namespace).To(Equal(e.ns), "the context names the guest's namespace")
	g.Expect(secret.Annotations).To(HaveKey(TokenExpiresAnnotation))

	owner := metav1.OwnerReference{APIVersion: clusterv1.GroupVersion.String(), Kind: "Cluster", Name: c.Name, UID: c.UID}
	ownedBy := HaveExactElements(And(
		HaveField("APIVersion", owner.APIVersion), HaveField("Kind", owner.Kind), HaveField("Name", owner.Name),
		HaveField("UID", owner.UID), HaveField("Controller", HaveValue(BeTrue()))))
	sa := &corev1.ServiceAccount{}
	g.Expect(mgmtClient.Get(ctx, client.ObjectKey{Namespace: e.ns, Name: "alpha-pvbridge"}, sa)).To(Succeed())
	g.Expect(sa.OwnerReferences).To(ownedBy)
	role := &rbacv1.Role{}
	g.Expect(mgmtClient.Get(ctx, client.ObjectKey{Namespace: e.ns, Name: "alpha-pvbridge"}, role)).To(Succeed())
	g.Expect(role.Rules).To(Equal(tenancy.GuestRules))
	g.Expect(role.OwnerReferences).To(ownedBy)
	binding := &rbacv1.RoleBinding{}
	g.Expect(mgmtClient.Get(ctx, client.ObjectKey{Namespace: e.ns, Name: "alpha-pvbridge"}, binding)).To(Succeed())
	g.Expect(binding.OwnerReferences).To(ownedBy)
	g.Expect(binding.RoleRef.Name).To(Equal("alpha-pvbridge"))
	// The capacity namespace's RBAC cannot be owned across namespaces; it is labelled for the
	// cleanup instead.
	capRole := &rbacv1.Role{}
	g.Expect(mgmtClient.Get(ctx, client.ObjectKey{Namespace: e.capacityNS, Name: e.ns + ".alpha-pvbridge"}, capRole)).To(Succeed())
	g.Expect(capRole.Rules).To(Equal(tenancy.CapacityRules))
	g.Expect(capRole.OwnerReferences).To(BeEmpty())
	g.Expect(capRole.Labels).To(HaveKeyWithValue(tenancy.ClusterUIDLabel, string(c.UID)))

	err = mgmtClient.Get(ctx, client.ObjectKey{Namespace: e.ns, Name: "other-pvbridge"}, &corev1.ServiceAccount{})
	g.Expect(apierrors.IsNotFound(err)).To(BeTrue(), "a Cluster without the opt-in label gets no identity: %v", err)

	guest := identityClient(t, kubeconfig)
	create(t, &vmv1.VirtualMachine{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "vm-0"}})
	for _, tc := range []struct {
		name    string
		call    func(ctx context.Context) error
		allowed bool
	}{
		{"list PVCs of its namespace", func(ctx context.Context) error {
			return guest.List(ctx, &corev1.PersistentVolumeClaimList{}, client.InNamespace(e.ns))
		}, true},
		{"create a PVC in its namespace", func(ctx context.Context) error {
			return guest.Create(ctx, e.pvc("claim", nil, ""))
		}, true},
		{"patch a VirtualMachine of its namespace", func(ctx context.Context) error {
			vm := &vmv1.VirtualMachine{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "vm-0"}}
			return guest.Patch(ctx, vm, client.RawPatch("application/merge-patch+json", []byte(`{"metadata":{"annotations":{"a":"b"}}}`)))
		}, true},
		{"list CSIStorageCapacities of the capacity namespace", func(ctx context.Context) error {
			return guest.List(ctx, &storagev1.CSIStorageCapacityList{}, client.InNamespace(e.capacityNS))
		}, true},
		{"list PVCs of another namespace", func(ctx context.Context) error {
			return guest.List(ctx, &corev1.PersistentVolumeClaimList{}, client.InNamespace(e.capacityNS))
		}, false},
		{"read Secrets of its namespace", func(ctx context.Context) error {
			return guest.List(ctx, &corev1.SecretList{}, client.InNamespace(e.ns))
		}, false},
		{"delete a VirtualMachine", func(ctx context.Context) error {
			return guest.Delete(ctx, &vmv1.VirtualMachine{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "vm-0"}})
		}, false},
		{"change its own Cluster", func(ctx context.Context) error {
			return guest.Patch(ctx, c.DeepCopy(), client.RawPatch("application/merge-patch+json", []byte(`{"metadata":{"labels":{"x":"y"}}}`)))
		}, false},
		{"write its own Role", func(ctx context.Context) error {
			return guest.Delete(ctx, role.DeepCopy())
		}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			err := tc.call(t.Context())
			if tc.allowed {
				g.Expect(err).NotTo(HaveOccurred())
			} else {
				g.Expect(apierrors.IsForbidden(err)).To(BeTrue(), "want Forbidden, got %v", err)
			}
		})
	}
	review := &authenticationv1.SelfSubjectReview{}
	g.Expect(guest.Create(ctx, review)).To(Succeed())
	g.Expect(review.Status.UserInfo.Username).To(Equal("system:serviceaccount:" + e.ns + ":alpha-pvbridge"))
}

// TestCredentialsRenewedAfterTwoThirds drives the credentials reconciler by a fake clock with
// 10-minute tokens: a fresh credential is kept (requeued for 2/3 of its life), one that is due
// is replaced in the guest Secret by a new token, and the old and the new token both work.
func TestCredentialsRenewedAfterTwoThirds(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	e := newTenantEnv(t, nil)
	clock := clocktesting.NewFakeClock(time.Now())
	cfg := e.config()
	cfg.Clock = clock
	r := &CredentialsReconciler{Client: mgmtClient, APIReader: mgmtClient, Config: cfg, Guests: NewGuestClients(scheme), Recorder: recorder(t)}
	c := e.createCluster(t, "rotating", true, nil)
	e.grantIdentity(t, r, c)
	e.createKubeconfigSecret(t, c)
	req := ctrl.Request{NamespacedName: client.ObjectKeyFromObject(c)}
	third := MinTokenTTL / 3

	res, err := r.Reconcile(ctx, req)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(res.RequeueAfter).To(BeNumerically("~", 2*third, 5*time.Second), "renewal is due after two thirds")
	first, err := e.guestSecret(ctx)
	g.Expect(err).NotTo(HaveOccurred())

	for _, step := range []struct {
		name    string
		advance time.Duration
		renewed bool
		requeue time.Duration
	}{
		{"fresh credential is kept", 0, false, 2 * third},
		{"one third in, kept", third, false, third},
		{"just before two thirds, kept", third - 10*time.Second, false, 10 * time.Second},
		// The fake clock now runs ahead of the apiserver's, which sets the new token's
		// expiry: its life as the controller sees it is shorter, and so is the requeue.
		{"two thirds passed, renewed", 15 * time.Second, true, 0},
	} {
		clock.Step(step.advance)
		res, err := r.Reconcile(ctx, req)
		g.Expect(err).NotTo(HaveOccurred(), step.name)
		now, err := e.guestSecret(ctx)
		g.Expect(err).NotTo(HaveOccurred())
		if step.renewed {
			expires, err := time.Parse(time.RFC3339, now.Annotations[TokenExpiresAnnotation])
			g.Expect(err).NotTo(HaveOccurred())
			step.requeue = expires.Sub(clock.Now()) * 2 / 3
			g.Expect(now.Annotations[TokenIssuedAnnotation]).To(Equal(clock.Now().UTC().Format(time.RFC3339)))
		}
		g.Expect(res.RequeueAfter).To(BeNumerically("~", step.requeue, 2*time.Second), step.name)
		issued, err := time.Parse(time.RFC3339, now.Annotations[TokenIssuedAnnotation])
		g.Expect(err).NotTo(HaveOccurred())
		expires, err := time.Parse(time.RFC3339, now.Annotations[TokenExpiresAnnotation])
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(testutil.ToFloat64(credentialRenewAt.WithLabelValues(c.Namespace, c.Name))).
			To(Equal(float64(renewAt(issued, expires).Unix())), "%s: the metric says when the credential in the guest is due", step.name)
		if step.renewed {
			g.Expect(tokenOf(now.Data[GuestSecretKey])).NotTo(Equal(tokenOf(first.Data[GuestSecretKey])), step.name)
			g.Expect(now.Annotations[TokenIssuedAnnotation]).NotTo(Equal(first.Annotations[TokenIssuedAnnotation]), step.name)
		} else {
			g.Expect(now.Data).To(Equal(first.Data), step.name)
		}
	}
	renewed, err := e.guestSecret(ctx)
	g.Expect(err).NotTo(HaveOccurred())
	for name, kubeconfig := range map[string][]byte{"old": first.Data[GuestSecretKey], "new": renewed.Data[GuestSecretKey]} {
		err := identityClient(t, kubeconfig).List(ctx, &corev1.PersistentVolumeClaimList{}, client.InNamespace(e.ns))
		g.Expect(err).NotTo(HaveOccurred(), "the %s token works until it expires", name)
	}
	eventually(g, func() ([]string, error) { return eventReasons(ctx, c) }).
		Should(HaveExactElements(eventCredentialsIssued, eventCredentialsRenewed))
}

// TestCredentialsReissuedWhenStale: a credential is replaced, whatever its age, when the
// guest Secret lost it, or when its ServiceAccount was recreated (the old token died with it).
func TestCredentialsReissuedWhenStale(t *testing.T) {
	for _, tc := range []struct {
		name  string
		spoil func(t *testing.T, e *tenantEnv, secret *corev1.Secret)
	}{
		{"guest Secret deleted", func(t *testing.T, e *tenantEnv, secret *corev1.Secret) {
			if err := guestAdmin.Delete(t.Context(), secret); err != nil {
				t.Fatal(err)
			}
		}},
		{"ServiceAccount recreated", func(t *testing.T, e *tenantEnv, _ *corev1.Secret) {
			sa := &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "stale-pvbridge"}}
			if err := mgmtClient.Delete(t.Context(), sa); err != nil {
				t.Fatal(err)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			ctx := t.Context()
			e := newTenantEnv(t, nil)
			r := &CredentialsReconciler{Client: mgmtClient, APIReader: mgmtClient, Config: e.config(), Guests: NewGuestClients(scheme), Recorder: recorder(t)}
			r.Config.Clock = clocktesting.NewFakeClock(time.Now())
			c := e.createCluster(t, "stale", true, nil)
			e.grantIdentity(t, r, c)
			e.createKubeconfigSecret(t, c)
			req := ctrl.Request{NamespacedName: client.ObjectKeyFromObject(c)}
			_, err := r.Reconcile(ctx, req)
			g.Expect(err).NotTo(HaveOccurred())
			before, err := e.guestSecret(ctx)
			g.Expect(err).NotTo(HaveOccurred())

			tc.spoil(t, e, before)
			_, err = r.Reconcile(ctx, req)
			g.Expect(err).NotTo(HaveOccurred())
			// A new account waits until the parameters name it, as the policy knows a guest by it.
			e.writeParams(t)
			_, err = r.Reconcile(ctx, req)
			g.Expect(err).NotTo(HaveOccurred())
			after, err := e.guestSecret(ctx)
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(tokenOf(after.Data[GuestSecretKey])).NotTo(Equal(tokenOf(before.Data[GuestSecretKey])))
			err = identityClient(t, after.Data[GuestSecretKey]).List(ctx, &corev1.PersistentVolumeClaimList{}, client.InNamespace(e.ns))
			g.Expect(err).NotTo(HaveOccurred(), "the new token works")
		})
	}
}

// recorder is a real Event recorder writing to the management apiserver until the test ends.
func recorder(t *testing.T) events.EventRecorder {
	t.Helper()
	cs, err := kubernetes.NewForConfig(mgmtConfig)
	if err != nil {
		t.Fatal(err)
	}
	b := events.NewBroadcaster(&events.EventSinkImpl{Interface: cs.EventsV1()})
	b.StartRecordingToSink(t.Context().Done())
	t.Cleanup(b.Shutdown)
	return b.NewRecorder(scheme, fieldManager)
}

// TestNoTokenBeforeThePolicyKnowsTheCluster: a guest gets no credential while the admission
// policy's parameters do not name its cluster, since the policy checks nothing without them.
func TestNoTokenBeforeThePolicyKnowsTheCluster(t *testing.T) {
	g := NewWithT(t)
	e := newTenantEnv(t, nil)
	r := &CredentialsReconciler{Client: mgmtClient, APIReader: mgmtClient, Config: e.config(), Guests: NewGuestClients(scheme), Recorder: recorder(t)}
	r.Config.Clock = clocktesting.NewFakeClock(time.Now())
	c := e.createCluster(t, "early", true, nil)
	e.createKubeconfigSecret(t, c)
	req := ctrl.Request{NamespacedName: client.ObjectKeyFromObject(c)}

	res, err := r.Reconcile(t.Context(), req)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(res.RequeueAfter).To(Equal(time.Second))
	_, err = e.guestSecret(t.Context())
	g.Expect(apierrors.IsNotFound(err)).To(BeTrue(), "no credential delivered: %v", err)

	e.writeParams(t)
	_, err = r.Reconcile(t.Context(), req)
	g.Expect(err).NotTo(HaveOccurred())
	_, err = e.guestSecret(t.Context())
	g.Expect(err).NotTo(HaveOccurred())
}

// TestIdentityRevokedOnOptOutAndNeverAdopted: a Cluster that opts out loses its ServiceAccount
// (every token of it ends) and Roles; a ServiceAccount of the identity's name that the Cluster
// does not control (an earlier Cluster's of the same name) is deleted, not adopted.
func TestIdentityRevokedOnOptOutAndNeverAdopted(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	e := newTenantEnv(t, nil)
	r := &CredentialsReconciler{Client: mgmtClient, APIReader: mgmtClient, Config: e.config(), Guests: NewGuestClients(scheme), Recorder: recorder(t)}
	r.Config.Clock = clocktesting.NewFakeClock(time.Now())
	c := e.createCluster(t, "again", true, nil)
	key := client.ObjectKey{Namespace: e.ns, Name: identityName(c.Name)}
	stale := &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: key.Name, OwnerReferences: []metav1.OwnerReference{{
		APIVersion: clusterv1.GroupVersion.String(), Kind: "Cluster", Name: c.Name, UID: "an-earlier-cluster", Controller: ptr.To(true),
	}}}}
	create(t, stale)
	e.grantIdentity(t, r, c)
	e.createKubeconfigSecret(t, c)
	req := ctrl.Request{NamespacedName: client.ObjectKeyFromObject(c)}
	_, err := r.Reconcile(ctx, req)
	g.Expect(err).NotTo(HaveOccurred())
	account := &corev1.ServiceAccount{}
	g.Expect(mgmtClient.Get(ctx, key, account)).To(Succeed())
	g.Expect(account.UID).NotTo(Equal(stale.UID), "a new account, not the earlier Cluster's")
	g.Expect(metav1.IsControlledBy(account, c)).To(BeTrue())

	patch := client.MergeFrom(c.DeepCopy())
	delete(c.Labels, tenancy.EnabledLabel)
	g.Expect(mgmtClient.Patch(ctx, c, patch)).To(Succeed())
	_, err = r.Reconcile(ctx, req)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(seriesOf(g, credentialRenewAt, e.ns)).To(BeEmpty(), "nothing to renew: no renewal is overdue")
	for _, obj := range []client.Object{&corev1.ServiceAccount{}, &rbacv1.Role{}, &rbacv1.RoleBinding{}} {
		err := mgmtClient.Get(ctx, key, obj)
		g.Expect(apierrors.IsNotFound(err)).To(BeTrue(), "%T %s revoked: %v", obj, key, err)
	}
}

// TestKubeconfigSecretChecks: only Cluster API's Secret of the Cluster, with inline credentials,
// makes a guest client.
func TestKubeconfigSecretChecks(t *testing.T) {
	cluster := &clusterv1.Cluster{ObjectMeta: metav1.ObjectMeta{Name: "c", UID: "uid-c"}, Spec: clusterv1.ClusterSpec{
		ControlPlaneRef: clusterv1.ContractVersionedObjectReference{APIGroup: "controlplane.cluster.x-k8s.io", Kind: "KubeadmControlPlane", Name: "c-cp"},
	}}
	owner := func(apiVersion, kind, name, uid string) []metav1.OwnerReference {
		return []metav1.OwnerReference{{APIVersion: apiVersion, Kind: kind, Name: name, UID: types.UID(uid)}}
	}
	for _, tc := range []struct {
		name    string
		typ     corev1.SecretType
		owners  []metav1.OwnerReference
		wantErr string
	}{
		{name: "owned by the Cluster", typ: clusterv1.ClusterSecretType, owners: owner(clusterv1.GroupVersion.String(), "Cluster", "c", "uid-c")},
		{name: "owned by its control plane", typ: clusterv1.ClusterSecretType, owners: owner("controlplane.cluster.x-k8s.io/v1beta2", "KubeadmControlPlane", "c-cp", "x")},
		{name: "an Opaque Secret", typ: corev1.SecretTypeOpaque, owners: owner(clusterv1.GroupVersion.String(), "Cluster", "c", "uid-c"),
			wantErr: `type "Opaque" is not Cluster API's "cluster.x-k8s.io/secret"`},
		{name: "owned by an earlier Cluster of the name", typ: clusterv1.ClusterSecretType, owners: owner(clusterv1.GroupVersion.String(), "Cluster", "c", "uid-old"),
			wantErr: "owned neither by Cluster c (uid uid-c) nor by its control plane"},
		{name: "owned by nothing", typ: clusterv1.ClusterSecretType,
			wantErr: "owned neither by Cluster c (uid uid-c) nor by its control plane"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			err := checkKubeconfigSecret(&corev1.Secret{ObjectMeta: metav1.ObjectMeta{OwnerReferences: tc.owners}, Type: tc.typ}, cluster)
			if tc.wantErr == "" {
				g.Expect(err).NotTo(HaveOccurred())
				return
			}
			g.Expect(err).To(MatchError(ContainSubstring(tc.wantErr)))
		})
	}

	kubeconfig := func(cluster, user string) []byte {
		return []byte("apiVersion: v1\nkind: Config\ncurrent-context: c\ncontexts:\n- name: c\n  context: {cluster: c, user: u}\n" +
			"clusters:\n- name: c\n  cluster:\n    server: https://127.0.0.1:6443\n" + cluster +
			"users:\n- name: u\n  user:\n" + user)
	}
	for _, tc := range []struct {
		name, cluster, user, wantErr string
	}{
		{name: "inline token and CA", cluster: "    certificate-authority-data: Zm9v\n", user: "    token: abc\n"},
		{name: "a token file", user: "    tokenFile: /var/run/secrets/kubernetes.io/serviceaccount/token\n",
			wantErr: "only inline credentials are accepted, not user u: tokenFile"},
		{name: "a program", user: "    exec: {apiVersion: client.authentication.k8s.io/v1, command: /bin/sh}\n",
			wantErr: "only inline credentials are accepted, not user u: exec"},
		{name: "files of the controller", cluster: "    certificate-authority: /etc/ca.crt\n", user: "    client-certificate: /etc/c.crt\n    client-key: /etc/c.key\n",
			wantErr: "only inline credentials are accepted, not cluster c: certificate-authority, user u: client-certificate, user u: client-key"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			_, err := inlineRESTConfig(kubeconfig(tc.cluster, tc.user))
			if tc.wantErr == "" {
				g.Expect(err).NotTo(HaveOccurred())
				return
			}
			g.Expect(err).To(MatchError(tc.wantErr))
		})
	}
}
