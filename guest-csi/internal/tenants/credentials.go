package tenants

import (
	"context"
	"errors"
	"fmt"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	corev1ac "k8s.io/client-go/applyconfigurations/core/v1"
	metav1ac "k8s.io/client-go/applyconfigurations/meta/v1"
	rbacv1ac "k8s.io/client-go/applyconfigurations/rbac/v1"
	"k8s.io/client-go/tools/events"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	"pvbridge.io/pkg/tenancy"
)

// Events of the credentials controller, on the Cluster.
const (
	eventCredentialsIssued  = "CredentialsIssued"
	eventCredentialsRenewed = "CredentialsRenewed"
	eventWaitingKubeconfig  = "WaitingForKubeconfig"
	eventGuestUnreachable   = "GuestUnreachable"
	eventCredentialsFailed  = "CredentialsFailed"
	eventCredentialsRevoked = "CredentialsRevoked"
	eventForeignIdentity    = "ForeignIdentityDeleted"
	unreachableGuestRetry   = 30 * time.Second
	credentialsAction       = "DeliverCredentials"
	credentialsRBACAction   = "GrantAccess"
)

// CredentialsReconciler gives each opted-in Cluster its management identity and delivers a
// token of it into the guest cluster; it revokes the identity of a Cluster that opts out.
type CredentialsReconciler struct {
	Client client.Client
	// APIReader reads ServiceAccounts the cache does not hold (not labelled as the controller's).
	APIReader client.Reader
	Config    Config
	Guests    *GuestClients
	Recorder  events.EventRecorder
}

// +kubebuilder:rbac:groups=cluster.x-k8s.io,resources=clusters,verbs=get;list;watch
// +kubebuilder:rbac:groups="",resources=secrets,verbs=get;list;watch
// +kubebuilder:rbac:groups="",resources=serviceaccounts,verbs=get;list;watch;create;patch;delete
// +kubebuilder:rbac:groups="",resources=serviceaccounts/token,verbs=create
// +kubebuilder:rbac:groups=rbac.authorization.k8s.io,resources=roles;rolebindings,verbs=create;patch;delete
// +kubebuilder:rbac:groups=events.k8s.io,resources=events,verbs=create;patch
//
// Owner references with blockOwnerDeletion to a Cluster, where the apiserver enforces them
// (admission plugin OwnerReferencesPermissionEnforcement):
// +kubebuilder:rbac:groups=cluster.x-k8s.io,resources=clusters/finalizers,verbs=update
//
// The controller holds the rules it grants, rather than escalate and bind on Roles: the
// apiserver lets it create a Role only with rules it holds in that namespace, and a RoleBinding
// only to a Role whose rules it holds. So tenancy.GuestRules in every namespace (a Cluster's
// namespace can be any) and tenancy.CapacityRules in the capacity namespace (pvbridge-system in
// manifests/base/tenants). With escalate and bind it could grant anything, itself included.
// +kubebuilder:rbac:groups="",resources=persistentvolumeclaims,verbs=get;list;watch;create;patch;delete
// +kubebuilder:rbac:groups=snapshot.storage.k8s.io,resources=volumesnapshots,verbs=get;list;watch;create;delete
// +kubebuilder:rbac:groups=groupsnapshot.storage.k8s.io,resources=volumegroupsnapshots,verbs=get;list;watch;create;delete
// +kubebuilder:rbac:groups=vm.pvbridge.io,resources=virtualmachines,verbs=get;list;watch;patch
// +kubebuilder:rbac:groups="",resources=events,verbs=list
// +kubebuilder:rbac:groups=storage.k8s.io,resources=csistoragecapacities,verbs=list,namespace=pvbridge-system

