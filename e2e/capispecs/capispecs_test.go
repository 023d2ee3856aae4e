// Package capispecs runs Cluster API's own provider end-to-end specs (sigs.k8s.io/cluster-api/test,
// the suite CAPD, CAPV and CAPZ run) against pvbridge's running Cluster API lab: its management
// cluster as the specs' bootstrap cluster, whose Cluster API and pvbridge provider the lab has
// installed (the specs' clusterctl init is not run), and its clusterctl repository, which has
// the lab's flavors (the shipped cluster templates and ClusterClass adapted to the lab's VMs, as
// e2e/capi's guests are). e2e/capi's step ClusterAPISpecs writes the configuration and runs this binary; it is
// not run on its own.
package capispecs_test

import (
	"context"
	"flag"
	"slices"
	"testing"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"
	controlplanev1 "sigs.k8s.io/cluster-api/api/controlplane/kubeadm/v1beta2"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	"sigs.k8s.io/cluster-api/test/e2e"
	"sigs.k8s.io/cluster-api/test/framework"
	"sigs.k8s.io/cluster-api/test/framework/clusterctl"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
)

var (
	configPath       = flag.String("e2e.config", "", "Cluster API's e2e configuration of the lab: providers, variables, intervals")
	clusterctlConfig = flag.String("e2e.clusterctl-config", "", "clusterctl's configuration of the lab's repository")
	kubeconfig       = flag.String("e2e.kubeconfig", "", "the management cluster's kubeconfig")
	artifactFolder   = flag.String("e2e.artifacts-folder", "", "where the specs write what they dump")
)

var (
	ctx       = context.Background()
	e2eConfig *clusterctl.E2EConfig
	proxy     framework.ClusterProxy
)

// The clusterctl flavors of the lab's guests (e2e/deploy.LabFlavor, TopologyLabFlavor,
// RemediationLabFlavor, TaintsLabFlavor): the cluster template's, the ClusterClass's, and the
// cluster template's whose MachineHealthCheck watches the Node condition
// MachineDeploymentRemediationSpec sets, or whose machines have the taints
// KCPAndMachineDeploymentRolloutSpec expects.
const (
	lab            = "lab"
	topologyLab    = "topology-lab"
	remediationLab = "md-remediation-lab"
	taintsLab      = "kcp-md-taints-lab"
	haLab          = "ha-lab"
)

func TestClusterAPISpecs(t *testing.T) {
	ctrl.SetLogger(klog.Background())
	RegisterFailHandler(Fail)
	RunSpecs(t, "Cluster API's provider specs on pvbridge")
}

var _ = BeforeSuite(func() {
	for name, path := range map[string]string{"e2e.config": *configPath, "e2e.clusterctl-config": *clusterctlConfig, "e2e.kubeconfig": *kubeconfig} {
		Expect(path).To(BeAnExistingFile(), "-%s", name)
	}
	Expect(*artifactFolder).NotTo(BeEmpty(), "-e2e.artifacts-folder")
	e2eConfig = clusterctl.LoadE2EConfig(ctx, clusterctl.LoadE2EConfigInput{ConfigPath: *configPath})
	scheme := runtime.NewScheme()
	framework.TryAddDefaultSchemes(scheme)
	proxy = framework.NewClusterProxy(e2eConfig.ManagementClusterName, *kubeconfig, scheme)
})

var _ = AfterSuite(func() {
	if proxy != nil {
		proxy.Dispose(ctx)
	}
})

var _ = Describe("QuickStart", Label("ci"), func() {
	e2e.QuickStartSpec(ctx, func() e2e.QuickStartSpecInput {
		return e2e.QuickStartSpecInput{
			E2EConfig: e2eConfig, ClusterctlConfigPath: *clusterctlConfig, BootstrapClusterProxy: proxy,
			ArtifactFolder: *artifactFolder, Flavor: ptr.To(lab),
		}
	})
})

var _ = Describe("QuickStart with ClusterClass", Label("ClusterClass"), func() {
	e2e.QuickStartSpec(ctx, func() e2e.QuickStartSpecInput {
		return e2e.QuickStartSpecInput{
			E2EConfig: e2eConfig, ClusterctlConfigPath: *clusterctlConfig, BootstrapClusterProxy: proxy,
			ArtifactFolder: *artifactFolder, Flavor: ptr.To(topologyLab),
		}
	})
})

// The HA flavor: 3 control plane machines holding the endpoint with keepalived, whose first (the
// one kubeadm init made, which took the endpoint's address first) is then deleted.
var _ = Describe("QuickStart with an HA control plane", Label("ha"), func() {
	e2e.QuickStartSpec(ctx, func() e2e.QuickStartSpecInput {
		return e2e.QuickStartSpecInput{
			E2EConfig: e2eConfig, ClusterctlConfigPath: *clusterctlConfig, BootstrapClusterProxy: proxy,
			ArtifactFolder: *artifactFolder, Flavor: ptr.To(haLab),
			ControlPlaneMachineCount: ptr.To[int64](3), WorkerMachineCount: ptr.To[int64](1),
			PostMachinesProvisioned: theEndpointOutlivesTheFirstMachine,
		}
	})
})

var _ = Describe("MachineDeploymentScale", func() {
	e2e.MachineDeploymentScaleSpec(ctx, func() e2e.MachineDeploymentScaleSpecInput {
		return e2e.MachineDeploymentScaleSpecInput{
			E2EConfig: e2eConfig, ClusterctlConfigPath: *clusterctlConfig, BootstrapClusterProxy: proxy,
			ArtifactFolder: *artifactFolder, Flavor: lab,
		}
	})
})

