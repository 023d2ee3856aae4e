package local

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	. "github.com/onsi/gomega"

	"pvbridge.io/vm-operator/internal/hypervisor"
)

// guestFilesystem attaches a new disk with serial to vm, and formats and mounts it as the
// guest-csi node plugin does, through its by-id link; it returns the host device and the mount
// point. The filesystem is unmounted when the test ends, after the VM is thawed.
func guestFilesystem(t *testing.T, e *env, vm hypervisor.VM, serial string) (device, mnt string) {
	t.Helper()
	g := NewWithT(t)
	device, _ = e.loop(t, 64*mib)
	g.Expect(e.d.Attach(t.Context(), vm, hypervisor.Disk{Serial: serial, Device: device})).To(Succeed())
	byID := filepath.Join(e.vmDir(vm), "dev/disk/by-id/virtio-"+serial)
	run(t, "mkfs.ext4", "-q", byID)
	mnt = e.path("staging-" + serial)
	g.Expect(os.Mkdir(mnt, 0o755)).To(Succeed())
	run(t, "mount", byID, mnt)
	t.Cleanup(func() { run(t, "umount", mnt) })
	// Never leave a filesystem frozen, whatever the test did.
	t.Cleanup(func() { _ = e.driver(t, Options{}).Thaw(context.Background(), vm) })
	return device, mnt
}

// writeIn writes a file in dir in the background; the channel receives the write's error once
// it returns.
func writeIn(dir string) <-chan error {
	done := make(chan error, 1)
	go func() { done <- os.WriteFile(filepath.Join(dir, "during-the-hold"), []byte("late"), 0o644) }()
	return done
}

// expectHeld checks that a write to dir blocks, and returns its channel.
func expectHeld(g Gomega, dir string) <-chan error {
	done := writeIn(dir)
	g.Consistently(done).WithTimeout(500*time.Millisecond).ShouldNot(Receive(), "a write to a frozen filesystem waits")
	return done
}

// expectWritable checks that a write to dir completes.
func expectWritable(g Gomega, dir string) {
	g.Eventually(writeIn(dir)).WithTimeout(10*time.Second).Should(Receive(BeNil()), "the filesystem is not frozen")
}

func TestFreezeHoldsTheGuestsWritesUntilThaw(t *testing.T) {
	tests := []struct {
		name string
		// thawer is the driver that thaws.
		thawer func(t *testing.T, e *env) *Driver
	}{
		{name: "thawed by the driver that froze", thawer: func(_ *testing.T, e *env) *Driver { return e.d }},
		{name: "thawed by a restarted agent", thawer: func(t *testing.T, e *env) *Driver { return e.driver(t, Options{}) }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			e := newEnv(t)
			vm := e.runningVM(t, "node-1")
			device, staging := guestFilesystem(t, e, vm, "disk-1")
			// The volume is published to a pod: a second mount of the same filesystem.
			publish := e.path("publish")
			g.Expect(os.Mkdir(publish, 0o755)).To(Succeed())
			run(t, "mount", "--bind", staging, publish)
			t.Cleanup(func() { run(t, "umount", publish) })
			// Written, not synced: the data is in the guest's page cache only.
			g.Expect(os.WriteFile(filepath.Join(publish, "before"), []byte("written before the hold"), 0o644)).To(Succeed())

			g.Expect(e.d.Freeze(t.Context(), vm, []string{"disk-1"})).To(Succeed())
			g.Expect(e.d.Freeze(t.Context(), vm, []string{"disk-1"})).To(Succeed(), "freezing a frozen disk does nothing")

			// What the guest wrote before is on the host device, read around the filesystem.
			g.Expect(run(t, "debugfs", "-c", "-R", "cat /before", device)).To(Equal("written before the hold"))
			g.Expect(filepath.Join(e.vmDir(vm), ".hypervisor/frozen")).To(BeARegularFile())
			held := expectHeld(g, publish)
			other := expectHeld(g, staging)

			g.Expect(tt.thawer(t, e).Thaw(t.Context(), vm)).To(Succeed())

			g.Eventually(held).WithTimeout(10*time.Second).Should(Receive(BeNil()), "the held write completes")
			g.Eventually(other).WithTimeout(10 * time.Second).Should(Receive(BeNil()))
			g.Expect(filepath.Join(e.vmDir(vm), ".hypervisor/frozen")).NotTo(BeAnExistingFile())
			g.Expect(tt.thawer(t, e).Thaw(t.Context(), vm)).To(Succeed(), "thawing a thawed VM does nothing")
		})
	}
}

