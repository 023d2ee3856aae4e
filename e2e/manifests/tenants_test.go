package manifests

import (
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	authorizationv1 "k8s.io/api/authorization/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	corev1ac "k8s.io/client-go/applyconfigurations/core/v1"
	rbacv1ac "k8s.io/client-go/applyconfigurations/rbac/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pvbridge.io/pkg/tenancy"
)

// The tenants controller as manifests/base/tenants deploys it.
const (
	tenantsNamespace = "pvbridge-system"
	tenantsAccount   = "guest-csi-tenants"
	tenantsUser      = "system:serviceaccount:" + tenantsNamespace + ":" + tenantsAccount
	tenantsRole      = "pvbridge-tenants"
	// tenantsPlaceholder is the management overlay's --mgmt-server, which a site must replace.
	tenantsPlaceholder = "https://set-mgmt-server.invalid:6443"
)

// tenantsObjects are the objects of manifests/base/tenants, as objectKey names them.
var tenantsObjects = []string{
	"ServiceAccount/" + tenantsNamespace + "/" + tenantsAccount,
	"Deployment/" + tenantsNamespace + "/" + tenantsAccount,
	"ClusterRole/" + tenantsRole,
	"ClusterRoleBinding/" + tenantsRole,
	"Role/" + tenantsNamespace + "/" + tenantsRole,
	"RoleBinding/" + tenantsNamespace + "/" + tenantsRole,
}

// TestTenantsDeployment checks the tenants controller's Deployment in the overlays that run it:
// its image comes from the images component (or the overlay's own), --mgmt-server from the
// ConfigMap the overlay makes (a placeholder in the management overlay, the site's value in an
// overlay of its own), leader election is on in pvbridge-system, the probes reach the health
// port and the container runs as non-root with a read-only root filesystem.
func TestTenantsDeployment(t *testing.T) {
	tests := []struct {
		overlay        string
		wantImage      string
		wantMgmtServer string
	}{
		{overlay: "management", wantImage: "ghcr.io/pvbridge/guest-csi-tenants:v0.1.0", wantMgmtServer: tenantsPlaceholder},
		{overlay: "dev", wantImage: "localhost:5000/pvbridge/guest-csi-tenants:dev", wantMgmtServer: "https://mgmt.example.com:6443"},
	}
	for _, tt := range tests {
		t.Run(tt.overlay, func(t *testing.T) {
			g := NewWithT(t)
			_, objs := build(t.Context(), g, filepath.Join(manifestsDir, "overlays", tt.overlay))
			byKey := map[string]*unstructured.Unstructured{}
			for _, obj := range objs {
				byKey[objectKey(obj)] = obj
			}
			u := byKey["Deployment/"+tenantsNamespace+"/"+tenantsAccount]
			g.Expect(u).NotTo(BeNil())
			var dep struct {
				Spec struct {
					Template corev1.PodTemplateSpec `json:"template"`
				} `json:"spec"`
			}
			g.Expect(runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, &dep)).To(Succeed())
			pod := dep.Spec.Template.Spec
			g.Expect(pod.ServiceAccountName).To(Equal(tenantsAccount))
			g.Expect(pod.Containers).To(HaveLen(1))
			c := pod.Containers[0]
			g.Expect(c.Image).To(Equal(tt.wantImage))
			g.Expect(c.Args).To(ContainElements("--mgmt-server=$(MGMT_SERVER)", "--leader-elect=true",
				"--leader-election-namespace="+tenantsNamespace, "--capacity-namespace="+tenantsNamespace,
				"--health-probe-bind-address=:8081"))

			// --mgmt-server: the environment variable names a ConfigMap of the overlay (by its
			// generated name) that holds the value.
			g.Expect(c.Env).To(HaveLen(1))
			g.Expect(c.Env[0].Name).To(Equal("MGMT_SERVER"))
			ref := c.Env[0].ValueFrom.ConfigMapKeyRef
			g.Expect(ref).NotTo(BeNil())
			cm := byKey["ConfigMap/"+tenantsNamespace+"/"+ref.Name]
			g.Expect(cm).NotTo(BeNil(), "the overlay has no ConfigMap %s", ref.Name)
			value, _, err := unstructured.NestedString(cm.Object, "data", ref.Key)
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(value).To(Equal(tt.wantMgmtServer))

			g.Expect(c.LivenessProbe.HTTPGet.Path).To(Equal("/healthz"))
			g.Expect(c.ReadinessProbe.HTTPGet.Path).To(Equal("/readyz"))
			for _, probe := range []*corev1.Probe{c.LivenessProbe, c.ReadinessProbe} {
				g.Expect(probe.HTTPGet.Port.StrVal).To(Equal("health"))
			}
			g.Expect(c.Ports).To(ContainElement(corev1.ContainerPort{Name: "health", ContainerPort: 8081}))
			g.Expect(c.Resources.Requests).NotTo(BeEmpty())
			g.Expect(c.Resources.Limits).To(HaveKey(corev1.ResourceMemory))
			g.Expect(pod.SecurityContext.RunAsNonRoot).To(HaveValue(BeTrue()))
			g.Expect(c.SecurityContext.ReadOnlyRootFilesystem).To(HaveValue(BeTrue()))
			g.Expect(c.SecurityContext.AllowPrivilegeEscalation).To(HaveValue(BeFalse()))
		})
	}
}

