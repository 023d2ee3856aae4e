package deploy

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sync/errgroup"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"

	"pvbridge.io/e2e/cluster"
	"pvbridge.io/e2e/images"
	"pvbridge.io/pkg/names"
	"pvbridge.io/pkg/tenancy"
)

// The installed lab: both clusters' nodes run real containers (containerd), and pvbridge is
// installed with `kubectl apply -k` of the shipped overlays and the images `make images` builds,
// as a platform admin installs it. The lab's own kustomizations (written below the lab's root)
// change only what a machine without PMEM or a hypervisor needs:
//   - mgmt-csi's node agents use PMEM mode file, on an XFS filesystem the lab mounts in each host
//     at PmemDir;
//   - the host agents use the local hypervisor, whose VMs are directories below VMRoot of the
//     host;
//   - the tenants controller names the management apiserver by its Service address;
//   - the guest is installed from the guest overlay (the Cluster opts out of the tenants
//     controller's install), with its identity, and with its node plugins looking at the VM's
//     device tree, which each guest node has at VMDeviceRoot.

const (
	// PmemDir is where an installed lab's hosts mount their emulated PMEM.
	PmemDir = "/var/lib/pvbridge/pmem"
	// VMSlots is the hot-plug slots of an installed lab's VMs, and so each guest node's volume
	// limit: few, so that Kubernetes' volumeLimits test, which fills a node to its limit with a
	// pod per volume, stays a short test.
	VMSlots = 8
	// VMRoot is where an installed lab's host agents keep their VMs (local hypervisor).
	VMRoot = "/var/lib/pvbridge/vms"
	// VMDeviceRoot is where a guest node of an installed lab sees its VM's device tree.
	VMDeviceRoot = "/var/lib/pvbridge/vm"
	// guestInstallAnnotation opts a Cluster out of the tenants controller's guest install.
	guestInstallAnnotation = "pvbridge.io/guest-install"
	// InstallNamespace is the namespace of both overlays.
	InstallNamespace = "pvbridge-system"
	// capiProviderNamespace is the namespace of the Cluster API provider's overlay.
	capiProviderNamespace = "pvbridge-capi-system"
)

// InstalledOptions describe an installed lab.
type InstalledOptions struct {
	// Hosts are the management hosts; each has PmemSize bytes of emulated PMEM.
	Hosts    []string
	PmemSize int64
	// Guest is the guest cluster; its VMs are its nodes.
	Guest GuestOptions
	// Images are more image archives every node imports (test images).
	Images []string
	// ClusterAPI makes the guest with Cluster API from the shipped cluster template: one control
	// plane machine and Workers worker machines, VMs of the hosts that the lab's VMMs boot with
	// their bootstrap data (Guest.VMs is not used).
	ClusterAPI bool
	Workers    int
	// Helm installs the management side from its Helm chart (charts/pvbridge-management)
	// rather than from its overlay.
	Helm bool
	// Previous installs that release of pvbridge instead of the lab's tree where a user
	// upgrades it: with Helm, both clusters' pvbridge (Upgrade moves them to the lab's tree);
	// with ClusterAPI, the infrastructure provider, by clusterctl init (UpgradeProvider).
	Previous *Release
	// QEMUHost, one of Hosts (with ClusterAPI, from the overlays), runs pvbridge's host agent
	// as shipped: its VMs are QEMU VMs that boot the node image on a QEMU network of the lab
	// (qemu.go); StartQEMUPool makes workers of them.
	QEMUHost string
}

// Installed is a lab whose pvbridge runs in containers, installed from the overlays (or the
// management chart).
type Installed struct {
	Mgmt  *cluster.ControlPlane
	Guest *cluster.ControlPlane
	// Hosts are keyed by host name, GuestNodes by VM name.
	Hosts      map[string]*cluster.Node
	GuestNodes map[string]*cluster.Node
	Options    InstalledOptions
	// UID is the UID of the guest's Cluster: its identity.
	UID string
	// ClusterAPI, the registry the guest's VMs pull from and VMMs (by host) run with
	// Options.ClusterAPI.
	ClusterAPI *ClusterAPI
	Registry   *cluster.Registry
	VMMs       map[string]*cluster.VMM
	// GuestReadyAfter is how long the Cluster API guest took from its template's objects
	// applied to every Machine Running with a Ready Node and guest-csi registered on the workers.
	GuestReadyAfter time.Duration
	// QEMUNetwork is the QEMU host's network, with Options.QEMUHost.
	QEMUNetwork *cluster.QEMUNetwork
	workers     []string
	archives    []string // every node's images
	// installed is the release whose overlays and chart are applied: with Helm,
	// Options.Previous until Upgrade, else nil, the lab's tree.
	installed *Release
}

