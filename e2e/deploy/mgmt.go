// Package deploy installs pvbridge's components into a lab's clusters the way the manifests
// install them into real ones: the same binaries, sidecars, CSIDriver objects, StorageClasses
// and flags, as processes on 127.0.0.1.
package deploy

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/dynamic"
	"k8s.io/utils/ptr"

	"pvbridge.io/e2e/cluster"
	"pvbridge.io/pkg/names"
	"pvbridge.io/pkg/qos"
	"pvbridge.io/pkg/qsd"
)

const (
	// StorageClassPmem binds WaitForFirstConsumer and formats ext4.
	StorageClassPmem = "pmem"
	// StorageClassPmemImmediate binds at once, on the host with the most room.
	StorageClassPmemImmediate = "pmem-immediate"
	// AttributesClassPmem is the lab's management VolumeAttributesClass: I/O limits of 1 GiB/s.
	AttributesClassPmem = "pmem-limited"
	// StorageClassPmemXFS formats xfs, which, unlike ext4, grows while mounted without
	// CAP_SYS_RESOURCE.
	StorageClassPmemXFS = "pmem-xfs"
	// StorageClassPmemReplicated keeps two replicas on distinct hosts, the first next to the
	// volume's consumer (WaitForFirstConsumer, as StorageClassPmem: csi-provisioner publishes
	// the capacity the guests' schedulers need only for late binding classes); its volumes are
	// served on every host.
	StorageClassPmemReplicated = "pmem-replicated"
	// SnapshotClassPmem is the VolumeSnapshotClass and VolumeGroupSnapshotClass of mgmt-csi.
	SnapshotClassPmem = "pmem"
	// CSINamespace is where csi-provisioner publishes CSIStorageCapacity objects.
	CSINamespace = "pvbridge-system"

	// sidecarTimeout is the sidecars' --timeout: the longest a single CSI call may wait before
	// the driver answers DeadlineExceeded and the sidecar retries.
	sidecarTimeout = "30s"
	// sidecarRetryMax is the sidecars' --retry-interval-max: the longest backoff after a failed
	// call.
	sidecarRetryMax = "30s"
)

// MgmtOptions configure the management side.
type MgmtOptions struct {
	// Hosts are the names of the hosts (kubelets with a node agent).
	Hosts []string
	// PmemSize is the size of each host's emulated PMEM region, in bytes.
	PmemSize int64
	// HostLabels are added to every host Node.
	HostLabels map[string]string
}

// Management is mgmt-csi deployed into a control plane.
type Management struct {
	CP    *cluster.ControlPlane
	Hosts []*Host
	// Controller is the central mgmt-csi; Sidecars are keyed by name (csi-provisioner, …).
	Controller *cluster.Process
	Sidecars   map[string]*cluster.Process
	// ReplicaKeys is the directory of the replica servers' pre-shared key, which every host's
	// agent is given (in a real cluster, a Secret).
	ReplicaKeys string

	pmemSize int64 // of each host's region
}

// Host is a management host: a kubelet, its PMEM region and its mgmt-csi node agent.
type Host struct {
	Node *cluster.Node
	// PmemDir is the mount point of the host's PMEM filesystem (xfs on a loop device).
	PmemDir string
	Agent   *cluster.Process
	// ReplicaAddress is where the host's replica server listens; RunDir holds its
	// qemu-storage-daemons.
	ReplicaAddress, RunDir string
}

