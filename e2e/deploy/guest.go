package deploy

import (
	"context"
	"fmt"
	"maps"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/dynamic"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pvbridge.io/e2e/cluster"
	pmemv1 "pvbridge.io/pkg/apis/pmem/v1alpha1"
	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/pkg/names"
	"pvbridge.io/pkg/tenancy"
)

const (
	// StorageClassGuest is the guest's default StorageClass (WaitForFirstConsumer, ext4, on
	// the management class StorageClassPmem).
	StorageClassGuest = "pvbridge"
	// StorageClassGuestXFS formats xfs.
	StorageClassGuestXFS = "pvbridge-xfs"
	// SnapshotClassGuest is the guest's VolumeSnapshotClass.
	SnapshotClassGuest = "pvbridge"
	// guestCSINamespace is where the guest's csi-provisioner publishes CSIStorageCapacity.
	guestCSINamespace = "kube-system"
	// GuestInstallNamespace is the guest namespace of the installed guest side, which holds the
	// management credential.
	GuestInstallNamespace = "pvbridge-system"
	// snapshotQuota is the ResourceQuota the tenants controller makes in every enforced
	// namespace (guest-csi/internal/tenants.SnapshotQuota).
	snapshotQuota = "pvbridge-snapshots"
)

// GuestOptions describe a guest cluster.
type GuestOptions struct {
	// Name is the name of its Cluster API Cluster; Namespace its management namespace.
	Name, Namespace string
	// VMs are its nodes: VirtualMachine name → management host.
	VMs map[string]string
	// StorageClasses is the cluster's allow-list of management StorageClasses
	// (DefaultAllowedClasses when empty).
	StorageClasses string
}

// DefaultAllowedClasses are the management StorageClasses a lab guest may use; the first is
// the one its installed StorageClasses name.
const DefaultAllowedClasses = StorageClassPmem + "," + StorageClassPmemXFS + "," + StorageClassPmemImmediate

// Guest is a guest cluster whose nodes are VirtualMachines of the management cluster, with
// guest-csi deployed as the manifests deploy it.
type Guest struct {
	CP      *cluster.ControlPlane
	Options GuestOptions
	// UID is the UID of the Cluster object: the guest's identity.
	UID string
	// MgmtKubeconfig is guest-csi's management credential, as the tenants controller delivered
	// it: a token of the guest's ServiceAccount, bound to the least-privilege Role.
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
	for _, add := range []func(*runtime.Scheme) error{clientgoscheme.AddToScheme, vmv1.AddToScheme, pmemv1.AddToScheme} {
		if err := add(s); err != nil {
			return nil, err
		}
	}
	return s, nil
}

// MgmtClient is a client of cp's management objects (MgmtScheme).
func MgmtClient(cp *cluster.ControlPlane) (client.Client, error) {
	scheme, err := MgmtScheme()
	if err != nil {
		return nil, err
	}
	return client.New(cp.RESTConfig(), client.Options{Scheme: scheme})
}

