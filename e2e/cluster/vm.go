package cluster

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"sigs.k8s.io/yaml"
)

// A lab VM is a machine that boots as a cloud VM does, for Cluster API: a containerd node (see
// containerd.go) with a network and host name of its own, whose first boot runs its user data
// as cloud-init would (CloudConfig: files, then commands, such as `kubeadm init`), and whose
// kubelet runs as kubeadm's systemd unit runs it, once kubeadm has written its configuration.
// What it runs comes from the lab's binaries (kubeadm, kubelet, containerd) and the machine's
// programs, as a VM image would carry them; the image's lab-specific kubelet settings (no
// cgroups of its own, cgroup v1) are a kubelet drop-in of the VM's, not the user data's.
//
// Its network is a veth pair: eth0 in the VM with 10.250.<i>.2/24, 10.250.<i>.1 on the
// machine, the VM's default route. Its pods are on a bridge of the VM, 10.245.<i>.0/24, which
// the machine routes to the VM. As from a pod network, the VM reaches each control plane of the
// lab at its Service address, and the lab's registry at 10.250.<i>.1: its containerd pulls
// every image from there (Registry), nothing is imported.

// vmPaths are a VM's directories besides nodePaths: what kubeadm and Cluster API's bootstrap
// data write, containerd's registry configuration, and the kernel's modules, which kube-proxy's
// DaemonSet mounts (empty: the machine's kernel has its netfilter built in).
var vmPaths = []string{"/etc/kubernetes", "/var/lib/etcd", "/run/kubeadm", "/run/cluster-api", "/etc/containerd", "/lib/modules", "/etc/keepalived", "/run/keepalived"}

// vmLocks holds one file per VM network in use across the labs of the machine.
const vmLocks = "/run/pvbridge-lab/vms"

// The VM's own programs and kubelet drop-in, and its containerd's registry hosts (containerd's
// config_path, at the place containerd's documentation has it), in its namespace.
const (
	vmBin            = "/run/pvbridge/bin"
	vmKubeletDropIns = "/run/pvbridge/kubelet.conf.d"
	vmCertsDir       = "/etc/containerd/certs.d"
)

// VMOptions configure a VM.
type VMOptions struct {
	// Registry is the lab's registry, from which the VM's containerd pulls every image: the
	// images pushed to it by their names (registry.k8s.io/pause, docker.io/library/busybox)
	// and those a user pushed to its address.
	Registry *Registry
	// Binds are more directories of the VM (see NodeOptions.Binds).
	Binds map[string]string
	// UserData and MetaData are its NoCloud seed; UserData a cloud-config.
	UserData, MetaData []byte
	// Addresses are more addresses of the VM, routed to it by the machine: the control plane
	// endpoint that a cloud's load balancer would give it.
	Addresses []string
	// Segment, a control plane endpoint of the lab (Lab.ControlPlaneEndpoint), puts the VM on
	// that endpoint's L2 segment too (a second link, eth1), where the control plane machines
	// hold the endpoint's address among themselves, as VMs on one bridge of their hosts do.
	Segment string
}

// VM is a running lab VM.
type VM struct {
	*Node
	// Address is the VM's address, on eth0.
	Address string
	// PodSubnet is its pods' subnet.
	PodSubnet string

	instanceID string
	network    *podNetwork
	booted     chan struct{} // closed when the user data has run
	bootErr    error
	stop       sync.Once
}