// StartManagement deploys mgmt-csi: the CSIDriver, the StorageClasses, the controller with its
// sidecars, and per host a kubelet, an emulated PMEM region and a node agent. It returns once
// every host reports PMEM capacity.
func StartManagement(ctx context.Context, lab *cluster.Lab, cp *cluster.ControlPlane, opts MgmtOptions) (*Management, error) {
	bin, err := lab.Binaries().Own("./mgmt-csi/cmd/mgmt-csi")
	if err != nil {
		return nil, err
	}
	m := &Management{CP: cp, Sidecars: map[string]*cluster.Process{}, ReplicaKeys: filepath.Join(cp.Dir, "replica-keys"), pmemSize: opts.PmemSize}
	if err := writeReplicaKeys(m.ReplicaKeys); err != nil {
		return nil, err
	}
	if err := m.installObjects(ctx); err != nil {
		return nil, err
	}
	if err := m.startController(ctx, lab, bin); err != nil {
		return nil, err
	}
	for _, name := range opts.Hosts {
		h, err := m.startHost(ctx, lab, bin, name, opts)
		if err != nil {
			return nil, err
		}
		m.Hosts = append(m.Hosts, h)
	}
	return m, nil
}

func (m *Management) installObjects(ctx context.Context) error {
	c := m.CP.Client()
	if _, err := c.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: CSINamespace}}, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return err
	}
	// attachRequired is false: otherwise a kube-controller-manager restart detaches the
	// VolumeAttachments vm-operator creates for VMs (see docs/design.md). csi-attacher still
	// handles those.
	if err := createCSIDriver(ctx, m.CP, names.PmemDriver, false); err != nil {
		return err
	}
	for _, class := range []struct {
		name     string
		mode     storagev1.VolumeBindingMode
		fsType   string
		replicas string
	}{
		{StorageClassPmem, storagev1.VolumeBindingWaitForFirstConsumer, "ext4", ""},
		{StorageClassPmemImmediate, storagev1.VolumeBindingImmediate, "ext4", ""},
		{StorageClassPmemXFS, storagev1.VolumeBindingWaitForFirstConsumer, "xfs", ""},
		{StorageClassPmemReplicated, storagev1.VolumeBindingWaitForFirstConsumer, "ext4", "2"},
	} {
		params := map[string]string{"csi.storage.k8s.io/fstype": class.fsType}
		if class.replicas != "" {
			params["replicas"] = class.replicas
		}
		sc := &storagev1.StorageClass{
			ObjectMeta:           metav1.ObjectMeta{Name: class.name},
			Provisioner:          names.PmemDriver,
			Parameters:           params,
			ReclaimPolicy:        ptr.To(corev1.PersistentVolumeReclaimDelete),
			VolumeBindingMode:    ptr.To(class.mode),
			AllowVolumeExpansion: ptr.To(true),
		}
		if _, err := c.StorageV1().StorageClasses().Create(ctx, sc, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			return err
		}
	}
	// A class of I/O limits high enough not to slow the lab, which its guests may use.
	vac := &storagev1.VolumeAttributesClass{
		ObjectMeta: metav1.ObjectMeta{Name: AttributesClassPmem}, DriverName: names.PmemDriver,
		Parameters: map[string]string{qos.MaxBytesPerSecondParam: "1Gi"},
	}
	if _, err := c.StorageV1().VolumeAttributesClasses().Create(ctx, vac, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return err
	}
	if err := createSnapshotClass(ctx, m.CP, SnapshotClassPmem, names.PmemDriver, nil); err != nil {
		return err
	}
	return createGroupSnapshotClass(ctx, m.CP, SnapshotClassPmem, names.PmemDriver, nil)
}

// createCSIDriver creates the CSIDriver object of driver: persistent volumes with storage
// capacity tracking, attached through VolumeAttachments if attachRequired.
func createCSIDriver(ctx context.Context, cp *cluster.ControlPlane, driver string, attachRequired bool) error {
	obj := &storagev1.CSIDriver{
		ObjectMeta: metav1.ObjectMeta{Name: driver},
		Spec: storagev1.CSIDriverSpec{
			AttachRequired:       ptr.To(attachRequired),
			PodInfoOnMount:       ptr.To(false),
			StorageCapacity:      ptr.To(true),
			FSGroupPolicy:        ptr.To(storagev1.FileFSGroupPolicy),
			VolumeLifecycleModes: []storagev1.VolumeLifecycleMode{storagev1.VolumeLifecyclePersistent},
		},
	}
	if _, err := cp.Client().StorageV1().CSIDrivers().Create(ctx, obj, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return err
	}
	return nil
}