// Install builds the images, starts both clusters on containerd nodes and installs pvbridge in
// them from the overlays; it returns once every pvbridge workload of both clusters is ready and
// every guest node plugin is registered.
func Install(ctx context.Context, lab *cluster.Lab, opts InstalledOptions) (*Installed, error) {
	bin := lab.Binaries()
	archives, err := images.BuildForLab(bin.Repo, bin.Dir, filepath.Join(lab.Root, "images"))
	if err != nil {
		return nil, err
	}
	in := &Installed{Options: opts}
	if opts.Previous != nil {
		if opts.Helm == opts.ClusterAPI {
			return nil, errors.New("a previous release is installed with helm or with Cluster API's clusterctl")
		}
		prev, err := opts.Previous.images(lab)
		if err != nil {
			return nil, err
		}
		archives = append(archives, prev...)
		if opts.Helm {
			in.installed = opts.Previous
		}
	}
	archives = append(archives, opts.Images...)
	in.archives = archives
	if opts.ClusterAPI {
		if in.Registry, err = lab.StartRegistry(ctx); err != nil {
			return nil, err
		}
	}
	hosts := opts.Hosts
	var nodeImage errgroup.Group
	var imageStore string
	if opts.QEMUHost != "" {
		if !opts.ClusterAPI || opts.Helm || !slices.Contains(opts.Hosts, opts.QEMUHost) {
			return nil, fmt.Errorf("QEMU host %s: one of the hosts of a Cluster API lab installed from the overlays", opts.QEMUHost)
		}
		if in.QEMUNetwork, err = lab.StartQEMUNetwork(in.Registry); err != nil {
			return nil, err
		}
		nodeImage.Go(func() (err error) {
			imageStore, _, err = bin.NodeImages(ctx)
			return err
		})
		// The QEMU host joins once the guest runs, so that its machines are placed on the
		// others (addQEMUHost).
		hosts = slices.DeleteFunc(slices.Clone(hosts), func(h string) bool { return h == opts.QEMUHost })
	}
	if in.Mgmt, err = lab.StartControlPlane(ctx, "mgmt"); err != nil {
		return nil, err
	}
	in.Hosts, err = addNodes(ctx, in.Mgmt, hosts, func(string) cluster.NodeOptions {
		return cluster.NodeOptions{Runtime: cluster.Containerd, Images: archives, Labels: VMHostLabels}
	}, func(node *cluster.Node) error { return emulatePmem(ctx, node, opts.PmemSize) })
	if err != nil {
		return nil, err
	}
	if err := createReplicaKeys(ctx, in.Mgmt.Client()); err != nil {
		return nil, err
	}
	if opts.Helm {
		err = in.helmInstall(ctx, lab)
	} else {
		var shipped []*unstructured.Unstructured
		if opts.QEMUHost != "" {
			// The QEMU worker's boot and steps are the longest path of the lab's test: its
			// VMs' cgroup gets the CPU weight of four processes.
			if err := lab.CPUWeight("vms-"+opts.QEMUHost, 4); err != nil {
				return nil, err
			}
			ds, err := shippedDaemonSet(ctx, lab, "management", "vm-operator-host-agent", map[string]string{
				"--qemu-network": "bridge:" + in.QEMUNetwork.Bridge, "--qemu-cgroup-parent": lab.Cgroup("vms-" + opts.QEMUHost),
			})
			if err != nil {
				return nil, err
			}
			shipped = append(shipped, ds)
		}
		err = in.apply(ctx, lab, in.Mgmt, "management", in.managementKustomization(lab), shipped...)
	}
	if err != nil {
		return nil, err
	}

	if opts.ClusterAPI {
		if err := in.installClusterAPIGuest(ctx, lab, archives); err != nil || opts.QEMUHost == "" {
			return in, err
		}
		if err := nodeImage.Wait(); err != nil {
			return in, err
		}
		return in, in.addQEMUHost(ctx, archives, imageStore)
	}
	if in.Guest, err = lab.StartControlPlane(ctx, "guest"); err != nil {
		return nil, err
	}
	if err := in.createTenant(ctx); err != nil {
		return nil, err
	}
	in.GuestNodes, err = addNodes(ctx, in.Guest, slices.Sorted(maps.Keys(opts.Guest.VMs)), func(vm string) cluster.NodeOptions {
		tree := in.Hosts[opts.Guest.VMs[vm]].HostPath(filepath.Join(VMRoot, opts.Guest.Namespace, vm))
		return cluster.NodeOptions{Runtime: cluster.Containerd, Images: archives, Binds: map[string]string{VMDeviceRoot: tree}}
	}, nil)
	if err != nil {
		return nil, err
	}
	if err := in.apply(ctx, lab, in.Guest, "guest", in.guestKustomization()); err != nil {
		return nil, err
	}
	for vm := range opts.Guest.VMs {
		if err := waitDriverRegistered(ctx, in.Guest.Client(), vm, names.GuestDriver); err != nil {
			return nil, err
		}
	}
	return in, nil
}

