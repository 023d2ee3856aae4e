package qemu

import (
	"context"
	"fmt"

	"k8s.io/klog/v2"

	"pvbridge.io/vm-operator/internal/hypervisor"
)

// statusPaused is what query-status says of a VM that `stop` paused. QEMU's other states in
// which the guest does not run (prelaunch, io-error, suspended, guest-panicked, ...) are not
// the driver's doing, and Thaw leaves them alone.
const statusPaused = "paused"

// Freeze implements hypervisor.Driver by pausing the whole VM with QMP `stop`, whatever the
// serials: QEMU cannot hold one disk's requests and let the guest run, and a guest that runs
// with one disk stalled would see its I/O time out. `stop` answers once every vCPU is stopped
// and QEMU has drained the requests in flight on every block device and flushed them to the
// host (bdrv_drain_all, bdrv_flush_all): with the driver's cache mode (direct, no host page
// cache) a flush is an fdatasync of the host device. The VM stays paused, and its guest
// clock stalls, until Thaw. Pausing a paused VM does nothing; a VM that does not run has no
// writes to hold.
func (d *Driver) Freeze(ctx context.Context, vm hypervisor.VM, serials []string) error {
	for _, s := range serials {
		if err := validateSerial(s); err != nil {
			return err
		}
	}
	v, mon, unlock, err := d.lockRunning(ctx, vm)
	if err != nil || mon == nil {
		return err
	}
	defer unlock()
	if err := mon.Execute(ctx, "stop", nil, nil); err != nil {
		return fmt.Errorf("VM %s: pause to hold the writes of disks %q: %w", v.name, serials, err)
	}
	klog.FromContext(ctx).V(2).Info("Paused VM to hold its writes", "vm", v.name, "serials", serials)
	return nil
}

// Thaw implements hypervisor.Driver: QMP `cont` of a VM that `stop` paused. It reads the
// state from QEMU, so it also resumes a VM that an agent paused before it restarted. A VM
// that runs, or does not, is success.
func (d *Driver) Thaw(ctx context.Context, vm hypervisor.VM) error {
	v, mon, unlock, err := d.lockRunning(ctx, vm)
	if err != nil || mon == nil {
		return err
	}
	defer unlock()
	status, err := runState(ctx, mon)
	if err != nil {
		return fmt.Errorf("VM %s: %w", v.name, err)
	}
	if status != statusPaused {
		return nil
	}
	if err := mon.Execute(ctx, "cont", nil, nil); err != nil {
		return fmt.Errorf("VM %s: resume after holding its writes: %w", v.name, err)
	}
	klog.FromContext(ctx).V(2).Info("Resumed VM", "vm", v.name)
	return nil
}

// runState returns QEMU's run state of the VM behind mon (query-status), e.g. "running".
func runState(ctx context.Context, mon *Monitor) (string, error) {
	var st struct {
		Status string `json:"status"`
	}
	if err := mon.Execute(ctx, "query-status", nil, &st); err != nil {
		return "", err
	}
	return st.Status, nil
}
