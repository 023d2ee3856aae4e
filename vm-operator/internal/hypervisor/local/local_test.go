package local

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	. "github.com/onsi/gomega"

	"pvbridge.io/vm-operator/internal/hypervisor"
)

func TestNew(t *testing.T) {
	tests := []struct {
		name string
		// root returns the root to pass, given a fresh directory.
		root    func(t *testing.T, dir string) string
		slots   int
		runDir  string
		wantErr string
	}{
		{
			name:    "refuses more slots than a VM can have",
			root:    func(_ *testing.T, dir string) string { return dir },
			slots:   hypervisor.MaxSlots + 1,
			wantErr: "slots 65",
		},
		{
			name:    "refuses negative slots",
			root:    func(_ *testing.T, dir string) string { return dir },
			slots:   -1,
			wantErr: "slots -1",
		},
		{
			name:    "refuses a relative run directory",
			root:    func(_ *testing.T, dir string) string { return dir },
			runDir:  "run/pvbridge",
			wantErr: "run directory",
		},
		{
			name:    "refuses a run directory too long for the daemons' sockets",
			root:    func(_ *testing.T, dir string) string { return dir },
			runDir:  "/run/" + strings.Repeat("x", 60),
			wantErr: "at most 64 bytes",
		},
		{
			name: "creates a missing root",
			root: func(_ *testing.T, dir string) string { return filepath.Join(dir, "a/b") },
		},
		{
			name:    "refuses a relative root",
			root:    func(*testing.T, string) string { return "vms" },
			wantErr: "absolute",
		},
		{
			name:    "refuses an empty root",
			root:    func(*testing.T, string) string { return "" },
			wantErr: "absolute",
		},
		{
			name: "refuses a root where device nodes do not work",
			root: func(t *testing.T, dir string) string {
				run(t, "mount", "-t", "tmpfs", "-o", "nodev,size=1m", "tmpfs", dir)
				t.Cleanup(func() { run(t, "umount", dir) })
				return filepath.Join(dir, "vms")
			},
			wantErr: "nodev",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			root := tt.root(t, t.TempDir())

			d, err := New(Options{Root: root, Slots: tt.slots, RunDir: tt.runDir})

			if tt.wantErr != "" {
				g.Expect(err).To(MatchError(ContainSubstring(tt.wantErr)))
				return
			}
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(d.Name()).To(Equal("local"))
			g.Expect(root).To(BeADirectory())
		})
	}
}

func TestPowerOnMakesTheVMsDeviceTree(t *testing.T) {
	g := NewWithT(t)
	e := newEnv(t)
	vm := hypervisor.VM{Namespace: "tenant-a", Name: "node-1.example", UID: "6d1c"}

	g.Expect(e.d.Running(t.Context(), vm)).To(BeFalse())
	g.Expect(e.d.PowerOn(t.Context(), vm)).To(Succeed())
	g.Expect(e.d.PowerOn(t.Context(), vm)).To(Succeed(), "powering on a running VM does nothing")

	g.Expect(e.d.Running(t.Context(), vm)).To(BeTrue())
	vmDir := filepath.Join(e.root, "tenant-a", "node-1.example")
	for _, dir := range []string{"sys/block", "dev/disk/by-id"} {
		g.Expect(filepath.Join(vmDir, dir)).To(BeADirectory())
	}
	g.Expect(os.ReadFile(filepath.Join(vmDir, ".hypervisor/running"))).To(BeEquivalentTo("6d1c\n"))
	g.Expect(e.d.Disks(t.Context(), vm)).To(BeEmpty())
}

