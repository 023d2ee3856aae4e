package qemu

import (
	"context"
	"fmt"
	"path/filepath"
	"time"

	"pvbridge.io/pkg/cgroups"
)

// cgroupOf is the cgroup of v's QEMU below each hierarchy, <CgroupParent>/<its directory's
// name>; "" when the driver leaves QEMU in the agent's cgroup.
func (d *Driver) cgroupOf(v *vmState) string {
	if d.opts.CgroupParent == "" {
		return ""
	}
	return filepath.Join(d.opts.CgroupParent, filepath.Base(v.dir))
}

// joinCgroup moves QEMU, process pid, into v's cgroup, once per process: at its start, and
// when a restarted agent takes up a VM that runs (its QEMU may have been started by an agent
// that ended before it moved it). The caller holds v.mu.
func (d *Driver) joinCgroup(v *vmState, pid int) error {
	path := d.cgroupOf(v)
	if path == "" || pid <= 0 || v.cgroupPid == pid {
		return nil
	}
	if err := cgroups.Join(d.opts.CgroupRoot, path, pid); err != nil {
		return fmt.Errorf("VM %s: %w", v.name, err)
	}
	v.cgroupPid = pid
	return nil
}

// removeCgroup removes v's cgroup once its QEMU has ended, after killing what is left in it
// (only the VM's processes are). A process counts in its cgroup until its parent has reaped it
// (the agent that started it, or init), which a stopped QEMU's has not always done when
// PowerOff sees it gone: removal is tried for up to cgroupRemoveWait, then the error leaves it
// for the next call. The caller holds v.mu.
func (d *Driver) removeCgroup(ctx context.Context, v *vmState) error {
	path := d.cgroupOf(v)
	if path == "" {
		return nil
	}
	v.cgroupPid = 0
	ctx, cancel := context.WithTimeout(ctx, cgroupRemoveWait)
	defer cancel()
	if err := cgroups.Destroy(ctx, d.opts.CgroupRoot, path); err != nil {
		return fmt.Errorf("VM %s: %w", v.name, err)
	}
	return nil
}

// cgroupRemoveWait bounds how long removeCgroup waits for the VM's processes to be reaped.
const cgroupRemoveWait = 5 * time.Second
