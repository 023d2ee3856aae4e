package cluster

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

	"k8s.io/apimachinery/pkg/util/wait"
)

// A containerd node is what a kind node is, without a container engine: its kubelet, its
// containerd and their pods live in a mount and PID namespace of their own, in which the node's
// directories are bind-mounted at the places a node has them (nodePaths), so that the shipped
// manifests' hostPaths mean what they mean on a real node and several nodes share one machine.
// Its network is the machine's (pods get their own, see podNetwork). When the namespace's first
// process ends, the kernel kills every other one: containers, shims, containerd, kubelet.

// nodePaths are a node's own directories, bind-mounted from <node dir>/root/<path>. Every
// socket a node's daemons listen on must be below one: /run/nri holds containerd's NRI socket,
// which containerd replaces at start, so two nodes starting at once collided on the machine's
// ("address already in use") and one that started later took over another's.
var nodePaths = []string{
	"/var/lib/kubelet", "/var/lib/containerd", "/run/containerd", "/run/nri", "/etc/cni/net.d",
	"/var/lib/cni", "/var/log/pods", "/var/lib/pvbridge", "/run/pvbridge",
}

// startNamespace starts the node's namespace and returns once its bind mounts are made: its own
// directories, then binds (path in the node → directory of the machine). Its first process is
// pause, which ends on SIGTERM and so ends the namespace.
func (n *Node) startNamespace(ctx context.Context, binds map[string]string) error {
	pause, err := n.lab.bin.Own("./e2e/cmd/pause")
	if err != nil {
		return err
	}
	ready := filepath.Join(n.Dir, "namespace-ready")
	var script strings.Builder
	// A new mount namespace copies every mount of the machine's, those of the other labs that
	// run beside this one too (their hosts' PMEM regions, their volumes' loop devices): a copy
	// here would keep their loop devices busy, after those labs unmount them, until this node
	// ends. They are dropped first.
	fmt.Fprintf(&script, "awk -v others=%q -v own=%q '%s' /proc/self/mountinfo | sort -r | xargs -r -n1 umount -l || true\n",
		labRootPrefix, n.lab.Root, `index($5, others) == 1 && $5 != own && index($5, own "/") != 1 { print $5 }`)
	if n.vm {
		// Its host name, and a hosts file of its own that names it (the VM writes it).
		hosts := filepath.Join(n.Dir, "hosts")
		if err := os.MkdirAll(n.Dir, 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(hosts, nil, 0o644); err != nil {
			return err
		}
		fmt.Fprintf(&script, "hostname %q\nmount --bind %q /etc/hosts\n", n.Name, hosts)
	}
	for _, p := range n.paths {
		// The mount point must exist in the machine's tree; it stays an empty directory there.
		if err := os.MkdirAll(p, 0o755); err != nil {
			return err
		}
		src := n.HostPath(p)
		if err := os.MkdirAll(src, 0o755); err != nil {
			return err
		}
		fmt.Fprintf(&script, "mount --bind %q %q\n", src, p)
	}
	for _, p := range slices.Sorted(maps.Keys(binds)) {
		// The mount point is made in the node's tree: below one of its own directories.
		if err := os.MkdirAll(n.HostPath(p), 0o755); err != nil {
			return err
		}
		fmt.Fprintf(&script, "mount --bind %q %q\n", binds[p], p)
	}
	// Shared, so that a pod's Bidirectional mount propagation works inside the node; the machine,
	// a master of this namespace, sees none of the node's mounts.
	fmt.Fprintf(&script, "mount --make-rshared /\ntouch %q\nexec %q\n", ready, pause)
	unshare := []string{"--mount", "--pid", "--fork", "--mount-proc", "--propagation", "slave"}
	if n.vm {
		unshare = append(unshare, "--net", "--uts")
	}
	n.namespace, err = n.lab.Start(Command{
		Name: n.prefix + "/namespace", Bin: "unshare",
		Args: append(unshare, "/bin/sh", "-ec", script.String()),
		Dir:  n.Dir, LogPath: filepath.Join(n.Dir, "namespace.log"),
	})
	if err != nil {
		return err
	}
	if err := WaitForFile(ctx, ready, n.namespace); err != nil {
		return err
	}
	// unshare forks the namespace's first process; nsenter joins it by its pid.
	children := fmt.Sprintf("/proc/%d/task/%[1]d/children", n.namespace.Pid())
	return wait.PollUntilContextTimeout(ctx, 20*time.Millisecond, 10*time.Second, true, func(context.Context) (bool, error) {
		data, err := os.ReadFile(children)
		if err != nil {
			return false, err
		}
		f := strings.Fields(string(data))
		if len(f) == 0 {
			return false, nil
		}
		n.nsPid, err = strconv.Atoi(f[0])
		return err == nil, err
	})
}

// HostPath returns where path of a containerd node's namespace is in the machine's tree, for
// the node's own directories (nodePaths); files are the same, mounts made inside are not seen.
func (n *Node) HostPath(path string) string { return filepath.Join(n.Dir, "root", path) }

// Command returns a command that runs name with args in the node's mount namespace (for a
// fake-runtime node, the machine's), as an administrator on the node would.
func (n *Node) Command(ctx context.Context, name string, args ...string) *exec.Cmd {
	if n.nsPid == 0 {
		return exec.CommandContext(ctx, name, args...)
	}
	return exec.CommandContext(ctx, "nsenter", append(n.nsenter("--mount"), append([]string{"--", name}, args...)...)...)
}

// inNamespace returns the command line that runs bin with args in the node's namespace.
func (n *Node) inNamespace(bin string, args ...string) (string, []string) {
	return "nsenter", append(n.nsenter("--mount", "--pid"), append([]string{"--", bin}, args...)...)
}

// nsenter returns nsenter's options that enter the node's namespaces of kinds, and a VM's
// network and host name.
func (n *Node) nsenter(kinds ...string) []string {
	o := append([]string{"--target", strconv.Itoa(n.nsPid)}, kinds...)
	if n.vm {
		o = append(o, "--net", "--uts")
	}
	return o
}

// containerdConfig is the configuration of a node's containerd: the default paths (which are
// the node's own in its namespace), runc from Debian, the lab's pause image, CNI from Debian,
// and, if certsDir is set, the registries' hosts.toml files in it.
func containerdConfig(certsDir string) string {
	config := `version = 3
[grpc]
  address = "/run/containerd/containerd.sock"
[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "` + SandboxImage + `"
[plugins.'io.containerd.cri.v1.runtime']
  # The machines the lab runs on may forbid lowering a process's oom_score_adj (this one
  # does): containers get no lower a score than containerd's, instead of failing to start.
  restrict_oom_score_adj = true
  [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
    BinaryName = "/usr/sbin/runc"
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["/usr/lib/cni"]
    conf_dir = "/etc/cni/net.d"
`
	if certsDir != "" {
		config += `[plugins.'io.containerd.cri.v1.images'.registry]
  config_path = "` + certsDir + `"
`
	}
	return config
}

// SandboxImage is the pause image of the lab's containerd nodes (images.LabImages builds it).
const SandboxImage = "registry.k8s.io/pause:3.10.2"

// startContainerd starts the node's containerd in its namespace and imports the image archives.
func (n *Node) startContainerd(ctx context.Context, archives []string) error {
	bin, err := n.lab.bin.Tool("containerd")
	if err != nil {
		return err
	}
	ctr, err := n.lab.bin.Tool("ctr")
	if err != nil {
		return err
	}
	config := filepath.Join(n.Dir, "containerd.toml")
	certsDir := ""
	if n.vm {
		certsDir = vmCertsDir
	}
	if err := os.WriteFile(config, []byte(containerdConfig(certsDir)), 0o644); err != nil {
		return err
	}
	nsenter, args := n.inNamespace(bin, "--config", config)
	if n.runtime, err = n.lab.Start(Command{
		Name: n.prefix + "/containerd", Bin: nsenter, Args: args,
		// containerd finds its shim, the shim runc, in PATH.
		Env: []string{"PATH=" + filepath.Dir(bin) + ":/usr/sbin:/usr/bin:/sbin:/bin"},
		Dir: n.Dir, LogPath: filepath.Join(n.Dir, "containerd.log"),
	}); err != nil {
		return err
	}
	socket := n.HostPath("/run/containerd/containerd.sock")
	if err := WaitForFile(ctx, socket, n.runtime); err != nil {
		return err
	}
	for _, a := range archives {
		out, err := exec.CommandContext(ctx, ctr, "--address", socket, "--namespace", "k8s.io", "images", "import", "--local", a).CombinedOutput()
		if err != nil {
			return fmt.Errorf("%s: import %s: %w\n%s", n.Name, a, err, out)
		}
	}
	return nil
}
