package hostagent

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	dto "github.com/prometheus/client_model/go"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/events"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/pkg/hold"
	"pvbridge.io/pkg/tenancy"
	"pvbridge.io/vm-operator/internal/hypervisor"
)

// holdHost is a host agent on host-a with a fake hypervisor, and an API server holding three
// VMs, each with one volume plugged: vm-1 (host-a) volume "data", PV pvc-1, volume ID pvc-1;
// vm-2 (host-a) volume "logs", PV pvc-2, volume ID vol-2; vm-3 (host-b) volume "other", PV
// pvc-3, volume ID vol-3.
type holdHost struct {
	r   *Reconciler
	c   client.Client
	h   *fakeHypervisor
	rec *events.FakeRecorder
}

func newHoldHost(t *testing.T) *holdHost {
	t.Helper()
	g := NewWithT(t)
	vm1 := virtualMachine([]string{"data"}, []vmv1.VirtualMachineVolumeStatus{{Name: "data", Attached: true, DiskSerial: SerialFor(pvName)}})
	c := newClient(g, vm1, true)
	h := newFakeHypervisor()
	h.disks["vm-1"] = map[string]string{SerialFor(pvName): "/dev/data"}
	for _, o := range []struct{ vm, host, volume, pv, volumeID string }{
		{"vm-2", "host-a", "logs", "pvc-2", "vol-2"},
		{"vm-3", "host-b", "other", "pvc-3", "vol-3"},
	} {
		vm := virtualMachine([]string{o.volume}, []vmv1.VirtualMachineVolumeStatus{{Name: o.volume, Attached: true, DiskSerial: SerialFor(o.pv)}})
		vm.Name, vm.UID, vm.Status.Host = o.vm, types.UID("uid-"+o.vm), o.host
		g.Expect(c.Create(t.Context(), vm)).To(Succeed())
		g.Expect(c.Status().Update(t.Context(), vm)).To(Succeed())
		g.Expect(c.Create(t.Context(), &corev1.PersistentVolume{
			ObjectMeta: metav1.ObjectMeta{Name: o.pv},
			Spec: corev1.PersistentVolumeSpec{PersistentVolumeSource: corev1.PersistentVolumeSource{
				CSI: &corev1.CSIPersistentVolumeSource{Driver: "pmem.csi.pvbridge.io", VolumeHandle: o.volumeID},
			}},
		})).To(Succeed())
		h.disks[o.vm] = map[string]string{SerialFor(o.pv): "/dev/" + o.volume}
	}
	rec := events.NewFakeRecorder(10)
	r := &Reconciler{Client: c, Node: "host-a", Hypervisor: h, CSI: &fakeCSI{}, StateDir: t.TempDir(), Recorder: rec}
	return &holdHost{r: r, c: c, h: h, rec: rec}
}

// holdsObserved is how many holds the duration histogram has seen.
func holdsObserved(g Gomega) uint64 {
	m := &dto.Metric{}
	g.Expect(writesHeld.Write(m)).To(Succeed())
	return m.GetHistogram().GetSampleCount()
}

func TestHoldFreezesTheVMsThatWriteToTheVolumesUntilTheRelease(t *testing.T) {
	g := NewWithT(t)
	host := newHoldHost(t)
	observed := holdsObserved(g)

	held, release, err := host.r.Hold(t.Context(), []string{"pvc-1", "vol-2", "vol-3", "unknown"})

	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(held).To(Equal([]string{"pvc-1", "vol-2"}), "vol-3 is written on another host, unknown nowhere")
	g.Expect(host.h.holdCalls()).To(Equal([]string{
		fmt.Sprintf("freeze vm-1 [%s]", SerialFor("pvc-1")),
		fmt.Sprintf("freeze vm-2 [%s]", SerialFor("pvc-2")),
	}))
	g.Expect(host.rec.Events).NotTo(Receive(), "the Event comes with the release")

	g.Expect(release(t.Context())).To(Succeed())

	g.Expect(host.h.holdCalls()).To(Equal([]string{"thaw vm-1", "thaw vm-2"}))
	g.Expect(host.h.frozenVMs()).To(BeEmpty())
	g.Expect(host.rec.Events).To(Receive(MatchRegexp(`^Normal WritesHeld The writes to volumes data were held for [0-9.]+[µm]?s while a group snapshot cut them`)))
	g.Expect(host.rec.Events).To(Receive(HavePrefix("Normal WritesHeld The writes to volumes logs were held for ")))
	g.Expect(holdsObserved(g)).To(Equal(observed + 1))
	g.Expect(host.r.holding).To(BeNil())
}

