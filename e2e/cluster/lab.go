// Package cluster runs real Kubernetes clusters as processes on 127.0.0.1: etcd, kube-apiserver,
// kube-controller-manager and kube-scheduler per control plane, and a real kubelet with a fake
// container runtime per node. Several control planes run side by side in one Lab.
//
// Everything a Lab starts lives below its root directory. Stop ends every process (by process
// group) and unmounts everything below the root. If the process that owns the Lab dies without
// calling Stop (a panic, a kill -9), a reaper process does the same.
package cluster

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"pvbridge.io/pkg/cgroups"
)

// Lab owns a root directory and every process and mount below it.
type Lab struct {
	Root string
	// WatchCache runs the apiservers of the control planes started after it is set with their
	// watch cache, as production apiservers run; the lab's run without it, which halves an idle
	// apiserver's CPU.
	WatchCache bool
	// CRDs is the tree whose manifests/crd the control planes started after it is set install
	// (an older release's, for an upgrade); empty: the repository's.
	CRDs string

	bin    *Binaries
	pidDir string
	reaper *reaper

	// ctx ends when the lab stops: the lifetime of what runs beside the processes.
	ctx    context.Context
	cancel context.CancelFunc

	mu            sync.Mutex
	processes     []*Process
	controlPlanes []*ControlPlane
	networks      []*podNetwork
	cleanups      []func() error // what Stop undoes once the processes are gone, newest first
	stopped       bool
}

// NewLab creates a lab under root, which must be short (unix socket paths are limited to 108
// bytes) and is created if missing. A Lab must be stopped with Stop.
func NewLab(root string, bin *Binaries) (*Lab, error) {
	root, err := filepath.Abs(root)
	if err != nil {
		return nil, err
	}
	l := &Lab{Root: root, bin: bin, pidDir: filepath.Join(root, "pids")}
	l.ctx, l.cancel = context.WithCancel(context.Background())
	if err := os.MkdirAll(l.pidDir, 0o755); err != nil {
		return nil, err
	}
	if l.reaper, err = startReaper(root, filepath.Join(root, "reaper.log")); err != nil {
		return nil, err
	}
	if err := raiseInotifyLimits(); err != nil {
		return nil, err
	}
	return l, nil
}

// inotifyLimits are the machine's inotify limits a lab needs, kind's recommendation (its "known
// issues"): every kubelet, containerd's CRI plugin (its CNI configuration watch) and control
// plane component holds inotify instances, and Debian's default of 128 per user is what two
// labs of the Cluster API kind hold at once (containerd's CRI plugin then fails to load: "too
// many open files", and kubeadm finds no CRI).
var inotifyLimits = map[string]int{"max_user_instances": 512, "max_user_watches": 524288}

// raiseInotifyLimits raises the machine's inotify limits to inotifyLimits, never lowering one.
func raiseInotifyLimits() error {
	for name, want := range inotifyLimits {
		path := filepath.Join("/proc/sys/fs/inotify", name)
		data, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		if have, err := strconv.Atoi(strings.TrimSpace(string(data))); err == nil && have >= want {
			continue
		}
		if err := os.WriteFile(path, []byte(strconv.Itoa(want)), 0o644); err != nil {
			return fmt.Errorf("raise fs.inotify.%s to %d: %w", name, want, err)
		}
	}
	return nil
}

// Context ends when the lab stops; helpers that run beside the lab's processes (as a kubelet's
// Secret volume sync runs beside its containers) live as long as it.
func (l *Lab) Context() context.Context { return l.ctx }

// Binaries returns where the lab finds its executables.
func (l *Lab) Binaries() *Binaries { return l.bin }

func (l *Lab) track(p *Process) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.processes = append(l.processes, p)
}

// AtStop makes Stop call f once every process has stopped.
func (l *Lab) AtStop(f func() error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.cleanups = append(l.cleanups, f)
}

// cgroupRoot is the machine's cgroup filesystem.
const cgroupRoot = "/sys/fs/cgroup"

// Cgroup is the path, below each cgroup hierarchy, of the lab's cgroup name: the lab's own
// cgroups are below pvbridge-lab/<the root's name>, which Stop (or the reaper) empties and
// removes.
func (l *Lab) Cgroup(name string) string {
	return filepath.Join(l.cgroups(), name)
}

func (l *Lab) cgroups() string { return filepath.Join("pvbridge-lab", filepath.Base(l.Root)) }

// CPUWeight gives the lab's cgroup name, and each of its ancestors, the CPU weight of n
// processes (cgroup v1 cpu.shares, v2 cpu.weight, where the cpu controller is on), making them
// where they are missing. Under group scheduling a cgroup competes with each process beside it
// as one process does: a VM's QEMU, alone in its cgroup, would get one process's share of a
// machine loaded with the other labs' processes, while its emulated CPU (TCG) wants a core.
func (l *Lab) CPUWeight(name string, n int) error {
	if err := cgroups.Make(cgroupRoot, l.Cgroup(name)); err != nil {
		return err
	}
	hierarchies, err := cgroups.Hierarchies(cgroupRoot)
	if err != nil {
		return err
	}
	for _, h := range hierarchies {
		file, weight := "cpu.shares", n*1024
		if _, err := os.Stat(filepath.Join(h, file)); err != nil {
			file, weight = "cpu.weight", n*100
		}
		for p := l.Cgroup(name); p != "."; p = filepath.Dir(p) {
			dir := filepath.Join(h, p)
			if _, err := os.Stat(filepath.Join(dir, file)); err != nil {
				continue // not the cpu hierarchy, or the controller is off there
			}
			if err := os.WriteFile(filepath.Join(dir, file), []byte(strconv.Itoa(weight)), 0); err != nil {
				return fmt.Errorf("cgroup %s: %w", dir, err)
			}
		}
	}
	return nil
}

// Processes returns every process the lab started, oldest first.
func (l *Lab) Processes() []*Process {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.processes)
}

// Stop stops every process the lab started, newest first (clients before the apiserver before
// etcd), then unmounts everything below the root and detaches the loop devices of files below
// it. It is idempotent.
func (l *Lab) Stop() error {
	l.mu.Lock()
	if l.stopped {
		l.mu.Unlock()
		return nil
	}
	l.stopped = true
	procs, cleanups := slices.Clone(l.processes), slices.Clone(l.cleanups)
	l.mu.Unlock()
	l.cancel()

	daemons := daemonLoops(nodeDirs(l.Root)...)
	var errs []error
	for _, p := range slices.Backward(procs) {
		_ = p.Stop() // an exit status on SIGTERM is expected
	}
	for _, f := range slices.Backward(cleanups) {
		if err := f(); err != nil {
			errs = append(errs, err)
		}
	}
	// What is left in the lab's cgroups (a QEMU whose VM was not deleted) is killed.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	if err := cgroups.Destroy(ctx, cgroupRoot, l.cgroups()); err != nil {
		errs = append(errs, err)
	}
	cancel()
	// The loop devices over the daemons' exports, which ended with their nodes.
	for _, dev := range daemons {
		if err := detachLoop(dev); err != nil {
			errs = append(errs, fmt.Errorf("detach %s: %w", dev, err))
		}
	}
	if err := ClearBelow(l.Root); err != nil {
		errs = append(errs, err)
	}
	if err := l.reaper.finish(); err != nil {
		errs = append(errs, fmt.Errorf("lab reaper: %w", err))
	}
	return errors.Join(errs...)
}