// StartVM boots VM name: it returns once the VM's containerd and kubelet service run, while its
// user data runs (WaitBooted).
func (l *Lab) StartVM(ctx context.Context, name string, opts VMOptions) (*VM, error) {
	if opts.Registry == nil {
		return nil, fmt.Errorf("vm %s: no registry to pull its images from", name)
	}
	config, err := ParseCloudConfig(opts.UserData, opts.MetaData)
	if err != nil {
		return nil, fmt.Errorf("vm %s: %w", name, err)
	}
	var meta struct {
		InstanceID string `json:"instance-id"`
	}
	if err := yaml.Unmarshal(opts.MetaData, &meta); err != nil {
		return nil, fmt.Errorf("vm %s: meta-data: %w", name, err)
	}
	if meta.InstanceID == "" {
		return nil, fmt.Errorf("vm %s: meta-data without an instance-id", name)
	}
	// One directory per instance: a VM powered on again is the same machine, which keeps its
	// files and does not run its user data twice, as cloud-init does not; a new VM of the same
	// name is another machine.
	dir := filepath.Join(l.Root, "vms", name+"-"+firstN(meta.InstanceID, 8))
	if id, err := os.ReadFile(filepath.Join(dir, "instance-id")); err == nil && string(id) == meta.InstanceID {
		config = &CloudConfig{}
	}
	vm := &VM{
		Node: &Node{
			Name: name, Dir: dir, lab: l, prefix: "vm/" + name,
			paths: append(append([]string(nil), nodePaths...), vmPaths...), vm: true,
		},
		instanceID: meta.InstanceID,
		booted:     make(chan struct{}),
	}
	vm.KubeletDir = vm.HostPath("/var/lib/kubelet")
	if err := vm.startNamespace(ctx, opts.Binds); err != nil {
		return nil, err
	}
	l.AtStop(vm.Stop)
	if err := vm.startNetwork(opts.Addresses, opts.Segment, opts.Registry); err != nil {
		return nil, err
	}
	if err := vm.writeImage(opts.Registry); err != nil {
		return nil, err
	}
	if err := vm.startContainerd(ctx, nil); err != nil {
		return nil, err
	}
	if err := vm.startKubeletService(); err != nil {
		return nil, err
	}
	go vm.runCloudConfig(l.ctx, config)
	return vm, nil
}

