package capi_test

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/dynamic"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pvbridge.io/e2e/deploy"
	"pvbridge.io/e2e/images"
	infrav1 "pvbridge.io/pkg/apis/infrastructure/v1alpha1"
	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
)

// TestClusterctlInstalledTheProvider: the provider the tests used after the upgrade step is the
// release's, as clusterctl installed it from the release's repository (deploy.StartClusterAPI,
// Installed.UpgradeProvider): recorded in clusterctl's inventory at the tree's version, its
// Deployment of two replicas running the release's image with its own RBAC, one of them
// leading; when the leader's pod is deleted the other takes its Lease over.
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

// clusterctlUpgradesTheProvider: the lab installed the previous release's provider (clusterctl
// init from a repository of both releases, deploy.PreviousRelease), which made the guest's
// Machines' VMs; clusterctl upgrade apply moves it to this tree's as docs/upgrade.md says while
// the StatefulSet's pods use their volumes. The new provider takes the old one's objects over:
// it marks the PVBridgeCluster against clusterctl move, which the previous release did not;
// every Machine that ran runs on, its VM not restarted (its uniqueID) and the pods' volumes
// still attached to theirs; the pods were not restarted and read their data back.
func clusterctlUpgradesTheProvider(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	mc := mgmtClient(g)
	ns := in.Options.Guest.Namespace
	ic := &infrav1.PVBridgeCluster{}
	g.Expect(mc.Get(ctx, client.ObjectKey{Namespace: ns, Name: in.Options.Guest.Name}, ic)).To(Succeed())
	g.Expect(ic.Annotations).NotTo(HaveKey(infrav1.BlockMoveAnnotation), "the previous release's provider made it")
	pods, err := in.Guest.Client().CoreV1().Pods("").List(ctx, metav1.ListOptions{LabelSelector: "app=web"})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(pods.Items).To(HaveLen(3))
	vms, running := upgradeState(ctx, g, mc, pods.Items)

	start := time.Now()
	g.Expect(in.UpgradeProvider(ctx, lab)).To(Succeed())
	t.Logf("clusterctl upgrade apply: the provider upgraded, its Deployment available again, in %.0f s", time.Since(start).Seconds())
	g.Eventually(func(g Gomega) {
		g.Expect(mc.Get(ctx, client.ObjectKeyFromObject(ic), ic)).To(Succeed())
		g.Expect(ic.Annotations).To(HaveKey(infrav1.BlockMoveAnnotation))
	}).WithContext(ctx).WithTimeout(2*time.Minute).Should(Succeed(), "the new provider reconciles the old one's PVBridgeCluster")

	vmsAfter, runningAfter := upgradeState(ctx, g, mc, pods.Items)
	for name, vm := range vms {
		g.Expect(vmsAfter).To(HaveKeyWithValue(name, vm), "VirtualMachine %s: not restarted, its pods' volumes attached", name)
	}
	for name, uid := range running {
		g.Expect(runningAfter).To(HaveKeyWithValue(name, uid), "Machine %s runs on", name)
	}
	for _, p := range pods.Items {
		now, err := in.Guest.Client().CoreV1().Pods(p.Namespace).Get(ctx, p.Name, metav1.GetOptions{})
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(now.UID).To(Equal(p.UID))
		g.Expect(now.Status.ContainerStatuses[0].RestartCount).To(BeZero(), "pod %s", p.Name)
	}
	readNamesBack(ctx, g, pods.Items)
}

// upgradeState is what the provider's upgrade must leave as it is: each Running
// VirtualMachine of the guest (its uniqueID, and the volumes attached to it if one of pods
// runs on it) and the UID of each Running Machine, by name.
func upgradeState(ctx context.Context, g Gomega, mc client.Client, pods []corev1.Pod) (vms, running map[string]string) {
	list := &vmv1.VirtualMachineList{}
	g.Expect(mc.List(ctx, list, client.InNamespace(in.Options.Guest.Namespace))).To(Succeed())
	vms = map[string]string{}
	for _, vm := range list.Items {
		if vm.Status.Phase != vmv1.PhaseRunning {
			continue
		}
		state := "uniqueID " + vm.Status.UniqueID
		if slices.ContainsFunc(pods, func(p corev1.Pod) bool { return p.Spec.NodeName == vm.Name }) {
			for _, v := range vm.Status.Volumes {
				state += fmt.Sprintf(", %s attached: %t", v.Name, v.Attached)
			}
		}
		vms[vm.Name] = state
	}
	running = map[string]string{}
	for _, m := range machines(ctx, g, mc, "") {
		if phase, _, _ := unstructured.NestedString(m.Object, "status", "phase"); phase == "Running" {
			running[m.GetName()] = string(m.GetUID())
		}
	}
	return vms, running
}
