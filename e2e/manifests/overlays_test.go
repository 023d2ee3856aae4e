package manifests

import (
	"bytes"
	"context"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/kubernetes"
)

// runKubectl runs the pinned kubectl as the admin with stdin and returns its output; an error
// carries its stderr.
func runKubectl(ctx context.Context, stdin []byte, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, kubectl, append([]string{"--kubeconfig=" + adminKubeconfig}, args...)...)
	cmd.Stdin = bytes.NewReader(stdin)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return out, &kubectlError{args: args, err: err, stderr: stderr.String()}
	}
	return out, nil
}

type kubectlError struct {
	args   []string
	err    error
	stderr string
}

func (e *kubectlError) Error() string {
	return "kubectl " + strings.Join(e.args, " ") + ": " + e.err.Error() + ": " + e.stderr
}

// build renders an overlay with `kubectl kustomize` and returns the YAML and its objects.
func build(ctx context.Context, g Gomega, dir string) ([]byte, []*unstructured.Unstructured) {
	out, err := runKubectl(ctx, nil, "kustomize", dir)
	g.Expect(err).NotTo(HaveOccurred())
	var objs []*unstructured.Unstructured
	dec := yaml.NewYAMLOrJSONDecoder(bytes.NewReader(out), 4096)
	for {
		obj := &unstructured.Unstructured{}
		if err := dec.Decode(&obj.Object); err != nil {
			g.Expect(err.Error()).To(Equal("EOF"))
			break
		}
		if len(obj.Object) > 0 {
			objs = append(objs, obj)
		}
	}
	return out, objs
}

// objectKey names an object of an overlay: Kind/name, or Kind/namespace/name when namespaced.
func objectKey(obj *unstructured.Unstructured) string {
	if obj.GetNamespace() == "" {
		return obj.GetKind() + "/" + obj.GetName()
	}
	return obj.GetKind() + "/" + obj.GetNamespace() + "/" + obj.GetName()
}

// TestOverlaysApplyWithServerSideDryRun builds every overlay and applies it with a server-side
// dry run: each object is validated by the real apiserver (schemas, CEL rules of the CRDs, the
// admission policies' expressions) without being stored. The namespaces the objects live in are
// created first, as the dry run of a Namespace stores nothing.
func TestOverlaysApplyWithServerSideDryRun(t *testing.T) {
	tests := []struct {
		overlay string
		// wantKinds are kinds the overlay must contain (at least one object each).
		wantKinds []string
		// wantObjects are objects the overlay must contain, as objectKey makes them.
		wantObjects []string
	}{
		{overlay: "management", wantKinds: []string{
			"Namespace", "CustomResourceDefinition", "CSIDriver", "StorageClass", "VolumeSnapshotClass",
			"Deployment", "DaemonSet", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding",
			"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding",
		}, wantObjects: tenantsObjects},
		{overlay: "guest", wantKinds: []string{
			"Namespace", "CustomResourceDefinition", "CSIDriver", "StorageClass", "VolumeSnapshotClass",
			"Deployment", "DaemonSet", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding",
			"ConfigMap",
		}},
		{overlay: "dev", wantKinds: []string{"Deployment", "DaemonSet", "ValidatingAdmissionPolicy"}, wantObjects: tenantsObjects},
		{overlay: "capi-provider", wantKinds: []string{
			"Namespace", "CustomResourceDefinition", "Deployment", "ServiceAccount", "ClusterRole", "ClusterRoleBinding",
		}, wantObjects: []string{
			"CustomResourceDefinition/pvbridgemachines.infrastructure.cluster.x-k8s.io",
			"Deployment/pvbridge-capi-system/pvbridge-infrastructure-provider",
			"ClusterRole/pvbridge-infrastructure-provider-capi",
		}},
	}
	cs, err := kubernetes.NewForConfig(adminConfig)
	NewWithT(t).Expect(err).NotTo(HaveOccurred())
	for _, tt := range tests {
		t.Run(tt.overlay, func(t *testing.T) {
			g := NewWithT(t)
			ctx := t.Context()
			yamlDoc, objs := build(ctx, g, filepath.Join(manifestsDir, "overlays", tt.overlay))
			kinds := map[string]int{}
			keys := map[string]bool{}
			for _, obj := range objs {
				kinds[obj.GetKind()]++
				keys[objectKey(obj)] = true
				if obj.GetKind() == "Namespace" {
					_, err := cs.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: obj.GetName()}}, metav1.CreateOptions{})
					if !apierrors.IsAlreadyExists(err) {
						g.Expect(err).NotTo(HaveOccurred())
					}
				}
			}
			for _, kind := range tt.wantKinds {
				g.Expect(kinds).To(HaveKey(kind), "overlay %s has no %s", tt.overlay, kind)
			}
			for _, key := range tt.wantObjects {
				g.Expect(keys).To(HaveKey(key), "overlay %s has no %s", tt.overlay, key)
			}

			out, err := runKubectl(ctx, yamlDoc, "apply", "--server-side", "--dry-run=server",
				"--field-manager=pvbridge-manifests-test", "-f", "-")
			g.Expect(err).NotTo(HaveOccurred())
			lines := strings.Split(strings.TrimSpace(string(out)), "\n")
			g.Expect(lines).To(HaveLen(len(objs)), "kubectl applied another number of objects than the overlay holds:\n%s", out)
			for _, line := range lines {
				g.Expect(line).To(HaveSuffix("serverside-applied (server dry run)"))
			}
		})
	}
}
