package deploy

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/yaml"

	"pvbridge.io/e2e/cluster"
	"pvbridge.io/e2e/images"
	"pvbridge.io/pkg/tenancy"
)

// ClusterAPISpecsOptions say which of Cluster API's own provider specs (e2e/capispecs) run, and
// on what.
type ClusterAPISpecsOptions struct {
	// Labels is the specs' Ginkgo label filter ("" runs them all).
	Labels string
	// Version and EtcdTag are the guests' Kubernetes version and etcd image tag.
	Version, EtcdTag string
	// Hosts are the management hosts the guests' machines run on (their failure domains).
	Hosts []string
	// Dir receives the specs' configuration, log, JUnit report and what they dump.
	Dir string
}

// The clusterctl names of the lab's guests' flavors in its repository: the cluster template, the
// ClusterClass's and the HA flavor, adapted to the lab; the cluster template whose
// MachineHealthCheck remediates a worker whose Node has RemediationCondition False, and the one
// whose machines have the taints of KCPAndMachineDeploymentRolloutSpec.
const (
	LabFlavor            = "lab"
	TopologyLabFlavor    = "topology-lab"
	HALabFlavor          = "ha-lab"
	RemediationLabFlavor = "md-remediation-lab"
	TaintsLabFlavor      = "kcp-md-taints-lab"
)

// withMachineTaints gives the control plane's and the workers' machines the taints
// KCPAndMachineDeploymentRolloutSpec expects before it changes them (CAPD's kcp-md-taints
// flavor): one propagated always, one only when the Node is made.
func withMachineTaints(o *unstructured.Unstructured) error {
	taints := []any{
		map[string]any{"key": "pre-existing-on-initialization-taint", "value": "on-initialization-value", "effect": "PreferNoSchedule", "propagation": "OnInitialization"},
		map[string]any{"key": "pre-existing-always-taint", "value": "always-value", "effect": "PreferNoSchedule", "propagation": "Always"},
	}
	switch o.GetKind() {
	case "KubeadmControlPlane":
		return unstructured.SetNestedSlice(o.Object, taints, "spec", "machineTemplate", "spec", "taints")
	case "MachineDeployment":
		return unstructured.SetNestedSlice(o.Object, taints, "spec", "template", "spec", "taints")
	}
	return nil
}

// RemediationCondition is the Node condition of Cluster API's MachineDeploymentRemediationSpec:
// it sets the first condition of a MachineHealthCheck on a Node, which must be one the kubelet
// does not overwrite (as Ready).
const RemediationCondition = "e2e.remediation.condition"

// remediatedOnCondition has a MachineHealthCheck remediate a machine whose Node has
// RemediationCondition False for 10 s, first of its conditions.
func remediatedOnCondition(o *unstructured.Unstructured) error {
	if o.GetKind() != "MachineHealthCheck" {
		return nil
	}
	conditions, _, err := unstructured.NestedSlice(o.Object, "spec", "checks", "unhealthyNodeConditions")
	if err != nil {
		return err
	}
	conditions = append([]any{map[string]any{"type": RemediationCondition, "status": "False", "timeoutSeconds": int64(10)}}, conditions...)
	return unstructured.SetNestedSlice(o.Object, conditions, "spec", "checks", "unhealthyNodeConditions")
}