// AddedHost is a management host added to a Cluster API lab after its install (AddHost). It
// is not in Installed.Hosts and VMMs, which tests read beside the one that adds it.
type AddedHost struct {
	Node *cluster.Node
	VMM  *cluster.VMM
}

// AddHost adds management host name to a Cluster API lab, as Install adds its hosts (emulated
// PMEM, a VMM for its VMs), and returns once pvbridge's DaemonSets run on it.
func (in *Installed) AddHost(ctx context.Context, lab *cluster.Lab, name string) (*AddedHost, error) {
	added, err := addNodes(ctx, in.Mgmt, []string{name}, func(string) cluster.NodeOptions {
		return cluster.NodeOptions{Runtime: cluster.Containerd, Images: in.archives, Labels: VMHostLabels}
	}, func(node *cluster.Node) error { return emulatePmem(ctx, node, in.Options.PmemSize) })
	if err != nil {
		return nil, err
	}
	h := &AddedHost{Node: added[name]}
	h.VMM = lab.StartVMM(cluster.VMMOptions{Root: h.Node.HostPath(VMRoot), Registry: in.Registry, DeviceRoot: VMDeviceRoot})
	if err := waitDriverRegistered(ctx, in.Mgmt.Client(), name, names.PmemDriver); err != nil {
		return nil, err
	}
	return h, WaitWorkloadsReady(ctx, in.Mgmt.Client(), InstallNamespace)
}

// PowerOff takes the host's power away: its VMs, and its kubelet, containers, daemons and PMEM
// (cluster.Node.PowerOff) end at once. Its Node stays, NotReady, until an admin acts.
func (h *AddedHost) PowerOff() error { return errors.Join(h.VMM.Stop(), h.Node.PowerOff()) }

// addNodes adds the containerd nodes names to cp at once (most of a node's start is importing
// every image archive) and returns them by name once each is Ready and setup, if not nil, is
// done with it.
func addNodes(ctx context.Context, cp *cluster.ControlPlane, names []string, opts func(name string) cluster.NodeOptions, setup func(*cluster.Node) error) (map[string]*cluster.Node, error) {
	nodes := make([]*cluster.Node, len(names))
	var g errgroup.Group
	for i, name := range names {
		g.Go(func() error {
			node, err := cp.AddNode(ctx, name, opts(name))
			if err == nil && setup != nil {
				err = setup(node)
			}
			nodes[i] = node
			return err
		})
	}
	if err := g.Wait(); err != nil {
		return nil, err
	}
	byName := make(map[string]*cluster.Node, len(names))
	for i, name := range names {
		byName[name] = nodes[i]
	}
	return byName, nil
}

