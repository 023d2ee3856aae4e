package deploy

import (
	"context"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/wait"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pvbridge.io/e2e/cluster"
	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/pkg/tenancy"
)

const (
	// GuestDriver is the guest cluster's CSI driver.
	GuestDriver = "guest.csi.pvbridge.io"
	// GuestTopologyKey is its topology key: the management host of a VM.
	GuestTopologyKey = "topology.guest.csi.pvbridge.io/host"
	// StorageClassGuest is the guest's default StorageClass (WaitForFirstConsumer, ext4, on
	// the management class StorageClassPmem).
	StorageClassGuest = "pvbridge"
	// StorageClassGuestXFS formats xfs.
	StorageClassGuestXFS = "pvbridge-xfs"
	// SnapshotClassGuest is the guest's VolumeSnapshotClass.
	SnapshotClassGuest = "pvbridge"
	// guestCSINamespace is where the guest's csi-provisioner publishes CSIStorageCapacity.
	guestCSINamespace = "kube-system"
)

// authTokenRequest asks for a token of a day: the lab lives shorter, a real deployment rotates
// the credential (docs/operations.md).
var authTokenRequest = authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: ptr.To(int64(24 * 3600))}}

// GuestOptions describe a guest cluster.
type GuestOptions struct {
	// Name is the name of its Cluster API Cluster; Namespace its management namespace.
	Name, Namespace string
	// VMs are its nodes: VirtualMachine name → management host.
	VMs map[string]string
}

// Guest is a guest cluster whose nodes are VirtualMachines of the management cluster, with
// guest-csi deployed as the manifests deploy it.
type Guest struct {
	CP      *cluster.ControlPlane
	Options GuestOptions
	// UID is the UID of the Cluster object: the guest's identity.
	UID string
	// MgmtKubeconfig is guest-csi's management credential: a ServiceAccount token of the
	// guest's namespace, bound to the least-privilege Role.
	MgmtKubeconfig string
	Controller     *cluster.Process
	Sidecars       map[string]*cluster.Process
	// Nodes and Plugins (the guest-csi node plugins) are keyed by VM name.
	Nodes   map[string]*cluster.Node
	Plugins map[string]*cluster.Process
	// DeviceRoots are the VMs' device trees, keyed by VM name.
	DeviceRoots map[string]string
}

// MgmtScheme holds the management objects the tests read.
func MgmtScheme() (*runtime.Scheme, error) {
	s := runtime.NewScheme()
	for _, add := range []func(*runtime.Scheme) error{clientgoscheme.AddToScheme, vmv1.AddToScheme} {
		if err := add(s); err != nil {
			return nil, err
		}
	}
	return s, nil
}

// StartGuest makes a guest cluster of gcp: in the management cluster its namespace, Cluster
// object, identity and VirtualMachines (placed on their hosts by vm-operator); in the guest
// cluster a node per VM with the guest-csi node plugin looking at that VM's device tree, the
// guest-csi controller with its sidecars, the CSIDriver and the classes.
func StartGuest(ctx context.Context, lab *cluster.Lab, m *Management, op *VMOperator, gcp *cluster.ControlPlane, opts GuestOptions) (*Guest, error) {
	bin, err := lab.Binaries().Own("./guest-csi/cmd/guest-csi")
	if err != nil {
		return nil, err
	}
	g := &Guest{
		CP: gcp, Options: opts, Nodes: map[string]*cluster.Node{}, Plugins: map[string]*cluster.Process{},
		DeviceRoots: map[string]string{},
	}
	scheme, err := MgmtScheme()
	if err != nil {
		return nil, err
	}
	mc, err := client.New(m.CP.RESTConfig(), client.Options{Scheme: scheme})
	if err != nil {
		return nil, err
	}
	if err := g.createTenant(ctx, m, mc); err != nil {
		return nil, err
	}
	if err := g.createVMs(ctx, mc); err != nil {
		return nil, err
	}
	for vm, host := range opts.VMs {
		g.DeviceRoots[vm] = filepath.Join(op.VMRoots[host], opts.Namespace, vm)
	}
	if err := g.installObjects(ctx); err != nil {
		return nil, err
	}
	if err := g.startController(ctx, lab, bin); err != nil {
		return nil, err
	}
	for vm := range opts.VMs {
		if err := g.startNode(ctx, lab, bin, vm); err != nil {
			return nil, err
		}
	}
	for vm := range opts.VMs {
		if err := g.waitRegistered(ctx, vm); err != nil {
			return nil, err
		}
	}
	return g, nil
}

