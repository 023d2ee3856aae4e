package qemu

import (
	"testing"

	. "github.com/onsi/gomega"

	"pvbridge.io/vm-operator/internal/hypervisor"
)

// status returns QEMU's run state of vm.
func status(t *testing.T, d *Driver, vm hypervisor.VM) string {
	t.Helper()
	var st struct {
		Status string `json:"status"`
	}
	if err := execute(t, d, vm, "query-status", nil, &st); err != nil {
		t.Fatal(err)
	}
	return st.Status
}

func TestFreezePausesTheVMUntilThaw(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	d := newDriver(t, Options{})
	loop, _ := newLoop(t)
	startVM(t, d, testVM)
	disk := hypervisor.Disk{Serial: "pvc-a", Device: loop}
	g.Expect(d.Attach(ctx, testVM, disk)).To(Succeed())
	g.Expect(status(t, d, testVM)).To(Equal("running"))

	g.Expect(d.Freeze(ctx, testVM, []string{disk.Serial})).To(Succeed())
	g.Expect(status(t, d, testVM)).To(Equal("paused"))
	g.Expect(d.Freeze(ctx, testVM, []string{disk.Serial})).To(Succeed(), "freezing a frozen VM does nothing")
	g.Expect(status(t, d, testVM)).To(Equal("paused"))
	g.Expect(d.Disks(ctx, testVM)).To(Equal([]hypervisor.Disk{disk}), "a paused VM keeps its disks")

	g.Expect(d.Thaw(ctx, testVM)).To(Succeed())
	g.Expect(status(t, d, testVM)).To(Equal("running"))
	g.Expect(d.Thaw(ctx, testVM)).To(Succeed(), "thawing a running VM does nothing")
	g.Expect(status(t, d, testVM)).To(Equal("running"))
}

func TestThawAfterARestartResumesTheVM(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	first := newDriver(t, Options{})
	startVM(t, first, testVM)
	g.Expect(first.Freeze(ctx, testVM, []string{"pvc-a"})).To(Succeed())
	g.Expect(first.Close()).To(Succeed()) // the agent dies mid-hold; QEMU stays paused

	second := newDriver(t, Options{RunDir: first.opts.RunDir})
	g.Expect(status(t, second, testVM)).To(Equal("paused"))
	g.Expect(second.Thaw(ctx, testVM)).To(Succeed())
	g.Expect(status(t, second, testVM)).To(Equal("running"))
}

func TestFreezeAndThawOfAVMThatDoesNotRun(t *testing.T) {
	g := NewWithT(t)
	d := newDriver(t, Options{})

	g.Expect(d.Freeze(t.Context(), testVM, []string{"pvc-a"})).To(Succeed(), "a VM that does not run writes nothing")
	g.Expect(d.Thaw(t.Context(), testVM)).To(Succeed())
	g.Expect(d.Running(t.Context(), testVM)).To(BeFalse())
	g.Expect(d.Freeze(t.Context(), testVM, []string{""})).To(MatchError(ContainSubstring("disk serial")))
}