// TestTenantsRBAC applies the tenants controller's RBAC of the management overlay (generated
// from its kubebuilder markers) for real and proves, as its ServiceAccount, that it allows every
// request the controller makes and no more than listed: the apiserver's authorizer answers a
// SubjectAccessReview per request. Then, applied as the controller, the identity the credentials
// reconciler applies for a guest (ServiceAccount, Role of tenancy.GuestRules and RoleBinding in
// the Cluster's namespace, Role of tenancy.CapacityRules and RoleBinding in the capacity
// namespace) passes the apiserver's escalation check without escalate or bind, while a Role or
// a binding beyond the controller's own rules is refused (in server-side dry runs).
func TestTenantsRBAC(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	const tenantNS = "tenants-rbac"
	// A SubjectAccessReview per request: more than the client's default 5 per second.
	fast := rest.CopyConfig(adminConfig)
	fast.QPS, fast.Burst = 100, 200
	cs, err := kubernetes.NewForConfig(fast)
	g.Expect(err).NotTo(HaveOccurred())
	for _, ns := range []string{tenantsNamespace, tenantNS} {
		_, err := cs.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{})
		if !apierrors.IsAlreadyExists(err) {
			g.Expect(err).NotTo(HaveOccurred())
		}
	}
	admin, err := client.New(adminConfig, client.Options{Scheme: scheme(g)})
	g.Expect(err).NotTo(HaveOccurred())
	_, objs := build(ctx, g, filepath.Join(manifestsDir, "overlays", "management"))
	applied := 0
	for _, obj := range objs {
		if key := objectKey(obj); slices.Contains(tenantsObjects, key) && obj.GetKind() != "Deployment" {
			g.Expect(admin.Apply(ctx, client.ApplyConfigurationFromUnstructured(obj),
				client.FieldOwner("pvbridge-manifests-test"), client.ForceOwnership)).To(Succeed(), key)
			applied++
		}
	}
	g.Expect(applied).To(Equal(len(tenantsObjects) - 1))

	type access struct {
		group, resource, subresource, verb, namespace string
	}
	// What the controller does (guest-csi/internal/tenants), where: "" is every namespace.
	var allowed []access
	add := func(group, resource, namespace string, verbs ...string) {
		for _, verb := range verbs {
			res, sub, _ := strings.Cut(resource, "/")
			allowed = append(allowed, access{group, res, sub, verb, namespace})
		}
	}
	add("cluster.x-k8s.io", "clusters", "", "get", "list", "watch", "patch")
	add("cluster.x-k8s.io", "clusters/finalizers", tenantNS, "update")
	add("", "secrets", "", "get", "list", "watch")
	add("", "serviceaccounts", "", "get", "list", "watch")
	// delete: an opted-out Cluster's identity is revoked, a foreign one of its name not adopted.
	add("", "serviceaccounts", tenantNS, "create", "patch", "delete")
	add("", "serviceaccounts/token", tenantNS, "create")
	add("rbac.authorization.k8s.io", "roles", tenantNS, "create", "patch", "delete")
	add("rbac.authorization.k8s.io", "rolebindings", tenantNS, "create", "patch", "delete")
	add("rbac.authorization.k8s.io", "roles", tenantsNamespace, "create", "patch", "delete")
	add("rbac.authorization.k8s.io", "rolebindings", tenantsNamespace, "create", "patch", "delete")
	add("events.k8s.io", "events", tenantNS, "create", "patch")
	add("", "configmaps", "", "get", "list", "watch")
	add("", "configmaps", tenantNS, "create", "patch", "delete")
	add("", "namespaces", "", "get", "list", "watch")
	add("", "persistentvolumeclaims", "", "get", "list", "watch")
	add("", "persistentvolumeclaims", tenantNS, "patch", "delete")
	add("snapshot.storage.k8s.io", "volumesnapshots", "", "get", "list", "watch")
	add("snapshot.storage.k8s.io", "volumesnapshots", tenantNS, "patch", "delete")
	add("vm.pvbridge.io", "virtualmachines", "", "get", "list", "watch")
	add("coordination.k8s.io", "leases", tenantsNamespace, "get", "create", "update")
	add("", "events", tenantsNamespace, "create", "patch")
	// What it must not do: grant beyond what it holds, write Clusters but for the finalizer
	// patch, write Secrets, elect its leader or grant capacity access outside pvbridge-system.
	denied := []access{
		{"rbac.authorization.k8s.io", "roles", "", "escalate", tenantNS},
		{"rbac.authorization.k8s.io", "roles", "", "bind", tenantNS},
		{"rbac.authorization.k8s.io", "clusterroles", "", "bind", ""},
		{"rbac.authorization.k8s.io", "clusterroles", "", "create", ""},
		{"rbac.authorization.k8s.io", "roles", "", "get", tenantNS},
		{"cluster.x-k8s.io", "clusters", "", "update", tenantNS},
		{"cluster.x-k8s.io", "clusters", "status", "patch", tenantNS},
		{"", "secrets", "", "create", tenantNS},
		{"", "pods", "", "create", tenantsNamespace},
		{"coordination.k8s.io", "leases", "", "update", tenantNS},
		{"storage.k8s.io", "csistoragecapacities", "", "list", tenantNS},
	}
	review := func(a access) (bool, string) {
		sar, err := cs.AuthorizationV1().SubjectAccessReviews().Create(ctx, &authorizationv1.SubjectAccessReview{
			Spec: authorizationv1.SubjectAccessReviewSpec{
				User:   tenantsUser,
				Groups: []string{"system:serviceaccounts", "system:serviceaccounts:" + tenantsNamespace, "system:authenticated"},
				ResourceAttributes: &authorizationv1.ResourceAttributes{
					Group: a.group, Resource: a.resource, Subresource: a.subresource, Verb: a.verb, Namespace: a.namespace,
				},
			},
		}, metav1.CreateOptions{})
		g.Expect(err).NotTo(HaveOccurred())
		return sar.Status.Allowed, sar.Status.Reason
	}
	// The authorizer sees new bindings through its informers: wait for the first.
	g.Eventually(func() bool { ok, _ := review(allowed[0]); return ok }).WithTimeout(30 * time.Second).Should(BeTrue())
	for _, a := range allowed {
		ok, reason := review(a)
		g.Expect(ok).To(BeTrue(), "%s may not %+v: %s", tenantsUser, a, reason)
	}
	for _, a := range denied {
		ok, _ := review(a)
		g.Expect(ok).To(BeFalse(), "%s may %+v", tenantsUser, a)
	}

	// The identity of guest cluster alpha, as CredentialsReconciler applies it.
	cfg := rest.CopyConfig(adminConfig)
	cfg.Impersonate = rest.ImpersonationConfig{
		UserName: tenantsUser,
		Groups:   []string{"system:serviceaccounts", "system:serviceaccounts:" + tenantsNamespace, "system:authenticated"},
	}
	controller, err := client.New(cfg, client.Options{Scheme: scheme(g)})
	g.Expect(err).NotTo(HaveOccurred())
	// For real: a RoleBinding's escalation check reads the Role it refers to.
	apply := func(obj runtime.ApplyConfiguration, opts ...client.ApplyOption) error {
		return controller.Apply(ctx, obj, append(opts, client.FieldOwner("pvbridge-tenants"), client.ForceOwnership)...)
	}
	subject := rbacv1ac.Subject().WithKind(rbacv1.ServiceAccountKind).WithNamespace(tenantNS).WithName("alpha-pvbridge")
	ref := func(kind, name string) *rbacv1ac.RoleRefApplyConfiguration {
		return rbacv1ac.RoleRef().WithAPIGroup(rbacv1.GroupName).WithKind(kind).WithName(name)
	}
	capacity := tenantNS + ".alpha-pvbridge"
	for _, obj := range []runtime.ApplyConfiguration{
		corev1ac.ServiceAccount("alpha-pvbridge", tenantNS),
		rbacv1ac.Role("alpha-pvbridge", tenantNS).WithRules(rules(tenancy.GuestRules)...),
		rbacv1ac.RoleBinding("alpha-pvbridge", tenantNS).WithSubjects(subject).WithRoleRef(ref("Role", "alpha-pvbridge")),
		rbacv1ac.Role(capacity, tenantsNamespace).WithRules(rules(tenancy.CapacityRules)...),
		rbacv1ac.RoleBinding(capacity, tenantsNamespace).WithSubjects(subject).WithRoleRef(ref("Role", capacity)),
	} {
		g.Expect(apply(obj)).To(Succeed())
	}

	// Beyond what the controller holds: refused by the apiserver's escalation check. (Within it,
	// a grant passes: the controller may grant a subset of its own rules, no more.)
	pods := rbacv1.PolicyRule{APIGroups: []string{""}, Resources: []string{"pods"}, Verbs: []string{"create"}}
	for name, obj := range map[string]runtime.ApplyConfiguration{
		"a Role with GuestRules and pods create": rbacv1ac.Role("alpha-pvbridge", tenantNS).
			WithRules(rules(append(slices.Clone(tenancy.GuestRules), pods))...),
		"CapacityRules outside the capacity namespace": rbacv1ac.Role(capacity, tenantNS).WithRules(rules(tenancy.CapacityRules)...),
		// Bootstrap ClusterRoles with rules of their own (admin and edit are aggregated by
		// kube-controller-manager, which the test apiserver runs without: empty here).
		"a binding to ClusterRole cluster-admin": rbacv1ac.RoleBinding("alpha-admin", tenantNS).
			WithSubjects(subject).WithRoleRef(ref("ClusterRole", "cluster-admin")),
		"a binding to ClusterRole system:aggregate-to-edit in the capacity namespace": rbacv1ac.RoleBinding("alpha-edit", tenantsNamespace).
			WithSubjects(subject).WithRoleRef(ref("ClusterRole", "system:aggregate-to-edit")),
	} {
		err := apply(obj, client.DryRunAll)
		g.Expect(apierrors.IsForbidden(err)).To(BeTrue(), "%s: %v", name, err)
	}
}

// rules converts policy rules to apply configurations.
func rules(in []rbacv1.PolicyRule) []*rbacv1ac.PolicyRuleApplyConfiguration {
	out := make([]*rbacv1ac.PolicyRuleApplyConfiguration, 0, len(in))
	for _, r := range in {
		out = append(out, rbacv1ac.PolicyRule().WithAPIGroups(r.APIGroups...).WithResources(r.Resources...).WithVerbs(r.Verbs...))
	}
	return out
}
