package qemu

// The test in this file boots a minimal Linux guest (Debian's kernel and busybox-static, built
// by testdata/build-guest.sh into ${XDG_CACHE_HOME:-~/.cache}/pvbridge/guest on first use) and
// checks from inside it, over the serial console, what the hot-plug did.

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	. "github.com/onsi/gomega"

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

// console is the guest's serial console: a busybox shell on ttyS0 after boot.
type console struct {
	conn net.Conn
	r    *bufio.Reader
	out  []byte // what was read and not consumed yet
	tag  int
}

func dialConsole(t *testing.T, path string) *console {
	t.Helper()
	conn, err := net.Dial("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return &console{conn: conn, r: bufio.NewReader(conn)}
}

// expect reads until re matches the output, consumes the output up to the match's end, and
// returns the submatches.
func (c *console) expect(ctx context.Context, re *regexp.Regexp) ([]string, error) {
	deadline, _ := ctx.Deadline()
	if err := c.conn.SetReadDeadline(deadline); err != nil {
		return nil, err
	}
	buf := make([]byte, 4096)
	for {
		if m := re.FindSubmatchIndex(c.out); m != nil {
			var subs []string
			for i := 0; i < len(m); i += 2 {
				if m[i] < 0 {
					subs = append(subs, "")
					continue
				}
				subs = append(subs, string(c.out[m[i]:m[i+1]]))
			}
			c.out = c.out[m[1]:]
			return subs, nil
		}
		n, err := c.r.Read(buf)
		c.out = append(c.out, buf[:n]...)
		if err != nil {
			return nil, fmt.Errorf("%w; console output so far: %q", err, c.out)
		}
	}
}

// run runs a shell command in the guest and returns its output and exit code.
func (c *console) run(ctx context.Context, command string) (string, int, error) {
	c.tag++
	if _, err := fmt.Fprintf(c.conn, "echo BEGIN-%d; %s; echo END-%d rc=$?\n", c.tag, command, c.tag); err != nil {
		return "", 0, err
	}
	// The shell echoes the command line; only the output has BEGIN-n at a line's end.
	re := regexp.MustCompile(fmt.Sprintf(`(?s)BEGIN-%d\r?\n(.*?)END-%d rc=(\d+)`, c.tag, c.tag))
	m, err := c.expect(ctx, re)
	if err != nil {
		return "", 0, err
	}
	rc, _ := strconv.Atoi(m[2])
	return strings.ReplaceAll(m[1], "\r", ""), rc, nil
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
	con := dialConsole(t, filepath.Join(d.Dir(testVM), serialSocket))
	if _, err := con.expect(ctx, regexp.MustCompile(`GUEST-READY uptime=\S+`)); err != nil {
		t.Fatalf("guest did not boot: %v\nserial.log: %s", err, tail(filepath.Join(d.Dir(testVM), serialLog), 4096))
	}
	t.Logf("guest booted in %v", time.Since(start).Round(time.Millisecond))
	_, _, err := con.run(ctx, "true") // the shell is up
	g.Expect(err).NotTo(HaveOccurred())

	start = time.Now()
	g.Expect(d.Attach(ctx, testVM, disk)).To(Succeed())
	attached := time.Since(start)
	var serial string
	g.Eventually(func(g Gomega) {
		out, rc, err := con.run(ctx, "cat /sys/block/vda/serial")
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(rc).To(Equal(0), out)
		serial = strings.TrimSpace(out)
	}).WithContext(ctx).WithTimeout(30 * time.Second).WithPolling(100 * time.Millisecond).Should(Succeed())
	t.Logf("Attach took %v; /sys/block/vda/serial in the guest after %v", attached.Round(time.Millisecond), time.Since(start).Round(time.Millisecond))
	g.Expect(serial).To(Equal(disk.Serial))

	// The guest's writes reach the loop device.
	out, rc, err := con.run(ctx, "echo pvbridge-was-here >/dev/vda")
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(rc).To(Equal(0), out)
	data, err := os.ReadFile(img)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(string(data[:18])).To(Equal("pvbridge-was-here\n"))

	// An expansion: the host device grows (a loop device over a longer file), and the next
	// Disks, as the host agent's reconcile of an expanded volume calls it, grows the disk in
	// the guest.
	size := func(g Gomega) string {
		out, rc, err := con.run(ctx, "cat /sys/block/vda/size")
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(rc).To(Equal(0), out)
		return strings.TrimSpace(out)
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
		out, rc, err := con.run(ctx, "dd if=/dev/vda of=/dev/null bs=256k count=16 iflag=direct")
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(rc).To(Equal(0), out)
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
	out, _, err = con.run(ctx, "ls /sys/block")
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(out).NotTo(ContainSubstring("vda"), "gone from the guest when Detach returns")
	g.Expect(d.Disks(ctx, testVM)).To(BeEmpty())
	g.Expect(hasNode(t, d, testVM, nodePrefix+disk.Serial)).To(BeFalse())
}
