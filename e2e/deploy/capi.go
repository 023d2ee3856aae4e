package deploy

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/util/cert"
	"k8s.io/utils/ptr"

	"pvbridge.io/e2e/cluster"
	"pvbridge.io/e2e/images"
)

// ClusterAPI is Cluster API running in the management cluster of a lab, installed as a real
// install has it: its core manager and kubeadm bootstrap and control plane providers (the
// pinned release, hack/build-tools.sh cluster-api) as processes, their CRDs from the release's
// module with the contract labels its kustomizations add, their mutating, validating and
// conversion webhooks served on 127.0.0.1 with a CA made here (URLs instead of Services), and
// pvbridge's infrastructure provider as shipped, installed by clusterctl init (its Deployment,
// in containers, with its RBAC: clusterctlInit). The managers use the lab's admin credentials;
// Cluster API's own RBAC is not installed.
type ClusterAPI struct {
	Managers map[string]*cluster.Process
	// dir is clusterctl's: its configuration and repository (clusterctlInit).
	dir string
}

// capiManagers are Cluster API's managers: binary, directory of the release's module (CRDs and
// webhooks), clusterctl's name of the provider, contract labels of its CRDs, extra arguments (the
// ClusterTopology gate, for ClusterClasses, on the two managers that have it, as clusterctl init
// with CLUSTER_TOPOLOGY=true sets it).
var capiManagers = []struct {
	name, binary, path, provider string
	labels                       map[string]string
	args                         []string
	// providerName, providerType, namespace and components (the file of a release's
	// repository) are clusterctl's.
	providerName, providerType, namespace, components string
}{
	{"core", "capi-manager", "core", "cluster-api", nil, []string{featureGates}, "cluster-api", "CoreProvider", "capi-system", "core-components.yaml"},
	{"bootstrap", "capi-kubeadm-bootstrap-manager", "bootstrap/kubeadm", "bootstrap-kubeadm", map[string]string{"cluster.x-k8s.io/v1beta1": "v1beta1", "cluster.x-k8s.io/v1beta2": "v1beta2"}, nil,
		"kubeadm", "BootstrapProvider", "capi-kubeadm-bootstrap-system", "bootstrap-components.yaml"},
	{"controlplane", "capi-kubeadm-control-plane-manager", "controlplane/kubeadm", "control-plane-kubeadm", map[string]string{"cluster.x-k8s.io/v1beta1": "v1beta1", "cluster.x-k8s.io/v1beta2": "v1beta2"}, []string{featureGates},
		"kubeadm", "ControlPlaneProvider", "capi-kubeadm-control-plane-system", "control-plane-components.yaml"},
}

// clusterctlLabels are the labels clusterctl init puts on the objects of provider: clusterctl
// move finds the kinds it moves by them.
func clusterctlLabels(provider string) map[string]string {
	return map[string]string{"clusterctl.cluster.x-k8s.io": "", "cluster.x-k8s.io/provider": provider}
}

// featureGates are the Cluster API feature gates the lab turns on in the core and control plane
// managers, which have them: ClusterTopology (ClusterClass), and MachineTaintPropagation, whose
// machine taints Cluster API's KCPAndMachineDeploymentRolloutSpec sets (its own e2e runs turn it
// on too).
const featureGates = "--feature-gates=ClusterTopology=true,MachineTaintPropagation=true"