// startNetwork makes the VM's link and addresses, its link to the segment of a control plane
// endpoint if it has one, the machine's route to its pods, and the machine's rule that takes the
// VM's connections to the registry's port at the machine's address on the link to the registry
// on 127.0.0.1 (route_localnet on the link).
func (vm *VM) startNetwork(addresses []string, segment string, registry *Registry) error {
	var i int
	pn, err := vm.lab.startNetwork(vmLocks, func(n int) *podNetwork {
		i = n
		return &podNetwork{Bridge: fmt.Sprintf("pvbvm%d", n), Subnet: fmt.Sprintf("10.250.%d.0/24", n), Gateway: fmt.Sprintf("10.250.%d.1", n)}
	}, func(pn *podNetwork) error {
		vm.Address, vm.PodSubnet = fmt.Sprintf("10.250.%d.2", i), fmt.Sprintf("10.245.%d.0/24", i)
		in := append([]string{"nsenter"}, vm.nsenter()...)
		cmds := [][]string{
			{"ip", "link", "add", pn.Bridge, "type", "veth", "peer", "name", "eth0", "netns", fmt.Sprint(vm.nsPid)},
			{"ip", "addr", "add", pn.Gateway + "/24", "dev", pn.Bridge},
			{"ip", "link", "set", pn.Bridge, "up"},
			{"sysctl", "-q", "-w", "net.ipv4.conf." + pn.Bridge + ".route_localnet=1"},
			append(in, "ip", "link", "set", "lo", "up"),
			append(in, "ip", "addr", "add", vm.Address+"/24", "dev", "eth0"),
			append(in, "ip", "link", "set", "eth0", "up"),
			append(in, "ip", "route", "add", "default", "via", pn.Gateway),
			append(in, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1"),
			{"ip", "route", "replace", vm.PodSubnet, "via", vm.Address},
		}
		for _, a := range addresses {
			cmds = append(cmds, append(in, "ip", "addr", "add", a+"/32", "dev", "eth0"), []string{"ip", "route", "replace", a + "/32", "via", vm.Address})
		}
		if segment != "" {
			bridge, prefix, err := endpointSegment(segment)
			if err != nil {
				return err
			}
			if i > 252 {
				return fmt.Errorf("no address for VM network %d on segment %s", i, bridge)
			}
			link := pn.Bridge + "s"
			cmds = append(cmds,
				[]string{"ip", "link", "add", link, "type", "veth", "peer", "name", "eth1", "netns", fmt.Sprint(vm.nsPid)},
				[]string{"ip", "link", "set", link, "master", bridge, "up"},
				append(in, "ip", "addr", "add", fmt.Sprintf("%s.%d/24", prefix, i+1), "dev", "eth1"),
				append(in, "ip", "link", "set", "eth1", "up"))
		}
		if err := run(cmds); err != nil {
			return err
		}
		return pn.dnat(pn.Gateway, registry.Port, registry.Address)
	})
	if err != nil {
		return fmt.Errorf("vm %s: network: %w", vm.Name, err)
	}
	vm.network = pn
	return nil
}

// writeImage writes what the VM's image has besides the machine's programs: its hosts file
// (written in place: it is bind-mounted at /etc/hosts), its pods' network, its containerd's
// registry mirrors (the lab's registry at the machine's address on the VM's link), its kubelet
// drop-in, and a systemctl that kubeadm finds first in PATH, which restarts the VM's kubelet
// rather than the machine's.
func (vm *VM) writeImage(registry *Registry) error {
	hosts := fmt.Sprintf("127.0.0.1\tlocalhost\n%s\t%s\n", vm.Address, vm.Name)
	if err := os.WriteFile(filepath.Join(vm.Dir, "hosts"), []byte(hosts), 0o644); err != nil {
		return err
	}
	files := map[string]string{
		"/etc/cni/net.d/10-vm.conflist": fmt.Sprintf(`{
  "cniVersion": "1.0.0",
  "name": "vm",
  "plugins": [
    {
      "type": "bridge", "bridge": "cni0", "isGateway": true, "hairpinMode": true,
      "ipam": {"type": "host-local", "ranges": [[{"subnet": %q}]], "routes": [{"dst": "0.0.0.0/0"}]}
    }
  ]
}
`, vm.PodSubnet),
		vmKubeletDropIns + "/10-lab.conf": vmKubeletDropIn,
		vmBin + "/systemctl":              vmSystemctl,
	}
	for host, hosts := range registry.mirrors(net.JoinHostPort(vm.network.Gateway, strconv.Itoa(registry.Port))) {
		files[path.Join(vmCertsDir, host, "hosts.toml")] = hosts
	}
	for p, data := range files {
		if err := os.MkdirAll(filepath.Dir(vm.HostPath(p)), 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(vm.HostPath(p), []byte(data), 0o755); err != nil {
			return err
		}
	}
	return nil
}

// vmKubeletDropIn is the lab's part of kubeletConfig, for a kubelet that kubeadm configures.
const vmKubeletDropIn = `apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
cgroupDriver: cgroupfs
cgroupsPerQOS: false
cgroupRoot: /pvbridge-lab-node
enforceNodeAllocatable: ["none"]
failCgroupV1: false
failSwapOn: false
makeIPTablesUtilChains: false
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: 100Mi, nodefs.available: 1%, nodefs.inodesFree: 1%, imagefs.available: 1%, imagefs.inodesFree: 1%}
crashLoopBackOff: {maxContainerRestartPeriod: 20s}
`

// kubeadmInitConfig is where Cluster API's kubeadm bootstrap provider writes the configuration
// of `kubeadm init`.
const kubeadmInitConfig = "/run/kubeadm/kubeadm.yaml"

// vmKubeProxyConfig is what a lab VM adds to kubeadm init's configuration, as Cluster API's
// docker provider adds it for its containers (cluster-api#4712): kube-proxy leaves
// nf_conntrack_max alone. The limit is the kernel's, which a lab VM shares with the machine;
// from the VM's network namespace it is read-only, and kube-proxy, which by default sets it
// whenever it differs from its own figure, exits on the write.
const vmKubeProxyConfig = `
---
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
conntrack:
  maxPerCore: 0
`

// vmSystemctl answers kubeadm's use of systemd (is-active, enable, daemon-reload, restart of
// kubelet.service): a restart ends the VM's kubelet, which its service starts again.
const vmSystemctl = `#!/bin/sh
for a; do
	case "$a" in restart | stop) action=$a ;; kubelet | kubelet.service) unit=kubelet ;; esac
done
if [ -n "$action" ] && [ "$unit" = kubelet ]; then
	pkill -x kubelet
fi
exit 0
`

// vmKubeletService runs the kubelet as kubeadm's systemd drop-in does (10-kubeadm.conf), once
// kubeadm has written its configuration, with the VM image's drop-in directory.
const vmKubeletService = `[ -f /var/lib/kubelet/config.yaml ] || { sleep 1; exit 1; }
KUBELET_KUBEADM_ARGS=
[ ! -f /var/lib/kubelet/kubeadm-flags.env ] || . /var/lib/kubelet/kubeadm-flags.env
exec kubelet --bootstrap-kubeconfig=/etc/kubernetes/bootstrap-kubelet.conf --kubeconfig=/etc/kubernetes/kubelet.conf \
	--config=/var/lib/kubelet/config.yaml --config-dir=` + vmKubeletDropIns + ` $KUBELET_KUBEADM_ARGS
`

// path is PATH in the VM: its own programs, the lab's binaries, the machine's.
func (vm *VM) path() (string, error) {
	kubelet, err := vm.lab.bin.Tool("kubelet")
	if err != nil {
		return "", err
	}
	kubeadm, err := vm.lab.bin.Tool("kubeadm")
	if err != nil {
		return "", err
	}
	return strings.Join([]string{vmBin, filepath.Dir(kubeadm), filepath.Dir(kubelet), "/usr/sbin", "/usr/bin", "/sbin", "/bin"}, ":"), nil
}

func (vm *VM) startKubeletService() error {
	path, err := vm.path()
	if err != nil {
		return err
	}
	bin, args := vm.inNamespace("/bin/sh", "-c", vmKubeletService)
	vm.kubelet, err = vm.lab.Start(Command{
		Name: vm.prefix + "/kubelet", Bin: bin, Args: args, Env: []string{"PATH=" + path},
		Dir: vm.Dir, LogPath: filepath.Join(vm.Dir, "kubelet.log"), Restart: true,
	})
	return err
}

// runCloudConfig runs the user data as cloud-init's first boot does, logging to
// cloud-init-output.log: every file, then each boot command and each run command; the first
// that fails ends it.
func (vm *VM) runCloudConfig(ctx context.Context, c *CloudConfig) {
	defer close(vm.booted)
	logPath := filepath.Join(vm.Dir, "cloud-init-output.log")
	log, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		vm.bootErr = err
		return
	}
	defer log.Close()
	if len(c.Unsupported) > 0 {
		fmt.Fprintf(log, "not run (the lab VM runs write_files, bootcmd, runcmd only): %s\n", strings.Join(c.Unsupported, ", "))
	}
	vm.bootErr = vm.cloudConfig(ctx, c, log)
	if vm.bootErr == nil {
		vm.bootErr = os.WriteFile(filepath.Join(vm.Dir, "instance-id"), []byte(vm.instanceID), 0o644)
	}
	if vm.bootErr != nil {
		vm.bootErr = fmt.Errorf("vm %s: %w (log: %s)", vm.Name, vm.bootErr, logPath)
		fmt.Fprintln(log, vm.bootErr)
	}
}

func (vm *VM) cloudConfig(ctx context.Context, c *CloudConfig, log *os.File) error {
	for _, f := range c.WriteFiles {
		if err := vm.writeFile(f); err != nil {
			return err
		}
		fmt.Fprintf(log, "wrote %s\n", f.Path)
	}
	path, err := vm.path()
	if err != nil {
		return err
	}
	for _, cmd := range append(append([]CloudCommand(nil), c.BootCmd...), c.RunCmd...) {
		args := cmd.Args()
		fmt.Fprintf(log, "+ %s\n", strings.Join(args, " "))
		start := time.Now()
		bin, nsArgs := vm.inNamespace(args[0], args[1:]...)
		x := exec.CommandContext(ctx, bin, nsArgs...)
		x.Env = append(os.Environ(), "PATH="+path, "HOME=/root")
		x.Stdout, x.Stderr = log, log
		if err := x.Run(); err != nil {
			return fmt.Errorf("%s: %w", strings.Join(args, " "), err)
		}
		fmt.Fprintf(log, "(%.1f s)\n", time.Since(start).Seconds())
	}
	return nil
}

// writeFile writes a file of the user data into the VM's own directories: a path elsewhere
// would be the machine's, and is refused.
func (vm *VM) writeFile(f CloudFile) error {
	own := false
	for _, p := range vm.paths {
		own = own || f.Path == p || strings.HasPrefix(f.Path, p+"/")
	}
	if !own || strings.Contains(f.Path, "/../") {
		return fmt.Errorf("write_files %s: not below a directory of the VM (%s)", f.Path, strings.Join(vm.paths, ", "))
	}
	data, err := f.Data()
	if err != nil {
		return err
	}
	if f.Path == kubeadmInitConfig {
		data = append(data, vmKubeProxyConfig...)
	}
	mode, err := f.Mode()
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(vm.HostPath(f.Path)), 0o755); err != nil {
		return err
	}
	flags := os.O_CREATE | os.O_WRONLY | os.O_TRUNC
	if f.Append {
		flags = os.O_CREATE | os.O_WRONLY | os.O_APPEND
	}
	file, err := os.OpenFile(vm.HostPath(f.Path), flags, os.FileMode(mode))
	if err != nil {
		return err
	}
	_, err = file.Write(data)
	return errors.Join(err, file.Chmod(os.FileMode(mode)), file.Close())
}