func TestHoldOfVolumesNoVMOfTheHostWritesHoldsNothing(t *testing.T) {
	g := NewWithT(t)
	host := newHoldHost(t)

	held, release, err := host.r.Hold(t.Context(), []string{"vol-3", "unknown"})

	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(held).To(BeEmpty())
	g.Expect(release(t.Context())).To(Succeed())
	g.Expect(host.h.holdCalls()).To(BeEmpty())
	g.Expect(host.rec.Events).NotTo(Receive())
}

// A claim of one guest cluster that a platform admin shared with another is plugged into a VM
// of that other cluster: a group snapshot of its owner would pause the other tenant's VM.
func TestHoldRefusesAVMOfAnotherClusterThanTheClaims(t *testing.T) {
	g := NewWithT(t)
	host := newHoldHost(t)
	vm2 := &vmv1.VirtualMachine{}
	g.Expect(host.c.Get(t.Context(), client.ObjectKey{Namespace: "tenant", Name: "vm-2"}, vm2)).To(Succeed())
	vm2.Labels = map[string]string{tenancy.CAPIClusterNameLabel: "beta"}
	g.Expect(host.c.Update(t.Context(), vm2)).To(Succeed())
	pv := &corev1.PersistentVolume{}
	g.Expect(host.c.Get(t.Context(), client.ObjectKey{Name: "pvc-2"}, pv)).To(Succeed())
	pv.Spec.ClaimRef = &corev1.ObjectReference{Namespace: "tenant", Name: "alphas-logs"}
	g.Expect(host.c.Update(t.Context(), pv)).To(Succeed())
	g.Expect(host.c.Create(t.Context(), &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{
		Namespace: "tenant", Name: "alphas-logs", Labels: map[string]string{tenancy.ClusterNameLabel: "alpha"},
	}})).To(Succeed())

	held, release, err := host.r.Hold(t.Context(), []string{"pvc-1", "vol-2"})

	g.Expect(err).To(MatchError(`find the VMs that write to volumes ["pvc-1" "vol-2"]: volume of claim tenant/alphas-logs (guest cluster alpha) ` +
		`is plugged into VM tenant/vm-2 of cluster "beta": a group snapshot holds only the VMs of the cluster that owns its volumes`))
	g.Expect(held).To(BeNil())
	g.Expect(release).To(BeNil())
	g.Expect(host.h.holdCalls()).To(BeEmpty(), "no VM is frozen")
	g.Expect(host.r.holding).To(BeNil())

	const ownersVM = "its owner's own VM holds it"
	vm2.Labels[tenancy.CAPIClusterNameLabel] = "alpha"
	g.Expect(host.c.Update(t.Context(), vm2)).To(Succeed())
	held, release, err = host.r.Hold(t.Context(), []string{"vol-2"})
	g.Expect(err).NotTo(HaveOccurred(), ownersVM)
	g.Expect(held).To(Equal([]string{"vol-2"}), ownersVM)
	g.Expect(release(t.Context())).To(Succeed())
}

func TestAFailedFreezeHoldsNothing(t *testing.T) {
	g := NewWithT(t)
	host := newHoldHost(t)
	host.h.freezeErr = map[string]error{"vm-2": errors.New("disk pvb123: a raw block volume")}

	held, release, err := host.r.Hold(t.Context(), []string{"pvc-1", "vol-2"})

	g.Expect(err).To(MatchError(ContainSubstring("hold the writes of VM tenant/vm-2 to disks [%q]: disk pvb123: a raw block volume", SerialFor("pvc-2"))))
	g.Expect(held).To(BeNil())
	g.Expect(release).To(BeNil())
	g.Expect(host.h.holdCalls()).To(Equal([]string{
		fmt.Sprintf("freeze vm-1 [%s]", SerialFor("pvc-1")),
		fmt.Sprintf("freeze vm-2 [%s]", SerialFor("pvc-2")),
		"thaw vm-1",
	}), "what was frozen is thawed")
	g.Expect(host.h.frozenVMs()).To(BeEmpty())
	g.Expect(host.rec.Events).To(Receive(HavePrefix("Warning WritesNotHeld The writes to disks " + SerialFor("pvc-2") + " could not be held")))
	g.Expect(host.r.isHeld("pvc-1")).To(BeFalse(), "no hold is left active")

	_, release, err = host.r.Hold(t.Context(), []string{"pvc-1"})
	g.Expect(err).NotTo(HaveOccurred(), "the next hold goes on")
	g.Expect(release(t.Context())).To(Succeed())
}

