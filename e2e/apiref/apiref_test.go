package apiref

import (
	"strings"
	"testing"

	. "github.com/onsi/gomega"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	"k8s.io/utils/ptr"
)

func TestRenderSaysWhatTheAPIServerChecks(t *testing.T) {
	str := func(desc string) apiextensionsv1.JSONSchemaProps {
		return apiextensionsv1.JSONSchemaProps{Type: "string", Description: desc}
	}
	node := str("node is\nthe host.")
	node.MinLength, node.MaxLength = ptr.To[int64](1), ptr.To[int64](253)
	node.XValidations = apiextensionsv1.ValidationRules{{Rule: "self == oldSelf", Message: "node is immutable"}}
	mode := str("mode of | the volume.")
	mode.Enum = []apiextensionsv1.JSON{{Raw: []byte(`"fsdax"`)}, {Raw: []byte(`"lvm"`)}}
	mode.Default = &apiextensionsv1.JSON{Raw: []byte(`"fsdax"`)}
	crd := apiextensionsv1.CustomResourceDefinition{Spec: apiextensionsv1.CustomResourceDefinitionSpec{
		Group: "pmem.pvbridge.io", Scope: apiextensionsv1.ClusterScoped,
		Names: apiextensionsv1.CustomResourceDefinitionNames{Kind: "PmemThing", Plural: "pmemthings", ShortNames: []string{"pt"}},
		Versions: []apiextensionsv1.CustomResourceDefinitionVersion{{
			Name: "v1alpha1", Served: true, Storage: true,
			AdditionalPrinterColumns: []apiextensionsv1.CustomResourceColumnDefinition{{Name: "Node", JSONPath: ".spec.node"}, {Name: "Mode", JSONPath: ".spec.mode", Priority: 1}},
			Schema: &apiextensionsv1.CustomResourceValidation{OpenAPIV3Schema: &apiextensionsv1.JSONSchemaProps{
				Type: "object", Description: "PmemThing is a thing.",
				Properties: map[string]apiextensionsv1.JSONSchemaProps{
					"apiVersion": str("ignored"), "kind": str("ignored"), "metadata": {Type: "object"},
					"spec": {Type: "object", Required: []string{"node"}, Properties: map[string]apiextensionsv1.JSONSchemaProps{
						"node":   node,
						"mode":   mode,
						"labels": {Type: "object", AdditionalProperties: &apiextensionsv1.JSONSchemaPropsOrBool{Schema: &apiextensionsv1.JSONSchemaProps{Type: "string"}}},
						"replicas": {Type: "array", MaxItems: ptr.To[int64](3), XListType: ptr.To("map"), XListMapKeys: []string{"name"},
							Items: &apiextensionsv1.JSONSchemaPropsOrArray{Schema: &apiextensionsv1.JSONSchemaProps{
								Type: "object", Required: []string{"name"}, Properties: map[string]apiextensionsv1.JSONSchemaProps{"name": str("name of the replica.")}}}},
					}},
				},
			}},
		}},
	}}
	g := NewWithT(t)
	var b strings.Builder
	g.Expect(Render(&b, []*apiextensionsv1.CustomResourceDefinition{&crd})).To(Succeed())
	out := b.String()
	for _, want := range []string{
		"  - [PmemThing](#pmemthing-v1alpha1) (v1alpha1)\n",
		"## PmemThing v1alpha1\n",
		"`apiVersion: pmem.pvbridge.io/v1alpha1`, cluster-scoped; `kubectl get pmemthings`, `pt`.\n",
		"`kubectl get` columns: Node (`.spec.node`), Mode (`.spec.mode`) with `-o wide`.\n",
		"| `spec.labels` | map of string |  |\n",
		"| `spec.mode` | string | mode of \\| the volume. One of `\"fsdax\"`, `\"lvm\"`; default `\"fsdax\"`. |\n",
		"| `spec.node` | string, required | node is the host. At least 1 character; at most 253 characters; node is immutable (`self == oldSelf`). |\n",
		"| `spec.replicas` | object array | At most 3 items; a map list keyed by name. |\n",
		"| `spec.replicas[].name` | string, required | name of the replica. |\n",
	} {
		g.Expect(out).To(ContainSubstring(want))
	}
	g.Expect(out).NotTo(ContainSubstring("ignored"), "apiVersion, kind and metadata are every object's")
}

func TestLoadReadsTheShippedCRDs(t *testing.T) {
	g := NewWithT(t)
	crds, err := Load("../../manifests/crd/bases", "../../manifests/crd/infrastructure")
	g.Expect(err).NotTo(HaveOccurred())
	var kinds []string
	for _, c := range crds {
		kinds = append(kinds, c.Spec.Names.Kind)
	}
	g.Expect(kinds).To(ContainElements("PmemVolume", "VirtualMachine", "PVBridgeMachine"))
	for i := 1; i < len(crds); i++ {
		prev, cur := crds[i-1].Spec, crds[i].Spec
		g.Expect(prev.Group+"/"+prev.Names.Kind < cur.Group+"/"+cur.Names.Kind).To(BeTrue())
	}
}
