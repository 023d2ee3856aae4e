package qemu

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"k8s.io/klog/v2"

	"pvbridge.io/vm-operator/internal/hypervisor"
)

// QOM ids of the driver's disks. The device id and the block node name derive from the serial,
// so that QEMU's state alone says which disk is which.
const (
	peripheral   = "/machine/peripheral/"
	devicePrefix = "pvb-disk-"
	nodePrefix   = "pvb-node-" // with a 20-character serial, 29 of the 31 characters a node name may have
)

// names returns the QOM device id and the block node name of the disk with serial. A serial
// that is not a well-formed QOM id is hashed.
func names(serial string) (device, node string) {
	key := serial
	if strings.IndexFunc(serial, func(r rune) bool { return !isIDChar(r) }) >= 0 {
		sum := sha256.Sum256([]byte(serial))
		key = "h" + hex.EncodeToString(sum[:8])
	}
	return devicePrefix + key, nodePrefix + key
}

// isIDChar reports whether QEMU accepts r in an id after its first character (a letter).
func isIDChar(r rune) bool {
	return r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '.' || r == '_'
}

func validateSerial(serial string) error {
	if serial == "" || len(serial) > hypervisor.MaxSerialLength {
		return fmt.Errorf("disk serial %q: want 1 to %d characters", serial, hypervisor.MaxSerialLength)
	}
	return nil
}

// attachment is a block device of a VM as QEMU reports it.
type attachment struct {
	path   string // QOM path of the device, e.g. /machine/peripheral/pvb-disk-X
	id     string // its id, "" when it has none
	serial string // "" when it has none
	node   string // the block node it uses
	file   string // the host file or device behind the node
	size   int64  // the node's length, which the guest sees
	limits hypervisor.Limits
}

// attachments lists the block devices of the VM behind mon, with their serials and host devices.
func attachments(ctx context.Context, mon *Monitor) ([]attachment, error) {
	var blocks []struct {
		// QDev is the device's QOM path, with /virtio-backend for virtio devices.
		QDev     string `json:"qdev"`
		Inserted *struct {
			NodeName string `json:"node-name"`
			File     string `json:"file"`
			BPS      int64  `json:"bps"`
			IOPS     int64  `json:"iops"`
			Image    struct {
				VirtualSize int64 `json:"virtual-size"`
			} `json:"image"`
		} `json:"inserted"`
	}
	if err := mon.Execute(ctx, "query-block", nil, &blocks); err != nil {
		return nil, err
	}
	var atts []attachment
	for _, b := range blocks {
		if b.QDev == "" || b.Inserted == nil {
			continue // a -drive without a device, or an empty drive
		}
		a := attachment{
			path:   strings.TrimSuffix(b.QDev, "/virtio-backend"),
			node:   b.Inserted.NodeName,
			file:   b.Inserted.File,
			size:   b.Inserted.Image.VirtualSize,
			limits: hypervisor.Limits{IOPS: b.Inserted.IOPS, BytesPerSecond: b.Inserted.BPS},
		}
		if id, ok := strings.CutPrefix(a.path, peripheral); ok && !strings.Contains(id, "/") {
			a.id = id
		}
		err := mon.Execute(ctx, "qom-get", map[string]string{"path": a.path, "property": "serial"}, &a.serial)
		var cerr *CommandError
		if err != nil && !errors.As(err, &cerr) { // a device without a serial property has none
			return nil, err
		}
		atts = append(atts, a)
	}
	return atts, nil
}

