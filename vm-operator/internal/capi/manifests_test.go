package capi

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"maps"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	. "github.com/onsi/gomega"
	appsv1 "k8s.io/api/apps/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer/json"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/utils/ptr"
	bootstrapv1 "sigs.k8s.io/cluster-api/api/bootstrap/kubeadm/v1beta2"
	controlplanev1 "sigs.k8s.io/cluster-api/api/controlplane/kubeadm/v1beta2"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	"sigs.k8s.io/yaml"

	infrav1 "pvbridge.io/pkg/apis/infrastructure/v1alpha1"
	"pvbridge.io/pkg/tenancy"
)

// clusterctlDir holds the provider's clusterctl files (hack/render-capi-provider.sh).
const clusterctlDir = "../../../manifests/clusterctl"

// documents splits a multi-document YAML file into its objects.
func documents(t *testing.T, file string) []*unstructured.Unstructured {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(clusterctlDir, file))
	if err != nil {
		t.Fatalf("read %s (run make generate): %v", file, err)
	}
	var objs []*unstructured.Unstructured
	r := utilyaml.NewYAMLReader(bufioReader(data))
	for {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			return objs
		}
		if err != nil {
			t.Fatal(err)
		}
		u := &unstructured.Unstructured{}
		if err := yaml.Unmarshal(doc, &u.Object); err != nil {
			t.Fatalf("%s: %v", file, err)
		}
		if len(u.Object) > 0 {
			objs = append(objs, u)
		}
	}
}

// The contract's rules that a CRD carries: namespaced, named <plural>.<group> (Cluster API's
// CalculateCRDName), the label mapping the contract to our version, which metadata.yaml's
// release series implements too, and the fields Cluster API reads.
func TestInfrastructureComponentsFollowTheContract(t *testing.T) {
	g := NewWithT(t)
	crds := map[string]*apiextensionsv1.CustomResourceDefinition{}
	var deployment *appsv1.Deployment
	var aggregated bool
	for _, u := range documents(t, "infrastructure-components.yaml") {
		switch u.GetKind() {
		case "CustomResourceDefinition":
			crd := &apiextensionsv1.CustomResourceDefinition{}
			g.Expect(runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, crd)).To(Succeed())
			crds[crd.Spec.Names.Kind] = crd
		case "Deployment":
			deployment = &appsv1.Deployment{}
			g.Expect(runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, deployment)).To(Succeed())
		case "ClusterRole":
			role := &rbacv1.ClusterRole{}
			g.Expect(runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, role)).To(Succeed())
			aggregated = aggregated || role.Labels["cluster.x-k8s.io/aggregate-to-manager"] == "true"
		}
	}
	g.Expect(crds).To(HaveLen(4))
	g.Expect(aggregated).To(BeTrue(), "Cluster API's controllers may manage the provider's kinds")
	g.Expect(deployment).NotTo(BeNil())
	g.Expect(deployment.Spec.Template.Spec.Containers[0].Args).To(ContainElement("--role=infrastructure-provider"))

	meta := map[string]any{}
	data, err := os.ReadFile(filepath.Join(clusterctlDir, "metadata.yaml"))
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(yaml.Unmarshal(data, &meta)).To(Succeed())
	g.Expect(meta["apiVersion"]).To(Equal("clusterctl.cluster.x-k8s.io/v1alpha3"))
	for _, s := range meta["releaseSeries"].([]any) {
		g.Expect(s.(map[string]any)["contract"]).To(Equal("v1beta2"))
	}

	prop := func(s apiextensionsv1.JSONSchemaProps, path ...string) apiextensionsv1.JSONSchemaProps {
		for _, p := range path {
			if s.Type == "array" {
				s = s.Items.Schema.Properties[p]
				continue
			}
			next, ok := s.Properties[p]
			g.Expect(ok).To(BeTrue(), "field %s of %v", p, path)
			s = next
		}
		return s
	}
	for kind, fields := range map[string]map[string]string{
		"PVBridgeCluster": {
			"spec.controlPlaneEndpoint.host": "string", "spec.controlPlaneEndpoint.port": "integer",
			"status.initialization.provisioned": "boolean", "status.failureDomains": "array",
			"status.failureDomains.name": "string", "status.failureDomains.controlPlane": "boolean",
			"status.conditions": "array",
		},
		"PVBridgeMachine": {
			"spec.providerID": "string", "status.initialization.provisioned": "boolean",
			"status.addresses": "array", "status.addresses.type": "string", "status.addresses.address": "string",
			"status.failureDomain": "string", "status.conditions": "array",
		},
		"PVBridgeMachineTemplate": {"spec.template.spec.className": "string", "spec.template.metadata.labels": "object"},
		"PVBridgeClusterTemplate": {"spec.template.spec.controlPlaneEndpoint.host": "string", "spec.template.metadata.labels": "object"},
	} {
		t.Run(kind, func(t *testing.T) {
			g := NewWithT(t)
			crd := crds[kind]
			g.Expect(crd).NotTo(BeNil())
			g.Expect(crd.Spec.Group).To(Equal(infrav1.GroupVersion.Group))
			g.Expect(crd.Name).To(Equal(crd.Spec.Names.Plural + "." + crd.Spec.Group))
			g.Expect(crd.Spec.Scope).To(Equal(apiextensionsv1.NamespaceScoped))
			g.Expect(crd.Labels).To(HaveKeyWithValue("cluster.x-k8s.io/v1beta2", infrav1.GroupVersion.Version))
			g.Expect(crd.Spec.Versions).To(HaveLen(1))
			g.Expect(crd.Spec.Versions[0].Name).To(Equal(infrav1.GroupVersion.Version))
			g.Expect(crd.Spec.Versions[0].Storage).To(BeTrue())
			schema := *crd.Spec.Versions[0].Schema.OpenAPIV3Schema
			for path, typ := range fields {
				g.Expect(prop(schema, strings.Split(path, ".")...).Type).To(Equal(typ), path)
			}
		})
	}
}

