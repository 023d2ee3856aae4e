package qemu

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	. "github.com/onsi/gomega"

	"pvbridge.io/vm-operator/internal/hypervisor"
)

func TestNames(t *testing.T) {
	tests := []struct {
		name, serial         string
		wantDevice, wantNode string
	}{{
		name:       "a serial that is a valid QOM id is kept readable",
		serial:     "PVB0123456789ABCDEFG",
		wantDevice: "pvb-disk-PVB0123456789ABCDEFG",
		wantNode:   "pvb-node-PVB0123456789ABCDEFG",
	}, {
		name:       "dots, dashes and underscores are valid",
		serial:     "pvc-a.b_c",
		wantDevice: "pvb-disk-pvc-a.b_c",
		wantNode:   "pvb-node-pvc-a.b_c",
	}, {
		name:       "a serial with other characters is hashed",
		serial:     "disk #1",
		wantDevice: "pvb-disk-h70aab128b94d1f88",
		wantNode:   "pvb-node-h70aab128b94d1f88",
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			device, node := names(tt.serial)
			g.Expect(device).To(Equal(tt.wantDevice))
			g.Expect(node).To(Equal(tt.wantNode))
			g.Expect(len(node)).To(BeNumerically("<=", 31), "QEMU's limit for node names")
		})
	}
}

func TestDirName(t *testing.T) {
	long := strings.Repeat("n", 253) // the longest Kubernetes name
	tests := []struct {
		name string
		vm   hypervisor.VM
		want string // "" to check the length only
	}{{
		name: "namespace and name, joined by a character neither may contain",
		vm:   hypervisor.VM{Namespace: "tenant-a", Name: "vm1"},
		want: "tenant-a_vm1",
	}, {
		name: "a long name is shortened with a hash, within the socket path limit",
		vm:   hypervisor.VM{Namespace: "tenant-a", Name: long},
	}}
	const runDir = "/var/run/pvbridge/vms"
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			got := dirName(runDir, tt.vm)
			if tt.want != "" {
				g.Expect(got).To(Equal(tt.want))
			}
			g.Expect(len(filepath.Join(runDir, got, serialSocket))).To(BeNumerically("<=", maxSocketPath))
		})
	}
	g := NewWithT(t)
	other := dirName(runDir, hypervisor.VM{Namespace: "tenant-a", Name: long[1:] + "x"})
	g.Expect(other).NotTo(Equal(dirName(runDir, hypervisor.VM{Namespace: "tenant-a", Name: long})),
		"names that share their start get different directories")
}

func TestHasVirtualizationFlag(t *testing.T) {
	tests := []struct {
		name    string
		cpuinfo string
		want    bool
	}{
		{"Intel VT-x", "processor\t: 0\nflags\t\t: fpu vme vmx sse\n", true},
		{"AMD-V", "processor\t: 0\nflags\t\t: fpu svm\n", true},
		{"none (software KVM such as kvm_pvm)", "processor\t: 0\nflags\t\t: fpu vme hypervisor\n", false},
		{"only in another field", "model name\t: vmx svm\nflags\t\t: fpu\n", false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			NewWithT(t).Expect(hasVirtualizationFlag(strings.NewReader(tt.cpuinfo))).To(Equal(tt.want))
		})
	}
}