// emulatePmem gives a containerd host size bytes of emulated PMEM: an XFS filesystem (reflink,
// for snapshots) in a sparse file, mounted at PmemDir in the host.
func emulatePmem(ctx context.Context, host *cluster.Node, size int64) error {
	img := filepath.Join(host.Dir, "pmem.img")
	if err := os.WriteFile(img, nil, 0o600); err != nil {
		return err
	}
	if err := os.Truncate(img, size); err != nil {
		return err
	}
	if err := os.MkdirAll(host.HostPath(PmemDir), 0o755); err != nil {
		return err
	}
	for _, cmd := range []*exec.Cmd{
		exec.CommandContext(ctx, "mkfs.xfs", "-q", "-m", "reflink=1", img),
		host.Command(ctx, "mount", "-o", "loop", img, PmemDir),
	} {
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("%s: PMEM: %s: %w\n%s", host.Name, cmd, err, out)
		}
	}
	return nil
}

// ReplicaKeysSecret is the Secret of the replica servers' pre-shared key that the shipped node
// agents mount (key ReplicaKeysFile), which an admin creates (docs/deployment.md).
const ReplicaKeysSecret = "mgmt-csi-replica-keys" //nolint:gosec // a Secret's name, not a credential

// createReplicaKeys creates the install namespace and in it, as an admin does before the
// install, the Secret ReplicaKeysSecret with a random key.
func createReplicaKeys(ctx context.Context, c kubernetes.Interface) error {
	keys, err := replicaKeys()
	if err != nil {
		return err
	}
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: InstallNamespace}}
	if _, err := c.CoreV1().Namespaces().Create(ctx, ns, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return err
	}
	secret := &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: ReplicaKeysSecret, Namespace: InstallNamespace},
		Data:       map[string][]byte{ReplicaKeysFile: keys},
	}
	if _, err := c.CoreV1().Secrets(InstallNamespace).Create(ctx, secret, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return err
	}
	return nil
}

// labArgs are the arguments the lab adds to the main container of management workloads (a
// flag given again overrides the shipped value): PMEM emulated in a file; VMs of the local
// hypervisor; the node agents' daemons in the lab's cgroups. A lab whose VMs boot (Cluster API) gives the host agents the process lab's
// UnplugTimeout: a lab VM's guest keeps its disks mounted until the VMM stops it, which it does
// once the VM is off, so a VM powered off with volumes (its Cluster deleted) is forced off after
// the timeout, 5 minutes by default.
func (in *Installed) labArgs(lab *cluster.Lab) map[string][]string {
	agent := []string{"--hypervisor=local", "--vm-root=" + VMRoot, "--vm-slots=" + fmt.Sprint(VMSlots)}
	if in.Options.ClusterAPI {
		agent = append(agent, "--unplug-timeout="+UnplugTimeout.String())
	}
	args := map[string][]string{
		// The hosts share the machine's cgroups: each one's daemons below a cgroup of its own,
		// in the lab's (which Stop empties).
		"mgmt-csi-node":          {"--pmem-mode=file", "--pmem-dir=" + PmemDir, "--daemon-cgroup-parent=" + lab.Cgroup("mgmt-csi") + "/$(NODE_NAME)"},
		"vm-operator-host-agent": agent,
	}
	if in.installed != nil {
		for w := range args {
			args[w] = slices.DeleteFunc(args[w], func(arg string) bool {
				return slices.ContainsFunc(previousLacks, func(flag string) bool { return strings.HasPrefix(arg, flag+"=") })
			})
		}
	}
	return args
}

// managementKustomization is the management overlay as the installed lab applies it.
func (in *Installed) managementKustomization(lab *cluster.Lab) string {
	k := `configMapGenerator:
  - name: pvbridge-tenants
    namespace: pvbridge-system
    behavior: merge
    literals:
      - mgmt-server=` + in.mgmtServer() + `
patches:
`
	args := in.labArgs(lab)
	for _, workload := range slices.Sorted(maps.Keys(args)) {
		k += "  - target:\n      kind: DaemonSet\n      name: " + workload + "\n    patch: |-\n"
		for _, arg := range args[workload] {
			k += "      - {op: add, path: /spec/template/spec/containers/0/args/-, value: " + strconv.Quote(arg) + "}\n"
		}
		if workload == "vm-operator-host-agent" && in.Options.QEMUHost != "" {
			k += avoidQEMUNodes
		}
	}
	return k
}

