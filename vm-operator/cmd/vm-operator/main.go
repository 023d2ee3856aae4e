// Command vm-operator manages the VirtualMachines of the management cluster. In the controller
// role it places them and drives their power state and volumes; in the host-agent role, one per
// host, it hot-plugs volumes into the VirtualMachines on that host; in the
// infrastructure-provider role it is pvbridge's Cluster API infrastructure provider.
package main

import (
	"context"
	"os"
	"time"

	"github.com/spf13/pflag"
	"k8s.io/klog/v2"
	ctrl "sigs.k8s.io/controller-runtime"

	"pvbridge.io/pkg/command"
	"pvbridge.io/pkg/hold"
	"pvbridge.io/vm-operator/internal/capi"
	"pvbridge.io/vm-operator/internal/operator"
)

// version is set at build time with -ldflags "-X main.version=<version>".
var version = "devel"

func main() {
	var opts operator.Options
	fs := pflag.NewFlagSet(os.Args[0], pflag.ExitOnError)
	fs.StringVar(&opts.Kubeconfig, "kubeconfig", "",
		"Path of the management cluster's kubeconfig. When empty: $KUBECONFIG, the in-cluster configuration, then ~/.kube/config.")
	fs.StringVar((*string)(&opts.Role), "role", "",
		`What to run: "controller" (one per management cluster), "host-agent" (one per host, beside its kubelet) or "infrastructure-provider" (Cluster API's, one per management cluster). Required.`)
	fs.StringVar(&opts.NodeName, "node-name", "",
		"Name of this host's Kubernetes Node; usually the pod's spec.nodeName. Required with --role=host-agent.")
	fs.Float32Var(&opts.KubeAPIQPS, "kube-api-qps", 50,
		"Queries per second to the Kubernetes API (each VolumeAttachment costs a few; at 20 a burst of 100 volumes waits 20 s).")
	fs.IntVar(&opts.KubeAPIBurst, "kube-api-burst", 100, "Burst of queries to the Kubernetes API.")
	fs.StringVar(&opts.Hypervisor, "hypervisor", "local",
		`Host agent: the hypervisor driver, "local" (a VM is a directory whose device tree receives the hot-plugged disks; the lab) or "qemu" (QEMU VMs started and hot-plugged over QMP).`)
	fs.StringVar(&opts.VMRoot, "vm-root", "/var/lib/pvbridge/vms",
		"Host agent, local hypervisor: the directory holding one directory per VM, <root>/<namespace>/<name>.")
	fs.StringVar(&opts.QEMU.RunDir, "qemu-run-dir", "/var/lib/pvbridge/qemu",
		"Host agent, qemu hypervisor: the directory holding each VM's boot disk overlay, QMP socket, pid file, QEMU's output and serial console log (at most 60 characters). Keep it on a disk, not a tmpfs: a VM's overlay holds what its guest wrote, which a host's reboot must not lose.")
	fs.StringVar(&opts.QEMU.Binary, "qemu-binary", "",
		"Host agent, qemu hypervisor: the QEMU system emulator, a path or a name looked up in PATH; empty is qemu-system-x86_64.")
	fs.StringVar(&opts.QEMU.Accel, "qemu-accel", "",
		`Host agent, qemu hypervisor: "kvm" or "tcg"; empty picks kvm when the CPU has vmx or svm and /dev/kvm exists, else tcg (emulation, about 10 times slower).`)
	fs.IntVar(&opts.QEMU.CPUs, "qemu-cpus", 0,
		"Host agent, qemu hypervisor: the vCPUs of a VirtualMachine whose spec.resources.cpu does not say; 0 is the driver's default, 1.")
	fs.IntVar(&opts.QEMU.MemoryMiB, "qemu-memory-mib", 0,
		"Host agent, qemu hypervisor: the memory in MiB of a VirtualMachine whose spec.resources.memory does not say; 0 is the driver's default, 256.")
	fs.StringVar(&opts.QEMU.Kernel, "qemu-kernel", "",
		"Host agent, qemu hypervisor: a Linux kernel a VM that names no image (spec.image) boots directly (-kernel); empty boots the firmware, which boots the VM's overlay of --qemu-image.")
	fs.StringVar(&opts.QEMU.Initrd, "qemu-initrd", "", "Host agent, qemu hypervisor: the initrd of --qemu-kernel (-initrd).")
	fs.StringVar(&opts.QEMU.Append, "qemu-append", "", "Host agent, qemu hypervisor: the command line of --qemu-kernel (-append).")
	fs.StringVar(&opts.QEMU.Image, "qemu-image", "",
		"Host agent, qemu hypervisor: a qcow2 boot disk a VM that names no image (spec.image) boots from through a copy-on-write overlay of its own, made at its first power-on (needs qemu-img); the image is never written. Empty: no boot disk.")
	fs.StringVar(&opts.QEMU.ImageDir, "qemu-image-dir", "/var/lib/pvbridge/images",
		"Host agent, qemu hypervisor: the host's image store, one directory per machine image named as VirtualMachine spec.image names it, holding disk.qcow2 and, for a direct kernel boot, vmlinuz, initrd.img and cmdline (make node-image builds one). A VM that names an image boots it instead of --qemu-image and --qemu-kernel; a VM whose image is not there does not start (Ready False, ImageNotFound).")
	fs.StringVar(&opts.QEMU.Network, "qemu-network", "",
		`Host agent, qemu hypervisor: every VM's virtio NIC, its MAC derived from the VM's UID: "user" on QEMU's user-mode network (the host's 127.0.0.1 is 10.0.2.2 in the guest, nothing reaches the guest); "bridge:<name>" a tap of its own on the host's Linux bridge <name>, a machine of that network (DHCP from it); empty gives none.`)
	fs.StringVar(&opts.QEMU.NetNS, "qemu-netns", "",
		"Host agent, qemu hypervisor: the network namespace QEMU runs in and makes its taps in, a /proc/<pid>/ns/net or /run/netns/<name> file; /proc/1/ns/net is the host's for an agent in a pod of its own network with the host's PID namespace (the shipped DaemonSet), whose network would go with the pod. Empty: the agent's.")
	fs.StringArrayVar(&opts.QEMU.ExtraArgs, "qemu-arg", nil,
		"Host agent, qemu hypervisor: an argument appended to every VM's QEMU command line (repeat the flag, one argument each), e.g. a device the other flags do not make.")
	fs.DurationVar(&opts.QEMU.ShutdownGracePeriod, "qemu-shutdown-grace-period", 0,
		"Host agent, qemu hypervisor: how long a VM that is powered off has to shut down after its ACPI power button is pressed before QEMU is stopped; 0 stops it at once.")
	fs.StringVar(&opts.QEMU.CgroupParent, "qemu-cgroup-parent", "",
		"Host agent, qemu hypervisor: run each VM's QEMU in a cgroup of its own, <parent>/<namespace>_<name>, in every hierarchy of --qemu-cgroup-root, rather than in the agent's: its memory is not charged to the agent's container, and stopping that container does not stop the VMs (with hostPID, as the shipped DaemonSet). Empty: QEMU stays in the agent's cgroup.")
	fs.StringVar(&opts.QEMU.CgroupRoot, "qemu-cgroup-root", "/sys/fs/cgroup",
		"Host agent, qemu hypervisor: where the host's cgroup filesystem is mounted, whole (in a container, the host's /sys/fs/cgroup mounted from a hostPath: the container's own shows only its cgroup).")
	fs.IntVar(&opts.Slots, "vm-slots", 0,
		"Host agent: how many disks a VirtualMachine holds hot-plugged at once when its spec.maxVolumes does not say (qemu: PCIe root ports per VM); 0 means the hypervisor driver's default, 16 for qemu, 64 for local. A guest node reports its VM's number as its CSI volume limit.")
	fs.StringVar(&opts.CSIEndpoint, "csi-endpoint", "unix:///var/lib/kubelet/plugins/pmem.csi.pvbridge.io/csi.sock",
		"Host agent: the socket of this host's mgmt-csi node plugin, through which VM volumes are staged and published.")
	fs.StringVar(&opts.StateDir, "state-dir", "/var/lib/pvbridge/host-agent",
		"Host agent: where VM volumes are staged and published before they are hot-plugged.")
	fs.DurationVar(&opts.UnplugTimeout, "unplug-timeout", 5*time.Minute,
		"Host agent: how long the guest of a VM that must stop (powered off or deleted) has to release its disks before the VM is forced off; 0 waits for ever.")
	fs.DurationVar(&opts.HoldMax, "hold-max", hold.DefaultMaxHold,
		"Host agent: the longest it holds the writes of VirtualMachines (pauses them, or freezes their guests' filesystems) while mgmt-csi cuts a group snapshot of their volumes; a hold that is not released by then is let go, and the cut reported inconsistent.")
	fs.DurationVar(&opts.VolumeDetachTimeout, "volume-detach-timeout", capi.DefaultVolumeDetachTimeout,
		"Infrastructure provider: how long a deleted Machine's VirtualMachine may keep volumes before it is powered off and deleted anyway (Cluster API waited for them to detach already); 0 waits for ever.")
	fs.BoolVar(&opts.LeaderElect, "leader-elect", false,
		"Controller and infrastructure provider: run one active replica of several, chosen by a Lease (pvbridge-vm-operator-controller, pvbridge-infrastructure-provider); the others wait to take over.")
	fs.StringVar(&opts.LeaderElectionNamespace, "leader-election-namespace", "",
		"Namespace of the leader election Lease; empty for the pod's namespace (required outside a cluster).")
	fs.StringVar(&opts.WatchNamespace, "namespace", "",
		"Infrastructure provider: the namespace whose Cluster API objects it reconciles; empty: every namespace.")
	fs.StringVar(&opts.WatchFilter, "watch-filter", "",
		"Infrastructure provider: reconcile only the Cluster API objects labelled cluster.x-k8s.io/watch-filter=<value>; empty: all of them.")
	fs.StringVar(&opts.MetricsAddress, "metrics-bind-address", "0",
		`host:port to serve Prometheus metrics on (/metrics), or "0" for none.`)
	fs.StringVar(&opts.HealthAddress, "health-probe-bind-address", ":8081",
		`host:port to serve the /healthz and /readyz probes on, or "0" for none.`)
	command.Main(fs, "vm-operator", version, "pvbridge vm-operator.", func(ctx context.Context) error {
		ctrl.SetLogger(klog.Background())
		op, err := operator.New(opts)
		if err != nil {
			return err
		}
		return op.Run(ctx)
	})
}
