package qemu

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	. "github.com/onsi/gomega"

	"pvbridge.io/vm-operator/internal/hypervisor"
)

// The guest agent as a guest runs it: Debian's qemu-ga, run here on the host in a network
// namespace of its own whose interfaces stand for the guest's (veth ends, one with the VM's
// MAC), serving the socket that QEMU's end of the virtio-serial port is.
func TestAddressesAreWhatTheGuestAgentSaysOfTheVMsNIC(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	netns := fmt.Sprintf("pvbga%d", os.Getpid())
	ip := func(args ...string) {
		t.Helper()
		if out, err := exec.Command("ip", append([]string{"-n", netns}, args...)...).CombinedOutput(); err != nil {
			t.Fatalf("ip %v: %v: %s", args, err, out)
		}
	}
	if out, err := exec.Command("ip", "netns", "add", netns).CombinedOutput(); err != nil {
		t.Fatalf("ip netns add: %v: %s", err, out)
	}
	t.Cleanup(func() { _ = exec.Command("ip", "netns", "del", netns).Run() })
	for _, nic := range []struct{ name, mac, v4, v6 string }{
		{"eth0", macFor(testVM), "10.0.7.12/24", "fd00::12/64"},
		{"eth1", "52:54:00:00:00:01", "10.9.9.9/24", "fd00::99/64"}, // not the VM's NIC
	} {
		ip("link", "add", nic.name, "address", nic.mac, "type", "veth", "peer", "name", nic.name+"-peer")
		ip("addr", "add", nic.v4, "dev", nic.name)
		ip("addr", "add", nic.v6, "dev", nic.name, "nodad")
		ip("link", "set", nic.name+"-peer", "up")
		ip("link", "set", nic.name, "up") // and a link-local fe80:: address, left out
	}

	g.Expect(newDriver(t, Options{}).Addresses(ctx, testVM)).To(BeNil(), "a VM without a NIC has no address")
	d := newDriver(t, Options{Network: "user"})
	g.Expect(os.MkdirAll(d.Dir(testVM), 0o750)).To(Succeed())
	_, err := d.Addresses(ctx, testVM)
	g.Expect(err).To(MatchError(hypervisor.ErrGuestAgent), "no guest agent")

	if _, err := exec.LookPath("qemu-ga"); err != nil {
		t.Fatal("qemu-ga is not installed: run `make deps` (hack/install-deps.sh installs Debian's qemu-guest-agent)")
	}
	agent := exec.Command("ip", "netns", "exec", netns, "qemu-ga", "--method=unix-listen",
		"--path="+filepath.Join(d.Dir(testVM), guestAgentSocket), "--statedir="+t.TempDir())
	g.Expect(agent.Start()).To(Succeed())
	t.Cleanup(func() { _ = agent.Process.Kill(); _ = agent.Wait() })
	g.Eventually(func() ([]string, error) { return d.Addresses(ctx, testVM) }).
		WithTimeout(30*time.Second).WithPolling(100*time.Millisecond).
		Should(Equal([]string{"10.0.7.12", "fd00::12"}), "the VM NIC's addresses, IPv4 first, no link-local one")
}
