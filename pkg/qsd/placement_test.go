package qsd

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"golang.org/x/sys/unix"

	"pvbridge.io/pkg/cgroups"
	"pvbridge.io/pkg/netns"
)

// A real daemon placed in a network namespace and a cgroup: its NBD server listens in that
// namespace only, it is in its cgroup in every hierarchy, and Stop ends it and removes the
// cgroup.
func TestPlacement(t *testing.T) {
	g := NewWithT(t)
	if os.Geteuid() != 0 {
		t.Fatal("this test makes network namespaces and cgroups and must run as root")
	}
	ns := fmt.Sprintf("pvbq%d", os.Getpid())
	if out, err := exec.Command("ip", "netns", "add", ns).CombinedOutput(); err != nil {
		t.Fatalf("ip netns add: %v: %s", err, out)
	}
	t.Cleanup(func() { _ = exec.Command("ip", "netns", "del", ns).Run() })
	g.Expect(exec.Command("ip", "-n", ns, "link", "set", "lo", "up").Run()).To(Succeed())
	const root = "/sys/fs/cgroup"
	p := Placement{NetNS: "/run/netns/" + ns, CgroupParent: fmt.Sprintf("pvbridge-test-%d", os.Getpid())}
	t.Cleanup(func() { _ = cgroups.Destroy(t.Context(), root, p.CgroupParent) })
	g.Expect(p.Validate()).To(Succeed())
	g.Expect(Placement{CgroupParent: "/abs"}.Validate()).To(HaveOccurred())
	g.Expect(Placement{CgroupParent: "../up"}.Validate()).To(HaveOccurred())

	dir, err := os.MkdirTemp("", "qsd-") // short: a socket path
	g.Expect(err).NotTo(HaveOccurred())
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	d := Dir(filepath.Join(dir, "server"))
	g.Expect(p.Start(t.Context(), d, "--nbd-server", "addr.type=inet,addr.host=127.0.0.1,addr.port=10809")).To(Succeed())
	t.Cleanup(func() { _ = Kill(t.Context(), d) })
	pid, err := Pid(d)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(pid).NotTo(BeZero())

	g.Expect(cgroups.Pids(root, filepath.Join(p.CgroupParent, "server"))).To(Equal([]int{pid}), "in its cgroup")
	own, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	g.Expect(err).NotTo(HaveOccurred())
	for _, line := range strings.Split(strings.TrimSpace(string(own)), "\n") {
		g.Expect(line).To(HaveSuffix(":/"+p.CgroupParent+"/server"), "in every hierarchy")
	}
	g.Expect(netns.Run(p.NetNS, func() error {
		c, err := net.DialTimeout("tcp", "127.0.0.1:10809", 5*time.Second)
		if err == nil {
			_ = c.Close()
		}
		return err
	})).To(Succeed(), "listening in the namespace")
	nsLink, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/net", pid))
	g.Expect(err).NotTo(HaveOccurred())
	var st unix.Stat_t
	g.Expect(unix.Stat(p.NetNS, &st)).To(Succeed())
	g.Expect(nsLink).To(Equal(fmt.Sprintf("net:[%d]", st.Ino)), "in the namespace")

	g.Expect(p.Stop(t.Context(), d)).To(Succeed())
	g.Expect(Pid(d)).To(BeZero())
	hierarchies, err := cgroups.Hierarchies(root)
	g.Expect(err).NotTo(HaveOccurred())
	for _, h := range hierarchies {
		g.Expect(filepath.Join(h, p.CgroupParent, "server")).NotTo(BeADirectory(), "its cgroup removed")
	}
	g.Expect(p.Stop(t.Context(), d)).To(Succeed(), "stopping what is gone")
}