// mgmtServer is the management apiserver's URL as the tenants controller's pod reaches it.
func (in *Installed) mgmtServer() string { return "https://" + in.Mgmt.ServiceIP + ":443" }

// helmInstall installs the management chart (charts/pvbridge-management) of the installed
// release as an admin would, with the lab's settings in a values file (helmValues), and waits
// until every workload of pvbridge-system is ready.
func (in *Installed) helmInstall(ctx context.Context, lab *cluster.Lab) error {
	values, err := in.helmValues(lab)
	if err != nil {
		return err
	}
	args := []string{"install", "pvbridge", filepath.Join(in.tree(lab), "charts", "pvbridge-management"),
		"--namespace", InstallNamespace, "--create-namespace", "--values", values}
	if in.installed != nil {
		// A release's chart names its images by its version; the lab built it as another.
		for _, name := range ownImageNames() {
			args = append(args, "--set", "images."+path.Base(name)+"="+name+":"+in.installed.Version)
		}
	}
	if _, err := in.Helm(ctx, lab, args...); err != nil {
		return err
	}
	return WaitWorkloadsReady(ctx, in.Mgmt.Client(), InstallNamespace)
}

// helmValues writes the lab's values of the management chart into a file below the lab's root,
// the one an admin keeps for helm install and upgrade, and returns its path.
func (in *Installed) helmValues(lab *cluster.Lab) (string, error) {
	values, err := json.Marshal(map[string]any{
		"mgmtServer": in.mgmtServer(), "extraArgs": in.labArgs(lab),
		// helm test's pod runs the lab's busybox, which every node imports.
		"images": map[string]string{"volume-test": "docker.io/library/busybox:latest"},
	})
	if err != nil {
		return "", err
	}
	file := filepath.Join(lab.Root, "helm", "values.json") // JSON is YAML
	if err := os.MkdirAll(filepath.Dir(file), 0o755); err != nil {
		return "", err
	}
	return file, os.WriteFile(file, values, 0o644)
}

// Helm runs helm with args against the management cluster and returns its output.
func (in *Installed) Helm(ctx context.Context, lab *cluster.Lab, args ...string) ([]byte, error) {
	helm, err := lab.Binaries().Tool("helm")
	if err != nil {
		return nil, err
	}
	cmd := exec.CommandContext(ctx, helm, append(args, "--kubeconfig", in.Mgmt.Kubeconfig)...)
	// helm keeps its cache and configuration below $HOME unless told otherwise.
	cmd.Env = append(os.Environ(), "HELM_CACHE_HOME="+filepath.Join(lab.Root, "helm", "cache"),
		"HELM_CONFIG_HOME="+filepath.Join(lab.Root, "helm", "config"), "HELM_DATA_HOME="+filepath.Join(lab.Root, "helm", "data"))
	out, err := cmd.CombinedOutput()
	if err != nil {
		return out, fmt.Errorf("%s: helm %s: %w\n%s", in.Mgmt.Name, args[0], err, out)
	}
	return out, nil
}

// tree is the root of the installed release's tree: the previous release's before Upgrade,
// else the lab's.
func (in *Installed) tree(lab *cluster.Lab) string {
	if in.installed != nil {
		return in.installed.Root
	}
	return lab.Binaries().Repo
}

// ownImageNames are the names of pvbridge's own images, without tags.
func ownImageNames() []string {
	var names []string
	for _, i := range images.Catalogue {
		if i.Package != "" {
			names = append(names, i.Name)
		}
	}
	return names
}