// createTenant creates the guest's namespace, Cluster object and identity in the management
// cluster: a ServiceAccount bound to GuestRules there and to CapacityRules in CSINamespace,
// whose token goes into a kubeconfig naming the namespace.
func (g *Guest) createTenant(ctx context.Context, m *Management, mc client.Client) error {
	ns, name := g.Options.Namespace, g.Options.Name
	objs := []client.Object{
		&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}},
		&corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name + "-pvbridge"}},
		&rbacv1.Role{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "pvbridge-guest"}, Rules: tenancy.GuestRules},
		&rbacv1.RoleBinding{
			ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name + "-pvbridge"},
			Subjects:   []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Namespace: ns, Name: name + "-pvbridge"}},
			RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: "pvbridge-guest"},
		},
		&rbacv1.Role{ObjectMeta: metav1.ObjectMeta{Namespace: CSINamespace, Name: "pvbridge-guest-capacity"}, Rules: tenancy.CapacityRules},
		&rbacv1.RoleBinding{
			ObjectMeta: metav1.ObjectMeta{Namespace: CSINamespace, Name: ns + "-" + name + "-capacity"},
			Subjects:   []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Namespace: ns, Name: name + "-pvbridge"}},
			RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: "pvbridge-guest-capacity"},
		},
	}
	for _, obj := range objs {
		if err := mc.Create(ctx, obj); err != nil && !apierrors.IsAlreadyExists(err) {
			return fmt.Errorf("management %T %s: %w", obj, obj.GetName(), err)
		}
	}
	// The Cluster names the guest's apiserver, as a Cluster API provider would fill it in.
	endpoint, err := url.Parse(g.CP.RESTConfig().Host)
	if err != nil {
		return err
	}
	port, err := strconv.Atoi(endpoint.Port())
	if err != nil {
		return fmt.Errorf("guest apiserver %s: %w", endpoint, err)
	}
	capi := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Cluster",
		"metadata": map[string]any{"namespace": ns, "name": name},
		"spec":     map[string]any{"controlPlaneEndpoint": map[string]any{"host": endpoint.Hostname(), "port": int64(port)}},
	}}
	if err := mc.Create(ctx, capi); err != nil {
		return fmt.Errorf("create the Cluster %s/%s: %w", ns, name, err)
	}
	g.UID = string(capi.GetUID())

	token, err := m.CP.Client().CoreV1().ServiceAccounts(ns).CreateToken(ctx, name+"-pvbridge", &authTokenRequest, metav1.CreateOptions{})
	if err != nil {
		return fmt.Errorf("token of %s/%s-pvbridge: %w", ns, name, err)
	}
	admin, err := clientcmd.LoadFromFile(m.CP.Kubeconfig)
	if err != nil {
		return err
	}
	cfg := clientcmdapi.NewConfig()
	for n, c := range admin.Clusters {
		cfg.Clusters[n] = c
		cfg.AuthInfos["guest"] = &clientcmdapi.AuthInfo{Token: token.Status.Token}
		cfg.Contexts["guest"] = &clientcmdapi.Context{Cluster: n, AuthInfo: "guest", Namespace: ns}
	}
	cfg.CurrentContext = "guest"
	g.MgmtKubeconfig = filepath.Join(g.CP.Dir, "mgmt-kubeconfig")
	return clientcmd.WriteToFile(*cfg, g.MgmtKubeconfig)
}

// createVMs creates the guest's VirtualMachines on their hosts and waits until they run.
func (g *Guest) createVMs(ctx context.Context, mc client.Client) error {
	for name, host := range g.Options.VMs {
		vm := &vmv1.VirtualMachine{
			ObjectMeta: metav1.ObjectMeta{
				Namespace: g.Options.Namespace, Name: name,
				Labels: map[string]string{tenancy.CAPIClusterNameLabel: g.Options.Name},
			},
			Spec: vmv1.VirtualMachineSpec{Host: host, PowerState: vmv1.PowerStateOn},
		}
		if err := mc.Create(ctx, vm); err != nil {
			return fmt.Errorf("VirtualMachine %s: %w", name, err)
		}
	}
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	return wait.PollUntilContextCancel(ctx, 100*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		for name := range g.Options.VMs {
			vm := &vmv1.VirtualMachine{}
			if err := mc.Get(ctx, client.ObjectKey{Namespace: g.Options.Namespace, Name: name}, vm); err != nil {
				return false, nil
			}
			if vm.Status.Phase != vmv1.PhaseRunning {
				return false, nil
			}
		}
		return true, nil
	})
}

