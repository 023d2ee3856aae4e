package deploy

import (
	"context"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/wait"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pvbridge.io/e2e/cluster"
	"pvbridge.io/pkg/names"
	"pvbridge.io/pkg/tenancy"
)

// MachineGVK is Cluster API's Machine.
var MachineGVK = schema.GroupVersionKind{Group: "cluster.x-k8s.io", Version: "v1beta2", Kind: "Machine"}

// installClusterAPIGuest makes the guest with Cluster API in the management cluster: Cluster
// API's controllers and pvbridge's provider, the lab's registry with every image the guest runs,
// a VMM per host that boots the VMs of the host's agent with their bootstrap data (pulling from
// that registry), the shipped cluster template (one control plane machine, Workers worker
// machines) adapted to the lab and opted in to the tenants controller, opted out of its guest
// install (the lab applies the guest overlay with the VMs' device tree instead).
// It returns once every Machine runs with a Ready Node and guest-csi is registered on every
// worker.
func (in *Installed) installClusterAPIGuest(ctx context.Context, lab *cluster.Lab, archives []string) error {
	opts := in.Options.Guest
	var err error
	if in.ClusterAPI, err = StartClusterAPI(ctx, lab, in.Mgmt, in.Options.Previous); err != nil {
		return err
	}
	kubeadmArchives, version, etcdTag, err := cluster.KubeadmImageArchives(ctx, lab)
	if err != nil {
		return err
	}
	if err := in.Registry.Push(ctx, slices.Compact(slices.Sorted(slices.Values(append(slices.Clone(archives), kubeadmArchives...))))...); err != nil {
		return err
	}
	endpoint, err := lab.ControlPlaneEndpoint()
	if err != nil {
		return err
	}
	in.VMMs = map[string]*cluster.VMM{}
	for name, host := range in.Hosts {
		in.VMMs[name] = lab.StartVMM(cluster.VMMOptions{Root: host.HostPath(VMRoot), Registry: in.Registry, DeviceRoot: VMDeviceRoot})
	}
	objs, err := ClusterTemplate(lab.Binaries().Repo, "cluster-template.yaml", map[string]string{
		"CLUSTER_NAME": opts.Name, "NAMESPACE": opts.Namespace, "KUBERNETES_VERSION": version,
		"CONTROL_PLANE_MACHINE_COUNT": "1", "WORKER_MACHINE_COUNT": strconv.Itoa(in.Options.Workers),
		"CONTROL_PLANE_ENDPOINT_IP": endpoint,
	})
	if err != nil {
		return err
	}
	if err := LabCluster(objs, etcdTag); err != nil {
		return err
	}
	mc, err := MgmtClient(in.Mgmt)
	if err != nil {
		return err
	}
	namespace := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: opts.Namespace, Labels: map[string]string{tenancy.TenancyNamespaceLabel: tenancy.TenancyEnforced}}}
	if err := mc.Create(ctx, namespace); err != nil && !apierrors.IsAlreadyExists(err) {
		return err
	}
	classes := opts.StorageClasses
	if classes == "" {
		classes = DefaultAllowedClasses
	}
	start := time.Now()
	for _, o := range objs {
		if o.GetKind() == "Cluster" {
			a := o.GetAnnotations()
			if a == nil {
				a = map[string]string{}
			}
			maps.Copy(a, map[string]string{
				tenancy.StorageClassesAnnotation: classes, guestInstallAnnotation: "false",
				tenancy.SnapshotClassesAnnotation: SnapshotClassPmem, tenancy.GroupSnapshotClassesAnnotation: SnapshotClassPmem,
			})
			o.SetAnnotations(a)
		}
		if err := mc.Create(ctx, o); err != nil {
			return fmt.Errorf("create %s %s: %w", o.GetKind(), o.GetName(), err)
		}
		if o.GetKind() == "Cluster" {
			in.UID = string(o.GetUID())
		}
	}

	// The guest, with the kubeconfig Secret Cluster API writes.
	kubeconfig := filepath.Join(lab.Root, "install", "guest.kubeconfig")
	err = wait.PollUntilContextTimeout(ctx, time.Second, 5*time.Minute, true, func(ctx context.Context) (bool, error) {
		secret := &corev1.Secret{}
		if err := mc.Get(ctx, client.ObjectKey{Namespace: opts.Namespace, Name: opts.Name + "-kubeconfig"}, secret); err != nil {
			return false, client.IgnoreNotFound(err)
		}
		if err := os.MkdirAll(filepath.Dir(kubeconfig), 0o755); err != nil {
			return false, err
		}
		return true, os.WriteFile(kubeconfig, secret.Data["value"], 0o600)
	})
	if err != nil {
		return fmt.Errorf("the kubeconfig Secret of %s/%s: %w", opts.Namespace, opts.Name, err)
	}
	if in.Guest, err = lab.ControlPlaneOf(opts.Name, filepath.Join(lab.Root, "install"), kubeconfig); err != nil {
		return err
	}
	workers, err := in.waitMachines(ctx, mc)
	if err != nil {
		return err
	}
	in.workers = workers
	// The credential the tenants controller delivers goes into the guest's pvbridge-system,
	// which the overlay applied next declares too.
	gc := in.Guest.Client()
	err = wait.PollUntilContextTimeout(ctx, time.Second, 3*time.Minute, true, func(ctx context.Context) (bool, error) {
		if _, err := gc.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: GuestInstallNamespace}}, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			return false, nil
		}
		_, err := gc.CoreV1().Secrets(GuestInstallNamespace).Get(ctx, tenancy.GuestCredentialsSecret, metav1.GetOptions{})
		return err == nil, nil
	})
	if err != nil {
		return fmt.Errorf("guest %s: no credential from the tenants controller: %w", opts.Name, err)
	}
	// The snapshot CRDs first, as deployment.md has an admin apply them to a guest.
	kubectl, err := lab.Binaries().Tool("kubectl")
	if err != nil {
		return err
	}
	for _, args := range [][]string{
		{"apply", "--server-side", "-k", filepath.Join(lab.Binaries().Repo, "manifests", "crd", "snapshot")},
		{"wait", "--for=condition=Established", "crd", "--all", "--timeout=60s"},
	} {
		if out, err := exec.CommandContext(ctx, kubectl, append([]string{"--kubeconfig", kubeconfig}, args...)...).CombinedOutput(); err != nil {
			return fmt.Errorf("guest %s: kubectl %s: %w: %s", opts.Name, strings.Join(args, " "), err, out)
		}
	}
	var shipped []*unstructured.Unstructured
	if in.Options.QEMUHost != "" {
		ds, err := shippedDaemonSet(ctx, lab, "guest", "guest-csi-node", nil)
		if err != nil {
			return err
		}
		shipped = append(shipped, ds)
	}
	if err := in.apply(ctx, lab, in.Guest, "guest", in.guestKustomization(), shipped...); err != nil {
		return err
	}
	for _, vm := range workers {
		if err := waitDriverRegistered(ctx, gc, vm, names.GuestDriver); err != nil {
			return err
		}
	}
	in.GuestReadyAfter = time.Since(start)
	return nil
}

