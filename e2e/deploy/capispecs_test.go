package deploy

import (
	"testing"

	. "github.com/onsi/gomega"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"pvbridge.io/pkg/tenancy"
)

// The lab's flavor keeps clusterctl's variables for clusterctl: once rendered, a number's
// variable is a number and a default applies, and the objects are LabCluster's, on the hosts.
func TestLabFlavorRendersAsTheLabsGuests(t *testing.T) {
	g := NewWithT(t)
	objs := renderedLabFlavor(g, "cluster-template.yaml", []string{"host-a", "host-b"}, nil, clusterVars("2"))
	byKind := map[string]*unstructured.Unstructured{}
	for _, o := range objs {
		g.Expect(o.GetNamespace()).To(Equal("ns"), "%s %s", o.GetKind(), o.GetName())
		byKind[o.GetKind()] = o
	}
	field := func(kind string, path ...string) any {
		g.Expect(byKind).To(HaveKey(kind))
		v, found, err := unstructured.NestedFieldNoCopy(byKind[kind].Object, path...)
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(found).To(BeTrue(), "%s %v", kind, path)
		return v
	}
	g.Expect(field("KubeadmControlPlane", "spec", "replicas")).To(BeEquivalentTo(1))
	g.Expect(field("KubeadmControlPlane", "spec", "kubeadmConfigSpec", "clusterConfiguration", "etcd", "local", "imageTag")).To(Equal("3.6.4-0"))
	g.Expect(field("KubeadmControlPlane", "spec", "kubeadmConfigSpec", "clusterConfiguration", "etcd", "local", "extraArgs")).To(ContainElement(map[string]any{"name": "unsafe-no-fsync", "value": "true"}))
	g.Expect(field("KubeadmControlPlane", "spec", "kubeadmConfigSpec", "initConfiguration", "nodeRegistration", "name")).To(Equal("{{ ds.meta_data.local_hostname }}"))
	g.Expect(field("MachineDeployment", "spec", "replicas")).To(BeEquivalentTo(2))
	g.Expect(field("MachineDeployment", "spec", "template", "spec", "failureDomain")).To(Equal("host-a"))
	g.Expect(field("MachineHealthCheck", "spec", "remediation", "triggerIf", "unhealthyLessThanOrEqualTo")).To(BeEquivalentTo(1))
	g.Expect(field("PVBridgeCluster", "spec", "controlPlaneEndpoint", "host")).To(Equal("10.251.3.1"))
	g.Expect(field("PVBridgeCluster", "spec", "failureDomains")).To(Equal([]any{map[string]any{"name": "host-a"}, map[string]any{"name": "host-b"}}))
	g.Expect(field("PVBridgeMachineTemplate", "spec", "template", "spec", "image")).To(Equal("node-v1.37.2"))
	g.Expect(field("Cluster", "spec", "clusterNetwork", "pods", "cidrBlocks")).To(Equal([]any{LabGuestPods}))
	g.Expect(byKind["Cluster"].GetLabels()).NotTo(HaveKey(tenancy.EnabledLabel))
}

// The lab's ClusterClass flavor runs on the hosts (the class's variable), its pool on the first,
// and the lab's ClusterClass is LabCluster's.
func TestLabTopologyFlavorRunsOnTheHosts(t *testing.T) {
	g := NewWithT(t)
	objs := renderedLabFlavor(g, "cluster-template-topology.yaml", []string{"host-a", "host-b"}, nil, clusterVars("2"))
	g.Expect(objs).To(HaveLen(1))
	topology := objs[0].Object["spec"].(map[string]any)["topology"].(map[string]any)
	g.Expect(topology["variables"]).To(ContainElement(map[string]any{"name": "hosts", "value": []any{"host-a", "host-b"}}))
	g.Expect(topology["workers"]).To(HaveKeyWithValue("machineDeployments", ConsistOf(HaveKeyWithValue("failureDomain", "host-a"))))
	g.Expect(topology["controlPlane"]).To(HaveKeyWithValue("replicas", BeEquivalentTo(1)))

	objs = renderedLabFlavor(g, "clusterclass-pvbridge.yaml", []string{"host-a", "host-b"}, nil, map[string]string{"NAMESPACE": "ns"})
	g.Expect(objs).To(ContainElement(WithTransform(func(o *unstructured.Unstructured) any {
		tag, _, _ := unstructured.NestedString(o.Object, "spec", "template", "spec", "kubeadmConfigSpec", "clusterConfiguration", "etcd", "local", "imageTag")
		return o.GetKind() + " " + tag
	}, Equal("KubeadmControlPlaneTemplate 3.6.4-0"))))
}