// Disks implements hypervisor.Driver. It lists the disks this driver attached (other block
// devices of the VM, such as its boot disk, are not its business), as QEMU reports them; a
// disk whose unplug is in progress is still listed. QEMU changes any disk's limits live, so a
// disk without limits is listed with nil ones. A disk whose host device grew is grown in the
// guest first (followSize).
func (d *Driver) Disks(ctx context.Context, vm hypervisor.VM) ([]hypervisor.Disk, error) {
	v, err := d.state(vm)
	if err != nil {
		return nil, err
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	mon, err := v.monitor(ctx)
	if errors.Is(err, hypervisor.ErrVMNotFound) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	atts, err := attachments(ctx, mon)
	if err != nil {
		return nil, fmt.Errorf("VM %s: %w", v.name, err)
	}
	var disks []hypervisor.Disk
	for _, a := range atts {
		if strings.HasPrefix(a.id, devicePrefix) {
			if err := followSize(ctx, mon, a); err != nil {
				return nil, fmt.Errorf("VM %s: disk %s: %w", v.name, a.serial, err)
			}
			disk := hypervisor.Disk{Serial: a.serial, Device: a.file}
			if a.limits != (hypervisor.Limits{}) {
				disk.Limits = &a.limits
			}
			disks = append(disks, disk)
		}
	}
	slices.SortFunc(disks, func(a, b hypervisor.Disk) int { return strings.Compare(a.Serial, b.Serial) })
	return disks, nil
}

// followSize grows disk a in the guest to the size of its host device when the device grew
// (its volume was expanded). QEMU's host_device node keeps the length it found when it opened
// the device; block_resize to the device's length, which a host device accepts up to its real
// size, gives the node that length and tells the guest its disk's new capacity (a virtio-blk
// configuration change: Linux logs "new size"). A device that is gone leaves the disk as it is.
func followSize(ctx context.Context, mon *Monitor, a attachment) error {
	size, err := deviceSize(a.file)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil || size <= a.size {
		return err
	}
	if err := mon.Execute(ctx, "block_resize", map[string]any{"node-name": a.node, "size": size}, nil); err != nil {
		return fmt.Errorf("grow from %d to %d bytes: %w", a.size, size, err)
	}
	klog.FromContext(ctx).V(2).Info("Grew disk", "serial", a.serial, "device", a.file, "from", a.size, "bytes", size)
	return nil
}

// deviceSize is the length of a host block device (or file).
func deviceSize(path string) (int64, error) {
	f, err := os.Open(path)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	return f.Seek(0, io.SeekEnd)
}

// Attach implements hypervisor.Driver: blockdev-add of disk.Device, then device_add of a
// virtio-blk-pci with the serial on a free hot-plug port. The node is removed again if the
// device cannot be added.
func (d *Driver) Attach(ctx context.Context, vm hypervisor.VM, disk hypervisor.Disk) error {
	if err := validateSerial(disk.Serial); err != nil {
		return err
	}
	if !filepath.IsAbs(disk.Device) {
		return fmt.Errorf("disk device %q: want an absolute path", disk.Device)
	}
	v, err := d.state(vm)
	if err != nil {
		return err
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	mon, err := v.monitor(ctx)
	if err != nil {
		return err
	}
	atts, err := attachments(ctx, mon)
	if err != nil {
		return fmt.Errorf("VM %s: %w", v.name, err)
	}
	id, node := names(disk.Serial)
	// Only a device this driver added counts as attached: another one with the serial or the
	// device conflicts, since Disks and Detach would not see it.
	for _, a := range atts {
		sameSerial := a.serial == disk.Serial || a.id == id
		sameDevice := sameFile(a.file, disk.Device)
		switch {
		case a.id == id && a.serial == disk.Serial && sameDevice:
			return nil
		case sameSerial:
			return fmt.Errorf("%w: VM %s has serial %q (%s) with device %s, not %s",
				hypervisor.ErrConflict, v.name, a.serial, a.path, a.file, disk.Device)
		case sameDevice:
			return fmt.Errorf("%w: VM %s has device %s with serial %q (%s), not %q",
				hypervisor.ErrConflict, v.name, a.file, a.serial, a.path, disk.Serial)
		}
	}

	// A node without its device is ours, left by an attach or detach that stopped halfway.
	if exists, err := nodeExists(ctx, mon, node); err != nil {
		return fmt.Errorf("VM %s: %w", v.name, err)
	} else if exists {
		if err := mon.Execute(ctx, "blockdev-del", map[string]string{"node-name": node}, nil); err != nil {
			return fmt.Errorf("VM %s: remove leftover block node: %w", v.name, err)
		}
	}
	port, err := d.freePort(ctx, mon)
	if err != nil {
		return fmt.Errorf("VM %s: %w", v.name, err)
	}

	type cache struct {
		Direct  bool `json:"direct"`
		NoFlush bool `json:"no-flush"`
	}
	// O_DIRECT with native AIO: the guest has its own page cache, the host must not add one.
	err = mon.Execute(ctx, "blockdev-add", struct {
		Driver   string `json:"driver"`
		NodeName string `json:"node-name"`
		Filename string `json:"filename"`
		Cache    cache  `json:"cache"`
		AIO      string `json:"aio"`
	}{"host_device", node, disk.Device, cache{Direct: true}, "native"}, nil)
	if err != nil {
		return fmt.Errorf("VM %s: add block node for %s: %w", v.name, disk.Device, err)
	}
	err = mon.Execute(ctx, "device_add", map[string]string{
		"driver": "virtio-blk-pci",
		"id":     id,
		"drive":  node,
		"serial": disk.Serial,
		"bus":    port,
	}, nil)
	if err != nil {
		// Leave nothing behind, even if ctx has ended.
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		if derr := mon.Execute(cctx, "blockdev-del", map[string]string{"node-name": node}, nil); derr != nil {
			err = errors.Join(err, fmt.Errorf("remove block node again: %w", derr))
		}
		return fmt.Errorf("VM %s: add disk %s with serial %q: %w", v.name, disk.Device, disk.Serial, err)
	}
	klog.FromContext(ctx).V(2).Info("Attached disk", "vm", v.name, "serial", disk.Serial, "device", disk.Device, "port", port)
	if disk.Limits != nil && *disk.Limits != (hypervisor.Limits{}) {
		// Interrupted before this, the disk is attached without its limits: the caller sees
		// that in Disks and sets them.
		return setThrottle(ctx, mon, v.name, id, *disk.Limits)
	}
	return nil
}

// SetLimits implements hypervisor.Driver: block_set_io_throttle on the disk's device, which
// QEMU applies to the requests that follow, whatever the disk was attached with.
func (d *Driver) SetLimits(ctx context.Context, vm hypervisor.VM, serial string, limits hypervisor.Limits) error {
	if err := validateSerial(serial); err != nil {
		return err
	}
	v, err := d.state(vm)
	if err != nil {
		return err
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	mon, err := v.monitor(ctx)
	if err != nil {
		return err
	}
	atts, err := attachments(ctx, mon)
	if err != nil {
		return fmt.Errorf("VM %s: %w", v.name, err)
	}
	id, _ := names(serial)
	i := slices.IndexFunc(atts, func(a attachment) bool { return a.id == id && a.serial == serial })
	switch {
	case i < 0:
		return fmt.Errorf("VM %s has no disk with serial %q", v.name, serial)
	case atts[i].limits == limits:
		return nil
	}
	return setThrottle(ctx, mon, v.name, id, limits)
}

// setThrottle sets the total limits of device id; zero lifts one. The block backend of a
// virtio-blk-pci device is its virtio-backend child's.
func setThrottle(ctx context.Context, mon *Monitor, vmName, id string, l hypervisor.Limits) error {
	err := mon.Execute(ctx, "block_set_io_throttle", map[string]any{
		"id": peripheral + id + "/virtio-backend", "bps": l.BytesPerSecond, "bps_rd": 0, "bps_wr": 0, "iops": l.IOPS, "iops_rd": 0, "iops_wr": 0,
	}, nil)
	if err != nil {
		return fmt.Errorf("VM %s: set I/O limits of %s: %w", vmName, id, err)
	}
	klog.FromContext(ctx).V(2).Info("Set disk I/O limits", "vm", vmName, "device", id, "iops", l.IOPS, "bytesPerSecond", l.BytesPerSecond)
	return nil
}

// Detach implements hypervisor.Driver: device_del, then wait for DEVICE_DELETED (at most
// UnplugTimeout, else ErrBusy), then blockdev-del.
func (d *Driver) Detach(ctx context.Context, vm hypervisor.VM, serial string) error {
	if err := validateSerial(serial); err != nil {
		return err
	}
	v, err := d.state(vm)
	if err != nil {
		return err
	}
	id, node := names(serial)

	mon, pending, err := d.requestUnplug(ctx, v, id)
	if err != nil || mon == nil {
		return err
	}
	if pending != nil {
		if err := d.waitDeleted(ctx, id, pending); err != nil {
			if errors.Is(err, ErrMonitorClosed) {
				if _, err := v.monitor(ctx); errors.Is(err, hypervisor.ErrVMNotFound) {
					return nil // QEMU exited: it holds nothing
				}
			}
			return fmt.Errorf("VM %s: %w", v.name, err)
		}
	}

	v.mu.Lock()
	defer v.mu.Unlock()
	exists, err := nodeExists(ctx, mon, node)
	if err != nil {
		return fmt.Errorf("VM %s: %w", v.name, err)
	}
	if !exists {
		return nil
	}
	if err := mon.Execute(ctx, "blockdev-del", map[string]string{"node-name": node}, nil); err != nil {
		var cerr *CommandError
		if errors.As(err, &cerr) { // "Node … is in use"
			return fmt.Errorf("%w: VM %s: %w", hypervisor.ErrBusy, v.name, err)
		}
		return fmt.Errorf("VM %s: %w", v.name, err)
	}
	klog.FromContext(ctx).V(2).Info("Detached disk", "vm", v.name, "serial", serial)
	return nil
}

// requestUnplug sends device_del for id. It returns a nil monitor if the VM does not run, and
// pending if the device exists and its unplug is under way (whether this or an earlier call
// requested it), with a subscription to events open from before the request.
func (d *Driver) requestUnplug(ctx context.Context, v *vmState, id string) (mon *Monitor, pending *Subscription, err error) {
	v.mu.Lock()
	defer v.mu.Unlock()
	mon, err = v.monitor(ctx)
	if errors.Is(err, hypervisor.ErrVMNotFound) {
		return nil, nil, nil
	}
	if err != nil {
		return nil, nil, err
	}
	sub := mon.Subscribe()
	err = mon.Execute(ctx, "device_del", map[string]string{"id": id}, nil)
	var cerr *CommandError
	switch {
	case err == nil:
		return mon, sub, nil
	case IsClass(err, ClassDeviceNotFound):
		sub.Close()
		return mon, nil, nil
	case errors.As(err, &cerr) && strings.Contains(cerr.Desc, "already in the process of unplug"):
		return mon, sub, nil
	default:
		sub.Close()
		return nil, nil, fmt.Errorf("VM %s: %w", v.name, err)
	}
}

// waitDeleted waits for the DEVICE_DELETED event of device id, and closes sub.
func (d *Driver) waitDeleted(ctx context.Context, id string, sub *Subscription) error {
	defer sub.Close()
	wctx, cancel := context.WithTimeout(ctx, d.opts.UnplugTimeout)
	defer cancel()
	_, err := sub.Wait(wctx, func(ev Event) bool {
		if ev.Event != "DEVICE_DELETED" {
			return false
		}
		// Every virtio device also has an event for its backend, which has no "device".
		var data struct {
			Device string `json:"device"`
		}
		return json.Unmarshal(ev.Data, &data) == nil && data.Device == id
	})
	switch {
	case err == nil:
		return nil
	case wctx.Err() != nil:
		return fmt.Errorf("%w: the guest has not released %s yet", hypervisor.ErrBusy, id)
	default:
		return err
	}
}

// nodeExists reports whether a block node named node exists.
func nodeExists(ctx context.Context, mon *Monitor, node string) (bool, error) {
	var nodes []struct {
		NodeName string `json:"node-name"`
	}
	if err := mon.Execute(ctx, "query-named-block-nodes", map[string]bool{"flat": true}, &nodes); err != nil {
		return false, err
	}
	for _, n := range nodes {
		if n.NodeName == node {
			return true, nil
		}
	}
	return false, nil
}

// freePort returns the first hot-plug port with no device on its bus; ErrNoSlot when every
// port holds one.
func (d *Driver) freePort(ctx context.Context, mon *Monitor) (string, error) {
	ports, err := hotplugPorts(ctx, mon)
	if err != nil {
		return "", err
	}
	for _, p := range ports {
		if !p.used {
			return p.id, nil
		}
	}
	return "", fmt.Errorf("%w: all %d hot-plug ports hold a device", hypervisor.ErrNoSlot, len(ports))
}

// port is a hot-plug port of a running VM.
type port struct {
	id   string
	used bool // a device is plugged into it
}

// hotplugPorts lists the hot-plug ports the running VM was started with, as QEMU reports them:
// they are numbered from 0 without gaps (args), so the first that does not exist ends them.
func hotplugPorts(ctx context.Context, mon *Monitor) ([]port, error) {
	var ports []port
	for i := range hypervisor.MaxSlots {
		id := portID(i)
		var props []qomProperty
		err := mon.Execute(ctx, "qom-list", map[string]string{"path": peripheral + id + "/" + id}, &props)
		if IsClass(err, ClassDeviceNotFound) {
			break
		}
		if err != nil {
			return nil, err
		}
		// The bus links each device on it as child[N].
		used := slices.ContainsFunc(props, func(p qomProperty) bool { return strings.HasPrefix(p.Name, "child[") })
		ports = append(ports, port{id: id, used: used})
	}
	return ports, nil
}

// Slots implements hypervisor.Driver: the hot-plug ports the running VM has, whatever the
// options or vm.Slots say now (a VM keeps the ports it was started with); 0 when it does not run.
// They are read from QEMU once per connection to its monitor (a new process is a new one).
func (d *Driver) Slots(ctx context.Context, vm hypervisor.VM) (int, error) {
	v, err := d.state(vm)
	if err != nil {
		return 0, err
	}
	mon, err := v.monitor(ctx)
	if errors.Is(err, hypervisor.ErrVMNotFound) {
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	v.monMu.Lock()
	n, known := v.ports, v.portsOf == mon
	v.monMu.Unlock()
	if known {
		return n, nil
	}
	ports, err := hotplugPorts(ctx, mon)
	if err != nil {
		return 0, fmt.Errorf("VM %s: list hot-plug ports: %w", v.name, err)
	}
	v.monMu.Lock()
	v.ports, v.portsOf = len(ports), mon
	v.monMu.Unlock()
	return len(ports), nil
}

// qomProperty is an entry of a qom-list reply.
type qomProperty struct {
	Name string `json:"name"`
	Type string `json:"type"`
}

// sameFile reports whether two paths name the same host device: the same path, the same file,
// or device nodes of the same device.
func sameFile(a, b string) bool {
	if filepath.Clean(a) == filepath.Clean(b) {
		return true
	}
	sa, errA := os.Stat(a)
	sb, errB := os.Stat(b)
	if errA != nil || errB != nil {
		return false
	}
	if os.SameFile(sa, sb) {
		return true
	}
	ra, okA := sa.Sys().(*syscall.Stat_t)
	rb, okB := sb.Sys().(*syscall.Stat_t)
	return okA && okB && sa.Mode()&os.ModeDevice != 0 && sa.Mode().Type() == sb.Mode().Type() && ra.Rdev == rb.Rdev
}