// waitMachines waits until the guest's Machines run with Ready Nodes, records their VMs as the
// guest's nodes and returns the workers' names.
func (in *Installed) waitMachines(ctx context.Context, mc client.Client) ([]string, error) {
	opts := in.Options.Guest
	machines, err := in.waitRunningMachines(ctx, mc, client.MatchingLabels{tenancy.CAPIClusterNameLabel: opts.Name}, 1+in.Options.Workers, 15*time.Minute, nil)
	if err != nil {
		return nil, fmt.Errorf("guest %s made by Cluster API: %w", opts.Name, err)
	}
	in.GuestNodes = map[string]*cluster.Node{}
	var workers []string
	for _, m := range machines {
		name := m.GetName()
		for _, vmm := range in.VMMs {
			if vm, _ := vmm.VM(opts.Namespace, name); vm != nil {
				in.GuestNodes[name] = vm.Node
			}
		}
		if _, cp := m.GetLabels()["cluster.x-k8s.io/control-plane"]; !cp {
			workers = append(workers, name)
		}
	}
	return workers, nil
}

// waitRunningMachines waits, within timeout, until the guest's Machines that match selector are
// n, each Running with a Ready Node of its name on which ready, if set, says nothing is missing
// (it returns what is), and returns them.
func (in *Installed) waitRunningMachines(ctx context.Context, mc client.Client, selector client.MatchingLabels, n int, timeout time.Duration,
	ready func(ctx context.Context, node string) string) ([]unstructured.Unstructured, error) {
	var problem string
	var items []unstructured.Unstructured
	err := wait.PollUntilContextTimeout(ctx, 2*time.Second, timeout, true, func(ctx context.Context) (bool, error) {
		machines := &unstructured.UnstructuredList{}
		machines.SetGroupVersionKind(MachineGVK)
		if err := mc.List(ctx, machines, client.InNamespace(in.Options.Guest.Namespace), selector); err != nil {
			return false, err
		}
		if len(machines.Items) != n {
			problem = fmt.Sprintf("%d Machines", len(machines.Items))
			return false, nil
		}
		for _, m := range machines.Items {
			name := m.GetName()
			if phase, _, _ := unstructured.NestedString(m.Object, "status", "phase"); phase != "Running" {
				problem = fmt.Sprintf("Machine %s is %q", name, phase)
				return false, nil
			}
			node, err := in.Guest.Client().CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
			if err != nil || !cluster.NodeReady(node) {
				problem = fmt.Sprintf("Node %s not Ready (%v)", name, err)
				return false, nil
			}
			if ready != nil {
				if problem = ready(ctx, name); problem != "" {
					return false, nil
				}
			}
		}
		items = machines.Items
		return true, nil
	})
	if err != nil {
		return nil, fmt.Errorf("%w: %s", err, problem)
	}
	return items, nil
}

// Workers are the names of the guest's worker nodes made by Cluster API, sorted.
func (in *Installed) Workers() []string { return slices.Sorted(slices.Values(in.workers)) }
