package cluster

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
)

// Node is a real kubelet. With the fake runtime (fakecri) pods run without processes, but the
// kubelet's volume manager makes real CSI calls to the plugins registered in its
// PluginRegistryDir. With containerd, pods run in real containers (see containerd.go).
type Node struct {
	Name string
	// Dir holds the node's files: kubelet/ (its root dir), pki/, podlogs/, volplugins/, cwd/,
	// logs; a containerd node's own directories are below root/ (HostPath).
	Dir string
	// KubeletDir is the kubelet's root directory, in the machine's tree.
	KubeletDir string

	cp      *ControlPlane // the kubelet's (nil for a VM, whose kubelet kubeadm configures)
	lab     *Lab
	prefix  string   // of its processes' names: <control plane>/<node>, vm/<name>
	paths   []string // a containerd node's own directories: nodePaths, and a VM's
	vm      bool     // a VM: its own network and host name too
	runtime *Process // fakecri, or containerd
	kubelet *Process

	namespace *Process // a containerd node's namespace (unshare)
	nsPid     int      // the pid of its first process
}

// Runtime is a node's container runtime.
type Runtime string

const (
	// FakeRuntime runs pods without processes (fakecri); the lab runs the components as
	// processes beside the kubelets.
	FakeRuntime Runtime = ""
	// Containerd runs pods in real containers: containerd 2 built from the module proxy, runc
	// and the CNI plugins from Debian.
	Containerd Runtime = "containerd"
)

// NodeOptions configures a node.
type NodeOptions struct {
	// Labels are set on the Node when the kubelet registers it.
	Labels map[string]string
	// Runtime is the node's container runtime.
	Runtime Runtime
	// Images are OCI archives a containerd node imports before its kubelet starts (no registry
	// is reachable); they must include SandboxImage.
	Images []string
	// Binds are more directories of a containerd node: path in the node → directory of the
	// machine, bind-mounted after the node's own (a VM's device tree, for a guest node).
	Binds map[string]string
}

// PluginRegistryDir is where CSI node plugins put their kubelet registration sockets.
func (n *Node) PluginRegistryDir() string { return filepath.Join(n.KubeletDir, "plugins_registry") }

// PluginDir is the conventional directory of a CSI driver's socket on this node.
func (n *Node) PluginDir(driver string) string { return filepath.Join(n.KubeletDir, "plugins", driver) }

// Kubelet returns the kubelet process.
func (n *Node) Kubelet() *Process { return n.kubelet }