// SetupWithManager watches opted-in Clusters, Cluster API's kubeconfig Secrets and the guests'
// ServiceAccounts, so that a guest gets its credential as soon as its apiserver can be reached
// and a new one as soon as its account was replaced.
func (r *CredentialsReconciler) SetupWithManager(mgr ctrl.Manager) error {
	return ctrl.NewControllerManagedBy(mgr).
		Named("credentials").
		// Cluster API writes a Cluster's status often; only spec, label and annotation changes
		// matter here. Renewals come from RequeueAfter. A Cluster that opts out is seen through
		// its update (and, after a restart, through its ServiceAccount).
		For(&clusterv1.Cluster{}, builder.WithPredicates(optedInBefore, predicate.Or(
			predicate.GenerationChangedPredicate{}, predicate.LabelChangedPredicate{}, predicate.AnnotationChangedPredicate{}))).
		Watches(&corev1.Secret{}, handler.EnqueueRequestsFromMapFunc(clusterOfKubeconfig)).
		// A deleted ServiceAccount (how an admin revokes every token of a guest) is made anew,
		// with a new token, at once.
		Owns(&corev1.ServiceAccount{}).
		WithOptions(controller.Options{MaxConcurrentReconciles: guestWorkers}).
		Complete(r)
}

// clusterOfKubeconfig maps Cluster API's Secret <c>-kubeconfig to Cluster c.
func clusterOfKubeconfig(_ context.Context, obj client.Object) []reconcile.Request {
	name := obj.GetLabels()[clusterv1.ClusterNameLabel]
	if name == "" || obj.GetName() != kubeconfigSecretName(name) {
		return nil
	}
	return []reconcile.Request{{NamespacedName: client.ObjectKey{Namespace: obj.GetNamespace(), Name: name}}}
}

// Reconcile makes the Cluster's identity, then delivers or renews its token.
func (r *CredentialsReconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	log := ctrl.LoggerFrom(ctx)
	cluster := &clusterv1.Cluster{}
	if err := r.Client.Get(ctx, req.NamespacedName, cluster); err != nil {
		if apierrors.IsNotFound(err) {
			r.Guests.Forget(req.NamespacedName)
			credentialRenewAt.DeleteLabelValues(req.Namespace, req.Name)
			return ctrl.Result{}, nil
		}
		return ctrl.Result{}, err
	}
	// A deleted Cluster keeps the credential it has (a third of its life at least) while its
	// VMs drain; the cleanup controller removes the identity's capacity access at the end and
	// the garbage collector the rest with the Cluster. Neither it nor a Cluster that opted out
	// has a renewal to come, so neither has a renewal metric.
	if !cluster.DeletionTimestamp.IsZero() {
		credentialRenewAt.DeleteLabelValues(cluster.Namespace, cluster.Name)
		return ctrl.Result{}, nil
	}
	if !optedIn(cluster) {
		credentialRenewAt.DeleteLabelValues(cluster.Namespace, cluster.Name)
		return ctrl.Result{}, r.revoke(ctx, cluster)
	}
	account, err := r.reconcileIdentity(ctx, cluster)
	if err != nil {
		r.Recorder.Eventf(cluster, nil, corev1.EventTypeWarning, eventCredentialsFailed, credentialsRBACAction, "grant the guest identity its access: %v", err)
		return ctrl.Result{}, err
	}
	// No token before the admission policy knows the cluster and its account: a namespace's
	// parameters are what the policy checks a guest's writes against.
	if known, err := r.policyKnows(ctx, cluster, account); err != nil || !known {
		if err == nil {
			log.V(2).Info("Waiting for the tenancy parameters of the cluster", "configMap", tenancy.ParamsConfigMap)
		}
		return ctrl.Result{RequeueAfter: time.Second}, err
	}
	guest, err := r.Guests.For(ctx, r.Client, cluster)
	if errors.Is(err, errNoKubeconfig) {
		log.V(2).Info("Waiting for Cluster API's kubeconfig Secret", "secret", kubeconfigSecretName(cluster.Name))
		r.Recorder.Eventf(cluster, nil, corev1.EventTypeNormal, eventWaitingKubeconfig, credentialsAction,
			"waiting for the Secret %s to reach the guest cluster", kubeconfigSecretName(cluster.Name))
		return ctrl.Result{}, nil // the Secret's creation triggers the next reconcile
	}
	if err != nil {
		r.Recorder.Eventf(cluster, nil, corev1.EventTypeWarning, eventCredentialsFailed, credentialsAction, "connect to the guest cluster: %v", err)
		return ctrl.Result{}, err
	}
	return r.deliver(ctx, cluster, account, guest)
}

