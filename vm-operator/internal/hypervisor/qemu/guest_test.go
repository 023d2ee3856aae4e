package qemu

// The test in this file boots a minimal Linux guest (Debian's kernel and busybox-static, built
// by testdata/build-guest.sh into ${XDG_CACHE_HOME:-~/.cache}/pvbridge/guest on first use) and
// checks from inside it, over the serial console, what the hot-plug did.

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"testing"
	"time"

	. "github.com/onsi/gomega"

	"pvbridge.io/pkg/console"
	"pvbridge.io/pkg/netns"
	"pvbridge.io/vm-operator/internal/hypervisor"
)

// testGuest returns the kernel and initramfs of the test guest, building them if needed.
func testGuest(t *testing.T) (kernel, initrd string) {
	t.Helper()
	cache, err := os.UserCacheDir()
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(cache, "pvbridge", "guest")
	start := time.Now()
	out, err := exec.Command("testdata/build-guest.sh", dir).CombinedOutput()
	if err != nil {
		t.Fatalf("build the test guest: %v\n%s", err, out)
	}
	if len(out) > 0 {
		t.Logf("built the test guest in %v: %s", time.Since(start).Round(time.Millisecond), bytes.TrimSpace(out))
	}
	return filepath.Join(dir, "vmlinux"), filepath.Join(dir, "initramfs.gz")
}

// guestShell connects to the console of testVM, which d runs, once its guest has booted and
// its shell answers (the shell's banner comes after GUEST-READY).
func guestShell(ctx context.Context, t *testing.T, d *Driver) *console.Console {
	t.Helper()
	con, err := console.Dial(filepath.Join(d.Dir(testVM), serialSocket))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = con.Close() })
	if _, err := con.Expect(ctx, regexp.MustCompile(`GUEST-READY uptime=\S+`)); err != nil {
		t.Fatalf("guest did not boot: %v\nserial.log: %s", err, tail(filepath.Join(d.Dir(testVM), serialLog), 4096))
	}
	if _, _, err := con.Run(ctx, "true"); err != nil {
		t.Fatal(err)
	}
	return con
}

func TestGuestSeesTheDiskBySerial(t *testing.T) {
	g := NewWithT(t)
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	kernel, initrd := testGuest(t)
	d := newDriver(t, Options{
		Kernel: kernel, Initrd: initrd, Append: "console=ttyS0 quiet panic=-1",
		MemoryMiB: 256,
		// Linux takes about 6.2 s; leave room for a loaded machine.
		UnplugTimeout: time.Minute,
	})
	loop, img := newLoop(t)
	disk := hypervisor.Disk{Serial: "PVB-GUEST-0123456789", Device: loop}

	start := time.Now()
	startVM(t, d, testVM)
	con := guestShell(ctx, t, d)
	t.Logf("guest booted in %v", time.Since(start).Round(time.Millisecond))

	start = time.Now()
	g.Expect(d.Attach(ctx, testVM, disk)).To(Succeed())
	attached := time.Since(start)
	var serial string
	g.Eventually(func(g Gomega) {
		var err error
		serial, err = con.Output(ctx, "cat /sys/block/vda/serial")
		g.Expect(err).NotTo(HaveOccurred())
	}).WithContext(ctx).WithTimeout(30 * time.Second).WithPolling(100 * time.Millisecond).Should(Succeed())
	t.Logf("Attach took %v; /sys/block/vda/serial in the guest after %v", attached.Round(time.Millisecond), time.Since(start).Round(time.Millisecond))
	g.Expect(serial).To(Equal(disk.Serial))

	// The guest's writes reach the loop device.
	_, err := con.Output(ctx, "echo pvbridge-was-here >/dev/vda")
	g.Expect(err).NotTo(HaveOccurred())
	data, err := os.ReadFile(img)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(string(data[:18])).To(Equal("pvbridge-was-here\n"))

	// An expansion: the host device grows (a loop device over a longer file), and the next
	// Disks, as the host agent's reconcile of an expanded volume calls it, grows the disk in
	// the guest.
	size := func(g Gomega) string {
		out, err := con.Output(ctx, "cat /sys/block/vda/size")
		g.Expect(err).NotTo(HaveOccurred())
		return out
	}
	g.Expect(size(g)).To(Equal(strconv.Itoa(64 << 20 / 512)))
	g.Expect(os.Truncate(img, 96<<20)).To(Succeed())
	grown, err := exec.Command("losetup", "--set-capacity", loop).CombinedOutput()
	g.Expect(err).NotTo(HaveOccurred(), "losetup --set-capacity: %s", grown)
	start = time.Now()
	g.Expect(d.Disks(ctx, testVM)).To(ConsistOf(HaveField("Serial", disk.Serial)))
	g.Eventually(size).WithContext(ctx).WithTimeout(30 * time.Second).WithPolling(100 * time.Millisecond).
		Should(Equal(strconv.Itoa(96 << 20 / 512)))
	t.Logf("the guest saw its disk grow %v after Disks", time.Since(start).Round(time.Millisecond))
	g.Expect(d.Disks(ctx, testVM)).To(HaveLen(1), "a disk of its device's size is left as it is")

	// QEMU throttles the guest's reads, and lifts the limit live. A direct read of 4 MiB takes
	// about 2 s at 2 MiB/s (less QEMU's burst); without a limit a fraction of that, even
	// emulated.
	readTime := func() time.Duration {
		start := time.Now()
		_, err := con.Output(ctx, "dd if=/dev/vda of=/dev/null bs=256k count=16 iflag=direct")
		g.Expect(err).NotTo(HaveOccurred())
		return time.Since(start)
	}
	g.Expect(d.SetLimits(ctx, testVM, disk.Serial, hypervisor.Limits{BytesPerSecond: 2 << 20})).To(Succeed())
	limited := readTime()
	g.Expect(d.SetLimits(ctx, testVM, disk.Serial, hypervisor.Limits{})).To(Succeed())
	unlimited := readTime()
	t.Logf("4 MiB read in the guest: %v at 2 MiB/s, %v without a limit", limited.Round(time.Millisecond), unlimited.Round(time.Millisecond))
	g.Expect(limited).To(BeNumerically(">", 1200*time.Millisecond))
	g.Expect(unlimited).To(BeNumerically("<", limited/2))

	// Linux releases the disk about 6 s after the request (pciehp's attention-button delay);
	// Detach returns only then.
	start = time.Now()
	g.Expect(d.Detach(ctx, testVM, disk.Serial)).To(Succeed())
	t.Logf("Detach took %v", time.Since(start).Round(time.Millisecond))
	out, _, err := con.Run(ctx, "ls /sys/block")
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(out).NotTo(ContainSubstring("vda"), "gone from the guest when Detach returns")
	g.Expect(d.Disks(ctx, testVM)).To(BeEmpty())
	g.Expect(hasNode(t, d, testVM, nodePrefix+disk.Serial)).To(BeFalse())
}