// createSnapshotClass creates a VolumeSnapshotClass of driver with parameters.
func createSnapshotClass(ctx context.Context, cp *cluster.ControlPlane, name, driver string, parameters map[string]any) error {
	gvr := schema.GroupVersionResource{Group: "snapshot.storage.k8s.io", Version: "v1", Resource: "volumesnapshotclasses"}
	return createClass(ctx, cp, gvr, "VolumeSnapshotClass", name, driver, parameters)
}

// createGroupSnapshotClass creates the default VolumeGroupSnapshotClass of driver with
// parameters.
func createGroupSnapshotClass(ctx context.Context, cp *cluster.ControlPlane, name, driver string, parameters map[string]any) error {
	gvr := schema.GroupVersionResource{Group: "groupsnapshot.storage.k8s.io", Version: "v1", Resource: "volumegroupsnapshotclasses"}
	return createClass(ctx, cp, gvr, "VolumeGroupSnapshotClass", name, driver, parameters,
		"groupsnapshot.storage.kubernetes.io/is-default-class")
}

// createClass creates a snapshot class of driver with parameters, deleting what it snapshots
// with it, annotated with each of defaults set to "true".
func createClass(ctx context.Context, cp *cluster.ControlPlane, gvr schema.GroupVersionResource, kind, name, driver string, parameters map[string]any, defaults ...string) error {
	dyn, err := dynamic.NewForConfig(cp.RESTConfig())
	if err != nil {
		return err
	}
	annotations := map[string]any{}
	for _, a := range defaults {
		annotations[a] = "true"
	}
	obj := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion":     gvr.GroupVersion().String(),
		"kind":           kind,
		"metadata":       map[string]any{"name": name, "annotations": annotations},
		"driver":         driver,
		"deletionPolicy": "Delete",
	}}
	if parameters != nil {
		obj.Object["parameters"] = parameters
	}
	if _, err := dyn.Resource(gvr).Create(ctx, obj, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return err
	}
	return nil
}

func (m *Management) startController(ctx context.Context, lab *cluster.Lab, bin string) error {
	dir := filepath.Join(m.CP.Dir, "mgmt-csi")
	socket := filepath.Join(dir, "csi.sock")
	p, err := lab.Start(cluster.Command{
		Name: m.CP.Name + "/mgmt-csi", Bin: bin, Dir: dir, LogPath: filepath.Join(m.CP.Dir, "logs", "mgmt-csi.log"),
		Args:    []string{"--mode=controller", "--endpoint=unix://" + socket, "--kubeconfig=" + m.CP.Kubeconfig, "--v=4"},
		Restart: true,
	})
	if err != nil {
		return err
	}
	m.Controller = p
	if err := cluster.WaitForFile(ctx, socket, p); err != nil {
		return err
	}
	m.Sidecars, err = startSidecars(lab, m.CP, dir, socket, CSINamespace)
	return err
}

// sidecar is a kubernetes-csi sidecar as a process.
type sidecar struct {
	name string
	args []string
	env  []string
}