// variable matches clusterctl's ${NAME} and ${NAME:=default}.
var variable = regexp.MustCompile(`\$\{([A-Z_]+)(:=([^}]*))?\}`)

// render substitutes values for the variables of a clusterctl file (each variable without a
// value must have a default, and each value must be used) and decodes its objects strictly
// with Cluster API's own types and the provider's, by kind (the last of a kind wins) and in order.
func render(t *testing.T, file string, values map[string]string) (map[string]runtime.Object, []runtime.Object) {
	t.Helper()
	g := NewWithT(t)
	data, err := os.ReadFile(filepath.Join(clusterctlDir, file))
	g.Expect(err).NotTo(HaveOccurred())
	used := map[string]bool{}
	rendered := variable.ReplaceAllStringFunc(string(data), func(m string) string {
		sub := variable.FindStringSubmatch(m)
		used[sub[1]] = true
		if v, ok := values[sub[1]]; ok {
			return v
		}
		g.Expect(sub[2]).NotTo(BeEmpty(), "%s: variable %s has no value and no default", file, sub[1])
		return sub[3]
	})
	for name := range values {
		g.Expect(used).To(HaveKey(name), "%s uses %s", file, name)
	}

	scheme := runtime.NewScheme()
	for _, add := range []func(*runtime.Scheme) error{clusterv1.AddToScheme, controlplanev1.AddToScheme, bootstrapv1.AddToScheme, infrav1.AddToScheme} {
		g.Expect(add(scheme)).To(Succeed())
	}
	strict := json.NewSerializerWithOptions(json.DefaultMetaFactory, scheme, scheme, json.SerializerOptions{Yaml: true, Strict: true})
	kinds := map[string]runtime.Object{}
	var objs []runtime.Object
	r := utilyaml.NewYAMLReader(bufioReader([]byte(rendered)))
	for {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			return kinds, objs
		}
		g.Expect(err).NotTo(HaveOccurred())
		if len(bytes.TrimSpace(doc)) == 0 || strings.HasPrefix(strings.TrimSpace(string(doc)), "#") && !strings.Contains(string(doc), "kind:") {
			continue
		}
		obj, gvk, err := strict.Decode(doc, nil, nil)
		g.Expect(err).NotTo(HaveOccurred(), "%s: decode %s", file, doc)
		kinds[gvk.Kind] = obj
		objs = append(objs, obj)
	}
}

// clusterValues are the variables clusterctl generate cluster sets for both flavors.
var clusterValues = map[string]string{
	"CLUSTER_NAME": "guest-1", "NAMESPACE": "tenant-a", "KUBERNETES_VERSION": "v1.37.0",
	"CONTROL_PLANE_MACHINE_COUNT": "3", "WORKER_MACHINE_COUNT": "2", "CONTROL_PLANE_ENDPOINT_IP": "10.0.0.10",
}

