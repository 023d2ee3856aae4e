package vmoperator_test

// The shipped qemu hypervisor, run by vm-operator's host agent on host-q: a VirtualMachine is
// a QEMU process (TCG here) booting the busybox guest of hack/build-guest.sh, and its volume is
// hot-plugged through the whole chain, then seen, written, grown and let go from inside the
// guest, over its serial console.

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pvbridge.io/e2e/cluster"
	"pvbridge.io/e2e/deploy"
	pmemv1 "pvbridge.io/pkg/apis/pmem/v1alpha1"
	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/pkg/console"
)

// qemuHost is the host whose agent runs the qemu hypervisor.
const qemuHost = "host-q"

// imageStore is the qemu host's image store (--qemu-image-dir), and guest the directory of the
// test guest (the kernel and initramfs the qemu driver's own tests boot), which addImage puts in
// the store.
var imageStore, guest string

// qemuHosts builds the test guest and returns the qemu host's vm-operator flags: an image store,
// empty until a test adds an image, as a new host's.
func qemuHosts(lab *cluster.Lab) (deploy.QEMUHosts, error) {
	cache, err := os.UserCacheDir()
	if err != nil {
		return nil, err
	}
	guest = filepath.Join(cache, "pvbridge", "guest")
	if out, err := exec.Command(filepath.Join(lab.Binaries().Repo, "hack", "build-guest.sh"), guest).CombinedOutput(); err != nil {
		return nil, fmt.Errorf("build the test guest: %w: %s", err, out)
	}
	imageStore = filepath.Join(lab.Root, "images")
	if err := os.MkdirAll(imageStore, 0o755); err != nil {
		return nil, err
	}
	return deploy.QEMUHosts{qemuHost: {"--qemu-image-dir=" + imageStore}}, nil
}