// policyKnows reports whether the namespace's tenancy parameters name the cluster with its UID
// and the UID of its account.
func (r *CredentialsReconciler) policyKnows(ctx context.Context, cluster *clusterv1.Cluster, account *corev1.ServiceAccount) (bool, error) {
	cm := &corev1.ConfigMap{}
	err := r.Client.Get(ctx, client.ObjectKey{Namespace: cluster.Namespace, Name: tenancy.ParamsConfigMap}, cm)
	if apierrors.IsNotFound(err) {
		return false, nil
	}
	return err == nil && cm.Data[cluster.Name+tenancy.ParamUID] == string(cluster.UID) &&
		cm.Data[cluster.Name+tenancy.ParamAccount] == string(account.UID), err
}

// reconcileIdentity applies the ServiceAccount, Roles and RoleBindings of a Cluster and returns
// the ServiceAccount. A ServiceAccount of that name that this Cluster does not control (an
// earlier Cluster's of the same name, or anyone else's) is deleted first: the admission policy
// knows a guest by its account's name, and adopting the account would keep every token issued
// for it valid.
func (r *CredentialsReconciler) reconcileIdentity(ctx context.Context, cluster *clusterv1.Cluster) (*corev1.ServiceAccount, error) {
	name, ns := identityName(cluster.Name), cluster.Namespace
	existing := &corev1.ServiceAccount{}
	switch err := r.APIReader.Get(ctx, client.ObjectKey{Namespace: ns, Name: name}, existing); {
	case apierrors.IsNotFound(err):
	case err != nil:
		return nil, fmt.Errorf("read ServiceAccount %s/%s: %w", ns, name, err)
	case !metav1.IsControlledBy(existing, cluster):
		if err := r.Client.Delete(ctx, existing, client.Preconditions{UID: &existing.UID}); err != nil && !apierrors.IsNotFound(err) {
			return nil, fmt.Errorf("delete ServiceAccount %s not controlled by the Cluster: %w", klog.KObj(existing), err)
		}
		ctrl.LoggerFrom(ctx).Info("Deleted a ServiceAccount of the guest identity's name that the Cluster does not control", "serviceAccount", klog.KObj(existing))
		r.Recorder.Eventf(cluster, nil, corev1.EventTypeWarning, eventForeignIdentity, credentialsRBACAction,
			"deleted ServiceAccount %s (uid %s), which this Cluster (uid %s) does not control; a new one is made", name, existing.UID, cluster.UID)
	}
	labels := managedLabels(cluster)
	owner := metav1ac.OwnerReference().
		WithAPIVersion(clusterv1.GroupVersion.String()).WithKind("Cluster").
		WithName(cluster.Name).WithUID(cluster.UID).
		WithController(true).WithBlockOwnerDeletion(true)
	subject := rbacv1ac.Subject().WithKind(rbacv1.ServiceAccountKind).WithNamespace(ns).WithName(name)
	// The capacity namespace's objects cannot be owned by the Cluster (an owner must live in
	// its dependent's namespace, or the garbage collector deletes the dependent at once); the
	// cleanup controller removes them instead.
	capacity := capacityName(cluster)
	sa := corev1ac.ServiceAccount(name, ns).WithLabels(labels).WithOwnerReferences(owner)
	for _, obj := range []namedApplyConfiguration{
		sa,
		rbacv1ac.Role(name, ns).WithLabels(labels).WithOwnerReferences(owner).WithRules(policyRules(tenancy.GuestRules)...),
		rbacv1ac.RoleBinding(name, ns).WithLabels(labels).WithOwnerReferences(owner).
			WithSubjects(subject).WithRoleRef(roleRef(name)),
		rbacv1ac.Role(capacity, r.Config.CapacityNamespace).WithLabels(labels).WithRules(policyRules(tenancy.CapacityRules)...),
		rbacv1ac.RoleBinding(capacity, r.Config.CapacityNamespace).WithLabels(labels).
			WithSubjects(subject).WithRoleRef(roleRef(capacity)),
	} {
		if err := r.Client.Apply(ctx, obj, client.FieldOwner(fieldManager), client.ForceOwnership); err != nil {
			return nil, fmt.Errorf("apply %s %s: %w", *obj.GetKind(), *obj.GetName(), err)
		}
	}
	// The apply answers with the object as stored: its UID tells a recreated account.
	return &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, UID: ptr.Deref(sa.UID, "")}}, nil
}

