package cluster

import (
	"errors"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// podNetwork is a containerd node's pod network: a Linux bridge of its own with a /24 of
// 10.244.0.0/16 for its pods (CNI bridge and host-local, from Debian), and, as the lab runs no
// kube-proxy, one DNAT rule that takes the pods' connections to the `kubernetes` Service
// (10.96.0.1:443) to the control plane's apiserver on 127.0.0.1 (route_localnet on the bridge).
// Subnets are taken across every lab of the machine through lock files in subnetLocks; the
// lab's reaper removes what a killed lab left.
type podNetwork struct {
	Bridge string
	Subnet string
	// Gateway is the bridge's address, the first of the subnet: the node's address.
	Gateway string
	lock    string
	rule    []string
}

// subnetLocks holds one file per /24 in use, named by its third octet, holding the lab root.
const subnetLocks = "/run/pvbridge-lab/subnets"

// serviceIP is the first address of the lab apiservers' --service-cluster-ip-range.
const serviceIP = "10.96.0.1"

func (l *Lab) startPodNetwork(cp *ControlPlane) (*podNetwork, error) {
	if err := os.MkdirAll(subnetLocks, 0o755); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(filepath.Join(l.Root, "bridges"), 0o755); err != nil {
		return nil, err
	}
	u, err := url.Parse(cp.Server)
	if err != nil {
		return nil, err
	}
	for i := 1; i < 255; i++ {
		lock := filepath.Join(subnetLocks, fmt.Sprint(i))
		f, err := os.OpenFile(lock, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o644)
		if errors.Is(err, os.ErrExist) {
			continue
		}
		if err != nil {
			return nil, err
		}
		_, err = f.WriteString(l.Root)
		f.Close()
		if err != nil {
			return nil, err
		}
		pn := &podNetwork{
			Bridge: fmt.Sprintf("pvblab%d", i), Subnet: fmt.Sprintf("10.244.%d.0/24", i), Gateway: fmt.Sprintf("10.244.%d.1", i),
			lock: lock,
		}
		pn.rule = []string{
			"PREROUTING", "-i", pn.Bridge, "-d", serviceIP, "-p", "tcp", "--dport", "443",
			"-m", "comment", "--comment", "pvbridge-lab " + l.Root,
			"-j", "DNAT", "--to-destination", u.Host,
		}
		// The reaper finds the bridge (and its lock) here if the lab is killed.
		if err := os.WriteFile(filepath.Join(l.Root, "bridges", pn.Bridge), []byte(lock), 0o644); err != nil {
			return nil, err
		}
		if err := pn.start(); err != nil {
			return nil, errors.Join(err, pn.stop())
		}
		return pn, nil
	}
	return nil, fmt.Errorf("no free /24 in 10.244.0.0/16 (locks in %s)", subnetLocks)
}

func (pn *podNetwork) start() error {
	for _, args := range [][]string{
		{"ip", "link", "add", pn.Bridge, "type", "bridge"},
		{"ip", "addr", "add", pn.Gateway + "/24", "dev", pn.Bridge},
		{"ip", "link", "set", pn.Bridge, "up"},
		{"sysctl", "-q", "-w", "net.ipv4.conf." + pn.Bridge + ".route_localnet=1"},
		append([]string{"iptables", "-t", "nat", "-A"}, pn.rule...),
	} {
		if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
			return fmt.Errorf("%s: %w: %s", strings.Join(args, " "), err, out)
		}
	}
	return nil
}

// stop removes the DNAT rule, the bridge and the subnet's lock. It is idempotent.
func (pn *podNetwork) stop() error {
	var errs []error
	if exec.Command("iptables", append([]string{"-t", "nat", "-C"}, pn.rule...)...).Run() == nil {
		if out, err := exec.Command("iptables", append([]string{"-t", "nat", "-D"}, pn.rule...)...).CombinedOutput(); err != nil {
			errs = append(errs, fmt.Errorf("iptables -D: %w: %s", err, out))
		}
	}
	if exec.Command("ip", "link", "show", pn.Bridge).Run() == nil {
		if out, err := exec.Command("ip", "link", "del", pn.Bridge).CombinedOutput(); err != nil {
			errs = append(errs, fmt.Errorf("ip link del %s: %w: %s", pn.Bridge, err, out))
		}
	}
	if err := os.Remove(pn.lock); err != nil && !os.IsNotExist(err) {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// cniConfig is the node's CNI network: its bridge, host-local addresses of its subnet, a
// default route through the bridge.
func (pn *podNetwork) cniConfig() string {
	return fmt.Sprintf(`{
  "cniVersion": "1.0.0",
  "name": "lab",
  "plugins": [
    {
      "type": "bridge", "bridge": %q, "isGateway": true, "hairpinMode": true,
      "ipam": {"type": "host-local", "ranges": [[{"subnet": %q}]], "routes": [{"dst": "0.0.0.0/0"}]}
    }
  ]
}
`, pn.Bridge, pn.Subnet)
}