// guestKustomization is the guest overlay as the installed lab applies it.
func (in *Installed) guestKustomization() string {
	k := `configMapGenerator:
  - name: pvbridge-cluster
    namespace: pvbridge-system
    behavior: merge
    options:
      disableNameSuffixHash: true
    literals:
      - cluster-name=` + in.Options.Guest.Name + `
      - cluster-uid=` + in.UID + `
patches:
  - target:
      kind: DaemonSet
      name: guest-csi-node
    patch: |-
      - op: add
        path: /spec/template/spec/containers/0/args/-
        value: --device-root=` + VMDeviceRoot + `
      - op: add
        path: /spec/template/spec/containers/0/volumeMounts/-
        value: {name: vm-device-tree, mountPath: ` + VMDeviceRoot + `}
      - op: add
        path: /spec/template/spec/volumes/-
        value: {name: vm-device-tree, hostPath: {path: ` + VMDeviceRoot + `, type: Directory}}
`
	if in.Options.QEMUHost != "" {
		k += avoidQEMUNodes
	}
	return k
}

// apply writes a kustomization of the overlay named overlay with more (generators and patches)
// and the shipped objects the QEMU nodes run (shippedDaemonSet) below the lab's root, applies it
// to cp as an admin would (server-side) and waits until every workload of pvbridge-system is
// ready.
func (in *Installed) apply(ctx context.Context, lab *cluster.Lab, cp *cluster.ControlPlane, overlay, more string, shipped ...*unstructured.Unstructured) error {
	dir := filepath.Join(lab.Root, "install", overlay)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	base, err := filepath.Rel(dir, filepath.Join(in.tree(lab), "manifests", "overlays", overlay))
	if err != nil {
		return err
	}
	k := "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n  - " + base + "\n"
	if in.installed != nil {
		// A release's overlay names its images by its version; the lab built it as another.
		k += "images:\n"
		for _, name := range ownImageNames() {
			k += "  - name: " + name + "\n    newTag: " + in.installed.Version + "\n"
		}
	}
	if len(shipped) > 0 {
		data, err := marshalObjects(shipped...)
		if err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(dir, "shipped-qemu.yaml"), data, 0o644); err != nil {
			return err
		}
		k += "  - shipped-qemu.yaml\n"
	}
	k += more
	if err := os.WriteFile(filepath.Join(dir, "kustomization.yaml"), []byte(k), 0o644); err != nil {
		return err
	}
	kubectl, err := lab.Binaries().Tool("kubectl")
	if err != nil {
		return err
	}
	out, err := exec.CommandContext(ctx, kubectl, "--kubeconfig", cp.Kubeconfig, "apply", "--server-side", "--force-conflicts", "-k", dir).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s: apply %s: %w\n%s", cp.Name, dir, err, out)
	}
	return WaitWorkloadsReady(ctx, cp.Client(), InstallNamespace)
}

// createTenant makes the guest a tenant of the management cluster (CreateTenant, with the
// guest's apiserver at its Service address, which the tenants controller's pod reaches), opted
// out of the tenants controller's install, and its VMs; it waits until the tenants controller
// has delivered the guest's credential.
func (in *Installed) createTenant(ctx context.Context) error {
	mc, err := MgmtClient(in.Mgmt)
	if err != nil {
		return err
	}
	// The credential goes into the guest's pvbridge-system, which the overlay applied later
	// declares too.
	gc := in.Guest.Client()
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: GuestInstallNamespace}}
	if _, err := gc.CoreV1().Namespaces().Create(ctx, ns, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return err
	}
	kubeconfig, err := os.ReadFile(in.Guest.Kubeconfig)
	if err != nil {
		return err
	}
	opts := in.Options.Guest
	if in.UID, err = CreateTenant(ctx, mc, opts, "https://"+in.Guest.ServiceIP+":443", kubeconfig,
		map[string]string{guestInstallAnnotation: "false"}); err != nil {
		return err
	}
	if err := createVMs(ctx, mc, opts); err != nil {
		return err
	}
	err = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		_, err := gc.CoreV1().Secrets(GuestInstallNamespace).Get(ctx, tenancy.GuestCredentialsSecret, metav1.GetOptions{})
		return err == nil, nil
	})
	if err != nil {
		return fmt.Errorf("guest %s: no credential from the tenants controller: %w", opts.Name, err)
	}
	return nil
}

// waitDriverRegistered waits until the kubelet of node has registered the CSI driver.
func waitDriverRegistered(ctx context.Context, c kubernetes.Interface, node, driver string) error {
	err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		ok, _ := driverRegistered(ctx, c, node, driver)
		return ok, nil
	})
	if err != nil {
		return fmt.Errorf("node %s: CSI driver %s not registered: %w", node, driver, err)
	}
	return nil
}