// The remediation flavor's MachineHealthCheck looks first at the condition Cluster API's spec
// sets on a Node, and still at the Node's readiness.
func TestLabRemediationFlavorWatchesTheSpecsCondition(t *testing.T) {
	g := NewWithT(t)
	objs := renderedLabFlavor(g, "cluster-template.yaml", []string{"host-a"}, remediatedOnCondition, clusterVars("1"))
	var conditions []any
	for _, o := range objs {
		if o.GetKind() == "MachineHealthCheck" {
			conditions, _, _ = unstructured.NestedSlice(o.Object, "spec", "checks", "unhealthyNodeConditions")
		}
	}
	g.Expect(conditions).To(HaveLen(3))
	g.Expect(conditions[0]).To(And(HaveKeyWithValue("type", RemediationCondition), HaveKeyWithValue("status", "False"), HaveKeyWithValue("timeoutSeconds", BeEquivalentTo(10))))
	g.Expect(conditions[1]).To(HaveKeyWithValue("type", "Ready"))
}

// renderedLabFlavor is the objects of file's lab flavor (labFlavor of etcd 3.6.4-0 on hosts,
// with edit) rendered with vars.
func renderedLabFlavor(g Gomega, file string, hosts []string, edit func(*unstructured.Unstructured) error, vars map[string]string) []*unstructured.Unstructured {
	flavor, err := labFlavor("../..", file, "3.6.4-0", hosts, edit)
	g.Expect(err).NotTo(HaveOccurred())
	objs, err := renderTemplate(file, flavor, vars)
	g.Expect(err).NotTo(HaveOccurred())
	return objs
}

// clusterVars are clusterctl's variables of a cluster qs of namespace ns, workers workers.
func clusterVars(workers string) map[string]string {
	return map[string]string{
		"CLUSTER_NAME": "qs", "NAMESPACE": "ns", "KUBERNETES_VERSION": "v1.37.2",
		"CONTROL_PLANE_MACHINE_COUNT": "1", "WORKER_MACHINE_COUNT": workers, "CONTROL_PLANE_ENDPOINT_IP": "10.251.3.1",
	}
}

// The taints flavor's control plane and workers have the two taints of Cluster API's rollout spec.
func TestLabTaintsFlavorTaintsEveryMachine(t *testing.T) {
	g := NewWithT(t)
	objs := renderedLabFlavor(g, "cluster-template.yaml", []string{"host-a"}, withMachineTaints, clusterVars("1"))
	paths := map[string][]string{"KubeadmControlPlane": {"spec", "machineTemplate", "spec", "taints"}, "MachineDeployment": {"spec", "template", "spec", "taints"}}
	for _, o := range objs {
		if path, ok := paths[o.GetKind()]; ok {
			taints, _, _ := unstructured.NestedSlice(o.Object, path...)
			g.Expect(taints).To(ConsistOf(HaveKeyWithValue("propagation", "Always"), HaveKeyWithValue("propagation", "OnInitialization")), o.GetKind())
			delete(paths, o.GetKind())
		}
	}
	g.Expect(paths).To(BeEmpty())
}

// The HA flavor's control plane machines hold the endpoint with keepalived, and its lab flavor
// keeps clusterctl's variables for them.
func TestLabHAFlavorKeepsTheEndpoint(t *testing.T) {
	g := NewWithT(t)
	vars := clusterVars("1")
	vars["CONTROL_PLANE_MACHINE_COUNT"] = "3"
	objs := renderedLabFlavor(g, "cluster-template-ha.yaml", []string{"host-a", "host-b"}, nil, vars)
	for _, o := range objs {
		if o.GetKind() != "KubeadmControlPlane" {
			continue
		}
		replicas, _, _ := unstructured.NestedFieldNoCopy(o.Object, "spec", "replicas")
		g.Expect(replicas).To(BeEquivalentTo(3))
		files, _, _ := unstructured.NestedSlice(o.Object, "spec", "kubeadmConfigSpec", "files")
		g.Expect(files).To(ContainElement(And(
			HaveKeyWithValue("path", "/etc/keepalived/keepalived.conf"),
			HaveKeyWithValue("content", And(ContainSubstring("10.251.3.1/32"), ContainSubstring("virtual_router_id 51"))))))
		return
	}
	t.Fatal("no KubeadmControlPlane")
}