// StartClusterAPI installs and starts Cluster API and pvbridge's provider in the management
// cluster mgmt: the lab's provider, or previous's when it is not nil.
func StartClusterAPI(ctx context.Context, lab *cluster.Lab, mgmt *cluster.ControlPlane, previous *Release) (*ClusterAPI, error) {
	dir := filepath.Join(mgmt.Dir, "cluster-api")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	module, err := capiModule(ctx, lab.Binaries().Repo)
	if err != nil {
		return nil, err
	}
	certPEM, keyPEM, err := cert.GenerateSelfSignedCertKey("127.0.0.1", []net.IP{net.IPv4(127, 0, 0, 1)}, nil)
	if err != nil {
		return nil, err
	}
	for name, data := range map[string][]byte{"tls.crt": certPEM, "tls.key": keyPEM} {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o600); err != nil {
			return nil, err
		}
	}
	dyn, err := dynamic.NewForConfig(mgmt.RESTConfig())
	if err != nil {
		return nil, err
	}
	c := &ClusterAPI{Managers: map[string]*cluster.Process{}, dir: dir}
	var health []string
	for _, mgr := range capiManagers {
		ports, err := cluster.FreePorts(3)
		if err != nil {
			return nil, err
		}
		url := fmt.Sprintf("https://127.0.0.1:%d", ports[0])
		labels := clusterctlLabels(mgr.provider)
		maps.Copy(labels, mgr.labels)
		if err := installCAPIObjects(ctx, dyn, filepath.Join(module.Dir, mgr.path), mgr.name, url, certPEM, labels); err != nil {
			return nil, fmt.Errorf("cluster api %s: %w", mgr.name, err)
		}
		bin, err := lab.Binaries().Tool(mgr.binary)
		if err != nil {
			return nil, fmt.Errorf("%w (hack/build-tools.sh cluster-api builds it)", err)
		}
		if c.Managers[mgr.name], err = lab.Start(cluster.Command{
			Name: mgmt.Name + "/capi-" + mgr.name, Bin: bin, Dir: dir,
			LogPath: filepath.Join(mgmt.Dir, "logs", "capi-"+mgr.name+".log"),
			Args: append([]string{
				"--kubeconfig=" + mgmt.Kubeconfig, "--webhook-cert-dir=" + dir,
				fmt.Sprintf("--webhook-port=%d", ports[0]),
				fmt.Sprintf("--health-addr=127.0.0.1:%d", ports[1]),
				fmt.Sprintf("--diagnostics-address=127.0.0.1:%d", ports[2]), "--insecure-diagnostics",
				"--v=2",
			}, mgr.args...),
			Restart: true,
		}); err != nil {
			return nil, err
		}
		health = append(health, fmt.Sprintf("http://127.0.0.1:%d/readyz", ports[1]))
	}
	if err := cluster.WaitHTTPReady(ctx, 2*time.Minute, health...); err != nil {
		return nil, err
	}
	return c, c.clusterctlInit(ctx, lab, mgmt, dyn, module, previous)
}

// ProviderGVR is clusterctl's inventory: its Provider objects.
var ProviderGVR = schema.GroupVersionResource{Group: "clusterctl.cluster.x-k8s.io", Version: "v1alpha3", Resource: "providers"}

// certManagerVersion is the cert-manager clusterctl v1.14.2 installs (its
// CertManagerDefaultVersion).
const certManagerVersion = "v1.21.1"

// clusterctlInit installs pvbridge's provider as an admin does (docs/deployment.md): clusterctl
// init --infrastructure pvbridge from the release's clusterctl repository (hack/release.sh
// clusterctl), waiting until its Deployment is available. With previous, the repository has
// that release too (its manifests/clusterctl, as its own release wrote them), and init installs
// it; UpgradeProvider then moves it to the lab's. Before that, the lab gives clusterctl what its
// own init of Cluster API would have left:
//   - its inventory: a Provider object for each manager the lab runs as a process, of the
//     module's version, in the namespace clusterctl would have installed it in;
//   - each manager's provider in a local repository of the module's, holding its metadata.yaml
//     (the contract; clusterctl reads it, and upgrade reads it of every provider installed);
//   - cert-manager's API: clusterctl refuses to install a provider until it can create an Issuer
//     and a Certificate. The lab installs the CRDs of the cert-manager release clusterctl would
//     install (from the Go module proxy), not its controllers: neither Cluster API's managers as
//     the lab runs them (its own CA) nor pvbridge's provider (no webhooks) use its certificates.
func (c *ClusterAPI) clusterctlInit(ctx context.Context, lab *cluster.Lab, mgmt *cluster.ControlPlane, dyn dynamic.Interface, module goModule, previous *Release) error {
	certManager, err := moduleDir(ctx, "github.com/cert-manager/cert-manager@"+certManagerVersion)
	if err != nil {
		return err
	}
	crds, err := filepath.Glob(filepath.Join(certManager, "deploy", "crds", "*.yaml"))
	if err != nil {
		return err
	}
	crds = append(crds, filepath.Join(module.Dir, "cmd", "clusterctl", "config", "manifest", "clusterctl-api.yaml"))
	for _, f := range crds {
		objs, err := readObjects(f)
		if err != nil {
			return err
		}
		for _, o := range objs {
			if err := apply(ctx, dyn, crdGVR, o); err != nil {
				return err
			}
		}
	}
	for _, mgr := range capiManagers {
		ns := &unstructured.Unstructured{Object: map[string]any{"apiVersion": "v1", "kind": "Namespace", "metadata": map[string]any{"name": mgr.namespace}}}
		if err := apply(ctx, dyn, schema.GroupVersionResource{Version: "v1", Resource: "namespaces"}, ns); err != nil {
			return err
		}
		p := &unstructured.Unstructured{Object: map[string]any{
			"apiVersion": ProviderGVR.GroupVersion().String(), "kind": "Provider",
			"metadata":     map[string]any{"name": mgr.provider, "namespace": mgr.namespace},
			"providerName": mgr.providerName, "type": mgr.providerType, "version": module.Version,
		}}
		p.SetLabels(clusterctlLabels(mgr.provider))
		data, err := json.Marshal(p.Object)
		if err != nil {
			return err
		}
		// The CRD was just made: its resource may not be served yet.
		err = wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
			_, err := dyn.Resource(ProviderGVR).Namespace(mgr.namespace).Patch(ctx, mgr.provider, types.ApplyPatchType, data,
				metav1.PatchOptions{FieldManager: "pvbridge-lab", Force: ptr.To(true)})
			return err == nil, nil
		})
		if err != nil {
			return fmt.Errorf("clusterctl's inventory: Provider %s: %w", mgr.provider, err)
		}
	}

	repo := c.repository()
	if out, err := exec.CommandContext(ctx, filepath.Join(lab.Binaries().Repo, "hack", "release.sh"), "clusterctl", repo).CombinedOutput(); err != nil {
		return fmt.Errorf("hack/release.sh clusterctl: %w\n%s", err, out)
	}
	provider := "pvbridge"
	if previous != nil {
		if err := previous.clusterctlRepository(repo); err != nil {
			return err
		}
		provider += ":" + previous.Version
	}
	metadata, err := os.ReadFile(filepath.Join(module.Dir, "metadata.yaml"))
	if err != nil {
		return err
	}
	var entries bytes.Buffer
	for _, mgr := range capiManagers {
		dir := filepath.Join(repo, mgr.provider, module.Version)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(dir, "metadata.yaml"), metadata, 0o644); err != nil {
			return err
		}
		fmt.Fprintf(&entries, "  - name: %s\n    type: %s\n    url: file://%s/%s\n", mgr.providerName, mgr.providerType, dir, mgr.components)
	}
	config, err := os.OpenFile(filepath.Join(repo, "clusterctl.yaml"), os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	_, err = config.Write(entries.Bytes())
	if err := errors.Join(err, config.Close()); err != nil {
		return err
	}
	return c.clusterctl(ctx, lab, mgmt, "init", "--infrastructure", provider)
}