// AddNode starts a kubelet named name with its own container runtime and waits until the Node
// is Ready.
func (cp *ControlPlane) AddNode(ctx context.Context, name string, opts NodeOptions) (*Node, error) {
	n := &Node{Name: name, Dir: filepath.Join(cp.Dir, "nodes", name), cp: cp, lab: cp.lab, prefix: cp.Name + "/" + name, paths: nodePaths}
	p, err := FreePorts(2)
	if err != nil {
		return nil, err
	}
	kubeletBin, err := cp.lab.bin.Tool("kubelet")
	if err != nil {
		return nil, err
	}
	kc := kubeletOptions{address: "127.0.0.1", port: p[0], healthzPort: p[1]}
	args := []string{"--hostname-override=" + name}
	switch opts.Runtime {
	case FakeRuntime:
		if err := n.startFakeRuntime(ctx); err != nil {
			return nil, err
		}
		n.KubeletDir = filepath.Join(n.Dir, "kubelet")
		kc.endpoint = filepath.Join(n.Dir, "cri.sock")
		kc.podLogs, kc.volumePlugins = filepath.Join(n.Dir, "podlogs"), filepath.Join(n.Dir, "volplugins")
		args = append(args, "--root-dir="+n.KubeletDir, "--cert-dir="+filepath.Join(n.Dir, "pki"))
	case Containerd:
		if err := n.startNamespace(ctx, opts.Binds); err != nil {
			return nil, err
		}
		pn, err := cp.lab.startPodNetwork()
		if err != nil {
			return nil, err
		}
		cp.lab.AtStop(pn.stop)
		if err := os.WriteFile(filepath.Join(n.HostPath("/etc/cni/net.d"), "10-lab.conflist"), []byte(pn.cniConfig()), 0o644); err != nil {
			return nil, err
		}
		if err := n.startContainerd(ctx, opts.Images); err != nil {
			return nil, err
		}
		// The defaults: /var/lib/kubelet, /var/log/pods are the node's own in its namespace.
		n.KubeletDir = n.HostPath("/var/lib/kubelet")
		// The node's address is its bridge's: the apiserver reaches the kubelet there (logs,
		// exec), and a kubelet may not have a loopback node IP.
		kc.address = pn.Gateway
		args = append(args, "--node-ip="+pn.Gateway)
		kc.endpoint = "/run/containerd/containerd.sock"
		kc.podLogs, kc.volumePlugins = "/var/log/pods", "/var/lib/kubelet/volume-plugins"
	default:
		return nil, fmt.Errorf("node %s: unknown runtime %q", name, opts.Runtime)
	}
	// The kubelet runs in an empty working directory of its own: a runtime that reports no
	// container log path makes it delete the files of its working directory.
	for _, d := range []string{n.KubeletDir, filepath.Join(n.Dir, "cwd")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return nil, err
		}
	}
	config := filepath.Join(n.Dir, "config.yaml")
	if err := os.WriteFile(config, []byte(kubeletConfig(kc)), 0o644); err != nil {
		return nil, err
	}
	kubeconfig := filepath.Join(n.Dir, "kubeconfig")
	data, err := os.ReadFile(cp.Kubeconfig)
	if err != nil {
		return nil, err
	}
	if err := os.WriteFile(kubeconfig, data, 0o600); err != nil {
		return nil, err
	}
	args = append(args, "--config="+config, "--kubeconfig="+kubeconfig)
	if len(opts.Labels) > 0 {
		var l []string
		for _, k := range slices.Sorted(maps.Keys(opts.Labels)) {
			l = append(l, k+"="+opts.Labels[k])
		}
		args = append(args, "--node-labels="+strings.Join(l, ","))
	}
	kubelet := Command{
		Name: cp.Name + "/" + name + "/kubelet", Bin: kubeletBin, Args: args,
		Dir: filepath.Join(n.Dir, "cwd"), LogPath: filepath.Join(n.Dir, "kubelet.log"),
	}
	if opts.Runtime == Containerd {
		kubelet.Bin, kubelet.Args = n.inNamespace(kubeletBin, args...)
		n.kubelet, err = cp.lab.Start(kubelet)
	} else {
		n.kubelet, err = n.startSharingDevicePlugins(ctx, kubelet)
	}
	if err != nil {
		return nil, err
	}
	if err := n.waitReady(ctx); err != nil {
		return nil, err
	}
	return n, nil
}

// PowerOff kills the node's kubelet and container runtime at once, as a machine's power loss
// would, and clears what a reboot clears of the kubelet's: every mount below its directory
// (pods' volumes, staged volumes). Its files stay, as a disk's do. A containerd node loses its
// namespace too: every process in it (containers, the daemons of its hostPID pods) ends, and so
// do the loop devices of its files (its emulated PMEM, the volumes on it) and those over its
// daemons' exports. PowerOn starts only a fake-runtime node again.
func (n *Node) PowerOff() error {
	if n.namespace != nil {
		exports := daemonLoops(n.Dir) // listed while the daemons run
		errs := []error{n.kubelet.Halt(), n.runtime.Halt(), n.namespace.Halt()}
		for _, dev := range exports {
			errs = append(errs, detachLoop(dev))
		}
		if err := errors.Join(append(errs, DetachLoopsBelow(n.Dir))...); err != nil {
			return fmt.Errorf("power off node %s: %w", n.Name, err)
		}
		return nil
	}
	if err := errors.Join(n.kubelet.Halt(), n.runtime.Halt()); err != nil {
		return fmt.Errorf("power off node %s: %w", n.Name, err)
	}
	return ClearBelow(n.KubeletDir)
}

// PowerOn starts a node that was powered off again, its runtime (without pods, as after a
// reboot) and its kubelet, and waits until it listens.
func (n *Node) PowerOn(ctx context.Context) error {
	socket := filepath.Join(n.Dir, "cri.sock") // the dead runtime's, until the new one listens
	if err := os.Remove(socket); err != nil && !os.IsNotExist(err) {
		return err
	}
	runtime, err := n.runtime.Respawn()
	if err != nil {
		return err
	}
	n.runtime = runtime
	if err := WaitForFile(ctx, socket, n.runtime); err != nil {
		return err
	}
	n.kubelet, err = n.startSharingDevicePlugins(ctx, n.kubelet.Command)
	return err
}