func TestArgs(t *testing.T) {
	tests := []struct {
		name    string
		opts    Options
		vm      hypervisor.VM
		want    []string // consecutive arguments that must appear
		notWant string   // an argument that must not appear
	}{{
		name: "software emulation with the most capable CPU model",
		opts: Options{Accel: "tcg"},
		want: []string{"-accel", "tcg", "-cpu", "max"},
	}, {
		name: "KVM with the host's CPU",
		opts: Options{Accel: "kvm"},
		want: []string{"-accel", "kvm", "-cpu", "host"},
	}, {
		name: "native PCIe hot-plug",
		want: []string{"-global", "ICH9-LPC.acpi-pci-hotplug-with-bridge-support=off"},
	}, {
		name: "the ninth hot-plug port opens the next slot",
		want: []string{"-device", "pcie-root-port,id=pvb-port8,bus=pcie.0,chassis=9,slot=9,addr=0x3.0,multifunction=on"},
	}, {
		name: "the VM's UID is its system UUID",
		vm:   hypervisor.VM{Namespace: "a", Name: "b", UID: "6c0c5b9e-2f59-4a51-9d67-4f7a53a1c0de"},
		want: []string{"-uuid", "6c0c5b9e-2f59-4a51-9d67-4f7a53a1c0de"},
	}, {
		name:    "a UID that is no UUID is not passed",
		vm:      hypervisor.VM{Namespace: "a", Name: "b", UID: "vm-17"},
		notWant: "-uuid",
	}, {
		name: "the driver's size for a VM that does not say",
		opts: Options{CPUs: 2, MemoryMiB: 512},
		want: []string{"-smp", "2", "-m", "512M"},
	}, {
		name: "the VM's own size over the driver's",
		opts: Options{CPUs: 2, MemoryMiB: 512},
		vm:   hypervisor.VM{Namespace: "a", Name: "b", CPUs: 4, MemoryMiB: 2048},
		want: []string{"-smp", "4", "-m", "2048M"},
	}, {
		name:    "a boot image that the firmware boots",
		opts:    Options{Image: "/images/node.qcow2"},
		want:    []string{"-device", "virtio-blk-pci,drive=pvb-boot,id=pvb-boot,bus=pcie.0,bootindex=0"},
		notWant: "virtio-blk-pci,drive=pvb-boot,id=pvb-boot,bus=pcie.0",
	}, {
		name:    "a boot image beside a direct kernel boot, whose boot index is taken",
		opts:    Options{Image: "/images/node.qcow2", Kernel: "/k"},
		want:    []string{"-device", "virtio-blk-pci,drive=pvb-boot,id=pvb-boot,bus=pcie.0"},
		notWant: "virtio-blk-pci,drive=pvb-boot,id=pvb-boot,bus=pcie.0,bootindex=0",
	}, {
		name: "a NIC on a bridge is the tap handed over after the QMP socket",
		opts: Options{Network: "bridge:br0"},
		want: []string{"-netdev", "tap,id=pvb-nic0,fd=4", "-device", "virtio-net-pci,netdev=pvb-nic0,id=pvb-nic0,bus=pcie.0,mac=" + macFor(hypervisor.VM{Namespace: "a", Name: "b"}) + ",romfile="},
	}, {
		name: "every VM has the guest agent's port",
		want: []string{"-device", "virtserialport,bus=pvb-vser.0,chardev=qga0,name=org.qemu.guest_agent.0"},
	}, {
		name: "direct kernel boot",
		opts: Options{Kernel: "/k", Initrd: "/i", Append: "console=ttyS0"},
		want: []string{"-kernel", "/k", "-initrd", "/i", "-append", "console=ttyS0"},
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			opts := tt.opts
			opts.RunDir = "/run/vms"
			d, err := New(opts)
			g.Expect(err).NotTo(HaveOccurred())
			vm := tt.vm
			if vm.Name == "" {
				vm = hypervisor.VM{Namespace: "a", Name: "b"}
			}
			v, err := d.state(vm)
			g.Expect(err).NotTo(HaveOccurred())
			b, err := d.bootOf(vm)
			g.Expect(err).NotTo(HaveOccurred())
			args := d.args(v, vm, b, 3)
			line := strings.Join(args, "\n")
			if tt.want != nil {
				g.Expect(line).To(ContainSubstring(strings.Join(tt.want, "\n")))
			}
			if tt.notWant != "" {
				g.Expect(args).NotTo(ContainElement(tt.notWant))
			}
			g.Expect(args).To(ContainElement("socket,id=qmp,fd=3,server=on,wait=off"))
		})
	}
}