// RunClusterAPISpecs runs Cluster API's own provider specs (the module e2e/capispecs, built
// here outside the workspace) against the lab's management cluster: the Cluster API and
// provider the lab installed (the specs' clusterctl init is not run), clusterctl's
// configuration of the lab's repository, to which this adds the lab's flavors (the shipped
// cluster templates and ClusterClass as LabCluster adapts them, their machines on opts.Hosts),
// and a control plane endpoint of the lab, which the specs' clusters take in turn (each spec
// deletes its cluster).
// It returns the path of the specs' log, and an error naming it when a spec failed.
func (in *Installed) RunClusterAPISpecs(ctx context.Context, lab *cluster.Lab, opts ClusterAPISpecsOptions) (string, error) {
	repo := lab.Binaries().Repo
	version, err := images.Version(repo)
	if err != nil {
		return "", err
	}
	if err := in.providerIs(ctx, version); err != nil {
		return "", err
	}
	// The lab's flavors, and its ClusterClass, which clusterctl adds to a topology's cluster.
	for _, f := range []struct {
		from, as string
		edit     func(*unstructured.Unstructured) error
	}{
		{"cluster-template.yaml", "cluster-template-" + LabFlavor + ".yaml", nil},
		{"cluster-template.yaml", "cluster-template-" + RemediationLabFlavor + ".yaml", remediatedOnCondition},
		{"cluster-template.yaml", "cluster-template-" + TaintsLabFlavor + ".yaml", withMachineTaints},
		{"cluster-template-topology.yaml", "cluster-template-" + TopologyLabFlavor + ".yaml", nil},
		{"cluster-template-ha.yaml", "cluster-template-" + HALabFlavor + ".yaml", nil},
		{"clusterclass-pvbridge.yaml", "clusterclass-pvbridge.yaml", nil},
	} {
		flavor, err := labFlavor(repo, f.from, opts.EtcdTag, opts.Hosts, f.edit)
		if err != nil {
			return "", err
		}
		if err := os.WriteFile(filepath.Join(in.ClusterAPI.repository(), "infrastructure-pvbridge", version, f.as), flavor, 0o644); err != nil {
			return "", err
		}
	}
	endpoint, err := lab.ControlPlaneEndpoint()
	if err != nil {
		return "", err
	}
	if err := os.MkdirAll(opts.Dir, 0o755); err != nil {
		return "", err
	}
	// clusterctl reads the template's variables from its configuration.
	clusterctlConfig := filepath.Join(opts.Dir, "clusterctl.yaml")
	config, err := os.ReadFile(filepath.Join(in.ClusterAPI.repository(), "clusterctl.yaml"))
	if err != nil {
		return "", err
	}
	config = fmt.Appendf(config, "CONTROL_PLANE_ENDPOINT_IP: %q\n", endpoint)
	if err := os.WriteFile(clusterctlConfig, config, 0o644); err != nil {
		return "", err
	}
	e2eConfig := filepath.Join(opts.Dir, "e2e.yaml")
	if err := os.WriteFile(e2eConfig, fmt.Appendf(nil, specsConfig, in.Mgmt.Name, opts.Version), 0o644); err != nil {
		return "", err
	}

	test := filepath.Join(opts.Dir, "capispecs.test")
	build := exec.CommandContext(ctx, "go", "test", "-c", "-trimpath", "-o", test, ".")
	build.Dir = filepath.Join(repo, "e2e", "capispecs")
	build.Env = append(os.Environ(), "GOWORK=off", "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		return "", fmt.Errorf("build e2e/capispecs: %w\n%s", err, out)
	}
	logPath := filepath.Join(opts.Dir, "specs.log")
	log, err := os.Create(logPath)
	if err != nil {
		return "", err
	}
	defer log.Close()
	run := exec.CommandContext(ctx, test, "-test.v", "-test.timeout=0", "-ginkgo.v", "-ginkgo.no-color",
		"-ginkgo.label-filter="+opts.Labels, "-ginkgo.junit-report="+filepath.Join(opts.Dir, "junit.xml"),
		"-e2e.config="+e2eConfig, "-e2e.clusterctl-config="+clusterctlConfig,
		"-e2e.kubeconfig="+in.Mgmt.Kubeconfig, "-e2e.artifacts-folder="+filepath.Join(opts.Dir, "artifacts"))
	run.Dir = opts.Dir
	// Hermetic clusterctl: no overrides or version check of the user's.
	run.Env = append(os.Environ(), "XDG_CONFIG_HOME="+opts.Dir, "CLUSTERCTL_DISABLE_VERSIONCHECK=true")
	run.Stdout, run.Stderr = log, log
	if err := run.Run(); err != nil {
		return logPath, fmt.Errorf("the specs of Cluster API: %w (their log: %s)", err, logPath)
	}
	return logPath, nil
}

// providerIs fails unless the provider clusterctl installed is of version: the specs judge the
// lab's release, not the previous one the lab installs first (InstalledOptions.Previous).
func (in *Installed) providerIs(ctx context.Context, version string) error {
	mc, err := MgmtClient(in.Mgmt)
	if err != nil {
		return err
	}
	p := &unstructured.Unstructured{}
	p.SetGroupVersionKind(ProviderGVR.GroupVersion().WithKind("Provider"))
	if err := mc.Get(ctx, client.ObjectKey{Namespace: capiProviderNamespace, Name: "infrastructure-pvbridge"}, p); err != nil {
		return fmt.Errorf("clusterctl's inventory of pvbridge: %w", err)
	}
	if installed, _, _ := unstructured.NestedString(p.Object, "version"); installed != version {
		return fmt.Errorf("the installed provider is pvbridge %s, not the lab's %s: upgrade it first (UpgradeProvider)", installed, version)
	}
	return nil
}