// startSidecars starts the CSI sidecars of the driver at socket in cp, with the flags of the
// shipped manifests; csi-provisioner publishes CSIStorageCapacity in namespace.
func startSidecars(lab *cluster.Lab, cp *cluster.ControlPlane, dir, socket, namespace string) (map[string]*cluster.Process, error) {
	// Every sidecar retries a failed call within 30 s, as in the manifests: the default cap of 5
	// minutes held a released volume's deletion (csi-provisioner refuses while a
	// VolumeAttachment exists, then backs off) for minutes after its attachment was gone.
	common := []string{"--csi-address=" + socket, "--kubeconfig=" + cp.Kubeconfig, "--leader-election=false", "--timeout=" + sidecarTimeout,
		"--retry-interval-max=" + sidecarRetryMax, "--v=3"}
	sidecars := []sidecar{
		{"csi-provisioner", append(common,
			// The node the scheduler selected is the only candidate of a WaitForFirstConsumer
			// volume; an Immediate one gets no requirements and the driver picks the node
			// with the most room.
			"--strict-topology", "--immediate-topology=false",
			"--enable-capacity", "--capacity-ownerref-level=-1", "--capacity-poll-interval=5s",
			"--extra-create-metadata", "--default-fstype=ext4",
			"--kube-api-qps=50", "--kube-api-burst=100"),
			[]string{"NAMESPACE=" + namespace, "POD_NAME=" + filepath.Base(dir) + "-controller"}},
		{"csi-attacher", append(common, "--kube-api-qps=50", "--kube-api-burst=100", "--worker-threads=100"), nil},
		{"csi-resizer", append(common, "--handle-volume-inuse-error=false", "--extra-modify-metadata", "--kube-api-qps=50", "--kube-api-burst=100"), nil},
		{"csi-snapshotter", append(common, "--extra-create-metadata", "--kube-api-qps=50", "--kube-api-burst=100"), nil},
		// As the shipped manifests: every tenant's snapshots share its client's rate.
		{"snapshot-controller", []string{"--kubeconfig=" + cp.Kubeconfig, "--leader-election=false", "--retry-interval-max=" + sidecarRetryMax,
			"--kube-api-qps=50", "--kube-api-burst=100", "--v=3"}, nil},
	}
	started := map[string]*cluster.Process{}
	for _, sc := range sidecars {
		path, err := lab.Binaries().Tool(sc.name)
		if err != nil {
			return nil, err
		}
		p, err := lab.Start(cluster.Command{
			Name: cp.Name + "/" + sc.name, Bin: path, Args: sc.args, Env: sc.env,
			Dir: dir, LogPath: filepath.Join(cp.Dir, "logs", sc.name+".log"),
			Restart: true, // a sidecar exits when it loses its driver
		})
		if err != nil {
			return nil, err
		}
		started[sc.name] = p
	}
	return started, nil
}

func (m *Management) startHost(ctx context.Context, lab *cluster.Lab, bin, name string, opts MgmtOptions) (*Host, error) {
	node, err := m.CP.AddNode(ctx, name, cluster.NodeOptions{Labels: opts.HostLabels})
	if err != nil {
		return nil, err
	}
	h := &Host{Node: node, PmemDir: filepath.Join(node.Dir, "pmem")}
	if err := makePmemRegion(ctx, filepath.Join(node.Dir, "pmem.img"), h.PmemDir, opts.PmemSize); err != nil {
		return nil, err
	}
	ports, err := cluster.FreePorts(1)
	if err != nil {
		return nil, err
	}
	h.ReplicaAddress = "127.0.0.1:" + strconv.Itoa(ports[0])
	// Short: the daemons' sockets are below it (the lab's root is short). The daemons outlive
	// the agent, as they do on a host: the lab stops them.
	h.RunDir = filepath.Join(lab.Root, "q-"+name)
	lab.AtStop(func() error { return stopDaemons(h.RunDir) })
	socketDir := node.PluginDir(names.PmemDriver)
	h.Agent, err = lab.Start(cluster.Command{
		Name: m.CP.Name + "/" + name + "/mgmt-csi", Bin: bin, Dir: socketDir,
		LogPath: filepath.Join(node.Dir, "mgmt-csi.log"),
		Args: []string{
			"--mode=node", "--node-id=" + name,
			"--endpoint=unix://" + filepath.Join(socketDir, "csi.sock"),
			"--kubelet-registration-dir=" + node.PluginRegistryDir(),
			"--kubeconfig=" + m.CP.Kubeconfig,
			"--pmem-mode=file", "--pmem-dir=" + h.PmemDir,
			"--replica-address=" + h.ReplicaAddress, "--replica-keys-dir=" + m.ReplicaKeys, "--run-dir=" + h.RunDir,
			// A rebuild starts within 2 s, not 10: the lab's specs wait for every one.
			"--rebuild-interval=2s",
			"--v=4",
		},
		Restart: true,
	})
	if err != nil {
		return nil, err
	}
	return h, m.waitHostReady(ctx, h)
}