// revoke deletes the identity of a Cluster that opted out: its ServiceAccount (which ends every
// token of it at once), Roles and RoleBindings. The policy's parameters drop the cluster too.
func (r *CredentialsReconciler) revoke(ctx context.Context, cluster *clusterv1.Cluster) error {
	name, ns := identityName(cluster.Name), cluster.Namespace
	capacity := capacityName(cluster)
	// The ServiceAccount last: it tells the next reconcile whether anything is left to revoke.
	objs := []client.Object{
		&rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}},
		&rbacv1.Role{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}},
		&rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Namespace: r.Config.CapacityNamespace, Name: capacity}},
		&rbacv1.Role{ObjectMeta: metav1.ObjectMeta{Namespace: r.Config.CapacityNamespace, Name: capacity}},
		&corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}},
	}
	account := &corev1.ServiceAccount{}
	err := r.Client.Get(ctx, client.ObjectKey{Namespace: ns, Name: name}, account)
	if apierrors.IsNotFound(err) {
		return nil // revoked already, or never opted in
	}
	if err != nil {
		return err
	}
	if !metav1.IsControlledBy(account, cluster) {
		return nil
	}
	for _, obj := range objs {
		if err := r.Client.Delete(ctx, obj); err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("revoke the guest identity: delete %T %s: %w", obj, klog.KObj(obj), err)
		}
	}
	ctrl.LoggerFrom(ctx).Info("Revoked the guest identity of a Cluster that opted out", "serviceAccount", klog.KObj(account))
	r.Recorder.Eventf(cluster, nil, corev1.EventTypeNormal, eventCredentialsRevoked, credentialsRBACAction,
		"the Cluster no longer has %s=true: deleted ServiceAccount %s, which ends every token of it, and its Roles", tenancy.EnabledLabel, name)
	return nil
}

// namedApplyConfiguration is an apply configuration of a kind with ObjectMeta.
type namedApplyConfiguration interface {
	runtime.ApplyConfiguration
	GetKind() *string
	GetName() *string
}

// roleRef refers to the Role name.
func roleRef(name string) *rbacv1ac.RoleRefApplyConfiguration {
	return rbacv1ac.RoleRef().WithAPIGroup(rbacv1.GroupName).WithKind("Role").WithName(name)
}

// deliver writes a new token into the guest's Secret when the one there is missing, due or
// stale, and requeues for the next renewal.
func (r *CredentialsReconciler) deliver(ctx context.Context, cluster *clusterv1.Cluster, account *corev1.ServiceAccount, guest client.Client) (ctrl.Result, error) {
	log := ctrl.LoggerFrom(ctx)
	want := target{server: r.Config.MgmtServer, ca: r.Config.MgmtCA, namespace: cluster.Namespace}
	key := client.ObjectKey{Namespace: r.Config.GuestNamespace, Name: tenancy.GuestCredentialsSecret}
	secret := &corev1.Secret{}
	if err := guest.Get(ctx, key, secret); apierrors.IsNotFound(err) {
		secret = nil
	} else if err != nil {
		return r.unreachable(ctx, cluster, fmt.Errorf("read Secret %s in the guest cluster: %w", key, err))
	}
	now := r.Config.Clock.Now()
	reason, due := renewal(secret, want, string(account.UID), now)
	if !due.IsZero() {
		credentialRenewAt.WithLabelValues(cluster.Namespace, cluster.Name).Set(float64(due.Unix()))
	}
	if reason == "" {
		log.V(2).Info("Guest credential is current", "renewAt", due)
		return ctrl.Result{RequeueAfter: due.Sub(now)}, nil
	}

	tr := &authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{
		ExpirationSeconds: ptr.To(int64(r.Config.TokenTTL / time.Second)),
	}}
	if err := r.Client.SubResource("token").Create(ctx, account, tr); err != nil {
		return ctrl.Result{}, fmt.Errorf("request a token of ServiceAccount %s: %w", klog.KObj(account), err)
	}
	data, err := kubeconfig(want, account.Name, tr.Status.Token)
	if err != nil {
		return ctrl.Result{}, err
	}
	expires := tr.Status.ExpirationTimestamp.Time
	annotations := map[string]string{
		TokenIssuedAnnotation:       now.UTC().Format(time.RFC3339),
		TokenExpiresAnnotation:      expires.UTC().Format(time.RFC3339),
		ServiceAccountUIDAnnotation: string(account.UID),
	}
	if err := writeGuestSecret(ctx, guest, key, secret, data, annotations); err != nil {
		return r.unreachable(ctx, cluster, err)
	}
	due = renewAt(now, expires)
	credentialRenewAt.WithLabelValues(cluster.Namespace, cluster.Name).Set(float64(due.Unix()))
	log.Info("Delivered a management credential into the guest cluster", "reason", reason, "serviceAccount", klog.KObj(account),
		"secret", key, "expires", expires, "renewAt", due)
	eventReason := eventCredentialsRenewed
	if secret == nil {
		eventReason = eventCredentialsIssued
	}
	r.Recorder.Eventf(cluster, nil, corev1.EventTypeNormal, eventReason, credentialsAction,
		"delivered a token of ServiceAccount %s into Secret %s of the guest cluster (%s); it expires at %s and is renewed at %s",
		account.Name, key, reason, expires.UTC().Format(time.RFC3339), due.UTC().Format(time.RFC3339))
	return ctrl.Result{RequeueAfter: due.Sub(now)}, nil
}

