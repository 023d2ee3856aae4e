package deploy

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/yaml"

	"pvbridge.io/e2e/cluster"
	"pvbridge.io/pkg/names"
)

// A QEMU host of the installed lab (InstalledOptions.QEMUHost) runs pvbridge as shipped: its
// host agent is the management overlay's DaemonSet with the qemu hypervisor, and the guest nodes
// of its VMs run the guest overlay's node plugin, unchanged but for the Linux bridge an admin
// names (--qemu-network=bridge:<name>, a QEMU network of the lab) and the cgroup the VMs go in
// (one of the lab's, which its reaper removes). The lab's own variants of the two DaemonSets
// (the local hypervisor, a lab VM's device tree) keep off the Nodes labelled
// LabHypervisorLabel=qemu: the QEMU host, labelled by the lab, and the guest nodes of its VMs,
// labelled by their kubelets (StartQEMUPool's bootstrap template).
const (
	LabHypervisorLabel = "lab.pvbridge.io/hypervisor"
	labQEMU            = "qemu"
	// nodeImageStore is the qemu driver's image store as the shipped DaemonSet names it.
	nodeImageStore = "/var/lib/pvbridge/images"
)

var (
	// mdGVK, kubeadmConfigTemplateGVK and machineTemplateGVK are a pool's kinds.
	mdGVK                    = schema.GroupVersionKind{Group: "cluster.x-k8s.io", Version: "v1beta2", Kind: "MachineDeployment"}
	kubeadmConfigTemplateGVK = schema.GroupVersionKind{Group: "bootstrap.cluster.x-k8s.io", Version: "v1beta2", Kind: "KubeadmConfigTemplate"}
	machineTemplateGVK       = schema.GroupVersionKind{Group: "infrastructure.cluster.x-k8s.io", Version: "v1alpha1", Kind: "PVBridgeMachineTemplate"}
)

// addQEMUHost adds the QEMU host to the management cluster, with its emulated PMEM and the node
// image in its image store, and waits until pvbridge's DaemonSets run on it.
func (in *Installed) addQEMUHost(ctx context.Context, archives []string, imageStore string) error {
	name := in.Options.QEMUHost
	labels := maps.Clone(VMHostLabels)
	labels[LabHypervisorLabel] = labQEMU
	added, err := addNodes(ctx, in.Mgmt, []string{name}, func(string) cluster.NodeOptions {
		return cluster.NodeOptions{Runtime: cluster.Containerd, Images: archives, Labels: labels, Binds: map[string]string{nodeImageStore: imageStore}}
	}, func(node *cluster.Node) error { return emulatePmem(ctx, node, in.Options.PmemSize) })
	if err != nil {
		return err
	}
	in.Hosts[name] = added[name]
	if err := waitDriverRegistered(ctx, in.Mgmt.Client(), name, names.PmemDriver); err != nil {
		return err
	}
	return WaitWorkloadsReady(ctx, in.Mgmt.Client(), InstallNamespace)
}

// avoidQEMUNodes is the JSON patch that keeps a lab variant of a DaemonSet off the QEMU nodes.
const avoidQEMUNodes = `      - op: add
        path: /spec/template/spec/affinity
        value: {nodeAffinity: {requiredDuringSchedulingIgnoredDuringExecution: {nodeSelectorTerms: [{matchExpressions: [{key: ` + LabHypervisorLabel + `, operator: DoesNotExist}]}]}}}
`