func TestBootOf(t *testing.T) {
	// store has node-full (a disk, a kernel, its initrd and command line), node-disk (a disk
	// for the firmware to boot) and node-empty (no disk).
	store := t.TempDir()
	for _, f := range []string{"node-full/disk.qcow2", "node-full/vmlinuz", "node-full/initrd.img", "node-disk/disk.qcow2", "node-empty/vmlinuz"} {
		path := filepath.Join(store, f)
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(store, "node-full", "cmdline"), []byte("root=LABEL=root console=ttyS0\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	hostDefault := Options{Image: "/default.qcow2", Kernel: "/k", Initrd: "/i", Append: "quiet"}
	tests := []struct {
		name    string
		opts    Options // the store is added unless noStore
		noStore bool
		image   string
		want    boot
		// wantErr is in the error, which is ErrImageNotFound when notFound.
		wantErr  string
		notFound bool
	}{{
		name: "a VM that names no image boots the driver's",
		opts: hostDefault, want: boot{image: "/default.qcow2", kernel: "/k", initrd: "/i", append: "quiet"},
	}, {
		name: "an image with a kernel boots it directly, with its initrd and command line",
		opts: hostDefault, image: "node-full",
		want: boot{
			image: filepath.Join(store, "node-full", imageDisk), kernel: filepath.Join(store, "node-full", imageKernel),
			initrd: filepath.Join(store, "node-full", imageInitrd), append: "root=LABEL=root console=ttyS0",
		},
	}, {
		name: "an image of a disk alone is booted by the firmware, nothing of the driver's added",
		opts: hostDefault, image: "node-disk",
		want: boot{image: filepath.Join(store, "node-disk", imageDisk)},
	}, {
		name: "an image the store does not have is not found", image: "node-v9",
		wantErr: "has no node-v9/disk.qcow2", notFound: true,
	}, {
		name: "an image without a disk is not found", image: "node-empty",
		wantErr: "has no node-empty/disk.qcow2", notFound: true,
	}, {
		name: "a host without an image store has no image", noStore: true, image: "node-full",
		wantErr: "no image store (--qemu-image-dir)", notFound: true,
	}, {
		name: "a path is no image name", image: "../node-full",
		wantErr: "not a name of the image store",
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			opts := tt.opts
			opts.RunDir = "/run/vms"
			if !tt.noStore {
				opts.ImageDir = store
			}
			d, err := New(opts)
			g.Expect(err).NotTo(HaveOccurred())
			b, err := d.bootOf(hypervisor.VM{Namespace: "a", Name: "b", Image: tt.image})
			if tt.wantErr != "" {
				g.Expect(err).To(MatchError(ContainSubstring(tt.wantErr)))
				g.Expect(errors.Is(err, hypervisor.ErrImageNotFound)).To(Equal(tt.notFound))
				return
			}
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(b).To(Equal(tt.want))
		})
	}
}

func TestNewRejectsBadOptions(t *testing.T) {
	tests := []struct {
		name    string
		opts    Options
		wantErr string
	}{
		{"no run directory", Options{}, "RunDir is required"},
		{"a run directory too long for sockets", Options{RunDir: "/" + strings.Repeat("d", 60)}, "longer than 60"},
		{"an unknown accelerator", Options{RunDir: "/run/vms", Accel: "hvf"}, "want kvm or tcg"},
		{"too many ports", Options{RunDir: "/run/vms", HotplugPorts: 65}, "want 1 to 64"},
		{"a bridge without a name", Options{RunDir: "/run/vms", Network: "bridge:"}, "want user, bridge:"},
		{"a bridge name longer than an interface's", Options{RunDir: "/run/vms", Network: "bridge:a-very-long-bridge"}, "want user, bridge:"},
		{"an unknown network", Options{RunDir: "/run/vms", Network: "slirp"}, "want user, bridge:"},
		{"an absolute cgroup parent", Options{RunDir: "/run/vms", CgroupParent: "/pvbridge-vms"}, "relative to the cgroup root"},
		{"a cgroup parent out of the root", Options{RunDir: "/run/vms", CgroupParent: "../vms"}, "relative to the cgroup root"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := New(tt.opts)
			NewWithT(t).Expect(err).To(MatchError(ContainSubstring(tt.wantErr)))
		})
	}
}

func TestInvalidVMNames(t *testing.T) {
	d, err := New(Options{RunDir: "/run/vms"})
	if err != nil {
		t.Fatal(err)
	}
	for _, vm := range []hypervisor.VM{{Name: "vm1"}, {Namespace: "a", Name: ".."}, {Namespace: "a", Name: "b/c"}, {Namespace: "a_b", Name: "c"}} {
		_, err := d.state(vm)
		NewWithT(t).Expect(err).To(MatchError(ContainSubstring("invalid VM")), "%+v", vm)
	}
}
