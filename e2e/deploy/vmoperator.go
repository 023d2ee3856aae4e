package deploy

import (
	"fmt"
	"path/filepath"
	"time"

	"pvbridge.io/e2e/cluster"
	"pvbridge.io/pkg/names"
)

// VMOperator is vm-operator deployed into the management cluster: its controller and, on every
// host, a host agent with the local hypervisor (a VM is a directory below the host's VMRoot), or
// with the qemu hypervisor on the hosts QEMUHosts names (a VM is a QEMU process whose files are
// below the host's QEMURunDir).
type VMOperator struct {
	Controller *cluster.Process
	// Agents, VMRoots and QEMURunDirs are keyed by host name.
	Agents      map[string]*cluster.Process
	VMRoots     map[string]string
	QEMURunDirs map[string]string
}

// QEMUHosts are the hosts whose agents run the shipped qemu hypervisor, each with the
// vm-operator flags of its VMs (--qemu-kernel, --qemu-memory-mib, ...).
type QEMUHosts map[string][]string

// VMHostLabels are the labels that make a management Node a VM host.
var VMHostLabels = map[string]string{"vm.pvbridge.io/host": "true"}

// UnplugTimeout is how long the lab's host agents give a guest that holds its disks before
// they force its VM off (the default is 5 minutes; the lab's specs wait for it).
const UnplugTimeout = 20 * time.Second

// StartVMOperator deploys vm-operator next to mgmt-csi: the controller, and a host agent per host
// that stages volumes through that host's mgmt-csi node plugin.
func StartVMOperator(lab *cluster.Lab, m *Management, qemuHosts QEMUHosts) (*VMOperator, error) {
	bin, err := lab.Binaries().Own("./vm-operator/cmd/vm-operator")
	if err != nil {
		return nil, err
	}
	op := &VMOperator{Agents: map[string]*cluster.Process{}, VMRoots: map[string]string{}, QEMURunDirs: map[string]string{}}
	common := []string{"--kubeconfig=" + m.CP.Kubeconfig, "--metrics-bind-address=0", "--health-probe-bind-address=0", "--v=4"}
	op.Controller, err = lab.Start(cluster.Command{
		Name: m.CP.Name + "/vm-operator", Bin: bin, Dir: filepath.Join(m.CP.Dir, "vm-operator"),
		LogPath: filepath.Join(m.CP.Dir, "logs", "vm-operator.log"),
		Args:    append([]string{"--role=controller"}, common...),
		Restart: true,
	})
	if err != nil {
		return nil, err
	}
	for _, h := range m.Hosts {
		name := h.Node.Name
		hypervisor := []string{"--hypervisor=local"}
		var cgroup string
		if args, ok := qemuHosts[name]; ok {
			// Below the lab's short root: the VMs' sockets are in it (the unix socket limit).
			op.QEMURunDirs[name] = filepath.Join(lab.Root, "qemu-"+name)
			// As the shipped DaemonSet: the agent in a cgroup of its own (its container's),
			// which its Kill kills whole; each VM's QEMU in one of its own beside it.
			cgroup = "host-agent-" + name
			hypervisor = append([]string{
				"--hypervisor=qemu", "--qemu-run-dir=" + op.QEMURunDirs[name], "--qemu-cgroup-parent=" + lab.Cgroup("vms-"+name),
			}, args...)
		} else {
			op.VMRoots[name] = filepath.Join(h.Node.Dir, "vms")
			hypervisor = append(hypervisor, "--vm-root="+op.VMRoots[name])
		}
		op.Agents[name], err = lab.Start(cluster.Command{
			Name: fmt.Sprintf("%s/%s/host-agent", m.CP.Name, name), Bin: bin,
			Dir: filepath.Join(h.Node.Dir, "host-agent"), LogPath: filepath.Join(h.Node.Dir, "host-agent.log"),
			Args: append([]string{
				"--role=host-agent", "--node-name=" + name,
				"--csi-endpoint=unix://" + filepath.Join(h.Node.PluginDir(names.PmemDriver), "csi.sock"),
				"--state-dir=" + filepath.Join(h.Node.Dir, "host-agent"),
				"--unplug-timeout=" + UnplugTimeout.String(),
			}, append(hypervisor, common...)...),
			Restart: true, Cgroup: cgroup,
		})
		if err != nil {
			return nil, err
		}
	}
	return op, nil
}