// repository is the lab's clusterctl repository, with clusterctl.yaml, its configuration.
func (c *ClusterAPI) repository() string { return filepath.Join(c.dir, "clusterctl") }

// UpgradeProvider upgrades the provider clusterctl init installed (InstalledOptions.Previous)
// to the lab's release as docs/upgrade.md says, clusterctl upgrade apply --infrastructure
// pvbridge:<version>, and returns once its new Deployment is available.
func (in *Installed) UpgradeProvider(ctx context.Context, lab *cluster.Lab) error {
	version, err := images.Version(lab.Binaries().Repo)
	if err != nil {
		return err
	}
	return in.ClusterAPI.clusterctl(ctx, lab, in.Mgmt, "upgrade", "apply", "--infrastructure", "pvbridge:"+version)
}

// clusterctl runs clusterctl's command args (init or upgrade apply) on mgmt with the lab's
// configuration, waiting for the providers it installs.
func (c *ClusterAPI) clusterctl(ctx context.Context, lab *cluster.Lab, mgmt *cluster.ControlPlane, args ...string) error {
	clusterctl, err := lab.Binaries().Tool("clusterctl")
	if err != nil {
		return err
	}
	cmd := exec.CommandContext(ctx, clusterctl, append(args, "--config", filepath.Join(c.repository(), "clusterctl.yaml"),
		"--kubeconfig", mgmt.Kubeconfig, "--wait-providers", "--wait-provider-timeout", "300")...)
	cmd.Env = append(os.Environ(), "CLUSTERCTL_DISABLE_VERSIONCHECK=true", "XDG_CONFIG_HOME="+c.dir)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("clusterctl %s: %w\n%s", strings.Join(args, " "), err, out)
	}
	return nil
}

// goModule is a module of the Go module cache: its directory and version.
type goModule struct{ Dir, Version string }

// moduleDir downloads module@version (from GOPROXY, once) and returns its directory.
func moduleDir(ctx context.Context, moduleAtVersion string) (string, error) {
	m, err := goModuleOf(ctx, os.TempDir(), "mod", "download", "-json", moduleAtVersion)
	return m.Dir, err
}

// capiModule is the pinned Cluster API module (hack/tools/kubernetes pins it).
func capiModule(ctx context.Context, repo string) (goModule, error) {
	return goModuleOf(ctx, filepath.Join(repo, "hack", "tools", "kubernetes"), "list", "-m", "-json", "sigs.k8s.io/cluster-api")
}