var _ = Describe("MachineDeploymentRemediation", func() {
	e2e.MachineDeploymentRemediationSpec(ctx, func() e2e.MachineDeploymentRemediationSpecInput {
		return e2e.MachineDeploymentRemediationSpecInput{
			E2EConfig: e2eConfig, ClusterctlConfigPath: *clusterctlConfig, BootstrapClusterProxy: proxy,
			ArtifactFolder: *artifactFolder, Flavor: ptr.To(remediationLab),
		}
	})
})

var _ = Describe("KCPAndMachineDeploymentRollout", Label("rollout"), func() {
	e2e.KCPAndMachineDeploymentRolloutSpec(ctx, func() e2e.KCPAndMachineDeploymentRolloutSpecInput {
		return e2e.KCPAndMachineDeploymentRolloutSpecInput{
			E2EConfig: e2eConfig, ClusterctlConfigPath: *clusterctlConfig, BootstrapClusterProxy: proxy,
			ArtifactFolder: *artifactFolder, Flavor: taintsLab,
		}
	})
})

// ClusterDeletion: the phases of Cluster API's own (the workers, then the control plane), then
// the PVBridgeCluster, which its finalizer holds until every VirtualMachine of the cluster is gone.
var _ = Describe("ClusterDeletion", func() {
	e2e.ClusterDeletionSpec(ctx, func() e2e.ClusterDeletionSpecInput {
		return e2e.ClusterDeletionSpecInput{
			E2EConfig: e2eConfig, ClusterctlConfigPath: *clusterctlConfig, BootstrapClusterProxy: proxy,
			ArtifactFolder: *artifactFolder, Flavor: ptr.To(lab),
			ClusterDeletionPhases: []e2e.ClusterDeletionPhase{
				deletionPhase("Machine", "MachineDeployment", "MachineSet"),
				deletionPhase("Machine", "KubeadmControlPlane"),
				{
					ObjectFilter:         kind("PVBridgeCluster"),
					BlockingObjectFilter: kind("PVBridgeCluster"),
				},
			},
		}
	})
})

// deletionPhase is the phase in which the Machines owned by one of owners and the owners go,
// the Machines blocking it.
func deletionPhase(machine string, owners ...string) e2e.ClusterDeletionPhase {
	return e2e.ClusterDeletionPhase{
		ObjectFilter: func(ref corev1.ObjectReference, ownerRefs []metav1.OwnerReference) bool {
			for _, o := range owners {
				if ref.Kind == o {
					return true
				}
				for _, or := range ownerRefs {
					if ref.Kind == machine && or.Kind == o {
						return true
					}
				}
			}
			return false
		},
		BlockingObjectFilter: kind(machine),
	}
}

// kind is the filter of the objects of kind k.
func kind(k string) func(corev1.ObjectReference, []metav1.OwnerReference) bool {
	return func(ref corev1.ObjectReference, _ []metav1.OwnerReference) bool { return ref.Kind == k }
}

// theEndpointOutlivesTheFirstMachine deletes the cluster's oldest control plane machine and
// checks that the cluster's API server answers at its endpoint once that machine is gone, before
// KubeadmControlPlane's replacement joins, and that the replacement joins through it.
func theEndpointOutlivesTheFirstMachine(mgmt framework.ClusterProxy, namespace, name string) {
	mc := mgmt.GetClient()
	workload := mgmt.GetWorkloadCluster(ctx, namespace, name).GetClient()
	machines := &clusterv1.MachineList{}
	Expect(mc.List(ctx, machines, client.InNamespace(namespace), client.MatchingLabels{clusterv1.ClusterNameLabel: name}, client.HasLabels{clusterv1.MachineControlPlaneLabel})).To(Succeed())
	Expect(machines.Items).To(HaveLen(3))
	first := slices.MinFunc(machines.Items, func(a, b clusterv1.Machine) int {
		return a.CreationTimestamp.Compare(b.CreationTimestamp.Time)
	})
	By("deleting the first control plane machine, " + first.Name)
	Expect(mc.Delete(ctx, &first)).To(Succeed())
	Eventually(func() bool {
		err := mc.Get(ctx, client.ObjectKeyFromObject(&first), &clusterv1.Machine{})
		return apierrors.IsNotFound(err)
	}, "10m", "2s").Should(BeTrue(), "Machine %s is deleted", first.Name)

	By("the endpoint answers without it")
	Eventually(func() error {
		return workload.List(ctx, &corev1.NodeList{})
	}, "2m", "1s").Should(Succeed())

	By("its replacement joins through the endpoint")
	Eventually(func(g Gomega) {
		kcp := &controlplanev1.KubeadmControlPlaneList{}
		g.Expect(mc.List(ctx, kcp, client.InNamespace(namespace), client.MatchingLabels{clusterv1.ClusterNameLabel: name})).To(Succeed())
		g.Expect(kcp.Items).To(HaveLen(1))
		g.Expect(kcp.Items[0].Status.ReadyReplicas).To(HaveValue(BeEquivalentTo(3)))
		nodes := &corev1.NodeList{}
		g.Expect(workload.List(ctx, nodes, client.HasLabels{"node-role.kubernetes.io/control-plane"})).To(Succeed())
		g.Expect(nodes.Items).To(HaveLen(3))
		g.Expect(nodes.Items).NotTo(ContainElement(HaveField("Name", first.Status.NodeRef.Name)))
	}, "20m", "5s").Should(Succeed())
}
