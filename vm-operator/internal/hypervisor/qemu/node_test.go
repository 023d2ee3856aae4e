//go:build nodevm

package qemu

// The node image (hack/build-node-image.sh) booted from the image store by this driver as a host
// agent runs it:
// systemd, cloud-init from the VM's NoCloud seed, containerd up, and a hot-plugged disk that
// udev names by its serial. Minutes under TCG, and the image's build needs the tool cache and
// Debian's mirror: not part of `make test` yet, `make node-vm` runs it.

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"testing"
	"time"

	. "github.com/onsi/gomega"

	"pvbridge.io/vm-operator/internal/hypervisor"
)

func TestNodeImageBootsAsAVMAndSeesAHotPluggedDisk(t *testing.T) {
	g := NewWithT(t)
	ctx, cancel := context.WithTimeout(t.Context(), 15*time.Minute)
	defer cancel()
	cache, err := os.UserCacheDir()
	g.Expect(err).NotTo(HaveOccurred())
	store := filepath.Join(cache, "pvbridge", "node-images")
	start := time.Now()
	out, err := exec.CommandContext(ctx, "../../../../hack/build-node-image.sh", store).CombinedOutput()
	g.Expect(err).NotTo(HaveOccurred(), "build the node image: %s", out)
	t.Logf("node image ready in %v: %s", time.Since(start).Round(time.Second), out)
	image := regexp.MustCompile(`build-node-image: (node-\S+?):? `).FindStringSubmatch(string(out))
	g.Expect(image).NotTo(BeNil(), "the script names the image it built")

	d := newDriver(t, Options{ImageDir: store, Network: "user", CPUs: 2, MemoryMiB: 1024, UnplugTimeout: time.Minute})
	const serial = "PVB-NODE-DISK-0001"
	const byID = "/dev/disk/by-id/virtio-" + serial
	vm := testVM
	vm.Image = image[1]
	vm.Bootstrap = &hypervisor.Bootstrap{
		MetaData: []byte("instance-id: " + vm.UID + "\nlocal-hostname: node-q\n"),
		// What a kubeadm bootstrap would do comes later; this says what the node has.
		UserData: []byte(`#cloud-config
runcmd:
  - [sh, -c, 'echo "PVB-RUNCMD hostname=$(hostname) containerd=$(systemctl is-active containerd) kubelet=$(kubelet --version)" >/dev/ttyS0']
  - [systemd-run, --no-block, --unit=pvb-watch, sh, -c, 'n=0; while true; do while ! [ -e ` + byID + ` ]; do sleep 0.1; done; echo "PVB-DISK-SEEN $n $(readlink -f ` + byID + `)" >/dev/ttyS0; while [ -e ` + byID + ` ]; do sleep 0.1; done; n=$((n+1)); done']
`),
	}
	serialLogOf := func() string {
		data, _ := os.ReadFile(filepath.Join(d.Dir(vm), serialLog))
		return string(data)
	}
	waitFor := func(re *regexp.Regexp, within time.Duration) []string {
		var m []string
		g.Eventually(func() []string {
			m = re.FindStringSubmatch(serialLogOf())
			return m
		}).WithContext(ctx).WithTimeout(within).WithPolling(500*time.Millisecond).ShouldNot(BeNil(),
			func() string { s := serialLogOf(); return fmt.Sprintf("console: %s", s[max(0, len(s)-4096):]) })
		return m
	}

	start = time.Now()
	startVM(t, d, vm)
	m := waitFor(regexp.MustCompile(`PVB-RUNCMD hostname=(\S+) containerd=(\S+) kubelet=(.*)`), 10*time.Minute)
	booted := time.Since(start)
	t.Logf("power-on to cloud-init's runcmd: %v (TCG); %q", booted.Round(time.Millisecond), m[0])
	g.Expect(m[1]).To(Equal("node-q"), "the hostname of the seed's meta-data")
	g.Expect(m[2]).To(Equal("active"), "containerd runs")
	g.Expect(m[3]).To(HavePrefix("Kubernetes v"))

	// The guest agent, started by udev once the port shows, reports the NIC's address (QEMU's
	// user-mode DHCP gives every guest 10.0.2.15; its router advertisements may add an IPv6 one).
	var addresses []string
	g.Eventually(func() (err error) { addresses, err = d.Addresses(ctx, vm); return err }).WithContext(ctx).
		WithTimeout(time.Minute).WithPolling(time.Second).Should(Succeed())
	t.Logf("the guest agent reports %v", addresses)
	g.Expect(addresses[0]).To(Equal("10.0.2.15"))

	// The disk plugged and unplugged again and again: how long from Attach until the guest's
	// udev names it, and how long Detach takes (until the guest let it go).
	loop, _ := newLoop(t)
	var plugged, unplugged []time.Duration
	for i := range 7 {
		start = time.Now()
		g.Expect(d.Attach(ctx, vm, hypervisor.Disk{Serial: serial, Device: loop})).To(Succeed())
		m = waitFor(regexp.MustCompile(fmt.Sprintf(`PVB-DISK-SEEN %d (/dev/vd[a-z]+)`, i)), 2*time.Minute)
		plugged = append(plugged, time.Since(start).Round(time.Millisecond))
		start = time.Now()
		g.Expect(d.Detach(ctx, vm, serial)).To(Succeed())
		unplugged = append(unplugged, time.Since(start).Round(time.Millisecond))
	}
	t.Logf("hot-plug to udev's %s (%s) in the guest, %d times: p50 %v, each %v", byID, m[1], len(plugged), p50(plugged), plugged)
	t.Logf("Detach (the guest let the disk go), %d times: p50 %v, each %v", len(unplugged), p50(unplugged), unplugged)
	g.Expect(d.Delete(ctx, vm)).To(Succeed())
	g.Expect(d.Dir(vm)).NotTo(BeADirectory())
}

// p50 is the median of ds.
func p50(ds []time.Duration) time.Duration {
	return slices.Sorted(slices.Values(ds))[len(ds)/2]
}