// StartGuest makes a guest cluster of gcp: in the management cluster its namespace, Cluster
// object and VirtualMachines (placed on their hosts by vm-operator); in the guest cluster a
// node per VM with the guest-csi node plugin looking at that VM's device tree, and the guest-csi
// controller with its sidecars. The tenants controller (StartTenants) must be running: it makes
// the guest's identity, delivers its credential and installs the CSIDriver and the classes.
func StartGuest(ctx context.Context, lab *cluster.Lab, m *Management, op *VMOperator, gcp *cluster.ControlPlane, opts GuestOptions) (*Guest, error) {
	g, err := StartGuestController(ctx, lab, m, op, gcp, opts)
	if err != nil {
		return nil, err
	}
	if g.Sidecars, err = startSidecars(lab, g.CP, filepath.Dir(g.ControllerSocket()), g.ControllerSocket(), guestCSINamespace); err != nil {
		return nil, err
	}
	bin, err := lab.Binaries().Own("./guest-csi/cmd/guest-csi")
	if err != nil {
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

// StartGuestController makes the management side of a guest cluster of gcp, as StartGuest
// does, and starts its guest-csi controller, without sidecars and without nodes: a guest whose
// controller a test drives over CSI (ControllerSocket), as the scale benchmark does for
// clusters whose kubelets would not fit on the machine.
func StartGuestController(ctx context.Context, lab *cluster.Lab, m *Management, op *VMOperator, gcp *cluster.ControlPlane, opts GuestOptions) (*Guest, error) {
	bin, err := lab.Binaries().Own("./guest-csi/cmd/guest-csi")
	if err != nil {
		return nil, err
	}
	g := &Guest{
		CP: gcp, Options: opts, Nodes: map[string]*cluster.Node{}, Plugins: map[string]*cluster.Process{},
		DeviceRoots: map[string]string{},
	}
	mc, err := MgmtClient(m.CP)
	if err != nil {
		return nil, err
	}
	kubeconfig, err := os.ReadFile(gcp.Kubeconfig)
	if err != nil {
		return nil, err
	}
	if g.UID, err = CreateTenant(ctx, mc, opts, gcp.Server, kubeconfig, nil); err != nil {
		return nil, err
	}
	if err := g.syncCredential(ctx, lab); err != nil {
		return nil, err
	}
	if err := createVMs(ctx, mc, opts); err != nil {
		return nil, err
	}
	for vm, host := range opts.VMs {
		g.DeviceRoots[vm] = filepath.Join(op.VMRoots[host], opts.Namespace, vm)
	}
	if err := g.waitInstalled(ctx); err != nil {
		return nil, err
	}
	if err := g.startController(ctx, lab, bin); err != nil {
		return nil, err
	}
	return g, nil
}

// CreateTenant does in the management cluster what a platform admin and Cluster API do for a
// new guest: its namespace, with the tenancy admission policy on; its Cluster object, opted in
// to the tenants controller with its allow-list of management StorageClasses (and annotations);
// and Cluster API's Secret with the guest's admin kubeconfig, whose apiserver is server (the
// Cluster's controlPlaneEndpoint). The tenants controller does the rest: identity, credential
// (delivered into the guest), policy parameters, guest install. It returns the Cluster's UID.
func CreateTenant(ctx context.Context, mc client.Client, opts GuestOptions, server string, kubeconfig []byte, annotations map[string]string) (string, error) {
	ns, name := opts.Namespace, opts.Name
	namespace := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns, Labels: map[string]string{tenancy.TenancyNamespaceLabel: tenancy.TenancyEnforced}}}
	if err := mc.Create(ctx, namespace); err != nil && !apierrors.IsAlreadyExists(err) {
		return "", fmt.Errorf("namespace %s: %w", ns, err)
	}
	kc, err := clientcmd.Load(kubeconfig)
	if err != nil {
		return "", err
	}
	for _, c := range kc.Clusters {
		c.Server = server
	}
	if kubeconfig, err = clientcmd.Write(*kc); err != nil {
		return "", err
	}
	// The Cluster names the guest's apiserver, as a Cluster API provider would fill it in.
	endpoint, err := url.Parse(server)
	if err != nil {
		return "", err
	}
	port, err := strconv.Atoi(endpoint.Port())
	if err != nil {
		return "", fmt.Errorf("guest apiserver %s: %w", endpoint, err)
	}
	classes := opts.StorageClasses
	if classes == "" {
		classes = DefaultAllowedClasses
	}
	capi := NewCluster(ns, name, classes, endpoint.Hostname(), port)
	a := capi.GetAnnotations()
	maps.Copy(a, annotations)
	capi.SetAnnotations(a)
	if err := mc.Create(ctx, capi); err != nil {
		return "", fmt.Errorf("create the Cluster %s/%s: %w", ns, name, err)
	}
	secret := &corev1.Secret{
		// Owned by the Cluster, as Cluster API's cluster controller writes it: the tenants
		// controller accepts no other.
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name + "-kubeconfig", Labels: map[string]string{tenancy.CAPIClusterNameLabel: name},
			OwnerReferences: []metav1.OwnerReference{{APIVersion: capi.GetAPIVersion(), Kind: capi.GetKind(), Name: name, UID: capi.GetUID(), Controller: ptr.To(true)}}},
		Type: "cluster.x-k8s.io/secret",
		Data: map[string][]byte{"value": kubeconfig},
	}
	if err := mc.Create(ctx, secret); err != nil {
		return "", fmt.Errorf("the kubeconfig Secret of %s/%s: %w", ns, name, err)
	}
	return string(capi.GetUID()), nil
}

