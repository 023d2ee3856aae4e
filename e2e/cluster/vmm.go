package cluster

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"
)

// The local hypervisor (vm-operator/internal/hypervisor/local) keeps a VM as a directory,
// <root>/<namespace>/<name>: its devices, its power-state marker and, for a VM with bootstrap
// data, its NoCloud seed. A VMM is what runs those VMs, as QEMU runs a VM the qemu driver
// configures: it boots a lab VM for each directory marked running that has a seed, with the
// directory as the VM's device tree, and stops it when the mark goes (or names another VM of
// that name). A VM without a seed is not booted: the lab runs its guest node itself.
const (
	localRunningFile = ".hypervisor/running"
	localSeedDir     = "var/lib/cloud/seed/nocloud"
)

// VMMOptions configure a VMM.
type VMMOptions struct {
	// Root is the local hypervisor's root.
	Root string
	// Registry is the lab's registry, which every VM pulls from (VMOptions.Registry).
	Registry *Registry
	// DeviceRoot is where a VM sees its directory (the guest-csi node plugin's --device-root).
	DeviceRoot string
}

// VMM boots the bootstrapped VMs of a local hypervisor's root.
type VMM struct {
	lab  *Lab
	opts VMMOptions
	log  string

	mu   sync.Mutex
	vms  map[string]*vmmEntry // by namespace/name
	stop context.CancelFunc
	done chan struct{}
}

type vmmEntry struct {
	uid string // the marker's: the VM's UID
	vm  *VM
	err error
}

// StartVMM starts a VMM on opts.Root, until Stop or the lab's end.
func (l *Lab) StartVMM(opts VMMOptions) *VMM {
	ctx, cancel := context.WithCancel(l.ctx)
	m := &VMM{lab: l, opts: opts, log: filepath.Join(l.Root, "vmm.log"), vms: map[string]*vmmEntry{}, stop: cancel, done: make(chan struct{})}
	go func() {
		defer close(m.done)
		wait.UntilWithContext(ctx, m.sync, 250*time.Millisecond)
	}()
	l.AtStop(m.Stop)
	return m
}

// VM returns the running lab VM of namespace/name, or nil, and the error its boot failed with.
func (m *VMM) VM(namespace, name string) (*VM, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	e := m.vms[namespace+"/"+name]
	if e == nil {
		return nil, nil
	}
	return e.vm, e.err
}

// Stop stops the VMM and every VM it runs.
func (m *VMM) Stop() error {
	m.stop()
	<-m.done
	m.mu.Lock()
	defer m.mu.Unlock()
	var errs []error
	for key, e := range m.vms {
		if e.vm != nil {
			errs = append(errs, e.vm.Stop())
		}
		delete(m.vms, key)
	}
	return errors.Join(errs...)
}

// sync boots the VMs marked running that it does not run, and stops those whose mark is gone.
func (m *VMM) sync(ctx context.Context) {
	marked := map[string]string{} // namespace/name → UID
	dirs, _ := filepath.Glob(filepath.Join(m.opts.Root, "*", "*", localRunningFile))
	for _, f := range dirs {
		uid, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		dir := filepath.Dir(filepath.Dir(f))
		if _, err := os.Stat(filepath.Join(dir, localSeedDir, "user-data")); err != nil {
			continue
		}
		marked[filepath.Base(filepath.Dir(dir))+"/"+filepath.Base(dir)] = string(uid)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	for key, e := range m.vms {
		if marked[key] != e.uid {
			m.logf("%s: powered off", key)
			if e.vm != nil {
				if err := e.vm.Stop(); err != nil {
					m.logf("%s: stop: %v", key, err)
				}
			}
			delete(m.vms, key)
		}
	}
	for key, uid := range marked {
		if _, ok := m.vms[key]; ok {
			continue
		}
		e := &vmmEntry{uid: uid}
		e.vm, e.err = m.boot(ctx, key)
		m.logf("%s: booted: %v", key, e.err)
		m.vms[key] = e
	}
}

// boot starts the lab VM of the directory of key with its seed; a failed boot is not retried
// until the VM is powered on again.
func (m *VMM) boot(ctx context.Context, key string) (*VM, error) {
	dir := filepath.Join(m.opts.Root, key)
	userData, err := os.ReadFile(filepath.Join(dir, localSeedDir, "user-data"))
	if err != nil {
		return nil, err
	}
	metaData, err := os.ReadFile(filepath.Join(dir, localSeedDir, "meta-data"))
	if err != nil {
		return nil, err
	}
	opts := VMOptions{Registry: m.opts.Registry, Binds: map[string]string{m.opts.DeviceRoot: dir}, UserData: userData, MetaData: metaData}
	// The control plane endpoint: the VMs of control plane machines that hold its address among
	// themselves (keepalived) are on its segment; otherwise the first control plane machine's VM
	// (whose kubeadm init makes the endpoint's apiserver) gets the address, as from a load
	// balancer.
	if c, err := ParseCloudConfig(userData, metaData); err == nil {
		switch endpoint, first := c.ControlPlane(); {
		case endpoint != "" && c.KeepsEndpoint():
			opts.Segment = endpoint
		case first:
			opts.Addresses = append(opts.Addresses, endpoint)
		}
	}
	return m.lab.StartVM(ctx, filepath.Base(key), opts)
}

func (m *VMM) logf(format string, args ...any) {
	f, err := os.OpenFile(m.log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return
	}
	defer f.Close()
	fmt.Fprintf(f, time.Now().Format(time.RFC3339)+" "+format+"\n", args...)
}
