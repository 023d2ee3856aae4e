package cluster

import (
	"fmt"
	"net"
	"os"
	"path"
	"path/filepath"
	"strconv"
)

// QEMUNetwork is what an admin gives the QEMU VMs of a host (the qemu hypervisor's
// --qemu-network=bridge:<name>): a Linux bridge of the host, 10.250.<i>.0/24 with the machine at
// 10.250.<i>.1 as the VMs' router, and a DHCP server on it (busybox's udhcpd) from which each
// VM's cloud-init takes its address. The lab's containerd hosts share the machine's network
// namespace, so the bridge is the machine's, as a lab VM's link is: the VMs reach every control
// plane of the lab through the machine's routes and the lab's registry at 10.250.<i>.1, and the
// control planes reach their kubelets at the VMs' addresses (logs, exec).
//
// A lab VM's image has its pods' network and its containerd's registry mirrors (writeImage);
// the node image of a QEMU VM has neither, so GuestFiles gives them to its bootstrap data, as
// a cluster template's files would: the pods of the network's VMs are on a bridge of each VM,
// 10.245.<i>.0/24 (the index lock keeps lab VMs off it), masqueraded to the VM's address and
// reachable from that VM only; and the lab's registry mirrors every image host.
type QEMUNetwork struct {
	// Bridge is the bridge's name, Gateway the machine's address on it.
	Bridge, Gateway string
	// PodSubnet is the VMs' pods' subnet.
	PodSubnet string

	registry *Registry
}

// StartQEMUNetwork makes a QEMU network whose VMs pull from registry, until the lab stops.
func (l *Lab) StartQEMUNetwork(registry *Registry) (*QEMUNetwork, error) {
	q := &QEMUNetwork{registry: registry}
	pn, err := l.startNetwork(vmLocks, func(i int) *podNetwork {
		q.PodSubnet = fmt.Sprintf("10.245.%d.0/24", i)
		return &podNetwork{Bridge: fmt.Sprintf("pvbq%d", i), Subnet: fmt.Sprintf("10.250.%d.0/24", i), Gateway: fmt.Sprintf("10.250.%d.1", i)}
	}, func(pn *podNetwork) error {
		if err := pn.start(); err != nil {
			return err
		}
		return pn.dnat(pn.Gateway, registry.Port, registry.Address)
	})
	if err != nil {
		return nil, fmt.Errorf("qemu network: %w", err)
	}
	l.AtStop(func() error { return l.stopNetwork(pn) })
	q.Bridge, q.Gateway = pn.Bridge, pn.Gateway

	dir := filepath.Join(l.Root, "qemu-networks", pn.Bridge)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	prefix := pn.Gateway[:len(pn.Gateway)-len("1")]
	conf := fmt.Sprintf("interface %s\nstart %s2\nend %s254\nlease_file %s\noption subnet 255.255.255.0\noption router %s\noption lease 86400\n",
		pn.Bridge, prefix, prefix, filepath.Join(dir, "leases"), pn.Gateway)
	if err := os.WriteFile(filepath.Join(dir, "udhcpd.conf"), []byte(conf), 0o644); err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(dir, "leases"), nil, 0o644); err != nil {
		return nil, err
	}
	if _, err := l.Start(Command{
		Name: "qemu-network/" + pn.Bridge + "/dhcp", Bin: "busybox", Args: []string{"udhcpd", "-f", filepath.Join(dir, "udhcpd.conf")},
		Dir: dir, LogPath: filepath.Join(dir, "udhcpd.log"), Restart: true,
	}); err != nil {
		return nil, err
	}
	return q, nil
}

// GuestFiles are the files (path → content) a VM of the network needs besides its node image:
// its pods' network and its containerd's registry mirrors.
func (q *QEMUNetwork) GuestFiles() map[string]string {
	files := map[string]string{
		"/etc/cni/net.d/10-pods.conflist": fmt.Sprintf(`{
  "cniVersion": "1.0.0",
  "name": "pods",
  "plugins": [
    {
      "type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": true, "hairpinMode": true,
      "ipam": {"type": "host-local", "ranges": [[{"subnet": %q}]], "routes": [{"dst": "0.0.0.0/0"}]}
    },
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
`, q.PodSubnet),
	}
	for host, hosts := range q.registry.mirrors(net.JoinHostPort(q.Gateway, strconv.Itoa(q.registry.Port))) {
		files[path.Join(vmCertsDir, host, "hosts.toml")] = hosts
	}
	return files
}