// The template renders (with the variables clusterctl documents) into objects that Cluster API's
// own types decode strictly, and its Cluster opts in to pvbridge storage.
func TestClusterTemplateRenders(t *testing.T) {
	g := NewWithT(t)
	kinds, _ := render(t, "cluster-template.yaml", clusterValues)
	g.Expect(kinds).To(HaveKey("Cluster"))
	g.Expect(kinds).To(HaveKey("PVBridgeCluster"))
	g.Expect(kinds).To(HaveKey("KubeadmControlPlane"))
	g.Expect(kinds).To(HaveKey("MachineDeployment"))
	g.Expect(kinds).To(HaveKey("PVBridgeMachineTemplate"))
	g.Expect(kinds).To(HaveKey("KubeadmConfigTemplate"))

	cluster := kinds["Cluster"].(*clusterv1.Cluster)
	g.Expect(cluster.Labels).To(HaveKeyWithValue(tenancy.EnabledLabel, "true"))
	g.Expect(cluster.Spec.InfrastructureRef.Kind).To(Equal("PVBridgeCluster"))
	ic := kinds["PVBridgeCluster"].(*infrav1.PVBridgeCluster)
	g.Expect(ic.Spec.ControlPlaneEndpoint).To(Equal(infrav1.APIEndpoint{Host: "10.0.0.10", Port: 6443}))
	kcp := kinds["KubeadmControlPlane"].(*controlplanev1.KubeadmControlPlane)
	g.Expect(kcp.Spec.MachineTemplate.Spec.InfrastructureRef.Kind).To(Equal("PVBridgeMachineTemplate"))
	for _, args := range [][]bootstrapv1.Arg{
		kcp.Spec.KubeadmConfigSpec.InitConfiguration.NodeRegistration.KubeletExtraArgs,
		kcp.Spec.KubeadmConfigSpec.JoinConfiguration.NodeRegistration.KubeletExtraArgs,
		kinds["KubeadmConfigTemplate"].(*bootstrapv1.KubeadmConfigTemplate).Spec.Template.Spec.JoinConfiguration.NodeRegistration.KubeletExtraArgs,
	} {
		g.Expect(args).To(ContainElement(bootstrapv1.Arg{Name: "provider-id", Value: ptr.To("{{ ds.meta_data.provider_id }}")}))
	}
}

// The HA flavor renders as the template does, with 3 control plane machines by default that hold
// the endpoint with keepalived (started before kubeadm, on the endpoint's address and the VRRP
// router ID), and a MachineHealthCheck of the control plane.
func TestHAFlavorRenders(t *testing.T) {
	g := NewWithT(t)
	values := maps.Clone(clusterValues)
	delete(values, "CONTROL_PLANE_MACHINE_COUNT")
	kinds, objs := render(t, "cluster-template-ha.yaml", values)
	kcp := kinds["KubeadmControlPlane"].(*controlplanev1.KubeadmControlPlane)
	g.Expect(kcp.Spec.Replicas).To(HaveValue(BeEquivalentTo(3)))
	spec := kcp.Spec.KubeadmConfigSpec
	files := map[string]string{}
	for _, f := range spec.Files {
		files[f.Path] = f.Content
	}
	g.Expect(files).To(HaveKey("/etc/keepalived/check-apiserver"))
	g.Expect(files).To(HaveKeyWithValue("/etc/keepalived/keepalived.conf", And(
		ContainSubstring("virtual_router_id 51\n"), ContainSubstring("10.0.0.10/32"), ContainSubstring("interface @INTERFACE@"))))
	g.Expect(spec.PreKubeadmCommands).To(ContainElement(ContainSubstring("ip -o route get 10.0.0.10")))
	g.Expect(spec.PreKubeadmCommands[len(spec.PreKubeadmCommands)-1]).To(HavePrefix("keepalived "))
	g.Expect(spec.InitConfiguration.NodeRegistration.KubeletExtraArgs).To(ContainElement(bootstrapv1.Arg{Name: "provider-id", Value: ptr.To("{{ ds.meta_data.provider_id }}")}))

	var checked []string
	for _, o := range objs {
		if mhc, ok := o.(*clusterv1.MachineHealthCheck); ok {
			checked = append(checked, mhc.Name)
			if mhc.Name == "guest-1-control-plane" {
				g.Expect(mhc.Spec.Selector.MatchLabels).To(Equal(map[string]string{clusterv1.MachineControlPlaneLabel: ""}))
			}
		}
	}
	g.Expect(checked).To(ConsistOf("guest-1-md-0", "guest-1-control-plane"))
}