// fakeNodeHostPaths are the hostPaths of type Directory that the installed system's pods (the
// guest-csi DaemonSet) mount. On a fake-runtime node they are the machine's, and nothing uses
// them, but the kubelet starts no pod whose hostPath is missing: a user of the lab would see
// those pods stuck in ContainerCreating.
var fakeNodeHostPaths = []string{"/var/lib/kubelet/plugins", "/var/lib/kubelet/plugins_registry", "/var/lib/kubelet/pods"}

// startFakeRuntime starts the node's fakecri.
func (n *Node) startFakeRuntime(ctx context.Context) error {
	for _, d := range []string{"pki", "podlogs", "volplugins"} {
		if err := os.MkdirAll(filepath.Join(n.Dir, d), 0o755); err != nil {
			return err
		}
	}
	for _, d := range fakeNodeHostPaths {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
	}
	fakecri, err := n.lab.bin.Own("./e2e/cmd/fakecri")
	if err != nil {
		return err
	}
	socket := filepath.Join(n.Dir, "cri.sock")
	if n.runtime, err = n.lab.Start(Command{
		Name: n.prefix + "/fakecri", Bin: fakecri, Args: []string{"--socket=" + socket},
		Dir: n.Dir, LogPath: filepath.Join(n.Dir, "fakecri.log"),
	}); err != nil {
		return err
	}
	return WaitForFile(ctx, socket, n.runtime)
}

// devicePluginSocket is where a kubelet serves its device-plugin registry, whatever its root
// dir. A kubelet deletes the files of that directory when it starts, then listens: two kubelets
// starting at once in one mount namespace can each delete the other's socket before either
// listens, and the second to listen exits ("bind: address already in use"). A containerd node
// has its own /var/lib/kubelet; the fake-runtime nodes share the machine's.
const devicePluginSocket = "/var/lib/kubelet/device-plugins/kubelet.sock"

// devicePluginLock is a lock file, outside that directory, that lets one fake-runtime kubelet
// at a time through its start, across the labs of every process on the machine.
const devicePluginLock = "/var/lib/kubelet/pvbridge-lab-kubelet-start.lock"

// startSharingDevicePlugins starts a kubelet of the machine's mount namespace, holding
// devicePluginLock until the kubelet listens on devicePluginSocket. The socket of a kubelet
// already running is deleted (as the new kubelet would do): no device plugin runs in the lab,
// and a kubelet does not look at its socket after it listens.
func (n *Node) startSharingDevicePlugins(ctx context.Context, c Command) (*Process, error) {
	if err := os.MkdirAll(filepath.Dir(devicePluginSocket), 0o755); err != nil {
		return nil, err
	}
	lock, err := os.OpenFile(devicePluginLock, os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, err
	}
	defer lock.Close() // releases the lock
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX); err != nil {
		return nil, fmt.Errorf("lock %s: %w", devicePluginLock, err)
	}
	if err := os.Remove(devicePluginSocket); err != nil && !os.IsNotExist(err) {
		return nil, err
	}
	p, err := n.lab.Start(c)
	if err != nil {
		return nil, err
	}
	if err := WaitForFile(ctx, devicePluginSocket, p); err != nil {
		return nil, fmt.Errorf("%s: %w", c.Name, err)
	}
	return p, nil
}

// kubeletOptions are what differs between the lab's kubelets.
type kubeletOptions struct {
	address                string // where the kubelet serves
	endpoint               string // the CRI socket
	podLogs, volumePlugins string
	port, healthzPort      int
}