// specsConfig is Cluster API's e2e configuration of the lab (%s: the management cluster's name,
// then the guests' Kubernetes version): the providers the lab installed, and intervals of a
// loaded 2-core machine.
const specsConfig = `managementClusterName: %s
providers:
  - name: cluster-api
    type: CoreProvider
  - name: kubeadm
    type: BootstrapProvider
  - name: kubeadm
    type: ControlPlaneProvider
  - name: pvbridge
    type: InfrastructureProvider
variables:
  KUBERNETES_VERSION: %q
intervals:
  default/wait-cluster: ["5m", "2s"]
  default/wait-control-plane: ["15m", "5s"]
  default/wait-worker-nodes: ["15m", "5s"]
  default/wait-machines: ["15m", "5s"]
  default/wait-delete-cluster: ["10m", "5s"]
  default/wait-nodes-ready: ["10m", "5s"]
  default/wait-machine-remediation: ["15m", "5s"]
  default/wait-machine-upgrade: ["15m", "5s"]
  default/wait-machine-provisioned: ["10m", "5s"]
  default/wait-machine-deleted: ["10m", "5s"]
  default/wait-deployment-available: ["5m", "5s"]
  default/check-machines-stable: ["30s", "5s"]
`

// labFlavor is the shipped template file of manifests/clusterctl (a cluster template or the
// ClusterClass) as LabCluster adapts it to the lab's VMs, with clusterctl's variables left for
// clusterctl: its objects are decoded with the variables as strings, adapted, and encoded again
// (as plain scalars: a number's variable is a number once substituted). The cluster's failure
// domains are hosts, its workers run on the first, and it does not opt in to the tenants
// controller (the specs judge the machines; guest alpha proves the storage). edit, if not nil,
// changes each object then.
func labFlavor(repo, file, etcdTag string, hosts []string, edit func(*unstructured.Unstructured) error) ([]byte, error) {
	path := filepath.Join(repo, "manifests", "clusterctl", file)
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	objs, err := decodeObjects(path, data)
	if err != nil {
		return nil, err
	}
	if err := LabCluster(objs, etcdTag); err != nil {
		return nil, err
	}
	var domains []any
	for _, h := range hosts {
		domains = append(domains, map[string]any{"name": h})
	}
	var out bytes.Buffer
	for _, o := range objs {
		switch o.GetKind() {
		case "Cluster":
			labels := o.GetLabels()
			delete(labels, tenancy.EnabledLabel)
			o.SetLabels(labels)
			err = onHosts(o, hosts)
		case "PVBridgeCluster":
			err = unstructured.SetNestedSlice(o.Object, domains, "spec", "failureDomains")
		case "MachineDeployment":
			err = unstructured.SetNestedField(o.Object, hosts[0], "spec", "template", "spec", "failureDomain")
		}
		if err == nil && edit != nil {
			err = edit(o)
		}
		if err != nil {
			return nil, err
		}
		y, err := yaml.Marshal(o.Object)
		if err != nil {
			return nil, err
		}
		out.WriteString("---\n")
		out.Write(y)
	}
	return out.Bytes(), nil
}

// onHosts has a Cluster of a ClusterClass (one with a topology) run on hosts: the class's
// variable hosts, its pools on the first.
func onHosts(c *unstructured.Unstructured, hosts []string) error {
	topology, found, err := unstructured.NestedMap(c.Object, "spec", "topology")
	if !found || err != nil {
		return err
	}
	variables, _, _ := unstructured.NestedSlice(topology, "variables")
	values := make([]any, len(hosts))
	for i, h := range hosts {
		values[i] = h
	}
	variables = append(variables, map[string]any{"name": "hosts", "value": values})
	pools, _, _ := unstructured.NestedSlice(topology, "workers", "machineDeployments")
	for _, p := range pools {
		p.(map[string]any)["failureDomain"] = hosts[0]
	}
	return errors.Join(unstructured.SetNestedSlice(c.Object, variables, "spec", "topology", "variables"),
		unstructured.SetNestedSlice(c.Object, pools, "spec", "topology", "workers", "machineDeployments"))
}
