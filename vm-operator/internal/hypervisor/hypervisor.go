// Package hypervisor is how the vm-operator host agent acts on the virtual machines of its host:
// power them on and off, hot-plug a host block device into one with a disk serial, and unplug
// it. One small interface, one implementation per hypervisor:
//
//   - local (the lab's): a VM is a directory on this machine, and hot-plug exposes the device
//     in that VM's own device tree, where the guest-csi node plugin of the VM looks for it;
//   - qemu: starts each VM as a qemu-system-x86_64 process and hot-plugs over its QMP socket.
//
// Every method is idempotent, so that an agent restarted at any step converges by repeating
// what it was doing.
package hypervisor

import (
	"context"
	"errors"

	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/pkg/qos"
)

// Errors a Driver returns, wrapped with details.
var (
	// ErrVMNotFound: the hypervisor does not know the VM (not created, or powered off for good).
	ErrVMNotFound = errors.New("virtual machine not found")
	// ErrBusy: the guest has not released the disk yet (an unplug in progress), or PowerOff
	// found disks that the driver cannot drop by itself; retry later.
	ErrBusy = errors.New("disk still held by the virtual machine")
	// ErrConflict: the serial is attached with another device, or the device under another serial.
	ErrConflict = errors.New("conflicting disk")
	// ErrNotLive: the driver cannot change the I/O limits of this attached disk without
	// detaching it (local: a disk attached without limits); they apply at its next Attach.
	ErrNotLive = errors.New("the disk's I/O limits cannot change while it is attached")
	// ErrInsufficientMemory: PowerOn found less memory available on the host than the VM
	// boots with; it does not start it smaller.
	ErrInsufficientMemory = errors.New("not enough memory available on the host")
	// ErrImageNotFound: PowerOn found no image of the name the VM boots (VM.Image) on the host.
	ErrImageNotFound = errors.New("machine image not found on the host")
	// ErrGuestAgent: the guest does not answer for itself (not booted yet, or no guest agent).
	ErrGuestAgent = errors.New("the guest agent does not answer")
	// ErrNoSlot: every hot-plug slot of the VM holds a disk; detach one first.
	// Its text is the API's vmv1.NoFreeSlotError, which reaches the guest in status.volumes.
	ErrNoSlot = errors.New(vmv1.NoFreeSlotError)
)

// MaxSlots bounds the hot-plug slots of a VM, as VirtualMachine's spec.volumes bounds its
// entries.
const MaxSlots = 64

// MaxSerialLength is the virtio-blk limit: QEMU silently truncates a longer serial.
const MaxSerialLength = 20

// VM identifies a virtual machine on this host.
type VM struct {
	// Namespace and Name are those of the VirtualMachine object.
	Namespace, Name string
	// UID is the VirtualMachine's status.uniqueID: stable for the VM's life, never reused.
	UID string
	// Slots is how many disks the VM is to hold hot-plugged at once (VirtualMachine
	// spec.maxVolumes); 0 means the driver's default. The qemu driver gives a VM its slots
	// when it starts it; the local driver applies them to every Attach.
	Slots int
	// CPUs and MemoryMiB size the VM (VirtualMachine spec.resources, rounded up to whole CPUs
	// and MiB); 0 means the driver's default. The qemu driver gives a VM its size when it
	// starts it; the local driver's VMs share the host's.
	CPUs, MemoryMiB int
	// Image names the machine image the VM boots (VirtualMachine spec.image), one of the
	// host's image store; "" means the driver's default. The qemu driver boots a VM it starts
	// from it; the local driver's VMs share the host's kernel and ignore it.
	Image string
	// Bootstrap, when set, is what the VM boots with (a Cluster API machine's bootstrap
	// data); PowerOn hands it to a VM it starts.
	Bootstrap *Bootstrap
}

// Bootstrap is the first-boot data of a VM as cloud-init's NoCloud data source reads it. Both
// files may hold secrets (a kubeadm join token): drivers keep them readable by root only.
type Bootstrap struct {
	// UserData is the user data (a cloud-config or a script).
	UserData []byte
	// MetaData is the NoCloud meta-data (YAML: instance-id, local-hostname, ...).
	MetaData []byte
}

// Disk is a host block device as a virtio disk of a VM.
type Disk struct {
	// Serial identifies the disk inside the VM (/sys/block/vdX/serial,
	// /dev/disk/by-id/virtio-<serial>); at most MaxSerialLength characters.
	Serial string
	// Device is the host block device that backs it, e.g. /dev/loop3.
	Device string
	// Limits, when set, are the I/O limits the hypervisor enforces on the disk (a volume with a
	// VolumeAttributesClass); SetLimits changes them while the VM runs. Nil: the disk is
	// attached without limits, and a driver may pass the device straight through (local),
	// so that limits set later apply only at its next Attach.
	Limits *Limits
}

