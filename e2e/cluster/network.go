package cluster

import (
	"errors"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
)

// podNetwork is a containerd node's pod network: a Linux bridge of its own with a /24 of
// 10.244.0.0/16 for its pods (CNI bridge and host-local, from Debian), and, as the lab runs no
// kube-proxy, a DNAT rule per control plane of the lab that takes the pods' connections to
// its `kubernetes` Service (ControlPlane.ServiceIP:443) to its apiserver on 127.0.0.1
// (route_localnet on the bridge): a guest's pods reach the management apiserver as in a real
// installation they reach it over the network. Subnets are taken across every lab of the
// machine through lock files in subnetLocks; the lab's reaper removes what a killed lab left.
type podNetwork struct {
	Bridge string
	Subnet string
	// Gateway is the bridge's address, the first of the subnet: the node's address.
	Gateway string
	lock    string
	record  string     // names the bridge and its lock to the reaper
	comment string     // marks the lab's rules, for the reaper
	rules   [][]string // added, to delete
}

// subnetLocks holds one file per /24 in use, named by its third octet, holding the lab root.
const subnetLocks = "/run/pvbridge-lab/subnets"

// addControlPlane records cp, gives it the next service range and returns it, and routes every
// pod network's connections to its Service address to its apiserver.
func (l *Lab) addControlPlane(cp *ControlPlane) (string, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := len(l.controlPlanes)
	if n > 255 {
		return "", fmt.Errorf("a lab has at most 256 control planes")
	}
	l.controlPlanes = append(l.controlPlanes, cp)
	cp.ServiceIP = fmt.Sprintf("10.96.%d.1", n)
	for _, pn := range l.networks {
		if err := pn.route(cp); err != nil {
			return "", err
		}
	}
	return fmt.Sprintf("10.96.%d.0/24", n), nil
}

func (l *Lab) startPodNetwork() (*podNetwork, error) {
	return l.startNetwork(subnetLocks, func(i int) *podNetwork {
		return &podNetwork{Bridge: fmt.Sprintf("pvblab%d", i), Subnet: fmt.Sprintf("10.244.%d.0/24", i), Gateway: fmt.Sprintf("10.244.%d.1", i)}
	}, (*podNetwork).start)
}

// startNetwork takes the first free /24 of those locked in locks, made by network (its link's
// name, subnet and the machine's address on it), and starts it: the link of a pod network or a
// VM. Its rules route to every control plane of the lab, now and later.
func (l *Lab) startNetwork(locks string, network func(i int) *podNetwork, start func(*podNetwork) error) (*podNetwork, error) {
	if err := os.MkdirAll(locks, 0o755); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(filepath.Join(l.Root, "bridges"), 0o755); err != nil {
		return nil, err
	}
	for i := 1; i < 255; i++ {
		lock := filepath.Join(locks, fmt.Sprint(i))
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
		pn := network(i)
		pn.lock, pn.comment = lock, "pvbridge-lab "+l.Root
		pn.record = filepath.Join(l.Root, "bridges", pn.Bridge)
		// The reaper finds the link (and its lock) here if the lab is killed.
		if err := os.WriteFile(pn.record, []byte(lock), 0o644); err != nil {
			return nil, err
		}
		if err := start(pn); err != nil {
			return nil, errors.Join(err, pn.stop())
		}
		l.mu.Lock()
		defer l.mu.Unlock()
		if pn.Gateway == "" { // an address, not a link
			return pn, nil
		}
		l.networks = append(l.networks, pn)
		for _, cp := range l.controlPlanes {
			if err := pn.route(cp); err != nil {
				return nil, err
			}
		}
		return pn, nil
	}
	return nil, fmt.Errorf("no free /24 (locks in %s)", locks)
}

// stopNetwork stops pn and takes it out of the lab's networks, before the lab stops.
func (l *Lab) stopNetwork(pn *podNetwork) error {
	l.mu.Lock()
	l.networks = slices.DeleteFunc(l.networks, func(n *podNetwork) bool { return n == pn })
	l.mu.Unlock()
	return pn.stop()
}

func (pn *podNetwork) start() error {
	return run([][]string{
		{"ip", "link", "add", pn.Bridge, "type", "bridge"},
		{"ip", "addr", "add", pn.Gateway + "/24", "dev", pn.Bridge},
		{"ip", "link", "set", pn.Bridge, "up"},
		{"sysctl", "-q", "-w", "net.ipv4.conf." + pn.Bridge + ".route_localnet=1"},
	})
}

// run runs each command line in turn.
func run(cmds [][]string) error {
	for _, args := range cmds {
		if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
			return fmt.Errorf("%s: %w: %s", strings.Join(args, " "), err, out)
		}
	}
	return nil
}

// route adds the DNAT rule of cp's Service address.
func (pn *podNetwork) route(cp *ControlPlane) error {
	u, err := url.Parse(cp.Server)
	if err != nil {
		return err
	}
	return pn.dnat(cp.ServiceIP, 443, u.Host)
}

// dnat adds a rule that takes the connections from the network to address:port to the
// machine's to (host:port).
func (pn *podNetwork) dnat(address string, port int, to string) error {
	rule := []string{
		"PREROUTING", "-i", pn.Bridge, "-d", address, "-p", "tcp", "--dport", strconv.Itoa(port),
		"-m", "comment", "--comment", pn.comment, "-j", "DNAT", "--to-destination", to,
	}
	if out, err := exec.Command("iptables", append([]string{"-t", "nat", "-A"}, rule...)...).CombinedOutput(); err != nil {
		return fmt.Errorf("iptables -A %s: %w: %s", strings.Join(rule, " "), err, out)
	}
	pn.rules = append(pn.rules, rule)
	return nil
}

// stop removes the DNAT rules, the bridge, the reaper's record of it and the subnet's lock, in
// that order. It is idempotent. The record goes before the lock: once the lock is free another
// lab may make a bridge of the same name, and this lab's reaper, which runs after Stop, must not
// find the name and delete that bridge (it did, in CI: a kubelet could not bind its node address).
func (pn *podNetwork) stop() error {
	var errs []error
	for _, rule := range pn.rules {
		if exec.Command("iptables", append([]string{"-t", "nat", "-C"}, rule...)...).Run() != nil {
			continue
		}
		if out, err := exec.Command("iptables", append([]string{"-t", "nat", "-D"}, rule...)...).CombinedOutput(); err != nil {
			errs = append(errs, fmt.Errorf("iptables -D: %w: %s", err, out))
		}
	}
	if exec.Command("ip", "link", "show", pn.Bridge).Run() == nil {
		// A VM's link also goes by itself, once the kernel has cleaned up the VM's network
		// namespace after its last process: asynchronously, so possibly between the two
		// commands ("Cannot find device").
		out, err := exec.Command("ip", "link", "del", pn.Bridge).CombinedOutput()
		if err != nil && exec.Command("ip", "link", "show", pn.Bridge).Run() == nil {
			// Record and lock stay: the reaper tries again, and no other lab takes the name.
			return errors.Join(append(errs, fmt.Errorf("ip link del %s: %w: %s", pn.Bridge, err, out))...)
		}
	}
	for _, f := range []string{pn.record, pn.lock} {
		if err := os.Remove(f); err != nil && !os.IsNotExist(err) {
			return errors.Join(append(errs, err)...)
		}
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