// NewCluster returns a Cluster API Cluster opted in to the tenants controller with the
// allow-list classes (and the lab's VolumeAttributesClass and snapshot classes), whose control
// plane is at host:port.
func NewCluster(ns, name, classes, host string, port int) *unstructured.Unstructured {
	return &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Cluster",
		"metadata": map[string]any{
			"namespace": ns, "name": name,
			"labels": map[string]any{tenancy.EnabledLabel: "true"},
			"annotations": map[string]any{
				tenancy.StorageClassesAnnotation: classes, tenancy.AttributesClassesAnnotation: AttributesClassPmem,
				tenancy.SnapshotClassesAnnotation: SnapshotClassPmem, tenancy.GroupSnapshotClassesAnnotation: SnapshotClassPmem,
			},
		},
		"spec": map[string]any{"controlPlaneEndpoint": map[string]any{"host": host, "port": int64(port)}},
	}}
}

// DeliveredCredential is the management kubeconfig the tenants controller delivered into the
// guest cluster of cp (Secret pvbridge-system/pvbridge-mgmt-credentials), empty while there is none.
func DeliveredCredential(ctx context.Context, cp *cluster.ControlPlane) ([]byte, error) {
	secret, err := cp.Client().CoreV1().Secrets(GuestInstallNamespace).Get(ctx, tenancy.GuestCredentialsSecret, metav1.GetOptions{})
	if err != nil {
		return nil, err
	}
	return secret.Data["kubeconfig"], nil
}

// syncCredential does for the lab's guest-csi controller what kubelet's Secret volume does for
// the installed one: it copies the credential the tenants controller delivered into the guest
// (Secret pvbridge-system/pvbridge-mgmt-credentials) to the file guest-csi reads, now and then
// every second for as long as the lab runs. It returns once the file is there.
func (g *Guest) syncCredential(ctx context.Context, lab *cluster.Lab) error {
	g.MgmtKubeconfig = filepath.Join(g.CP.Dir, "mgmt-credentials", "kubeconfig")
	if err := os.MkdirAll(filepath.Dir(g.MgmtKubeconfig), 0o700); err != nil {
		return err
	}
	var last []byte
	sync := func(ctx context.Context) (bool, error) {
		data, err := DeliveredCredential(ctx, g.CP)
		if err != nil || len(data) == 0 || string(data) == string(last) {
			return last != nil, nil //nolint:nilerr // not delivered yet, or the guest apiserver is briefly away: keep the last copy
		}
		tmp := g.MgmtKubeconfig + ".tmp"
		if err := os.WriteFile(tmp, data, 0o600); err != nil {
			return false, err
		}
		if err := os.Rename(tmp, g.MgmtKubeconfig); err != nil {
			return false, err
		}
		last = data
		return true, nil
	}
	wctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	if err := wait.PollUntilContextCancel(wctx, 200*time.Millisecond, true, sync); err != nil {
		return fmt.Errorf("guest %s: no credential from the tenants controller in the guest's Secret %s/%s: %w",
			g.Options.Name, GuestInstallNamespace, tenancy.GuestCredentialsSecret, err)
	}
	go func() {
		_ = wait.PollUntilContextCancel(lab.Context(), time.Second, false, func(ctx context.Context) (bool, error) {
			_, err := sync(ctx)
			return false, err
		})
	}()
	return nil
}