// goModuleOf runs go with args (a -json module query) in dir, outside the workspace, and
// returns the module it prints.
func goModuleOf(ctx context.Context, dir string, args ...string) (goModule, error) {
	cmd := exec.CommandContext(ctx, "go", args...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "GOWORK=off")
	var m goModule
	out, err := cmd.Output()
	if err == nil {
		err = json.Unmarshal(out, &m)
	}
	if err != nil {
		return m, fmt.Errorf("go %s: %w", strings.Join(args, " "), err)
	}
	return m, nil
}

// installCAPIObjects applies a manager's CRDs (with labels, converted by its webhook at url)
// and its webhook configurations (named after the manager, called at url).
func installCAPIObjects(ctx context.Context, dyn dynamic.Interface, dir, manager, url string, ca []byte, labels map[string]string) error {
	caBundle := base64.StdEncoding.EncodeToString(ca)
	crds, err := filepath.Glob(filepath.Join(dir, "config", "crd", "bases", "*.yaml"))
	if err != nil {
		return err
	}
	var objs []*unstructured.Unstructured
	for _, f := range append(crds, filepath.Join(dir, "config", "webhook", "manifests.yaml")) {
		docs, err := readObjects(f)
		if err != nil {
			return err
		}
		objs = append(objs, docs...)
	}
	for _, o := range objs {
		gvr := crdGVR
		switch o.GetKind() {
		case "CustomResourceDefinition":
			l := o.GetLabels()
			if l == nil {
				l = map[string]string{}
			}
			maps.Copy(l, labels)
			o.SetLabels(l)
			if err := unstructured.SetNestedMap(o.Object, map[string]any{
				"strategy": "Webhook",
				"webhook": map[string]any{
					"conversionReviewVersions": []any{"v1"},
					"clientConfig":             map[string]any{"url": url + "/convert", "caBundle": caBundle},
				},
			}, "spec", "conversion"); err != nil {
				return err
			}
		case "MutatingWebhookConfiguration", "ValidatingWebhookConfiguration":
			gvr = schema.GroupVersionResource{Group: "admissionregistration.k8s.io", Version: "v1", Resource: strings.ToLower(o.GetKind()) + "s"}
			o.SetName("capi-" + manager + "-" + o.GetName())
			hooks, _, _ := unstructured.NestedSlice(o.Object, "webhooks")
			for _, h := range hooks {
				h := h.(map[string]any)
				path, _, _ := unstructured.NestedString(h, "clientConfig", "service", "path")
				h["clientConfig"] = map[string]any{"url": url + path, "caBundle": caBundle}
			}
			if err := unstructured.SetNestedSlice(o.Object, hooks, "webhooks"); err != nil {
				return err
			}
		default:
			return fmt.Errorf("%s: unexpected %s", dir, o.GetKind())
		}
		if err := apply(ctx, dyn, gvr, o); err != nil {
			return err
		}
	}
	return nil
}

var crdGVR = schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}

// apply applies a cluster-scoped object, taking over the fields others set.
func apply(ctx context.Context, dyn dynamic.Interface, gvr schema.GroupVersionResource, o *unstructured.Unstructured) error {
	data, err := json.Marshal(o.Object)
	if err != nil {
		return err
	}
	if _, err := dyn.Resource(gvr).Patch(ctx, o.GetName(), types.ApplyPatchType, data, metav1.PatchOptions{FieldManager: "pvbridge-lab", Force: ptr.To(true)}); err != nil {
		return fmt.Errorf("apply %s %s: %w", o.GetKind(), o.GetName(), err)
	}
	return nil
}

// readObjects reads the objects of a YAML file.
func readObjects(path string) ([]*unstructured.Unstructured, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	return decodeObjects(path, data)
}

// decodeObjects decodes the objects of YAML data read from path.
func decodeObjects(path string, data []byte) ([]*unstructured.Unstructured, error) {
	dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(data), 4096)
	var objs []*unstructured.Unstructured
	for {
		o := &unstructured.Unstructured{}
		if err := dec.Decode(&o.Object); errors.Is(err, io.EOF) {
			return objs, nil
		} else if err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		if len(o.Object) > 0 {
			objs = append(objs, o)
		}
	}
}

// templateVariable is a clusterctl variable: ${NAME} or ${NAME:=default}.
var templateVariable = regexp.MustCompile(`\$\{([A-Z0-9_]+)(:=([^}]*))?\}`)

