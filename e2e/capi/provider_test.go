package capi_test

import (
	"testing"

	. "github.com/onsi/gomega"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/dynamic"

	"pvbridge.io/e2e/deploy"
	"pvbridge.io/e2e/images"
)

// TestClusterctlInstalledTheProvider: the provider every other test used is the release's, as
// clusterctl init installed it from the release's repository (deploy.StartClusterAPI):
// recorded in clusterctl's inventory at the tree's version, its Deployment of two replicas
// running the release's image with its own RBAC, one of them leading; when the leader's pod is
// deleted the other takes its Lease over.
func TestClusterctlInstalledTheProvider(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	const ns = "pvbridge-capi-system"
	version, err := images.Version(lab.Binaries().Repo)
	g.Expect(err).NotTo(HaveOccurred())

	dyn, err := dynamic.NewForConfig(in.Mgmt.RESTConfig())
	g.Expect(err).NotTo(HaveOccurred())
	providers := deploy.ProviderGVR
	p, err := dyn.Resource(providers).Namespace(ns).Get(ctx, "infrastructure-pvbridge", metav1.GetOptions{})
	g.Expect(err).NotTo(HaveOccurred(), "clusterctl's inventory has the provider")
	for field, want := range map[string]string{"providerName": "pvbridge", "type": "InfrastructureProvider", "version": version} {
		got, _, _ := unstructured.NestedString(p.Object, field)
		g.Expect(got).To(Equal(want), field)
	}

	mc := in.Mgmt.Client()
	d, err := mc.AppsV1().Deployments(ns).Get(ctx, "pvbridge-infrastructure-provider", metav1.GetOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(d.Status.AvailableReplicas).To(BeEquivalentTo(2))
	g.Expect(d.Spec.Template.Spec.Containers[0].Image).To(Equal("ghcr.io/pvbridge/vm-operator:" + version))
	g.Expect(d.Spec.Template.Spec.ServiceAccountName).NotTo(BeEmpty())

	leader, err := deploy.DeleteLeader(ctx, mc, ns, "pvbridge-infrastructure-provider", "app.kubernetes.io/name=vm-operator,app.kubernetes.io/component=infrastructure-provider")
	g.Expect(err).NotTo(HaveOccurred())
	t.Logf("the leader %s deleted, the other replica took the Lease over", leader)
}