// shippedDaemonSet renders overlay as shipped and returns its DaemonSet name as the QEMU nodes
// run it: named name-qemu, on the Nodes labelled for them, its container's arguments changed by
// args (a flag → its value).
func shippedDaemonSet(ctx context.Context, lab *cluster.Lab, overlay, name string, args map[string]string) (*unstructured.Unstructured, error) {
	kubectl, err := lab.Binaries().Tool("kubectl")
	if err != nil {
		return nil, err
	}
	dir := filepath.Join(lab.Binaries().Repo, "manifests", "overlays", overlay)
	out, err := exec.CommandContext(ctx, kubectl, "kustomize", dir).Output()
	if err != nil {
		return nil, fmt.Errorf("kubectl kustomize %s: %w", dir, err)
	}
	objs, err := decodeObjects(dir, out)
	if err != nil {
		return nil, err
	}
	i := slices.IndexFunc(objs, func(o *unstructured.Unstructured) bool { return o.GetKind() == "DaemonSet" && o.GetName() == name })
	if i < 0 {
		return nil, fmt.Errorf("%s has no DaemonSet %s", dir, name)
	}
	ds := objs[i]
	ds.SetName(name + "-" + labQEMU)
	if err := unstructured.SetNestedStringMap(ds.Object, map[string]string{LabHypervisorLabel: labQEMU}, "spec", "template", "spec", "nodeSelector"); err != nil {
		return nil, err
	}
	containers, _, err := unstructured.NestedSlice(ds.Object, "spec", "template", "spec", "containers")
	if err != nil {
		return nil, err
	}
	if len(containers) == 0 {
		return nil, fmt.Errorf("%s: DaemonSet %s without containers", dir, name)
	}
	c := containers[0].(map[string]any)
	list, _, _ := unstructured.NestedStringSlice(c, "args")
	for flag, value := range args {
		i := slices.IndexFunc(list, func(a string) bool { return strings.HasPrefix(a, flag+"=") })
		if i < 0 {
			return nil, fmt.Errorf("%s: DaemonSet %s has no %s", dir, name, flag)
		}
		list[i] = flag + "=" + value
	}
	if err := unstructured.SetNestedStringSlice(c, list, "args"); err != nil {
		return nil, err
	}
	if err := unstructured.SetNestedSlice(ds.Object, containers, "spec", "template", "spec", "containers"); err != nil {
		return nil, err
	}
	return ds, nil
}

// StartQEMUPool makes a pool of the guest's workers on the QEMU host (CreateQEMUPool, untainted)
// and returns the workers' names once each Machine runs with a Ready Node on which guest-csi is
// registered: within 30 minutes, for a worker whose CPU QEMU emulates on a loaded machine (more
// than 11 beside e2e/suite, measured).
func (in *Installed) StartQEMUPool(ctx context.Context, name string, replicas int64) ([]string, error) {
	if err := in.CreateQEMUPool(ctx, name, replicas); err != nil {
		return nil, err
	}
	mc, err := MgmtClient(in.Mgmt)
	if err != nil {
		return nil, err
	}
	// guest-csi registers once its images are pulled and unpacked by the emulated CPU: minutes
	// on a loaded machine, within the same wait.
	machines, err := in.waitRunningMachines(ctx, mc, client.MatchingLabels{"cluster.x-k8s.io/deployment-name": name}, int(replicas), 30*time.Minute,
		func(ctx context.Context, node string) string {
			if ok, err := driverRegistered(ctx, in.Guest.Client(), node, names.GuestDriver); !ok {
				return fmt.Sprintf("guest-csi not registered on %s (%v)", node, err)
			}
			return ""
		})
	if err != nil {
		return nil, fmt.Errorf("QEMU pool %s: %w", name, err)
	}
	var workers []string
	for _, m := range machines {
		workers = append(workers, m.GetName())
	}
	return slices.Sorted(slices.Values(workers)), nil
}

// CreateQEMUPool creates a pool of the guest's workers on the QEMU host: a MachineDeployment name
// of replicas Machines whose Nodes are labelled node.cluster.x-k8s.io/pool=name, of the
// template's md-0 machine (the node image of the guest's Kubernetes version), sized for TCG (1
// CPU and 1.5 GiB: a worker's kubelet, containerd and pods) and bootstrapped with the QEMU
// network's files, the label the shipped DaemonSets look for and taints, which the kubelet
// registers its Node with (a pool that boots beside other work keeps that work's pods off).
func (in *Installed) CreateQEMUPool(ctx context.Context, name string, replicas int64, taints ...corev1.Taint) error {
	if in.QEMUNetwork == nil {
		return fmt.Errorf("the lab has no QEMU host")
	}
	mc, err := MgmtClient(in.Mgmt)
	if err != nil {
		return err
	}
	objs, err := in.qemuPool(ctx, mc, name, replicas, taints)
	if err != nil {
		return err
	}
	for _, o := range objs {
		if err := mc.Create(ctx, o); err != nil {
			return fmt.Errorf("create %s %s: %w", o.GetKind(), o.GetName(), err)
		}
	}
	return nil
}