func TestAttachOfAHeldVolumeWaitsForTheRelease(t *testing.T) {
	g := NewWithT(t)
	vm := virtualMachine([]string{"data"}, nil)
	c := newClient(g, vm, true)
	h, fc := newFakeHypervisor(), &fakeCSI{}
	r := &Reconciler{Client: c, Node: "host-a", Hypervisor: h, CSI: fc, StateDir: t.TempDir()}
	req := ctrl.Request{NamespacedName: client.ObjectKeyFromObject(vm)}
	serial := SerialFor(pvName)

	// The volume is not plugged anywhere: nothing to freeze, but it gets no writer meanwhile.
	held, release, err := r.Hold(t.Context(), []string{pvName})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(held).To(BeEmpty())

	res, err := r.Reconcile(t.Context(), req)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(res.RequeueAfter).To(Equal(retryAfter), "tried again")
	g.Expect(h.disks["vm-1"]).To(BeEmpty())
	g.Expect(fc.calls).To(BeEmpty(), "not even published")
	// A hot-plug that passed the first check before the hold began does not plug either.
	done, err := r.plug(t.Context(), vmRef(vm), pvName, hypervisor.Disk{Serial: serial, Device: "/dev/x"})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(done).To(BeFalse())
	g.Expect(h.disks["vm-1"]).To(BeEmpty())

	g.Expect(release(t.Context())).To(Succeed())
	res, err = r.Reconcile(t.Context(), req)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(res.RequeueAfter).To(BeZero())
	g.Expect(h.disks["vm-1"]).To(HaveKey(serial))
	got := &vmv1.VirtualMachine{}
	g.Expect(c.Get(t.Context(), req.NamespacedName, got)).To(Succeed())
	g.Expect(got.Status.Volumes).To(Equal([]vmv1.VirtualMachineVolumeStatus{{Name: "data", Attached: true, DiskSerial: serial}}))
}

func TestHoldServerThawsTheHostsVMsThenServes(t *testing.T) {
	g := NewWithT(t)
	host := newHoldHost(t)
	host.h.frozen = map[string]bool{"vm-1": true, "vm-3": true}                         // an earlier agent died mid-hold
	path := filepath.Join(t.TempDir(), "plugins/pmem.csi.pvbridge.io", hold.SocketName) // made by the agent
	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan error, 1)
	go func() { stopped <- (&HoldServer{Agent: host.r, Path: path, MaxHold: time.Minute}).Start(ctx) }()
	defer func() {
		cancel()
		g.Expect(<-stopped).To(Succeed())
	}()

	var lease *hold.Lease
	g.Eventually(func() (err error) {
		lease, err = hold.Acquire(t.Context(), path, []string{"pvc-1"})
		return err
	}).WithTimeout(10 * time.Second).WithPolling(20 * time.Millisecond).Should(Succeed())

	g.Expect(lease.Held).To(Equal([]string{"pvc-1"}))
	g.Expect(host.h.holdCalls()).To(Equal([]string{
		"thaw vm-1", "thaw vm-2", // the host's VMs, before the first hold; vm-3 is another host's
		fmt.Sprintf("freeze vm-1 [%s]", SerialFor("pvc-1")),
	}))
	_, err := lease.Release(t.Context())
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(host.h.holdCalls()).To(Equal([]string{"thaw vm-1"}))
	g.Expect(host.h.frozenVMs()).To(Equal(map[string]bool{"vm-3": true}))
}

func TestVMRefSizesTheVMAsItsResourcesAskRoundedUp(t *testing.T) {
	tests := []struct {
		name            string
		resources       *vmv1.VirtualMachineResources
		cpus, memoryMiB int
	}{
		{name: "no resources: the driver's defaults"},
		{name: "whole CPUs and MiB", resources: &vmv1.VirtualMachineResources{CPU: ptr.To(resource.MustParse("2")), Memory: ptr.To(resource.MustParse("1Gi"))}, cpus: 2, memoryMiB: 1024},
		{name: "a fraction of a CPU is a whole one", resources: &vmv1.VirtualMachineResources{CPU: ptr.To(resource.MustParse("1500m"))}, cpus: 2},
		{name: "decimal memory up to the next MiB", resources: &vmv1.VirtualMachineResources{Memory: ptr.To(resource.MustParse("100M"))}, memoryMiB: 96},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			vm := &vmv1.VirtualMachine{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "vm-1"}}
			vm.Spec.Resources = tt.resources
			ref := vmRef(vm)
			g := NewWithT(t)
			g.Expect(ref.CPUs).To(Equal(tt.cpus))
			g.Expect(ref.MemoryMiB).To(Equal(tt.memoryMiB))
		})
	}
}