// driverRegistered says whether node's CSINode lists driver.
func driverRegistered(ctx context.Context, c kubernetes.Interface, node, driver string) (bool, error) {
	csiNode, err := c.StorageV1().CSINodes().Get(ctx, node, metav1.GetOptions{})
	if err != nil {
		return false, err
	}
	return slices.ContainsFunc(csiNode.Spec.Drivers, func(d storagev1.CSINodeDriver) bool { return d.Name == driver }), nil
}

// WaitWorkloadsReady waits until every Deployment and DaemonSet of ns has all its pods ready,
// or says which pods are not.
func WaitWorkloadsReady(ctx context.Context, c kubernetes.Interface, ns string) error {
	var problem string
	err := wait.PollUntilContextTimeout(ctx, time.Second, 3*time.Minute, true, func(ctx context.Context) (bool, error) {
		p := workloadsNotReady(ctx, c, ns)
		if ctx.Err() == nil { // not the last call's own deadline
			problem = p
		}
		return p == "", nil
	})
	if err != nil {
		return fmt.Errorf("workloads of %s not ready: %w: %s", ns, err, problem)
	}
	return nil
}

// workloadsNotReady describes the Deployments and DaemonSets of ns that are not ready, and their
// pods that are not, or returns "".
func workloadsNotReady(ctx context.Context, c kubernetes.Interface, ns string) string {
	deps, err := c.AppsV1().Deployments(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		return err.Error()
	}
	dss, err := c.AppsV1().DaemonSets(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		return err.Error()
	}
	var s []string
	// Ready as `kubectl rollout status` says it: the controller saw the latest spec, every pod is
	// of it (none of an older one left) and ready.
	for _, d := range deps.Items {
		want := ptr.Deref(d.Spec.Replicas, 1)
		if d.Status.ObservedGeneration < d.Generation || d.Status.UpdatedReplicas != want || d.Status.Replicas != want || d.Status.ReadyReplicas != want {
			s = append(s, fmt.Sprintf("Deployment %s: %d of %d updated, %d ready, %d in all", d.Name, d.Status.UpdatedReplicas, want, d.Status.ReadyReplicas, d.Status.Replicas))
		}
	}
	for _, ds := range dss.Items {
		// A DaemonSet on no Node is a mistake, but for the QEMU nodes' before they join.
		none := ds.Status.DesiredNumberScheduled == 0 && ds.Spec.Template.Spec.NodeSelector[LabHypervisorLabel] == ""
		want := ds.Status.DesiredNumberScheduled
		if none || ds.Status.ObservedGeneration < ds.Generation || ds.Status.UpdatedNumberScheduled != want || ds.Status.NumberReady != want {
			s = append(s, fmt.Sprintf("DaemonSet %s: %d of %d updated, %d ready", ds.Name, ds.Status.UpdatedNumberScheduled, want, ds.Status.NumberReady))
		}
	}
	if len(deps.Items) == 0 {
		s = append(s, "no Deployment")
	}
	if len(s) == 0 {
		return ""
	}
	pods, err := c.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		return err.Error()
	}
	for _, p := range pods.Items {
		for _, cs := range p.Status.ContainerStatuses {
			switch {
			case cs.State.Waiting != nil:
				s = append(s, fmt.Sprintf("%s/%s waiting: %s %s", p.Name, cs.Name, cs.State.Waiting.Reason, cs.State.Waiting.Message))
			case cs.State.Terminated != nil:
				s = append(s, fmt.Sprintf("%s/%s terminated: %s %s", p.Name, cs.Name, cs.State.Terminated.Reason, cs.State.Terminated.Message))
			case !cs.Ready:
				s = append(s, fmt.Sprintf("%s/%s not ready (restarts %d)", p.Name, cs.Name, cs.RestartCount))
			}
		}
		if len(p.Status.ContainerStatuses) == 0 {
			s = append(s, fmt.Sprintf("%s: %s", p.Name, p.Status.Phase))
		}
	}
	return strings.Join(s, "; ")
}