// qemuPool returns the objects of CreateQEMUPool's pool.
func (in *Installed) qemuPool(ctx context.Context, mc client.Client, name string, replicas int64, taints []corev1.Taint) ([]*unstructured.Unstructured, error) {
	ns, md0 := in.Options.Guest.Namespace, in.Options.Guest.Name+"-md-0"
	get := func(gvk schema.GroupVersionKind) (*unstructured.Unstructured, error) {
		o := &unstructured.Unstructured{}
		o.SetGroupVersionKind(gvk)
		if err := mc.Get(ctx, client.ObjectKey{Namespace: ns, Name: md0}, o); err != nil {
			return nil, fmt.Errorf("%s %s: %w", gvk.Kind, md0, err)
		}
		copied := &unstructured.Unstructured{Object: map[string]any{"spec": o.Object["spec"]}}
		copied.SetGroupVersionKind(gvk)
		copied.SetNamespace(ns)
		copied.SetName(name)
		return copied, nil
	}
	md0Spec, err := get(mdGVK)
	if err != nil {
		return nil, err
	}
	// A new MachineDeployment of md-0's machine spec: md-0's own selector (defaulted to its
	// name) would adopt md-0's MachineSets.
	spec, _, err := unstructured.NestedMap(md0Spec.Object, "spec", "template", "spec")
	if err != nil {
		return nil, err
	}
	md := &unstructured.Unstructured{Object: map[string]any{"spec": map[string]any{
		"clusterName": in.Options.Guest.Name, "replicas": replicas,
		"selector": map[string]any{"matchLabels": map[string]any{}},
		"template": map[string]any{"metadata": map[string]any{"labels": map[string]any{"node.cluster.x-k8s.io/pool": name}}, "spec": spec},
	}}}
	md.SetGroupVersionKind(mdGVK)
	md.SetNamespace(ns)
	md.SetName(name)
	bootstrap, err := get(kubeadmConfigTemplateGVK)
	if err != nil {
		return nil, err
	}
	machine, err := get(machineTemplateGVK)
	if err != nil {
		return nil, err
	}

	var files []any
	guestFiles := in.QEMUNetwork.GuestFiles()
	for _, p := range slices.Sorted(maps.Keys(guestFiles)) {
		files = append(files, map[string]any{"path": p, "content": guestFiles[p], "permissions": "0644"})
	}
	registration := []string{"spec", "template", "spec", "joinConfiguration", "nodeRegistration"}
	extra, _, _ := unstructured.NestedSlice(bootstrap.Object, append(registration, "kubeletExtraArgs")...)
	extra = append(extra, map[string]any{"name": "node-labels", "value": LabHypervisorLabel + "=" + labQEMU})
	taintList, _, _ := unstructured.NestedSlice(bootstrap.Object, append(registration, "taints")...)
	for _, t := range taints {
		taintList = append(taintList, map[string]any{"key": t.Key, "value": t.Value, "effect": string(t.Effect)})
	}
	err = errors.Join(
		unstructured.SetNestedSlice(bootstrap.Object, files, "spec", "template", "spec", "files"),
		unstructured.SetNestedSlice(bootstrap.Object, extra, append(registration, "kubeletExtraArgs")...),
		unstructured.SetNestedMap(machine.Object, map[string]any{"cpu": "1", "memory": "1536Mi"}, "spec", "template", "spec", "resources"),
		unstructured.SetNestedField(md.Object, in.Options.QEMUHost, "spec", "template", "spec", "failureDomain"),
		unstructured.SetNestedField(md.Object, name, "spec", "template", "spec", "bootstrap", "configRef", "name"),
		unstructured.SetNestedField(md.Object, name, "spec", "template", "spec", "infrastructureRef", "name"),
	)
	if err == nil && len(taintList) > 0 {
		err = unstructured.SetNestedSlice(bootstrap.Object, taintList, append(registration, "taints")...)
	}
	if err != nil {
		return nil, fmt.Errorf("QEMU pool %s: %w", name, err)
	}
	return []*unstructured.Unstructured{bootstrap, machine, md}, nil
}

// marshalObjects is objs as one YAML stream.
func marshalObjects(objs ...*unstructured.Unstructured) ([]byte, error) {
	var out []byte
	for _, o := range objs {
		data, err := yaml.Marshal(o.Object)
		if err != nil {
			return nil, err
		}
		out = append(append(out, "---\n"...), data...)
	}
	return out, nil
}
