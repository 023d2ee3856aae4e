package qsd

import (
	"context"
	"fmt"
	"path/filepath"
	"time"

	"pvbridge.io/pkg/cgroups"
	"pvbridge.io/pkg/netns"
)

// Placement is where on its host an agent in a container runs its daemons: out of the
// container, so that a restarted or upgraded agent finds them again and the disks they serve
// go on. The container runtime kills every process of the container's cgroup when it stops
// it, and the pod's network goes with the pod; a daemon in a cgroup of its own and in the
// host's network namespace outlives both (with the host's PID namespace, hostPID, the agent
// sees it again). The zero Placement leaves a daemon where its agent runs, as an agent that is
// a host's process wants.
type Placement struct {
	// NetNS is the network namespace file the daemons run in (/proc/1/ns/net, the host's);
	// "" for the agent's.
	NetNS string
	// CgroupParent, when set, puts each daemon in a cgroup of its own, <CgroupParent>/<its
	// directory's name>, in every hierarchy of the cgroup filesystem at CgroupRoot (default
	// /sys/fs/cgroup), removed when Stop stops it.
	CgroupParent, CgroupRoot string
}

// Start starts the daemon of d as Start does, in p's network namespace, then moves it into its
// cgroup. A daemon found by an agent that ended between the two is left where it is: it runs
// on, but a stop of the agent's container will end it.
func (p Placement) Start(ctx context.Context, d Dir, args ...string) error {
	if err := netns.Run(p.NetNS, func() error { return Start(ctx, d, args...) }); err != nil {
		return err
	}
	path := p.cgroup(d)
	if path == "" {
		return nil
	}
	pid, err := Pid(d)
	if err != nil {
		return err
	}
	if err := cgroups.Join(p.root(), path, pid); err != nil {
		return fmt.Errorf("qemu-storage-daemon of %s: %w", d, err)
	}
	return nil
}

// Stop stops the daemon of d as Stop does, then removes its cgroup, waiting up to
// cgroupRemoveWait for the exited daemon to be reaped.
func (p Placement) Stop(ctx context.Context, d Dir) error {
	if err := Stop(ctx, d); err != nil {
		return err
	}
	path := p.cgroup(d)
	if path == "" {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, cgroupRemoveWait)
	defer cancel()
	if err := cgroups.Destroy(ctx, p.root(), path); err != nil {
		return fmt.Errorf("qemu-storage-daemon of %s: %w", d, err)
	}
	return nil
}

// Validate says what is wrong with p.
func (p Placement) Validate() error {
	if p.CgroupParent != "" && (filepath.IsAbs(p.CgroupParent) || !filepath.IsLocal(p.CgroupParent)) {
		return fmt.Errorf("daemons' cgroup parent %q: want a path relative to the cgroup root", p.CgroupParent)
	}
	return nil
}

func (p Placement) cgroup(d Dir) string {
	if p.CgroupParent == "" {
		return ""
	}
	return filepath.Join(p.CgroupParent, filepath.Base(string(d)))
}

func (p Placement) root() string {
	if p.CgroupRoot == "" {
		return "/sys/fs/cgroup"
	}
	return p.CgroupRoot
}

// cgroupRemoveWait bounds how long Stop waits for a stopped daemon to leave its cgroup: it
// counts there until its parent (init, for a daemonized process) has reaped it.
const cgroupRemoveWait = 5 * time.Second
