package pmem

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"testing"
	"time"

	. "github.com/onsi/gomega"
)

// guestModules are the kernel modules of the NVDIMM guest: the ACPI NFIT bus QEMU's NVDIMMs sit
// on, the fsdax block driver, device-mapper for LVM, and the filesystems (xfs needs the crc32c
// the kernel loads no module for by itself).
const guestModules = "nfit,nd_pmem,dm_mod,crc32c_generic,ext4,xfs"

// guestPrograms are the host programs the guest runs: what the back ends and the node's
// mounter call, and the setup of the tests.
const guestPrograms = "ndctl,lvm,pvcreate,vgcreate,vgs,lvs,lvcreate,lvremove,lvchange,lvextend," +
	"mkfs.ext4,mkfs.xfs,blkid,fsck,fsck.ext4,e2fsck,resize2fs,dumpe2fs,xfs_growfs,xfs_io,blockdev"

// guestEnv, set, makes TestModesOnEmulatedNVDIMMs run the guest's side (inGuest).
const guestEnv = "PVBRIDGE_PMEM_GUEST"

// runScript runs in the guest: LVM without udev (the guest has none), labels on the NVDIMMs,
// then the tests.
const runScript = `#!/bin/sh
mkdir -p /etc/lvm /run/lvm /run/lock/lvm /tmp
cat >/etc/lvm/lvm.conf <<EOF
activation {
	udev_sync = 0
	udev_rules = 0
}
devices {
	obtain_device_list_from_udev = 0
}
EOF
# New NVDIMMs have no namespace labels: the kernel then shows each region as one raw
# namespace over all of it. Namespaces of their own need labels, written as an admin would.
ndctl disable-region all && ndctl init-labels -f all && ndctl enable-region all || exit 1
export TMPDIR=/tmp ` + guestEnv + `=1
/pmem.test -test.v -test.timeout 6m -test.run '^TestModesOnEmulatedNVDIMMs$'
`

// TestModesOnEmulatedNVDIMMs runs nvdimm_guest_test.go's tests (the ndctl and lvm back ends,
// DAX filesystems) in a QEMU guest with two emulated NVDIMM regions: Debian's kernel, ndctl and
// lvm2 against real libnvdimm regions, which this machine does not have. The guest runs this
// test too, built static, with guestEnv set.
func TestModesOnEmulatedNVDIMMs(t *testing.T) {
	if os.Getenv(guestEnv) != "" {
		inGuest(t)
		return
	}
	g := NewWithT(t)
	ctx, cancel := context.WithTimeout(t.Context(), 8*time.Minute)
	defer cancel()
	qemu, err := exec.LookPath("qemu-system-x86_64")
	if err != nil || runtime.GOARCH != "amd64" {
		t.Fatalf("qemu-system-x86_64 is not installed (%v): run `make deps` (hack/install-deps.sh installs Debian's qemu-system-x86)", err)
	}
	cache, err := os.UserCacheDir()
	g.Expect(err).NotTo(HaveOccurred())
	guest := filepath.Join(cache, "pvbridge", "pmem-guest")
	out, err := exec.CommandContext(ctx, "../../../hack/build-guest.sh", guest, guestModules, guestPrograms).CombinedOutput()
	g.Expect(err).NotTo(HaveOccurred(), "build the guest: %s", out)

	// The tests, static, in an archive appended to the guest's initramfs with /run.sh. Built
	// with the flags of the lab's static builds (-trimpath, CGO off, GOFLAGS' tags), whose
	// compiled packages the build cache then has; without go vet (make lint runs its analyzers),
	// which go test -c otherwise runs over each of the package's 320 dependencies.
	dir := t.TempDir()
	root := filepath.Join(dir, "root")
	g.Expect(os.MkdirAll(root, 0o755)).To(Succeed())
	build := exec.CommandContext(ctx, "go", "test", "-c", "-vet=off", "-trimpath", "-buildvcs=false", "-o", filepath.Join(root, "pmem.test"), ".")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	out, err = build.CombinedOutput()
	g.Expect(err).NotTo(HaveOccurred(), "build the guest's tests: %s", out)
	g.Expect(os.WriteFile(filepath.Join(root, "run.sh"), []byte(runScript), 0o755)).To(Succeed())
	initrd := filepath.Join(dir, "initrd")
	base, err := os.ReadFile(filepath.Join(guest, "initramfs.gz"))
	g.Expect(err).NotTo(HaveOccurred())
	cpio := exec.CommandContext(ctx, "sh", "-c", "find . | busybox cpio -o -H newc 2>/dev/null")
	cpio.Dir = root
	extra, err := cpio.Output()
	g.Expect(err).NotTo(HaveOccurred())
	// The kernel unpacks concatenated archives in order; an uncompressed one goes first (after
	// a compressed one it finds no magic).
	g.Expect(os.WriteFile(initrd, append(extra, base...), 0o600)).To(Succeed())

	args := []string{
		"-machine", "pc,nvdimm=on,accel=" + accel(), "-smp", "2",
		"-m", "512M,slots=2,maxmem=2G",
		"-kernel", filepath.Join(guest, "vmlinux"), "-initrd", initrd,
		"-append", "console=ttyS0 panic=-1 quiet",
		"-display", "none", "-no-reboot", "-serial", "file:" + filepath.Join(dir, "serial.log"),
	}
	for i := range 2 {
		// Sparse backing files; 128 KiB of each is the namespace label area.
		backing := filepath.Join(dir, fmt.Sprintf("nvdimm%d", i))
		g.Expect(os.WriteFile(backing, nil, 0o600)).To(Succeed())
		g.Expect(os.Truncate(backing, 512<<20)).To(Succeed())
		args = append(args,
			"-object", fmt.Sprintf("memory-backend-file,id=mem%d,share=on,mem-path=%s,size=512M", i, backing),
			// Placed by hand: packed one after the other, the second region would start 128 KiB
			// (the first one's labels) short of 16 MiB alignment, and ndctl refuses namespaces
			// there ("misaligned to 16M").
			"-device", fmt.Sprintf("nvdimm,id=nvdimm%d,memdev=mem%d,label-size=128K,addr=%#x", i, i, 4<<30+i*512<<20))
	}
	start := time.Now()
	cmd := exec.CommandContext(ctx, qemu, args...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	err = cmd.Run()
	serial, _ := os.ReadFile(filepath.Join(dir, "serial.log"))
	t.Logf("the guest ran for %v; its console:\n%s", time.Since(start).Round(time.Millisecond), serial)
	g.Expect(err).NotTo(HaveOccurred(), "qemu: %s", stderr.String())
	m := regexp.MustCompile(`GUEST-DONE rc=(\d+)`).FindSubmatch(serial)
	g.Expect(m).NotTo(BeNil(), "the guest finished its tests")
	g.Expect(string(m[1])).To(Equal("0"), "the tests in the guest passed")
	for _, test := range []string{"ndctl", "lvm", "filesystems/ext4", "filesystems/xfs"} {
		g.Expect(string(serial)).To(MatchRegexp(`--- PASS: TestModesOnEmulatedNVDIMMs/%s \(`, regexp.QuoteMeta(test)))
	}
}

// accel is KVM where the CPU has hardware virtualization, else TCG: a /dev/kvm without it (a
// software backend such as kvm_pvm) boots a Linux guest slower than TCG does.
func accel() string {
	cpuinfo, err := os.ReadFile("/proc/cpuinfo")
	if err == nil && regexp.MustCompile(`(?m)^flags\s*:.*\b(vmx|svm)\b`).Match(cpuinfo) {
		return "kvm:tcg"
	}
	return "tcg"
}
