package cluster

import (
	"context"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
)

// Node is a real kubelet whose container runtime is fakecri: pods run without processes, but
// the kubelet's volume manager makes real CSI calls to the plugins registered in its
// PluginRegistryDir.
type Node struct {
	Name string
	// Dir holds the node's files: kubelet/ (its root dir), pki/, podlogs/, volplugins/, cwd/, logs.
	Dir string
	// KubeletDir is the kubelet's --root-dir.
	KubeletDir string

	cp      *ControlPlane
	cri     *Process
	kubelet *Process
}

// NodeOptions configures a node.
type NodeOptions struct {
	// Labels are set on the Node when the kubelet registers it.
	Labels map[string]string
}

// PluginRegistryDir is where CSI node plugins put their kubelet registration sockets.
func (n *Node) PluginRegistryDir() string { return filepath.Join(n.KubeletDir, "plugins_registry") }

// PluginDir is the conventional directory of a CSI driver's socket on this node.
func (n *Node) PluginDir(driver string) string { return filepath.Join(n.KubeletDir, "plugins", driver) }

// Kubelet returns the kubelet process.
func (n *Node) Kubelet() *Process { return n.kubelet }

// AddNode starts a kubelet named name with its own fake container runtime and waits until the
// Node is Ready.
func (cp *ControlPlane) AddNode(ctx context.Context, name string, opts NodeOptions) (*Node, error) {
	n := &Node{Name: name, Dir: filepath.Join(cp.Dir, "nodes", name), cp: cp}
	n.KubeletDir = filepath.Join(n.Dir, "kubelet")
	// The kubelet runs in an empty working directory of its own: a runtime that reports no
	// container log path makes it delete the files of its working directory.
	for _, d := range []string{"kubelet", "pki", "podlogs", "volplugins", "cwd"} {
		if err := os.MkdirAll(filepath.Join(n.Dir, d), 0o755); err != nil {
			return nil, err
		}
	}
	p, err := freePorts(2)
	if err != nil {
		return nil, err
	}
	criSocket := filepath.Join(n.Dir, "cri.sock")
	fakecri, err := cp.lab.bin.Own("./e2e/cmd/fakecri")
	if err != nil {
		return nil, err
	}
	if n.cri, err = cp.lab.Start(Command{
		Name: cp.Name + "/" + name + "/fakecri", Bin: fakecri, Args: []string{"--socket=" + criSocket},
		Dir: n.Dir, LogPath: filepath.Join(n.Dir, "fakecri.log"),
	}); err != nil {
		return nil, err
	}
	if err := WaitForFile(ctx, criSocket, n.cri); err != nil {
		return nil, err
	}

	config := filepath.Join(n.Dir, "config.yaml")
	if err := os.WriteFile(config, []byte(kubeletConfig(n.Dir, criSocket, p[0], p[1])), 0o644); err != nil {
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
	kubeletBin, err := cp.lab.bin.Tool("kubelet")
	if err != nil {
		return nil, err
	}
	args := []string{
		"--config=" + config, "--kubeconfig=" + kubeconfig,
		"--root-dir=" + n.KubeletDir, "--cert-dir=" + filepath.Join(n.Dir, "pki"),
		"--hostname-override=" + name,
	}
	if len(opts.Labels) > 0 {
		var l []string
		for _, k := range slices.Sorted(maps.Keys(opts.Labels)) {
			l = append(l, k+"="+opts.Labels[k])
		}
		args = append(args, "--node-labels="+strings.Join(l, ","))
	}
	if n.kubelet, err = cp.lab.Start(Command{
		Name: cp.Name + "/" + name + "/kubelet", Bin: kubeletBin, Args: args,
		Dir: filepath.Join(n.Dir, "cwd"), LogPath: filepath.Join(n.Dir, "kubelet.log"),
	}); err != nil {
		return nil, err
	}
	if err := n.waitReady(ctx); err != nil {
		return nil, err
	}
	return n, nil
}

// kubeletConfig is the lab's KubeletConfiguration (see shared/reference/lab-fit.md): no
// cgroups, no iptables, every path that defaults outside the root dir set per node, and a node
// status loop of 1 s (with a 5 min report period) so that a pod's volume is mounted in a second
// instead of ten.
func kubeletConfig(dir, criSocket string, port, healthzPort int) string {
	return fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: 127.0.0.1
port: %d
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: %d
authentication: {anonymous: {enabled: false}, webhook: {enabled: false}}
authorization: {mode: AlwaysAllow}
cgroupDriver: cgroupfs
cgroupsPerQOS: false
enforceNodeAllocatable: []
failCgroupV1: false
failSwapOn: false
containerRuntimeEndpoint: unix://%[3]s
imageServiceEndpoint: unix://%[3]s
registerNode: true
resolvConf: ""
podLogsDir: %[4]s/podlogs
volumePluginDir: %[4]s/volplugins
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
makeIPTablesUtilChains: false
`, port, healthzPort, criSocket, dir)
}

func (n *Node) waitReady(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
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
func NodeReady(node *corev1.Node) bool {
	for _, c := range node.Status.Conditions {
		if c.Type == corev1.NodeReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// WaitForFile waits until path exists (a socket a process listens on), failing early if p exits.
func WaitForFile(ctx context.Context, path string, p *Process) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	return wait.PollUntilContextCancel(ctx, 20*time.Millisecond, true, func(context.Context) (bool, error) {
		if p.Exited() {
			return false, fmt.Errorf("%s exited; see %s", p.Name, p.LogPath)
		}
		_, err := os.Stat(path)
		return err == nil, nil
	})
}