// On a bridge (Network "bridge:<name>") in the network namespace the driver is given (NetNS, as
// the shipped agent is given the host's), the VM is a machine of the bridge's network: its NIC,
// with the MAC of its UID, is a tap on the bridge of that namespace, the guest reaches the
// address the namespace has there and is reached at its own (which user-mode networking cannot
// do); the tap goes with QEMU.
func TestAGuestOnABridgeIsAMachineOfItsNetwork(t *testing.T) {
	g := NewWithT(t)
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	n := os.Getpid() % 200
	nsName, bridge := fmt.Sprintf("pvbt%d", os.Getpid()), "br0"
	host, guest := fmt.Sprintf("10.254.%d.1", n), fmt.Sprintf("10.254.%d.2", n)
	ip := func(args ...string) string {
		t.Helper()
		out, err := exec.Command("ip", append([]string{"-n", nsName}, args...)...).CombinedOutput()
		if err != nil {
			t.Fatalf("ip %v: %v: %s", args, err, out)
		}
		return string(out)
	}
	if out, err := exec.Command("ip", "netns", "add", nsName).CombinedOutput(); err != nil {
		t.Fatalf("ip netns add: %v: %s", err, out)
	}
	t.Cleanup(func() { _ = exec.Command("ip", "netns", "del", nsName).Run() })
	ip("link", "add", bridge, "type", "bridge")
	ip("addr", "add", host+"/24", "dev", bridge)
	ip("link", "set", bridge, "up")

	kernel, initrd := testGuest(t)
	d := newDriver(t, Options{
		Kernel: kernel, Initrd: initrd, Append: "console=ttyS0 quiet panic=-1",
		Network: "bridge:" + bridge, NetNS: "/run/netns/" + nsName,
	})
	startVM(t, d, testVM)
	tap := tapName(testVM)
	g.Expect(ip("-o", "link", "show", "dev", tap)).To(And(ContainSubstring("master "+bridge), MatchRegexp(`<[^>]*\bUP\b`)),
		"the VM's tap, up on the namespace's bridge")
	_, err := net.InterfaceByName(tap)
	g.Expect(err).To(HaveOccurred(), "not in the driver's own namespace")

	con := guestShell(ctx, t, d)
	g.Expect(con.Output(ctx, "cat /sys/class/net/eth0/address")).To(Equal(macFor(testVM)))
	_, err = con.Output(ctx, "ip link set eth0 up && ip addr add "+guest+"/24 dev eth0 && ping -c 1 -W 10 "+host+" >/dev/null")
	g.Expect(err).NotTo(HaveOccurred(), "the guest reaches the namespace's address on the bridge")
	_, err = con.Output(ctx, "(echo reached | nc -l -p 7000 >/dev/null &)")
	g.Expect(err).NotTo(HaveOccurred())
	g.Eventually(func() (reply string, err error) {
		err = netns.Run("/run/netns/"+nsName, func() error {
			c, err := net.DialTimeout("tcp", guest+":7000", 5*time.Second)
			if err != nil {
				return err
			}
			defer c.Close()
			data, err := io.ReadAll(c)
			reply = string(data)
			return err
		})
		return reply, err
	}).WithContext(ctx).WithTimeout(30*time.Second).Should(Equal("reached\n"), "the guest is reached at its address")

	g.Expect(d.PowerOff(ctx, testVM)).To(Succeed())
	g.Expect(exec.Command("ip", "-n", nsName, "link", "show", "dev", tap).Run()).To(HaveOccurred(), "the tap goes with QEMU")
}