// stopDaemons stops the qemu-storage-daemons of a host's agent below runDir: its replica
// server and its targets.
func stopDaemons(runDir string) error { return signalDaemons(runDir, qsd.Stop) }

// signalDaemons stops (qsd.Stop) or kills (qsd.Kill) the qemu-storage-daemons below runDir.
func signalDaemons(runDir string, signal func(context.Context, qsd.Dir) error) error {
	dirs, err := filepath.Glob(filepath.Join(runDir, "t", "*"))
	if err != nil {
		return err
	}
	var errs []error
	for _, d := range append(dirs, filepath.Join(runDir, "server")) {
		errs = append(errs, signal(context.Background(), qsd.Dir(d)))
	}
	return errors.Join(errs...)
}

// PowerOff takes host name down at once, as a power loss would: its kubelet, node agent,
// replica server and targets killed, then what a reboot clears (the kubelet's mounts, the loop
// devices of its PMEM's volumes, the daemons' run directory, a tmpfs on a host). Its PMEM region
// stays mounted with its files, as a machine's disk would keep them, until ReplaceHost: the
// lab's VMs, namespaces made after the region was mounted, hold copies of its mount, so an
// unmount would leave it behind them. The host's VMs (vm-operator's) are not its to stop.
func (m *Management) PowerOff(name string) error {
	h := m.Host(name)
	errs := []error{h.Agent.Halt(), signalDaemons(h.RunDir, qsd.Kill)}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("power off host %s: %w", name, err)
	}
	if err := errors.Join(h.Node.PowerOff(), cluster.DetachLoopsBelow(h.PmemDir), cluster.ClearBelow(h.RunDir)); err != nil {
		return err
	}
	return os.RemoveAll(h.RunDir)
}

// ReplaceHost brings host name, powered off, back as a new machine of the same name: an empty
// PMEM region (every file of the old one removed), its kubelet and node agent started again.
// It returns once the agent reports the region's capacity.
func (m *Management) ReplaceHost(ctx context.Context, name string) error {
	h := m.Host(name)
	entries, err := os.ReadDir(h.PmemDir)
	if err != nil {
		return err
	}
	for _, e := range entries {
		if err := os.RemoveAll(filepath.Join(h.PmemDir, e.Name())); err != nil {
			return err
		}
	}
	if err := h.Node.PowerOn(ctx); err != nil {
		return err
	}
	agent, err := h.Agent.Respawn()
	if err != nil {
		return err
	}
	h.Agent = agent
	return m.waitHostReady(ctx, h)
}

// AddHost starts one more host, as StartManagement starts each (not one for VMs: it has no
// host label), and returns once its agent reports its PMEM.
func (m *Management) AddHost(ctx context.Context, lab *cluster.Lab, name string) error {
	bin, err := lab.Binaries().Own("./mgmt-csi/cmd/mgmt-csi")
	if err != nil {
		return err
	}
	h, err := m.startHost(ctx, lab, bin, name, MgmtOptions{PmemSize: m.pmemSize})
	if err != nil {
		return err
	}
	m.Hosts = append(m.Hosts, h)
	return nil
}

// RemoveHost takes a host that AddHost started out of the cluster for good: it stops its agent,
// its daemons and its kubelet, clears its mounts, and deletes its Node and PmemNode. Its
// volumes and replicas must be gone first.
func (m *Management) RemoveHost(ctx context.Context, name string) error {
	h := m.Host(name)
	if h == nil {
		return nil
	}
	errs := []error{h.Agent.Stop(), stopDaemons(h.RunDir), h.Node.PowerOff(), cluster.ClearBelow(h.Node.Dir, h.RunDir), os.RemoveAll(h.RunDir)}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("remove host %s: %w", name, err)
	}
	c := m.CP.Client()
	if err := c.CoreV1().Nodes().Delete(ctx, name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		return err
	}
	dyn, err := dynamic.NewForConfig(m.CP.RESTConfig())
	if err != nil {
		return err
	}
	if err := dyn.Resource(pmemNodes).Delete(ctx, name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		return err
	}
	m.Hosts = slices.DeleteFunc(m.Hosts, func(h *Host) bool { return h.Node.Name == name })
	return nil
}