// installObjects creates the guest's CSIDriver, StorageClasses and VolumeSnapshotClass.
func (g *Guest) installObjects(ctx context.Context) error {
	c := g.CP.Client()
	if err := createCSIDriver(ctx, g.CP, GuestDriver, true); err != nil {
		return err
	}
	for _, class := range []struct {
		name, fsType string
		isDefault    bool
	}{{StorageClassGuest, "ext4", true}, {StorageClassGuestXFS, "xfs", false}} {
		sc := &storagev1.StorageClass{
			ObjectMeta:  metav1.ObjectMeta{Name: class.name},
			Provisioner: GuestDriver,
			Parameters: map[string]string{
				"mgmtStorageClass":          StorageClassPmem,
				"csi.storage.k8s.io/fstype": class.fsType,
			},
			ReclaimPolicy:        ptr.To(corev1.PersistentVolumeReclaimDelete),
			VolumeBindingMode:    ptr.To(storagev1.VolumeBindingWaitForFirstConsumer),
			AllowVolumeExpansion: ptr.To(true),
		}
		if class.isDefault {
			sc.Annotations = map[string]string{"storageclass.kubernetes.io/is-default-class": "true"}
		}
		if _, err := c.StorageV1().StorageClasses().Create(ctx, sc, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			return err
		}
	}
	return createSnapshotClass(ctx, g.CP, SnapshotClassGuest, GuestDriver, map[string]any{"mgmtSnapshotClass": SnapshotClassPmem})
}

// ControllerSocket is the CSI endpoint of the guest-csi controller.
func (g *Guest) ControllerSocket() string { return filepath.Join(g.CP.Dir, "guest-csi", "csi.sock") }

func (g *Guest) startController(ctx context.Context, lab *cluster.Lab, bin string) error {
	socket := g.ControllerSocket()
	dir := filepath.Dir(socket)
	p, err := lab.Start(cluster.Command{
		Name: g.CP.Name + "/guest-csi", Bin: bin, Dir: dir, LogPath: filepath.Join(g.CP.Dir, "logs", "guest-csi.log"),
		Args: []string{
			"--mode=controller", "--endpoint=unix://" + socket, "--kubeconfig=" + g.CP.Kubeconfig,
			"--cluster-name=" + g.Options.Name, "--cluster-uid=" + g.UID,
			"--mgmt-kubeconfig=" + g.MgmtKubeconfig, "--mgmt-capacity-namespace=" + CSINamespace,
			"--default-mgmt-storage-class=" + StorageClassPmem, "--default-mgmt-snapshot-class=" + SnapshotClassPmem,
			"--kube-api-qps=50", "--kube-api-burst=100", "--v=4",
		},
		Restart: true,
	})
	if err != nil {
		return err
	}
	g.Controller = p
	if err := cluster.WaitForFile(ctx, socket, p); err != nil {
		return err
	}
	g.Sidecars, err = startSidecars(lab, g.CP, dir, socket, guestCSINamespace)
	return err
}

func (g *Guest) startNode(ctx context.Context, lab *cluster.Lab, bin, vm string) error {
	node, err := g.CP.AddNode(ctx, vm, cluster.NodeOptions{})
	if err != nil {
		return err
	}
	g.Nodes[vm] = node
	socketDir := node.PluginDir(GuestDriver)
	if err := os.MkdirAll(socketDir, 0o755); err != nil {
		return err
	}
	g.Plugins[vm], err = lab.Start(cluster.Command{
		Name: g.CP.Name + "/" + vm + "/guest-csi", Bin: bin, Dir: socketDir,
		LogPath: filepath.Join(node.Dir, "guest-csi.log"),
		Args: []string{
			"--mode=node", "--node-id=" + vm,
			"--endpoint=unix://" + filepath.Join(socketDir, "csi.sock"),
			"--kubelet-registration-dir=" + node.PluginRegistryDir(),
			"--kubeconfig=" + g.CP.Kubeconfig,
			"--device-root=" + g.DeviceRoots[vm],
			"--v=4",
		},
		Restart: true,
	})
	return err
}

// waitRegistered waits until kubelet has registered the node plugin of vm, with its host.
func (g *Guest) waitRegistered(ctx context.Context, vm string) error {
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	err := wait.PollUntilContextCancel(ctx, 100*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		if p := g.Plugins[vm]; p.Exited() {
			return false, fmt.Errorf("%s exited; see %s", p.Name, p.LogPath)
		}
		csiNode, err := g.CP.Client().StorageV1().CSINodes().Get(ctx, vm, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		for _, d := range csiNode.Spec.Drivers {
			if d.Name == GuestDriver {
				return true, nil
			}
		}
		return false, nil
	})
	if err != nil {
		return fmt.Errorf("guest node %s: guest-csi node plugin not registered: %w (log: %s)", vm, err, g.Plugins[vm].LogPath)
	}
	return nil
}