// The topology flavor and its ClusterClass render and decode strictly; the class names only
// templates its file holds, the Cluster sets only variables the class declares, every variable a
// patch reads is declared, and the machines' kubelets get the provider ID as in the template.
func TestClusterClassAndTopologyFlavorRender(t *testing.T) {
	g := NewWithT(t)
	kinds, _ := render(t, "cluster-template-topology.yaml", clusterValues)
	cluster := kinds["Cluster"].(*clusterv1.Cluster)
	g.Expect(cluster.Labels).To(HaveKeyWithValue(tenancy.EnabledLabel, "true"))

	classKinds, objs := render(t, "clusterclass-pvbridge.yaml", map[string]string{"NAMESPACE": "tenant-a"})
	class := classKinds["ClusterClass"].(*clusterv1.ClusterClass)
	g.Expect(cluster.Spec.Topology.ClassRef.Name).To(Equal(class.Name))
	g.Expect(cluster.Spec.Topology.Workers.MachineDeployments).To(HaveLen(1))
	g.Expect(cluster.Spec.Topology.Workers.MachineDeployments[0].Class).To(Equal(class.Spec.Workers.MachineDeployments[0].Class))

	held := map[string]bool{}
	for _, o := range objs {
		m := o.(metav1.Object)
		held[o.GetObjectKind().GroupVersionKind().Kind+"/"+m.GetName()] = true
		g.Expect(m.GetNamespace()).To(Equal("tenant-a"))
	}
	refs := []clusterv1.ClusterClassTemplateReference{
		class.Spec.Infrastructure.TemplateRef, class.Spec.ControlPlane.TemplateRef, class.Spec.ControlPlane.MachineInfrastructure.TemplateRef,
	}
	for _, md := range class.Spec.Workers.MachineDeployments {
		refs = append(refs, md.Bootstrap.TemplateRef, md.Infrastructure.TemplateRef)
	}
	for _, ref := range refs {
		g.Expect(held).To(HaveKey(ref.Kind+"/"+ref.Name), "the class's template %s/%s is in its file", ref.Kind, ref.Name)
	}
	g.Expect(class.Spec.Infrastructure.TemplateRef.Kind).To(Equal("PVBridgeClusterTemplate"))

	declared := map[string]bool{}
	for _, v := range class.Spec.Variables {
		declared[v.Name] = true
	}
	for _, v := range cluster.Spec.Topology.Variables {
		g.Expect(declared).To(HaveKey(v.Name), "the Cluster's variable %s", v.Name)
	}
	read := regexp.MustCompile(`\.([a-zA-Z]+)`)
	for _, p := range class.Spec.Patches {
		for _, d := range p.Definitions {
			for _, jp := range d.JSONPatches {
				g.Expect(jp.ValueFrom).NotTo(BeNil(), "patch %s", p.Name)
				if jp.ValueFrom.Variable != "" {
					g.Expect(declared).To(HaveKey(jp.ValueFrom.Variable), "patch %s", p.Name)
				}
				for _, m := range read.FindAllStringSubmatch(jp.ValueFrom.Template, -1) {
					if m[1] != "builtin" && m[1] != "controlPlane" && m[1] != "machineDeployment" && m[1] != "version" {
						g.Expect(declared).To(HaveKey(m[1]), "patch %s reads .%s", p.Name, m[1])
					}
				}
			}
		}
	}
	kcpt := classKinds["KubeadmControlPlaneTemplate"].(*controlplanev1.KubeadmControlPlaneTemplate)
	for _, args := range [][]bootstrapv1.Arg{
		kcpt.Spec.Template.Spec.KubeadmConfigSpec.InitConfiguration.NodeRegistration.KubeletExtraArgs,
		kcpt.Spec.Template.Spec.KubeadmConfigSpec.JoinConfiguration.NodeRegistration.KubeletExtraArgs,
		classKinds["KubeadmConfigTemplate"].(*bootstrapv1.KubeadmConfigTemplate).Spec.Template.Spec.JoinConfiguration.NodeRegistration.KubeletExtraArgs,
	} {
		g.Expect(args).To(ContainElement(bootstrapv1.Arg{Name: "provider-id", Value: ptr.To("{{ ds.meta_data.provider_id }}")}))
	}
}

func bufioReader(data []byte) *bufio.Reader { return bufio.NewReader(bytes.NewReader(data)) }