// ClusterTemplate renders file of manifests/clusterctl (cluster-template.yaml, a flavor or a
// ClusterClass) with vars, as clusterctl generate cluster does, and returns its objects.
func ClusterTemplate(repo, file string, vars map[string]string) ([]*unstructured.Unstructured, error) {
	path := filepath.Join(repo, "manifests", "clusterctl", file)
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	return renderTemplate(path, data, vars)
}

// renderTemplate substitutes vars for the variables of the template data (read from path) and
// returns its objects.
func renderTemplate(path string, data []byte, vars map[string]string) ([]*unstructured.Unstructured, error) {
	var missing []string
	text := templateVariable.ReplaceAllStringFunc(string(data), func(m string) string {
		sub := templateVariable.FindStringSubmatch(m)
		if v, ok := vars[sub[1]]; ok {
			return v
		}
		if sub[2] != "" {
			return sub[3]
		}
		missing = append(missing, sub[1])
		return m
	})
	if len(missing) > 0 {
		return nil, fmt.Errorf("%s: variables not set: %s", path, strings.Join(missing, ", "))
	}
	return decodeObjects(path, []byte(text))
}

// LabGuestServices and LabGuestPods are the Service and pod ranges of the lab's guests made by
// Cluster API: Services outside the lab's own Service addresses (10.96.<n>.0/24, which the
// machine routes to the lab's control planes), pods in the lab VMs' pod networks
// (10.245.<i>.0/24), which kube-proxy then counts as the cluster's own.
const (
	LabGuestServices = "10.112.0.0/16"
	LabGuestPods     = "10.245.0.0/16"
)

// LabCluster adapts a rendered cluster template to the lab's VMs (docs/design.md): the guest's
// Service and pod ranges, kubeadm's preflight check of the cgroup version skipped (the machine
// runs cgroup v1, which the VMs' kubelets accept), the lab's etcd, without fsync as the lab's
// management etcd (the guests are throwaway; on a loaded machine a guest etcd's fdatasync took 4 s
// and its API server stopped answering), and timeouts for a loaded 2-core machine.
func LabCluster(objs []*unstructured.Unstructured, etcdTag string) error {
	ignore := []any{"SystemVerification"}
	set := func(o *unstructured.Unstructured, value any, path ...string) error {
		return unstructured.SetNestedField(o.Object, runtime.DeepCopyJSONValue(value), path...)
	}
	for _, o := range objs {
		var errs []error
		switch o.GetKind() {
		case "Cluster":
			network := []string{"spec", "clusterNetwork"}
			errs = append(errs,
				set(o, []any{LabGuestServices}, append(network, "services", "cidrBlocks")...),
				set(o, []any{LabGuestPods}, append(network, "pods", "cidrBlocks")...))
		case "KubeadmControlPlane", "KubeadmControlPlaneTemplate":
			spec := []string{"spec", "kubeadmConfigSpec"}
			if o.GetKind() == "KubeadmControlPlaneTemplate" {
				spec = []string{"spec", "template", "spec", "kubeadmConfigSpec"}
			}
			errs = append(errs,
				set(o, etcdTag, append(spec, "clusterConfiguration", "etcd", "local", "imageTag")...),
				set(o, []any{map[string]any{"name": "unsafe-no-fsync", "value": "true"}}, append(spec, "clusterConfiguration", "etcd", "local", "extraArgs")...),
				set(o, map[string]any{"controlPlaneComponentHealthCheckSeconds": int64(600), "kubernetesAPICallSeconds": int64(300)}, append(spec, "initConfiguration", "timeouts")...),
				set(o, map[string]any{"controlPlaneComponentHealthCheckSeconds": int64(600), "kubernetesAPICallSeconds": int64(300), "tlsBootstrapSeconds": int64(600)}, append(spec, "joinConfiguration", "timeouts")...),
				set(o, ignore, append(spec, "initConfiguration", "nodeRegistration", "ignorePreflightErrors")...),
				set(o, ignore, append(spec, "joinConfiguration", "nodeRegistration", "ignorePreflightErrors")...),
			)
		case "KubeadmConfigTemplate":
			join := []string{"spec", "template", "spec", "joinConfiguration"}
			errs = append(errs,
				set(o, map[string]any{"kubernetesAPICallSeconds": int64(300), "tlsBootstrapSeconds": int64(600)}, append(join, "timeouts")...),
				set(o, ignore, append(join, "nodeRegistration", "ignorePreflightErrors")...))
		}
		if err := errors.Join(errs...); err != nil {
			return fmt.Errorf("%s %s: %w", o.GetKind(), o.GetName(), err)
		}
	}
	return nil
}