// kubeletConfig is the lab's KubeletConfiguration (see shared/reference/lab-fit.md): no
// cgroups, no iptables, every path that defaults outside the root dir set per node, and a node
// status loop of 1 s (with a 5 min report period) so that a pod's volume is mounted in a second
// instead of ten.
func kubeletConfig(o kubeletOptions) string {
	return fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: %s
port: %d
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: %d
# The apiserver reaches the kubelet (logs, exec) without a client certificate; the kubelet
# listens only on 127.0.0.1, or on a containerd node's bridge address.
authentication: {anonymous: {enabled: true}, webhook: {enabled: false}}
authorization: {mode: AlwaysAllow}
cgroupDriver: cgroupfs
cgroupsPerQOS: false
# Without pod cgroups the kubelet makes none, and cgroupRoot only tells its cAdvisor which
# cgroups to collect statistics of: by default all of the machine's, every 10 s, in every
# kubelet of every lab. A path that has none leaves cAdvisor the machine's root alone (the
# node's figures). At "/" the lab's idle kubelets spent 7%% of a core each reading the 700
# cgroups that killed containerd nodes had left on this machine.
cgroupRoot: /pvbridge-lab-node
enforceNodeAllocatable: []
failCgroupV1: false
failSwapOn: false
containerRuntimeEndpoint: unix://%[4]s
imageServiceEndpoint: unix://%[4]s
registerNode: true
resolvConf: ""
podLogsDir: %[5]s
volumePluginDir: %[6]s
nodeStatusUpdateFrequency: 1s
# A pod is synced every 10 s, not every minute: kubelet notices an online expansion (and
# calls NodeExpandVolume) when it syncs the pod.
syncFrequency: 10s
# A failed attach leaves the volume in the attach-detach controller's state "assumed mounted
# until proven otherwise", and only a Node status write proves otherwise: a kubelet whose
# status did not change writes it every nodeStatusReportFrequency. At the default 5 minutes a
# refused volume's VolumeAttachment (and so its PV's deletion) waited up to 5 minutes after its
# pod was gone; the lab reports every 20 s.
nodeStatusReportFrequency: 20s
# A container that exits (a controller whose leader lease lapsed while the loaded machine
# stalled its API server) runs again within 20 s, not kubelet's default 5 minutes, which in a
# CI run kept a crash-looping csi-provisioner and with it a clone's provisioning away for longer
# than the test waits.
crashLoopBackOff: {maxContainerRestartPeriod: 20s}
makeIPTablesUtilChains: false
# CSI volume health (alpha in v1.37, with the apiserver's gate): the kubelet asks each node
# plugin that offers it for the health of every volume in use, every volumeStatsAggPeriod, and
# writes the answer into the pod's status.volumeHealth. 10 s instead of a minute, so that a
# test sees a change within seconds; the lab's pods have few volumes.
featureGates:
  CSIVolumeHealth: true
volumeStatsAggPeriod: 10s
# The nodes share the machine's disk, most of which is not theirs: at the default thresholds
# (85%% used) a node removed the images it had not run yet (the conformance tests' busybox, which
# no registry serves here) and would evict pods. No image garbage collection; evictions only
# when the machine is really out of room.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard:
  memory.available: 100Mi
  nodefs.available: 1%%
  nodefs.inodesFree: 1%%
  imagefs.available: 1%%
  imagefs.inodesFree: 1%%
`, o.address, o.port, o.healthzPort, o.endpoint, o.podLogs, o.volumePlugins)
}

func (n *Node) waitReady(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, StartTimeout)
	defer cancel()
	err := wait.PollUntilContextCancel(ctx, 100*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		if n.kubelet.Exited() {
			return false, fmt.Errorf("kubelet exited")
		}
		node, err := n.cp.client.CoreV1().Nodes().Get(ctx, n.Name, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		return NodeReady(node), nil
	})
	if err != nil {
		return fmt.Errorf("%s: node %s not ready: %w (log: %s)", n.cp.Name, n.Name, err, n.kubelet.LogPath)
	}
	return nil
}

// NodeReady reports whether a Node's Ready condition is True.
var NodeReady = vmv1.NodeReady

// StartTimeout bounds the wait for a process of the lab to serve (a socket, a Ready Node): the
// waits fail at once when the process exits, so the bound only has to outlast a loaded machine.
// With three labs and the QEMU worker beside one another (load average 130 on 2 cores), a new
// host's kubelet took 9 s to print its configuration and 30 more to open its device plugin
// socket: three minutes, as for an apiserver's /readyz (ControlPlane.waitReady).
const StartTimeout = 3 * time.Minute

// WaitForFile waits until path exists (a socket a process listens on), failing early if p exits.
func WaitForFile(ctx context.Context, path string, p *Process) error {
	ctx, cancel := context.WithTimeout(ctx, StartTimeout)
	defer cancel()
	return wait.PollUntilContextCancel(ctx, 20*time.Millisecond, true, func(context.Context) (bool, error) {
		if p.Exited() {
			return false, fmt.Errorf("%s exited; see %s", p.Name, p.LogPath)
		}
		_, err := os.Stat(path)
		return err == nil, nil
	})
}