// createVMs creates the guest's VirtualMachines on their hosts and waits until they run. The
// namespace is enforced: until the tenants controller has written its tenancy parameters the
// admission policy refuses every VirtualMachine write there, the lab's as any admin's.
func createVMs(ctx context.Context, mc client.Client, opts GuestOptions) error {
	params := client.ObjectKey{Namespace: opts.Namespace, Name: tenancy.ParamsConfigMap}
	err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		err := mc.Get(ctx, params, &corev1.ConfigMap{})
		return err == nil, client.IgnoreNotFound(err)
	})
	if err != nil {
		return fmt.Errorf("the tenancy parameters %s (written by the tenants controller): %w", params, err)
	}
	// The tenants controller's snapshot quota, once kube-controller-manager has computed the
	// usage of each of its resources: until then the apiserver refuses every snapshot of the
	// namespace ("status unknown for quota"), which csi-sanity, calling once, took for a failure.
	// A status with hard limits is not enough: the quota controller counts VolumeSnapshots only
	// once it has discovered their CRD (on a loaded machine, a sync later), and leaves them out
	// of used until then.
	quota := client.ObjectKey{Namespace: opts.Namespace, Name: snapshotQuota}
	err = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 3*time.Minute, true, func(ctx context.Context) (bool, error) {
		q := &corev1.ResourceQuota{}
		if err := mc.Get(ctx, quota, q); err != nil {
			return false, client.IgnoreNotFound(err)
		}
		for r := range q.Spec.Hard {
			if _, ok := q.Status.Used[r]; !ok {
				return false, nil
			}
		}
		return len(q.Spec.Hard) > 0, nil
	})
	if err != nil {
		return fmt.Errorf("the snapshot quota %s (made by the tenants controller) computed: %w", quota, err)
	}
	for name, host := range opts.VMs {
		vm := &vmv1.VirtualMachine{
			ObjectMeta: metav1.ObjectMeta{
				Namespace: opts.Namespace, Name: name,
				Labels: map[string]string{tenancy.CAPIClusterNameLabel: opts.Name},
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
		for name := range opts.VMs {
			vm := &vmv1.VirtualMachine{}
			if err := mc.Get(ctx, client.ObjectKey{Namespace: opts.Namespace, Name: name}, vm); err != nil {
				return false, nil
			}
			if vm.Status.Phase != vmv1.PhaseRunning {
				return false, nil
			}
		}
		return true, nil
	})
}

// waitInstalled waits until the tenants controller has installed the guest side: the
// CSIDriver, the StorageClasses and the VolumeSnapshotClass (the manifests' guest overlay).
func (g *Guest) waitInstalled(ctx context.Context) error {
	c := g.CP.Client()
	dyn, err := dynamic.NewForConfig(g.CP.RESTConfig())
	if err != nil {
		return err
	}
	snapshotClasses := schema.GroupVersionResource{Group: "snapshot.storage.k8s.io", Version: "v1", Resource: "volumesnapshotclasses"}
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	err = wait.PollUntilContextCancel(ctx, 200*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		if _, err := c.StorageV1().CSIDrivers().Get(ctx, names.GuestDriver, metav1.GetOptions{}); err != nil {
			return false, nil
		}
		for _, sc := range []string{StorageClassGuest, StorageClassGuestXFS} {
			if _, err := c.StorageV1().StorageClasses().Get(ctx, sc, metav1.GetOptions{}); err != nil {
				return false, nil
			}
		}
		_, err := dyn.Resource(snapshotClasses).Get(ctx, SnapshotClassGuest, metav1.GetOptions{})
		return err == nil, nil
	})
	if err != nil {
		return fmt.Errorf("guest %s: the tenants controller did not install the guest side: %w", g.Options.Name, err)
	}
	return nil
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
	return cluster.WaitForFile(ctx, socket, p)
}

func (g *Guest) startNode(ctx context.Context, lab *cluster.Lab, bin, vm string) error {
	node, err := g.CP.AddNode(ctx, vm, cluster.NodeOptions{})
	if err != nil {
		return err
	}
	g.Nodes[vm] = node
	socketDir := node.PluginDir(names.GuestDriver)
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
			if d.Name == names.GuestDriver {
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