// unreachable reports a failed request to the guest cluster and retries it later; the error is
// not returned, so that a guest that is down does not fill the log with backoff retries.
func (r *CredentialsReconciler) unreachable(ctx context.Context, cluster *clusterv1.Cluster, err error) (ctrl.Result, error) {
	ctrl.LoggerFrom(ctx).Error(err, "Cannot deliver the management credential into the guest cluster")
	r.Recorder.Eventf(cluster, nil, corev1.EventTypeWarning, eventGuestUnreachable, credentialsAction, "%v", err)
	return ctrl.Result{RequeueAfter: unreachableGuestRetry}, nil
}

// writeGuestSecret creates the guest Secret, or updates old (read just before) in place.
func writeGuestSecret(ctx context.Context, guest client.Client, key client.ObjectKey, old *corev1.Secret, data []byte, annotations map[string]string) error {
	if old == nil {
		secret := &corev1.Secret{
			ObjectMeta: metav1.ObjectMeta{Namespace: key.Namespace, Name: key.Name, Annotations: annotations,
				Labels: map[string]string{ManagedByLabel: fieldManager}},
			Type: corev1.SecretTypeOpaque,
			Data: map[string][]byte{GuestSecretKey: data},
		}
		if err := guest.Create(ctx, secret, client.FieldOwner(fieldManager)); err != nil {
			return fmt.Errorf("create Secret %s in the guest cluster: %w", key, err)
		}
		return nil
	}
	secret := old.DeepCopy()
	if secret.Annotations == nil {
		secret.Annotations = map[string]string{}
	}
	for k, v := range annotations {
		secret.Annotations[k] = v
	}
	if secret.Labels == nil {
		secret.Labels = map[string]string{}
	}
	secret.Labels[ManagedByLabel] = fieldManager
	if secret.Data == nil {
		secret.Data = map[string][]byte{}
	}
	secret.Data[GuestSecretKey] = data
	// Update carries old's resourceVersion: a concurrent writer makes it fail and the
	// reconcile run again, rather than being overwritten.
	if err := guest.Update(ctx, secret, client.FieldOwner(fieldManager)); err != nil {
		return fmt.Errorf("update Secret %s in the guest cluster: %w", key, err)
	}
	return nil
}

// capacityName is the name of a Cluster's Role and RoleBinding in the capacity namespace:
// <namespace>.<cluster>-pvbridge, unique because a namespace name has no dot.
func capacityName(c *clusterv1.Cluster) string {
	return c.Namespace + "." + identityName(c.Name)
}

// policyRules converts rules to apply configurations.
func policyRules(rules []rbacv1.PolicyRule) []*rbacv1ac.PolicyRuleApplyConfiguration {
	out := make([]*rbacv1ac.PolicyRuleApplyConfiguration, 0, len(rules))
	for _, rule := range rules {
		out = append(out, rbacv1ac.PolicyRule().
			WithAPIGroups(rule.APIGroups...).WithResources(rule.Resources...).WithVerbs(rule.Verbs...).
			WithResourceNames(rule.ResourceNames...).WithNonResourceURLs(rule.NonResourceURLs...))
	}
	return out
}