// pmemNodes is the resource of PmemNodes, which the lab reads without pvbridge's API types.
var pmemNodes = schema.GroupVersionResource{Group: "pmem.pvbridge.io", Version: "v1alpha1", Resource: "pmemnodes"}

// Host returns the host of that name, nil if there is none.
func (m *Management) Host(name string) *Host {
	for _, h := range m.Hosts {
		if h.Node.Name == name {
			return h
		}
	}
	return nil
}

// ReplicaKeysFile is the file of the replica servers' pre-shared key in its directory, and its
// key in the installed side's Secret ReplicaKeysSecret.
const ReplicaKeysFile = "keys.psk"

// replicaKeys returns a keys file's content with a random pre-shared key.
func replicaKeys() ([]byte, error) {
	key := make([]byte, 32)
	if _, err := rand.Read(key); err != nil {
		return nil, err
	}
	return []byte("pvbridge:" + hex.EncodeToString(key) + "\n"), nil
}

// writeReplicaKeys writes a keys file with a random pre-shared key into dir.
func writeReplicaKeys(dir string) error {
	keys, err := replicaKeys()
	if err != nil {
		return err
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, ReplicaKeysFile), keys, 0o600)
}

// waitHostReady waits until kubelet has registered the node plugin (CSINode) and the agent
// reports PMEM capacity (PmemNode Ready).
func (m *Management) waitHostReady(ctx context.Context, h *Host) error {
	dyn, err := dynamic.NewForConfig(m.CP.RESTConfig())
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	err = wait.PollUntilContextCancel(ctx, 100*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		if h.Agent.Exited() {
			return false, fmt.Errorf("%s exited; see %s", h.Agent.Name, h.Agent.LogPath)
		}
		csiNode, err := m.CP.Client().StorageV1().CSINodes().Get(ctx, h.Node.Name, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		registered := false
		for _, d := range csiNode.Spec.Drivers {
			registered = registered || d.Name == names.PmemDriver
		}
		pn, err := dyn.Resource(pmemNodes).Get(ctx, h.Node.Name, metav1.GetOptions{})
		if !registered || err != nil {
			return false, nil
		}
		conds, _, _ := unstructured.NestedSlice(pn.Object, "status", "conditions")
		for _, c := range conds {
			if c, ok := c.(map[string]any); ok && c["type"] == "Ready" && c["status"] == "True" {
				return true, nil
			}
		}
		return false, nil
	})
	if err != nil {
		return fmt.Errorf("host %s: mgmt-csi node plugin not ready: %w (log: %s)", h.Node.Name, err, h.Agent.LogPath)
	}
	return nil
}

// makePmemRegion emulates a host's PMEM region: a sparse file with an xfs filesystem (reflink
// on, so snapshots and clones are copy-on-write), loop-mounted at dir. The lab's Stop unmounts
// it and frees the loop device.
func makePmemRegion(ctx context.Context, image, dir string, size int64) error {
	f, err := os.Create(image)
	if err != nil {
		return err
	}
	if err := f.Truncate(size); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	for _, args := range [][]string{
		{"mkfs.xfs", "-q", "-m", "reflink=1", image},
		{"mount", "-o", "loop", image, dir},
	} {
		if out, err := exec.CommandContext(ctx, args[0], args[1:]...).CombinedOutput(); err != nil {
			return fmt.Errorf("%v: %w: %s", args, err, out)
		}
	}
	return nil
}