// Limits are a disk's I/O limits (IOPS, BytesPerSecond), enforced by the hypervisor's block
// layer over all of the guest's reads and writes together. Zero is no limit.
type Limits = qos.Limits

// Driver acts on the VMs of this host. Implementations are safe for concurrent use.
type Driver interface {
	// Name names the driver ("local", "qemu").
	Name() string
	// PowerOn starts vm, or does nothing if it runs. A VM started with vm.Bootstrap receives it
	// (local: files of its NoCloud seed directory; qemu: a read-only FAT disk labelled CIDATA).
	PowerOn(ctx context.Context, vm VM) error
	// PowerOff stops vm, or does nothing if it is off. A stopped VM holds no disk: a driver
	// whose guest would keep using its disks (local) returns ErrBusy naming them instead, and
	// the caller detaches them first.
	PowerOff(ctx context.Context, vm VM) error
	// ForceOff stops vm at once, as pulling its power does: every disk is released with it,
	// whatever the guest was doing with them. It is for a VM that must stop and whose guest has
	// not released its disks within the unplug timeout.
	ForceOff(ctx context.Context, vm VM) error
	// Delete is for a VM whose object is gone: it stops vm at once if it still runs, as
	// ForceOff, and removes what the driver keeps of it (qemu: its directory, with its boot
	// disk overlay and logs; local: nothing more). A VM the driver does not know is success.
	Delete(ctx context.Context, vm VM) error
	// Running reports whether vm runs.
	Running(ctx context.Context, vm VM) (bool, error)

	// Attach hot-plugs disk into the running vm. Attaching a disk that is attached with the
	// same serial and device is success; ErrConflict otherwise; ErrVMNotFound if vm is not
	// running.
	Attach(ctx context.Context, vm VM, disk Disk) error
	// Detach unplugs the disk with serial from vm and returns nil only once the hypervisor no
	// longer holds its device: ErrBusy while the guest has not let go yet. A disk that is not
	// attached, or a VM that does not run, is success.
	Detach(ctx context.Context, vm VM, serial string) error
	// SetLimits changes the I/O limits of the disk with serial attached to the running vm, at
	// once and without detaching it; setting the limits it has is success. ErrNotLive when the
	// disk was attached without limits and the driver cannot add them live (the caller
	// reports that they apply at the next attach); ErrVMNotFound or an error naming the serial
	// when vm does not run or the disk is not attached.
	SetLimits(ctx context.Context, vm VM, serial string, limits Limits) error
	// Slots reports how many disks the running vm can hold hot-plugged at once (qemu: the
	// hot-plug ports it was started with; local: vm.Slots or the driver's default); 0 when vm
	// does not run. An Attach of one more disk than that fails with ErrNoSlot.
	Slots(ctx context.Context, vm VM) (int, error)
	// Addresses lists the IP addresses of the running vm's NIC as its guest reports them, IPv4
	// first: nil for a VM without a NIC, or a driver whose VMs have none of their own (local);
	// ErrGuestAgent while the guest does not say (it boots, or runs no guest agent).
	Addresses(ctx context.Context, vm VM) ([]string, error)
	// Disks lists the disks attached to vm, those its guest sees (empty when it does not run),
	// each with the limits the hypervisor enforces on it (nil for a disk attached without).
	// A disk whose Attach was interrupted is not listed until Attach is repeated: the host
	// agent takes a listed disk for done and reports it attached without a second hot-plug.
	// A disk whose host device grew (its volume was expanded) is grown in the guest first,
	// since only the driver knows the size its guest sees: the host agent lists a VM's disks
	// at each of its reconciles, which the PV's new capacity brings.
	Disks(ctx context.Context, vm VM) ([]Disk, error)

	// Freeze holds the guest's writes to the disks of vm with serials until Thaw (a group
	// snapshot cuts them meanwhile): when it returns, every write the guest completed before
	// is on the host device, and no new write reaches it. A driver may hold more than asked
	// (qemu pauses the whole VM). A serial that is not attached, or a VM that does not run,
	// has no writes to hold. Freezing what is frozen is success. When the driver cannot hold
	// a disk the guest uses, it returns an error naming its serial and why, and holds nothing.
	Freeze(ctx context.Context, vm VM, serials []string) error
	// Thaw lets every disk Freeze held of vm go, also after a restart of the agent (the driver
	// remembers what it froze). A VM that is not frozen, or does not run, is success.
	Thaw(ctx context.Context, vm VM) error
}