func TestPowerOffOfAVMWithoutDisks(t *testing.T) {
	tests := []struct {
		name    string
		powerOn bool
	}{
		{name: "running VM stops", powerOn: true},
		{name: "unknown VM is success"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			e := newEnv(t)
			vm := hypervisor.VM{Namespace: "tenant-a", Name: "node-1"}
			if tt.powerOn {
				g.Expect(e.d.PowerOn(t.Context(), vm)).To(Succeed())
			}

			g.Expect(e.d.PowerOff(t.Context(), vm)).To(Succeed())
			g.Expect(e.d.PowerOff(t.Context(), vm)).To(Succeed(), "powering off a stopped VM does nothing")

			g.Expect(e.d.Running(t.Context(), vm)).To(BeFalse())
		})
	}
}

func TestPowerOffWithDisksAttachedIsRefused(t *testing.T) {
	g := NewWithT(t)
	e := newEnv(t)
	vm := e.runningVM(t, "node-1")
	for _, serial := range []string{"disk-1", "disk-2"} {
		device, _ := e.loop(t, 16*mib)
		g.Expect(e.d.Attach(t.Context(), vm, hypervisor.Disk{Serial: serial, Device: device})).To(Succeed())
	}

	err := e.d.PowerOff(t.Context(), vm)

	g.Expect(err).To(MatchError(hypervisor.ErrBusy))
	g.Expect(err).To(MatchError(ContainSubstring(`["disk-1" "disk-2"]`)))
	g.Expect(e.d.Running(t.Context(), vm)).To(BeTrue())
	g.Expect(e.d.Disks(t.Context(), vm)).To(HaveLen(2))

	g.Expect(e.d.Detach(t.Context(), vm, "disk-1")).To(Succeed())
	g.Expect(e.d.Detach(t.Context(), vm, "disk-2")).To(Succeed())
	g.Expect(e.d.PowerOff(t.Context(), vm)).To(Succeed())
	g.Expect(e.d.Running(t.Context(), vm)).To(BeFalse())
}

func TestWaitingForAnotherOperationOnTheVMEndsWithTheContext(t *testing.T) {
	g := NewWithT(t)
	e := newEnv(t)
	vm := e.runningVM(t, "node-1")
	unlock, err := e.d.lock(t.Context(), vm)
	g.Expect(err).NotTo(HaveOccurred())
	defer unlock()
	ctx, cancel := context.WithTimeout(t.Context(), 50*time.Millisecond)
	defer cancel()

	g.Expect(e.d.Detach(ctx, vm, "disk-1")).To(MatchError(context.DeadlineExceeded))

	other := hypervisor.VM{Namespace: "tenant-a", Name: "node-2"}
	g.Expect(e.d.PowerOn(t.Context(), other)).To(Succeed(), "other VMs do not wait")
}

func TestPowerOnWritesTheBootstrapSeedOnce(t *testing.T) {
	g := NewWithT(t)
	e := newEnv(t)
	vm := hypervisor.VM{Namespace: "tenant-a", Name: "vm-1", UID: "uid-1", Bootstrap: &hypervisor.Bootstrap{
		UserData: []byte("#cloud-config\n"), MetaData: []byte("instance-id: uid-1\n"),
	}}

	g.Expect(e.d.PowerOn(t.Context(), vm)).To(Succeed())

	seed := filepath.Join(e.vmDir(vm), "var/lib/cloud/seed/nocloud")
	for name, want := range map[string]string{"user-data": "#cloud-config\n", "meta-data": "instance-id: uid-1\n"} {
		data, err := os.ReadFile(filepath.Join(seed, name))
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(string(data)).To(Equal(want))
		st, err := os.Stat(filepath.Join(seed, name))
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(st.Mode().Perm()).To(Equal(os.FileMode(0o600)), "bootstrap data holds secrets")
	}
	st, err := os.Stat(seed)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(st.Mode().Perm()).To(Equal(os.FileMode(0o700)))

	// A running VM is not given its data again: PowerOn of a running VM changes nothing.
	vm.Bootstrap.UserData = []byte("changed\n")
	g.Expect(e.d.PowerOn(t.Context(), vm)).To(Succeed())
	data, err := os.ReadFile(filepath.Join(seed, "user-data"))
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(string(data)).To(Equal("#cloud-config\n"))
}