func TestFreezeRefusesADiskWhoseWritesItCannotHold(t *testing.T) {
	tests := []struct {
		name string
		// use has the guest use disk-2 of vm (attached as vdb) so that its writes cannot be
		// held, and returns what stops that.
		use func(t *testing.T, e *env, vm hypervisor.VM) (release func())
		// reason is part of the error.
		reason string
		// stillFrozen: disk-2's filesystem, which someone else froze, stays frozen.
		stillFrozen bool
	}{
		{
			name: "raw block volume: the node bind-mounted",
			use: func(t *testing.T, e *env, vm hypervisor.VM) func() {
				target := e.path("block-target")
				NewWithT(t).Expect(os.WriteFile(target, nil, 0o644)).To(Succeed())
				run(t, "mount", "--bind", filepath.Join(e.vmDir(vm), "dev/vdb"), target)
				return func() { run(t, "umount", target) }
			},
			reason: "disk disk-2: its device node is bind-mounted at ",
		},
		{
			name: "filesystem mounted in another mount namespace",
			use: func(t *testing.T, e *env, vm hypervisor.VM) func() {
				byID := filepath.Join(e.vmDir(vm), "dev/disk/by-id/virtio-disk-2")
				run(t, "mkfs.ext4", "-q", byID)
				mnt := e.path("private")
				NewWithT(t).Expect(os.Mkdir(mnt, 0o755)).To(Succeed())
				return mountElsewhere(t, byID, mnt)
			},
			reason: "disk disk-2: claimed exclusively",
		},
		{
			name: "filesystem frozen by someone else",
			use: func(t *testing.T, e *env, vm hypervisor.VM) func() {
				byID := filepath.Join(e.vmDir(vm), "dev/disk/by-id/virtio-disk-2")
				run(t, "mkfs.ext4", "-q", byID)
				mnt := e.path("frozen-by-the-guest")
				NewWithT(t).Expect(os.Mkdir(mnt, 0o755)).To(Succeed())
				run(t, "mount", byID, mnt)
				run(t, "fsfreeze", "--freeze", mnt)
				return func() {
					run(t, "fsfreeze", "--unfreeze", mnt)
					run(t, "umount", mnt)
				}
			},
			reason:      "disk disk-2: its filesystem at ",
			stillFrozen: true,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			e := newEnv(t)
			vm := e.runningVM(t, "node-1")
			_, mnt := guestFilesystem(t, e, vm, "disk-1")
			device, _ := e.loop(t, 64*mib)
			g.Expect(e.d.Attach(t.Context(), vm, hypervisor.Disk{Serial: "disk-2", Device: device})).To(Succeed())
			release := tt.use(t, e, vm)
			defer release()

			err := e.d.Freeze(t.Context(), vm, []string{"disk-2", "disk-1"})

			g.Expect(err).To(MatchError(ContainSubstring(tt.reason)))
			expectWritable(g, mnt) // disk-1 is not held
			g.Expect(filepath.Join(e.vmDir(vm), ".hypervisor/frozen")).NotTo(BeAnExistingFile())
			if tt.stillFrozen {
				err := exec.Command("fsfreeze", "--freeze", e.path("frozen-by-the-guest")).Run()
				g.Expect(err).To(HaveOccurred(), "someone else's freeze is not undone")
			}
		})
	}
}

func TestFreezeOfDisksTheGuestDoesNotUse(t *testing.T) {
	g := NewWithT(t)
	e := newEnv(t)
	vm := e.runningVM(t, "node-1")
	device, _ := e.loop(t, 64*mib)
	g.Expect(e.d.Attach(t.Context(), vm, hypervisor.Disk{Serial: "disk-1", Device: device})).To(Succeed())

	g.Expect(e.d.Freeze(t.Context(), vm, []string{"disk-1", "not-attached"})).To(Succeed(), "an unused disk has no writes to hold")
	g.Expect(filepath.Join(e.vmDir(vm), ".hypervisor/frozen")).NotTo(BeAnExistingFile())
	g.Expect(e.d.Thaw(t.Context(), vm)).To(Succeed())
	g.Expect(e.d.Detach(t.Context(), vm, "disk-1")).To(Succeed())

	unknown := hypervisor.VM{Namespace: "tenant-a", Name: "never-created"}
	g.Expect(e.d.Freeze(t.Context(), unknown, []string{"disk-1"})).To(Succeed())
	g.Expect(e.d.Thaw(t.Context(), unknown)).To(Succeed())
	g.Expect(e.d.Freeze(t.Context(), vm, []string{"../x"})).To(MatchError(ContainSubstring("serial")))
}

func TestForceOffThawsWhatItFroze(t *testing.T) {
	g := NewWithT(t)
	e := newEnv(t)
	vm := e.runningVM(t, "node-1")
	byID := filepath.Join(e.vmDir(vm), "dev/disk/by-id/virtio-disk-1")
	device, _ := e.loop(t, 64*mib)
	g.Expect(e.d.Attach(t.Context(), vm, hypervisor.Disk{Serial: "disk-1", Device: device})).To(Succeed())
	run(t, "mkfs.ext4", "-q", byID)
	mnt := e.path("staging")
	g.Expect(os.Mkdir(mnt, 0o755)).To(Succeed())
	run(t, "mount", byID, mnt)
	g.Expect(e.d.Freeze(t.Context(), vm, []string{"disk-1"})).To(Succeed())

	g.Expect(e.d.ForceOff(t.Context(), vm)).To(Succeed())

	// The filesystem was thawed before its mount was detached: the device is free, and a
	// new mount of it is writable.
	g.Expect(filepath.Join(e.vmDir(vm), ".hypervisor/frozen")).NotTo(BeAnExistingFile())
	g.Eventually(func() error { return exec.Command("mount", device, mnt).Run() }).
		WithTimeout(10 * time.Second).WithPolling(100 * time.Millisecond).Should(Succeed())
	defer run(t, "umount", mnt)
	expectWritable(g, mnt)
}