// WaitBooted waits until the user data has run, and returns its error.
func (vm *VM) WaitBooted(ctx context.Context) error {
	select {
	case <-vm.booted:
		return vm.bootErr
	case <-ctx.Done():
		return fmt.Errorf("vm %s: user data still running: %w", vm.Name, ctx.Err())
	}
}

// Stop powers the VM off: every process of its namespace ends with it, then its network goes.
// It is idempotent.
func (vm *VM) Stop() error {
	var err error
	vm.stop.Do(func() {
		var errs []error
		for _, p := range []*Process{vm.kubelet, vm.runtime, vm.namespace} {
			if p != nil {
				errs = append(errs, p.Stop())
			}
		}
		if vm.network != nil {
			// The machine's route to the VM's pods goes with the link.
			errs = append(errs, vm.lab.stopNetwork(vm.network))
		}
		err = errors.Join(errs...)
	})
	return err
}

func firstN(s string, n int) string {
	if len(s) > n {
		return s[:n]
	}
	return s
}

// endpointLocks holds one file per control plane endpoint address in use across the labs.
const endpointLocks = "/run/pvbridge-lab/endpoints"

// ControlPlaneEndpoint reserves an address for a guest cluster's control plane endpoint,
// 10.251.<i>.1, until the lab stops, with its L2 segment: a bridge pvbep<i> of 10.251.<i>.0/24
// (the machine at .254). Either a cloud's load balancer gives the address to the VM whose kubeadm
// init makes the endpoint's apiserver (VMOptions.Addresses, a route more specific than the
// segment's), or the control plane machines on the segment hold it among themselves
// (VMOptions.Segment: keepalived, VRRP).
func (l *Lab) ControlPlaneEndpoint() (string, error) {
	var prefix string
	pn, err := l.startNetwork(endpointLocks, func(i int) *podNetwork {
		prefix = fmt.Sprintf("10.251.%d", i)
		// No Gateway: an address, not a pod network. The lab's stop and its reaper delete the bridge.
		return &podNetwork{Bridge: fmt.Sprintf("pvbep%d", i)}
	}, func(pn *podNetwork) error {
		return run([][]string{
			{"ip", "link", "add", pn.Bridge, "type", "bridge"},
			{"ip", "addr", "add", prefix + ".254/24", "dev", pn.Bridge},
			{"ip", "link", "set", pn.Bridge, "up"},
		})
	})
	if err != nil {
		return "", fmt.Errorf("control plane endpoint: %w", err)
	}
	l.AtStop(func() error { return l.stopNetwork(pn) })
	return prefix + ".1", nil
}

// endpointSegment returns the bridge of the L2 segment of a control plane endpoint of
// ControlPlaneEndpoint, and its /24's first three octets.
func endpointSegment(endpoint string) (bridge, prefix string, err error) {
	ip := net.ParseIP(endpoint).To4()
	if ip == nil || ip[0] != 10 || ip[1] != 251 || ip[3] != 1 {
		return "", "", fmt.Errorf("%q is not a control plane endpoint of the lab (10.251.<i>.1)", endpoint)
	}
	return fmt.Sprintf("pvbep%d", ip[2]), fmt.Sprintf("10.251.%d", ip[2]), nil
}