// addImage puts the test guest in the image store as image name, the way
// hack/build-node-image.sh lays out a node image: a boot disk (blank here: the guest runs from
// its initramfs), its kernel, initrd and command line. It is removed when the test ends.
func addImage(t *testing.T, name string) {
	t.Helper()
	dir := filepath.Join(imageStore, name)
	tmp := dir + ".new"
	if err := os.Mkdir(tmp, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	if out, err := exec.Command("qemu-img", "create", "-q", "-f", "qcow2", filepath.Join(tmp, "disk.qcow2"), "16M").CombinedOutput(); err != nil {
		t.Fatalf("qemu-img create: %v: %s", err, out)
	}
	for link, target := range map[string]string{"vmlinuz": "vmlinux", "initrd.img": "initramfs.gz"} {
		if err := os.Symlink(filepath.Join(guest, target), filepath.Join(tmp, link)); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(tmp, "cmdline"), []byte("console=ttyS0 quiet panic=-1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	// Whole or not at all, as an admin's copy should land.
	if err := os.Rename(tmp, dir); err != nil {
		t.Fatal(err)
	}
}

// guestConsole connects to the serial console of vm on the qemu host once its guest has booted.
func guestConsole(ctx context.Context, t *testing.T, vm *vmv1.VirtualMachine) *console.Console {
	t.Helper()
	g := NewWithT(t)
	dir := filepath.Join(vmop.QEMURunDirs[qemuHost], vm.Namespace+"_"+vm.Name)
	var con *console.Console
	g.Eventually(func() (err error) {
		con, err = console.Dial(filepath.Join(dir, "serial.sock"))
		return err
	}).WithContext(ctx).WithTimeout(timeout).Should(Succeed(), "QEMU serves the console")
	t.Cleanup(func() { _ = con.Close() })
	// The socket keeps no output for a client that was not there: the shell's answer says the
	// guest is up, whenever the connection came.
	g.Eventually(inGuest).WithArguments(ctx, con, "echo up").WithContext(ctx).WithTimeout(timeout).
		Should(Equal("up"), func() string { return "serial.log: " + tail(filepath.Join(dir, "serial.log")) })
	return con
}

// inGuest runs a command in the guest, waiting at most 10 s for its answer, and returns its
// output (console.Console.Output: an exit code other than 0 is an error).
func inGuest(ctx context.Context, con *console.Console, command string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	return con.Output(ctx, command)
}

func tail(path string) string {
	data, _ := os.ReadFile(path)
	return string(data[max(0, len(data)-2048):])
}

// TestAQEMUVMGetsItsVolumeIntoItsGuest runs the volume's whole life through the shipped qemu
// driver, in a VM sized by its VirtualMachineClass and booting its image from the host's store
// (it waits for each): the guest finds the disk by its serial and its writes reach the PMEM
// volume; the VM keeps running with its disk while the host agent is killed as its container
// would be (every process of its cgroup), and the restarted agent grows the disk in the guest
// when the claim is expanded; a detach waits for the guest to
// let it go.
func TestAQEMUVMGetsItsVolumeIntoItsGuest(t *testing.T) {
	g := NewWithT(t)
	ctx, ns := t.Context(), namespace(t)
	pv := blockClaim(ctx, g, ns, "data", qemuHost)
	vm := virtualMachine(ns, "vm-q", qemuHost, "data")
	// Cluster-scoped or host-wide: one per test namespace.
	vm.Spec.ClassName, vm.Spec.Image = "q-"+ns, "guest-"+ns
	readyReason := func(g Gomega) string { return readyOf(ctx, g, vm).Reason }

	t.Log("a VM whose class and image do not exist waits for each, then boots its image with the class's size")
	g.Expect(c.Create(ctx, vm)).To(Succeed())
	g.Eventually(readyReason).WithContext(ctx).WithTimeout(timeout).Should(Equal(vmv1.ClassNotFoundReason))
	// Not the driver's defaults (1 vCPU, 256 MiB).
	class := &vmv1.VirtualMachineClass{
		ObjectMeta: metav1.ObjectMeta{Name: vm.Spec.ClassName},
		Spec:       vmv1.VirtualMachineClassSpec{CPUs: 2, Memory: resource.MustParse("192Mi")},
	}
	g.Expect(c.Create(ctx, class)).To(Succeed())
	t.Cleanup(func() { _ = c.Delete(context.WithoutCancel(ctx), class) })
	g.Eventually(readyReason).WithContext(ctx).WithTimeout(timeout).Should(Equal(vmv1.ImageNotFoundReason))
	addImage(t, vm.Spec.Image)
	con := guestConsole(ctx, t, vm)
	e := volumeStatus(ctx, g, vm, "data", attached)

	run := func(g Gomega, command string) string {
		out, err := inGuest(ctx, con, command)
		g.Expect(err).NotTo(HaveOccurred())
		return out
	}
	g.Expect(run(g, "grep -c ^processor /proc/cpuinfo")).To(Equal("2"))
	memTotal, err := strconv.Atoi(strings.Fields(run(g, "grep MemTotal /proc/meminfo"))[1])
	g.Expect(err).NotTo(HaveOccurred())
	// The kernel keeps some of the 192 MiB for itself (about 50 MiB here, the initramfs
	// included); the driver's default of 256 MiB would show about 200.
	g.Expect(memTotal).To(And(BeNumerically(">", 128<<10), BeNumerically("<=", 192<<10)), "MemTotal in kB")
	t.Log("the guest sees the disk by its serial, and its writes reach the PMEM volume")
	// The image's boot disk is the guest's first virtio disk; the volume is whichever has its serial.
	var disk string
	g.Eventually(func(g Gomega) {
		m := regexp.MustCompile(`^/sys/block/(vd[a-z]+)/serial$`).FindStringSubmatch(run(g, "grep -lx "+e.DiskSerial+" /sys/block/vd*/serial"))
		g.Expect(m).NotTo(BeNil())
		disk = m[1]
	}).WithContext(ctx).WithTimeout(timeout).Should(Succeed())
	run(g, "echo written-in-the-guest >/dev/"+disk+" && sync")
	pmv := &pmemv1.PmemVolume{}
	g.Expect(c.Get(ctx, client.ObjectKey{Name: pv.Spec.CSI.VolumeHandle}, pmv)).To(Succeed())
	g.Eventually(func(g Gomega) {
		f, err := os.Open(pmv.Status.Device)
		g.Expect(err).NotTo(HaveOccurred())
		defer f.Close()
		buf := make([]byte, 21)
		_, err = f.ReadAt(buf, 0)
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(string(buf)).To(Equal("written-in-the-guest\n"))
	}).WithContext(ctx).WithTimeout(timeout).Should(Succeed())

	t.Log("the host agent's container killed, every process of its cgroup; the VM, in a cgroup of its own, runs on, and the restarted agent takes it up and grows its disk")
	uptime := func(g Gomega) float64 {
		up, err := strconv.ParseFloat(strings.Fields(run(g, "cat /proc/uptime"))[0], 64)
		g.Expect(err).NotTo(HaveOccurred())
		return up
	}
	sectors := func(g Gomega) int {
		n, err := strconv.Atoi(run(g, "cat /sys/block/"+disk+"/size"))
		g.Expect(err).NotTo(HaveOccurred())
		return n
	}
	before, booted := sectors(g), uptime(g)
	g.Expect(vmop.Agents[qemuHost].Kill()).To(Succeed()) // it restarts, as kubelet restarts a container
	pvc := &corev1.PersistentVolumeClaim{}
	g.Expect(c.Get(ctx, client.ObjectKey{Namespace: ns, Name: "data"}, pvc)).To(Succeed())
	patch := client.MergeFrom(pvc.DeepCopy())
	pvc.Spec.Resources.Requests[corev1.ResourceStorage] = resource.MustParse("96Mi")
	g.Expect(c.Patch(ctx, pvc, patch)).To(Succeed())
	g.Eventually(sectors).WithContext(ctx).WithTimeout(timeout).Should(BeNumerically(">=", 96<<20/512))
	t.Logf("the guest's disk grew from %d to %d sectors", before, sectors(g))
	g.Expect(uptime(g)).To(BeNumerically(">", booted), "the same guest, not a new boot")
	g.Expect(volumeStatus(ctx, g, vm, "data", attached).DiskSerial).To(Equal(e.DiskSerial))

	t.Log("a detach: the guest lets the disk go, then the VolumeAttachment goes")
	detachAll(ctx, g, vm)
	g.Eventually(func(g Gomega) {
		g.Expect(c.Get(ctx, client.ObjectKeyFromObject(vm), vm)).To(Succeed())
		g.Expect(vm.Status.Volumes).To(BeEmpty())
		g.Expect(attachmentsOf(ctx, g, vm)).To(BeEmpty())
	}).WithContext(ctx).WithTimeout(timeout).Should(Succeed())
	g.Expect(run(g, "ls /sys/block")).NotTo(ContainSubstring(disk))
	g.Expect(regexp.MustCompile(`\b` + disk + `\b`).MatchString(run(g, "cat /proc/partitions"))).To(BeFalse())
}
