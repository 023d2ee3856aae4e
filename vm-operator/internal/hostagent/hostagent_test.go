package hostagent

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	. "github.com/onsi/gomega"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/tools/events"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	clientfake "sigs.k8s.io/controller-runtime/pkg/client/fake"

	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/vm-operator/internal/hypervisor"
)

// fakeCSI records the Node calls of the host agent.
type fakeCSI struct {
	csi.NodeClient
	mu    sync.Mutex
	calls []string
}

func (f *fakeCSI) record(call string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls = append(f.calls, call)
}

func (f *fakeCSI) NodeStageVolume(_ context.Context, req *csi.NodeStageVolumeRequest, _ ...grpc.CallOption) (*csi.NodeStageVolumeResponse, error) {
	f.record("stage " + req.GetVolumeId())
	return &csi.NodeStageVolumeResponse{}, nil
}

func (f *fakeCSI) NodePublishVolume(_ context.Context, req *csi.NodePublishVolumeRequest, _ ...grpc.CallOption) (*csi.NodePublishVolumeResponse, error) {
	f.record("publish " + req.GetVolumeId())
	return &csi.NodePublishVolumeResponse{}, nil
}

func (f *fakeCSI) NodeUnpublishVolume(_ context.Context, req *csi.NodeUnpublishVolumeRequest, _ ...grpc.CallOption) (*csi.NodeUnpublishVolumeResponse, error) {
	f.record("unpublish " + req.GetVolumeId())
	return &csi.NodeUnpublishVolumeResponse{}, nil
}

func (f *fakeCSI) NodeUnstageVolume(_ context.Context, req *csi.NodeUnstageVolumeRequest, _ ...grpc.CallOption) (*csi.NodeUnstageVolumeResponse, error) {
	f.record("unstage " + req.GetVolumeId())
	return &csi.NodeUnstageVolumeResponse{}, nil
}

// fakeHypervisor keeps disks per VM in memory.
type fakeHypervisor struct {
	mu        sync.Mutex
	on        map[string]bool
	disks     map[string]map[string]string // vm → serial → device
	attachErr error
	detachErr error // of a disk that is attached
	forced    int
	// slots is what Slots reports of a running VM that asks for none; slotsErr fails it.
	slots    int
	slotsErr error
	// bootstraps records the bootstrap data each VM was powered on with.
	bootstraps map[string]*hypervisor.Bootstrap
	// limits are the I/O limits of the disks attached with some, by serial; notLive makes
	// SetLimits refuse a disk attached without (as the local driver does).
	limits  map[string]hypervisor.Limits
	notLive bool
	// holds records the Freeze and Thaw calls ("freeze vm-1 [serial]", "thaw vm-1");
	// frozen, which VMs are frozen; freezeErr fails the Freeze of the VMs it names.
	holds     []string
	frozen    map[string]bool
	freezeErr map[string]error
	// deleted are the VMs Delete stopped.
	deleted []string
	// started holds each VM as PowerOn started it, its size included.
	started map[string]hypervisor.VM
	// images is the host's image store: PowerOn of a VM that names another image is
	// ErrImageNotFound.
	images []string
	// addresses are what the guests of VMs report, by name; silent: no guest answers.
	addresses map[string][]string
	silent    bool
}

func newFakeHypervisor() *fakeHypervisor {
	return &fakeHypervisor{on: map[string]bool{}, disks: map[string]map[string]string{}, limits: map[string]hypervisor.Limits{}}
}

func (h *fakeHypervisor) Name() string { return "fake" }

func (h *fakeHypervisor) PowerOn(_ context.Context, vm hypervisor.VM) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if vm.Image != "" && !slices.Contains(h.images, vm.Image) {
		return fmt.Errorf("%w: %s", hypervisor.ErrImageNotFound, vm.Image)
	}
	if !h.on[vm.Name] {
		if h.started == nil {
			h.started = map[string]hypervisor.VM{}
		}
		h.started[vm.Name] = vm
	}
	if !h.on[vm.Name] && vm.Bootstrap != nil {
		if h.bootstraps == nil {
			h.bootstraps = map[string]*hypervisor.Bootstrap{}
		}
		h.bootstraps[vm.Name] = vm.Bootstrap
	}
	h.on[vm.Name] = true
	return nil
}

func (h *fakeHypervisor) PowerOff(_ context.Context, vm hypervisor.VM) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if len(h.disks[vm.Name]) > 0 {
		return hypervisor.ErrBusy
	}
	h.on[vm.Name] = false
	return nil
}

func (h *fakeHypervisor) Delete(_ context.Context, vm hypervisor.VM) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.on[vm.Name] {
		h.deleted = append(h.deleted, vm.Name)
	}
	delete(h.on, vm.Name)
	delete(h.disks, vm.Name)
	return nil
}

func (h *fakeHypervisor) ForceOff(_ context.Context, vm hypervisor.VM) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	delete(h.disks, vm.Name)
	h.on[vm.Name] = false
	h.forced++
	return nil
}

func (h *fakeHypervisor) Running(_ context.Context, vm hypervisor.VM) (bool, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.on[vm.Name], nil
}

func (h *fakeHypervisor) Attach(_ context.Context, vm hypervisor.VM, d hypervisor.Disk) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.attachErr != nil {
		return h.attachErr
	}
	if h.disks[vm.Name] == nil {
		h.disks[vm.Name] = map[string]string{}
	}
	h.disks[vm.Name][d.Serial] = d.Device
	if d.Limits != nil {
		h.limits[d.Serial] = *d.Limits
	}
	return nil
}

func (h *fakeHypervisor) SetLimits(_ context.Context, vm hypervisor.VM, serial string, l hypervisor.Limits) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	_, limited := h.limits[serial]
	switch {
	case h.disks[vm.Name][serial] == "":
		return fmt.Errorf("no disk %s", serial)
	case h.notLive && !limited:
		return hypervisor.ErrNotLive
	}
	h.limits[serial] = l
	return nil
}

func (h *fakeHypervisor) Detach(_ context.Context, vm hypervisor.VM, serial string) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if _, ok := h.disks[vm.Name][serial]; ok && h.detachErr != nil {
		return h.detachErr
	}
	delete(h.disks[vm.Name], serial)
	return nil
}

func (h *fakeHypervisor) Addresses(_ context.Context, vm hypervisor.VM) ([]string, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.silent {
		return nil, hypervisor.ErrGuestAgent
	}
	return h.addresses[vm.Name], nil
}

func (h *fakeHypervisor) Slots(_ context.Context, vm hypervisor.VM) (int, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	switch {
	case h.slotsErr != nil:
		return 0, h.slotsErr
	case !h.on[vm.Name]:
		return 0, nil
	case vm.Slots > 0:
		return vm.Slots, nil
	}
	return h.slots, nil
}

func (h *fakeHypervisor) Freeze(_ context.Context, vm hypervisor.VM, serials []string) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.holds = append(h.holds, fmt.Sprintf("freeze %s %v", vm.Name, serials))
	if err := h.freezeErr[vm.Name]; err != nil {
		return err
	}
	if h.frozen == nil {
		h.frozen = map[string]bool{}
	}
	h.frozen[vm.Name] = true
	return nil
}

func (h *fakeHypervisor) Thaw(_ context.Context, vm hypervisor.VM) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.holds = append(h.holds, "thaw "+vm.Name)
	delete(h.frozen, vm.Name)
	return nil
}

// frozenVMs returns the names of the frozen VMs.
func (h *fakeHypervisor) frozenVMs() map[string]bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return maps.Clone(h.frozen)
}

// holdCalls returns the Freeze and Thaw calls so far, and forgets them.
func (h *fakeHypervisor) holdCalls() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	calls := h.holds
	h.holds = nil
	return calls
}

func (h *fakeHypervisor) Disks(_ context.Context, vm hypervisor.VM) ([]hypervisor.Disk, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	var out []hypervisor.Disk
	for s, d := range h.disks[vm.Name] {
		disk := hypervisor.Disk{Serial: s, Device: d}
		if l, ok := h.limits[s]; ok {
			disk.Limits = &l
		}
		out = append(out, disk)
	}
	return out, nil
}

const pvName = "pvc-1"

func objects(vm *vmv1.VirtualMachine, attached bool) []client.Object {
	va := &storagev1.VolumeAttachment{
		ObjectMeta: metav1.ObjectMeta{Name: vmv1.AttachmentName(vm.Namespace, vm.Name, "data"), Labels: vmv1.AttachmentLabels(vm)},
		Spec: storagev1.VolumeAttachmentSpec{
			Attacher: "pmem.csi.pvbridge.io", NodeName: "host-a",
			Source: storagev1.VolumeAttachmentSource{PersistentVolumeName: ptr.To(pvName)},
		},
		Status: storagev1.VolumeAttachmentStatus{Attached: attached},
	}
	pv := &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: pvName},
		Spec: corev1.PersistentVolumeSpec{PersistentVolumeSource: corev1.PersistentVolumeSource{
			CSI: &corev1.CSIPersistentVolumeSource{Driver: "pmem.csi.pvbridge.io", VolumeHandle: pvName},
		}},
	}
	return []client.Object{vm, va, pv}
}

// newClient is a fake API server holding vm with its volume "data" and that volume's attachment.
func newClient(g Gomega, vm *vmv1.VirtualMachine, attached bool) client.Client {
	scheme := runtime.NewScheme()
	g.Expect(clientgoscheme.AddToScheme(scheme)).To(Succeed())
	g.Expect(vmv1.AddToScheme(scheme)).To(Succeed())
	return clientfake.NewClientBuilder().WithScheme(scheme).WithObjects(objects(vm, attached)...).
		WithStatusSubresource(&vmv1.VirtualMachine{}).Build()
}

func virtualMachine(volumes []string, status []vmv1.VirtualMachineVolumeStatus) *vmv1.VirtualMachine {
	vm := &vmv1.VirtualMachine{
		ObjectMeta: metav1.ObjectMeta{Namespace: "tenant", Name: "vm-1", UID: "uid-1"},
		Spec:       vmv1.VirtualMachineSpec{PowerState: vmv1.PowerStateOn},
		Status:     vmv1.VirtualMachineStatus{Host: "host-a", UniqueID: "uid-1", Volumes: status},
	}
	for _, v := range volumes {
		vm.Spec.Volumes = append(vm.Spec.Volumes, vmv1.VirtualMachineVolume{
			Name: v, PersistentVolumeClaim: vmv1.PersistentVolumeClaimVolumeSource{ClaimName: v},
		})
	}
	return vm
}

func TestReconcile(t *testing.T) {
	serial := SerialFor(pvName)
	attachedEntry := vmv1.VirtualMachineVolumeStatus{Name: "data", Attached: true, DiskSerial: serial}
	tests := []struct {
		name       string
		vm         *vmv1.VirtualMachine
		vaAttached bool
		prepare    func(h *fakeHypervisor)
		// plugged: the disk of "data" is plugged as the agent plugs it (its published device).
		plugged     bool
		wantStatus  []vmv1.VirtualMachineVolumeStatus
		wantCalls   []string
		wantDisks   int
		wantRequeue bool
	}{
		{
			name: "an attached volume is staged, published and hot-plugged", vm: virtualMachine([]string{"data"}, nil), vaAttached: true,
			wantStatus: []vmv1.VirtualMachineVolumeStatus{attachedEntry},
			wantCalls:  []string{"stage pvc-1", "publish pvc-1"}, wantDisks: 1,
		},
		{
			name: "a volume recorded attached whose disk is plugged costs no call", vaAttached: true,
			vm: virtualMachine([]string{"data"}, []vmv1.VirtualMachineVolumeStatus{attachedEntry}), plugged: true,
			wantStatus: []vmv1.VirtualMachineVolumeStatus{attachedEntry}, wantCalls: nil, wantDisks: 1,
		},
		{
			name: "a plugged disk whose status entry is not written yet is recorded without a call", vaAttached: true,
			vm: virtualMachine([]string{"data"}, nil), plugged: true,
			wantStatus: []vmv1.VirtualMachineVolumeStatus{attachedEntry}, wantCalls: nil, wantDisks: 1,
		},
		{
			name: "a volume recorded attached whose disk is gone (the VM restarted) is plugged again", vaAttached: true,
			vm:         virtualMachine([]string{"data"}, []vmv1.VirtualMachineVolumeStatus{attachedEntry}),
			wantStatus: []vmv1.VirtualMachineVolumeStatus{attachedEntry},
			wantCalls:  []string{"stage pvc-1", "publish pvc-1"}, wantDisks: 1,
		},
		{
			name: "a volume whose attachment is not attached yet waits", vm: virtualMachine([]string{"data"}, nil),
			wantStatus: nil, wantCalls: nil,
		},
		{
			name: "a hot-plug failure is reported and retried", vm: virtualMachine([]string{"data"}, nil), vaAttached: true,
			prepare:    func(h *fakeHypervisor) { h.attachErr = hypervisor.ErrConflict },
			wantStatus: []vmv1.VirtualMachineVolumeStatus{{Name: "data", Error: "hot-plug: conflicting disk"}},
			wantCalls:  []string{"stage pvc-1", "publish pvc-1"}, wantRequeue: true,
		},
		{
			name: "a removed volume is unplugged, unpublished and unstaged", vaAttached: true,
			vm:      virtualMachine(nil, []vmv1.VirtualMachineVolumeStatus{attachedEntry}),
			prepare: func(h *fakeHypervisor) { h.disks["vm-1"] = map[string]string{serial: "/dev/x"} },
			// The volume was staged by an earlier reconcile: see the test body.
			wantStatus: nil, wantCalls: []string{"unpublish pvc-1", "unstage pvc-1"},
		},
		{
			name: "a disk plugged by an agent that died before recording it is unplugged", vaAttached: true,
			vm:      virtualMachine(nil, []vmv1.VirtualMachineVolumeStatus{{Name: "data"}}),
			prepare: func(h *fakeHypervisor) { h.disks["vm-1"] = map[string]string{serial: "/dev/x"} },
			// No serial in status: the one recorded when it was published is unplugged.
			wantStatus: nil, wantCalls: []string{"unpublish pvc-1", "unstage pvc-1"}, wantDisks: 0,
		},
		{
			name: "a disk the guest still holds stays, with the reason", vaAttached: true,
			vm: virtualMachine(nil, []vmv1.VirtualMachineVolumeStatus{attachedEntry}),
			prepare: func(h *fakeHypervisor) {
				h.disks["vm-1"] = map[string]string{serial: "/dev/x"}
				h.detachErr = hypervisor.ErrBusy
			},
			wantStatus: []vmv1.VirtualMachineVolumeStatus{{Name: "data", Attached: true, DiskSerial: serial,
				Error: "waiting for the guest to release disk " + serial + ": disk still held by the virtual machine"}},
			wantCalls: nil, wantDisks: 1, wantRequeue: true,
		},
		{
			name: "a VM on another host is not touched", vaAttached: true,
			vm: func() *vmv1.VirtualMachine {
				vm := virtualMachine([]string{"data"}, nil)
				vm.Status.Host = "host-b"
				return vm
			}(),
			wantStatus: nil, wantCalls: nil,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			c := newClient(g, tt.vm, tt.vaAttached)
			h, fc := newFakeHypervisor(), &fakeCSI{}
			if tt.prepare != nil {
				tt.prepare(h)
			}
			r := &Reconciler{Client: c, Node: "host-a", Hypervisor: h, CSI: fc, StateDir: t.TempDir()}
			// A volume in status was published by an earlier run, which left its volume ID.
			if len(tt.vm.Status.Volumes) > 0 {
				_, err := r.publish(t.Context(), filepath.Join(r.StateDir, vmv1.AttachmentName("tenant", "vm-1", "data")), pvName, serial, nil)
				g.Expect(err).NotTo(HaveOccurred())
				fc.calls = nil
			}
			if tt.plugged {
				h.disks["vm-1"] = map[string]string{serial: filepath.Join(r.StateDir, vmv1.AttachmentName("tenant", "vm-1", "data"), "device")}
			}

			res, err := r.Reconcile(t.Context(), ctrl.Request{NamespacedName: client.ObjectKeyFromObject(tt.vm)})
			g.Expect(err).NotTo(HaveOccurred())
			if tt.wantRequeue {
				g.Expect(res.RequeueAfter).To(Equal(retryAfter))
			} else {
				g.Expect(res.RequeueAfter).To(BeZero())
			}
			got := &vmv1.VirtualMachine{}
			g.Expect(c.Get(t.Context(), client.ObjectKeyFromObject(tt.vm), got)).To(Succeed())
			g.Expect(got.Status.Volumes).To(Equal(tt.wantStatus))
			g.Expect(fc.calls).To(Equal(tt.wantCalls))
			g.Expect(h.disks["vm-1"]).To(HaveLen(tt.wantDisks))
		})
	}
}

func TestReconcileGivesTheDiskItsClassLimits(t *testing.T) {
	serial := SerialFor(pvName)
	gold := hypervisor.Limits{IOPS: 100, BytesPerSecond: 4 << 20}
	goldEntry := vmv1.VirtualMachineVolumeStatus{Name: "data", Attached: true, DiskSerial: serial, VolumeAttributesClassName: "gold"}
	tests := []struct {
		name string
		// status is the VM's status.volumes before; plugged plugs the disk, with limits if set.
		status      []vmv1.VirtualMachineVolumeStatus
		plugged     bool
		limits      *hypervisor.Limits
		notLive     bool
		noClass     bool
		wantStatus  []vmv1.VirtualMachineVolumeStatus
		wantLimits  *hypervisor.Limits
		wantEvent   string
		wantRequeue bool
	}{
		{
			name: "a volume is plugged with the limits of its class", wantStatus: []vmv1.VirtualMachineVolumeStatus{goldEntry},
			wantLimits: &gold, wantEvent: "Normal Attached Volume data attached as disk " + serial + " with the I/O limits of VolumeAttributesClass gold (100 IOPS, 4194304 bytes/s)",
		},
		{
			name: "a plugged disk gets its new class's limits live", plugged: true, limits: &hypervisor.Limits{IOPS: 5},
			status:     []vmv1.VirtualMachineVolumeStatus{{Name: "data", Attached: true, DiskSerial: serial, VolumeAttributesClassName: "bronze"}},
			wantStatus: []vmv1.VirtualMachineVolumeStatus{goldEntry}, wantLimits: &gold,
			wantEvent: "Normal IOLimitsChanged Volume data now has the I/O limits of VolumeAttributesClass gold (100 IOPS, 4194304 bytes/s), applied live",
		},
		{
			name: "a plugged disk with its class's limits costs no call", plugged: true, limits: &gold,
			status: []vmv1.VirtualMachineVolumeStatus{goldEntry}, wantStatus: []vmv1.VirtualMachineVolumeStatus{goldEntry}, wantLimits: &gold,
		},
		{
			name: "limits a hypervisor cannot add live are reported for the next attach", plugged: true, notLive: true,
			status: []vmv1.VirtualMachineVolumeStatus{{Name: "data", Attached: true, DiskSerial: serial}},
			wantStatus: []vmv1.VirtualMachineVolumeStatus{{Name: "data", Attached: true, DiskSerial: serial,
				Error: vmv1.LimitsAtNextAttach("gold") + " (100 IOPS, 4194304 bytes/s): " + hypervisor.ErrNotLive.Error()}},
			wantEvent: "Warning IOLimitsNotApplied Volume data: the I/O limits of VolumeAttributesClass gold",
		},
		{
			name: "a volume whose class cannot be read is not plugged", noClass: true,
			wantStatus: []vmv1.VirtualMachineVolumeStatus{{Name: "data",
				Error: `VolumeAttributesClass gold of persistent volume pvc-1: volumeattributesclasses.storage.k8s.io "gold" not found`}},
			wantRequeue: true,
		},
		{
			name: "a plugged disk whose class cannot be read stays attached, with the reason", noClass: true, plugged: true,
			status: []vmv1.VirtualMachineVolumeStatus{goldEntry},
			wantStatus: []vmv1.VirtualMachineVolumeStatus{{Name: "data", Attached: true, DiskSerial: serial, VolumeAttributesClassName: "gold",
				Error: `VolumeAttributesClass gold of persistent volume pvc-1: volumeattributesclasses.storage.k8s.io "gold" not found`}},
			wantRequeue: true,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			vm := virtualMachine([]string{"data"}, tt.status)
			c := newClient(g, vm, true)
			pv := &corev1.PersistentVolume{}
			g.Expect(c.Get(t.Context(), client.ObjectKey{Name: pvName}, pv)).To(Succeed())
			pv.Spec.VolumeAttributesClassName = ptr.To("gold")
			g.Expect(c.Update(t.Context(), pv)).To(Succeed())
			if !tt.noClass {
				g.Expect(c.Create(t.Context(), &storagev1.VolumeAttributesClass{
					ObjectMeta: metav1.ObjectMeta{Name: "gold"}, DriverName: "pmem.csi.pvbridge.io",
					Parameters: map[string]string{"maxIOPS": "100", "maxBytesPerSecond": "4Mi"},
				})).To(Succeed())
			}
			h, fc := newFakeHypervisor(), &fakeCSI{}
			h.notLive = tt.notLive
			rec := events.NewFakeRecorder(10)
			r := &Reconciler{Client: c, Node: "host-a", Hypervisor: h, CSI: fc, StateDir: t.TempDir(), Recorder: rec}
			if tt.plugged {
				h.disks["vm-1"] = map[string]string{serial: filepath.Join(r.StateDir, vmv1.AttachmentName("tenant", "vm-1", "data"), "device")}
				if tt.limits != nil {
					h.limits[serial] = *tt.limits
				}
			}

			res, err := r.Reconcile(t.Context(), ctrl.Request{NamespacedName: client.ObjectKeyFromObject(vm)})
			g.Expect(err).NotTo(HaveOccurred())
			if tt.wantRequeue {
				g.Expect(res.RequeueAfter).To(BeNumerically(">", 0))
			} else {
				g.Expect(res.RequeueAfter).To(BeZero())
			}
			got := &vmv1.VirtualMachine{}
			g.Expect(c.Get(t.Context(), client.ObjectKeyFromObject(vm), got)).To(Succeed())
			g.Expect(got.Status.Volumes).To(Equal(tt.wantStatus))
			if tt.wantLimits != nil {
				g.Expect(h.limits).To(HaveKeyWithValue(serial, *tt.wantLimits))
			}
			if tt.wantEvent != "" {
				g.Expect(rec.Events).To(Receive(HavePrefix(tt.wantEvent)))
			} else {
				g.Expect(rec.Events).NotTo(Receive())
			}
		})
	}
}

func TestReconcileReportsTheVMsSlots(t *testing.T) {
	tests := []struct {
		name    string
		vm      func(vm *vmv1.VirtualMachine)
		prepare func(h *fakeHypervisor)
		want    *int32
	}{
		{
			name: "a running VM reports its hypervisor's default", vm: func(*vmv1.VirtualMachine) {},
			prepare: func(h *fakeHypervisor) { h.slots = 16 }, want: ptr.To[int32](16),
		},
		{
			name:    "a VM that asks for slots reports what its hypervisor gave it",
			vm:      func(vm *vmv1.VirtualMachine) { vm.Spec.MaxVolumes = ptr.To[int32](3) },
			prepare: func(h *fakeHypervisor) { h.slots = 16 }, want: ptr.To[int32](3),
		},
		{
			name: "a VM whose hypervisor cannot tell keeps its number",
			vm:   func(vm *vmv1.VirtualMachine) { vm.Status.MaxVolumes = ptr.To[int32](5) },
			prepare: func(h *fakeHypervisor) {
				h.slots, h.slotsErr = 16, errors.New("monitor gone")
			},
			want: ptr.To[int32](5),
		},
		{
			name:    "a VM asked to be off reports nothing new",
			vm:      func(vm *vmv1.VirtualMachine) { vm.Spec.PowerState = vmv1.PowerStateOff },
			prepare: func(h *fakeHypervisor) { h.slots = 16 }, want: nil,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			vm := virtualMachine(nil, nil)
			tt.vm(vm)
			c := newClient(g, vm, false)
			h := newFakeHypervisor()
			tt.prepare(h)
			r := &Reconciler{Client: c, Node: "host-a", Hypervisor: h, CSI: &fakeCSI{}, StateDir: t.TempDir()}
			_, err := r.Reconcile(t.Context(), ctrl.Request{NamespacedName: client.ObjectKeyFromObject(vm)})
			g.Expect(err).NotTo(HaveOccurred())
			got := &vmv1.VirtualMachine{}
			g.Expect(c.Get(t.Context(), client.ObjectKeyFromObject(vm), got)).To(Succeed())
			g.Expect(got.Status.MaxVolumes).To(Equal(tt.want))
		})
	}
}

func TestDeletedVMLosesItsDisksThenItsPower(t *testing.T) {
	g := NewWithT(t)
	serial := SerialFor(pvName)
	vm := virtualMachine([]string{"data"}, nil)
	vm.Finalizers = []string{vmv1.VolumesFinalizer}
	c := newClient(g, vm, true)
	h, fc := newFakeHypervisor(), &fakeCSI{}
	r := &Reconciler{Client: c, Node: "host-a", Hypervisor: h, CSI: fc, StateDir: t.TempDir()}
	req := ctrl.Request{NamespacedName: client.ObjectKeyFromObject(vm)}

	_, err := r.Reconcile(t.Context(), req)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(h.disks["vm-1"]).To(HaveKey(serial))
	g.Expect(h.on["vm-1"]).To(BeTrue())

	g.Expect(c.Delete(t.Context(), vm)).To(Succeed()) // held by the finalizer
	_, err = r.Reconcile(t.Context(), req)
	g.Expect(err).NotTo(HaveOccurred())
	got := &vmv1.VirtualMachine{}
	g.Expect(c.Get(t.Context(), req.NamespacedName, got)).To(Succeed())
	g.Expect(got.Status.Volumes).To(BeEmpty())
	g.Expect(h.disks["vm-1"]).To(BeEmpty())

	_, err = r.Reconcile(t.Context(), req) // with nothing attached, the VM is powered off
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(h.on["vm-1"]).To(BeFalse())
	g.Expect(c.Get(t.Context(), req.NamespacedName, got)).To(Succeed())
	ready := meta.FindStatusCondition(got.Status.Conditions, vmv1.ReadyCondition)
	g.Expect(ready).NotTo(BeNil())
	g.Expect(ready.Reason).To(Equal(vmv1.PoweredOffReason), "the controller derives phase Stopped from it")
}

// A VM that the controller says went with this host, declared lost, is not this agent's any
// more: it neither starts it nor writes its status (the controller's HostLost stays).
func TestVMOfALostHostIsLeftAlone(t *testing.T) {
	g := NewWithT(t)
	vm := virtualMachine([]string{"data"}, nil)
	vm.Status.Conditions = []metav1.Condition{{Type: vmv1.ReadyCondition, Status: metav1.ConditionFalse, Reason: vmv1.HostLostReason, LastTransitionTime: metav1.Now()}}
	c := newClient(g, vm, true)
	h := newFakeHypervisor()
	r := &Reconciler{Client: c, Node: "host-a", Hypervisor: h, CSI: &fakeCSI{}, StateDir: t.TempDir()}
	req := ctrl.Request{NamespacedName: client.ObjectKeyFromObject(vm)}

	_, err := r.Reconcile(t.Context(), req)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(h.on["vm-1"]).To(BeFalse())
	got := &vmv1.VirtualMachine{}
	g.Expect(c.Get(t.Context(), req.NamespacedName, got)).To(Succeed())
	g.Expect(meta.FindStatusCondition(got.Status.Conditions, vmv1.ReadyCondition)).To(HaveField("Reason", vmv1.HostLostReason))
	g.Expect(got.Status.Volumes).To(BeEmpty())
}

// A VM without volumes is gone as soon as it is deleted (the controller's finalizer has nothing
// to wait for), maybe before the agent saw the deletion: the VM's reconcile then finds no object
// and deletes what the hypervisor has of it.
func TestVMWhoseObjectIsGoneIsDeletedFromTheHypervisor(t *testing.T) {
	g := NewWithT(t)
	vm := virtualMachine(nil, nil)
	c := newClient(g, vm, true)
	h := newFakeHypervisor()
	r := &Reconciler{Client: c, Node: "host-a", Hypervisor: h, CSI: &fakeCSI{}, StateDir: t.TempDir()}
	req := ctrl.Request{NamespacedName: client.ObjectKeyFromObject(vm)}

	_, err := r.Reconcile(t.Context(), req)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(h.on["vm-1"]).To(BeTrue())

	g.Expect(c.Delete(t.Context(), vm)).To(Succeed()) // no finalizer: gone at once
	_, err = r.Reconcile(t.Context(), req)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(h.on["vm-1"]).To(BeFalse())
	g.Expect(h.deleted).To(Equal([]string{"vm-1"}))
}

func TestApplyDecisionsKeepsOtherWritersEntries(t *testing.T) {
	g := NewWithT(t)
	status := []vmv1.VirtualMachineVolumeStatus{
		{Name: "c", Error: "PVC c is not bound"}, // the controller's
		{Name: "f", Error: "attach failed: x"},   // the controller's, and claimed
		{Name: "a", Attached: true, DiskSerial: "s-a"},
		{Name: "b", Attached: true, DiskSerial: "s-b"},
	}
	got := applyDecisions(status, &decisions{
		set:   map[string]vmv1.VirtualMachineVolumeStatus{"e": {Name: "e", Attached: true, DiskSerial: "s-e"}},
		drop:  []string{"b"},
		claim: []string{"a", "d", "f"},
	})
	g.Expect(got).To(Equal([]vmv1.VirtualMachineVolumeStatus{
		{Name: "c", Error: "PVC c is not bound"},
		{Name: "f"},                                    // a claim takes over the controller's entry
		{Name: "a", Attached: true, DiskSerial: "s-a"}, // and never replaces the agent's
		{Name: "d"},
		{Name: "e", Attached: true, DiskSerial: "s-e"},
	}))
}

// A reconcile whose cached VM predates the agent's own last status write decides from the VM as
// the API server has it, and from the cache again once the cache has caught up.
func TestStaleCacheAfterOwnWriteIsReadAgain(t *testing.T) {
	g := NewWithT(t)
	cached := virtualMachine([]string{"data"}, []vmv1.VirtualMachineVolumeStatus{{Name: "data", Attached: true, DiskSerial: "s"}})
	cached.ResourceVersion = "5"
	live := cached.DeepCopy()
	live.ResourceVersion, live.Spec.Volumes, live.Status.Volumes = "7", nil, nil
	r := &Reconciler{APIReader: newClient(g, live, true)}
	r.wrote(client.ObjectKeyFromObject(cached), "7")

	vm := cached.DeepCopy()
	g.Expect(r.current(t.Context(), vm)).To(Succeed())
	g.Expect(vm.Status.Volumes).To(BeEmpty(), "the entry the agent dropped stays dropped")

	caughtUp := live.DeepCopy()
	caughtUp.Status.Host = "from the cache"
	g.Expect(r.current(t.Context(), caughtUp)).To(Succeed())
	g.Expect(caughtUp.Status.Host).To(Equal("from the cache"))
	g.Expect(r.written).To(BeEmpty())
}

func TestSerialFor(t *testing.T) {
	g := NewWithT(t)
	s := SerialFor("pvc-0b3f7c1e-2f7a-4d0c-9b1e-4c2e8f0a1d2c")
	g.Expect(s).To(HaveLen(hypervisor.MaxSerialLength))
	g.Expect(s).To(MatchRegexp(`^pvb[0-9a-f]{17}$`))
	g.Expect(SerialFor("pvc-0b3f7c1e-2f7a-4d0c-9b1e-4c2e8f0a1d2c")).To(Equal(s), "deterministic")
	g.Expect(SerialFor("pvc-other")).NotTo(Equal(s))
}

func TestVMWhoseGuestKeepsItsDisksIsForcedOffAfterTheUnplugTimeout(t *testing.T) {
	g := NewWithT(t)
	serial := SerialFor(pvName)
	vm := virtualMachine([]string{"data"}, []vmv1.VirtualMachineVolumeStatus{{Name: "data", Attached: true, DiskSerial: serial}})
	vm.Spec.PowerState = vmv1.PowerStateOff
	c := newClient(g, vm, true)
	h, fc := newFakeHypervisor(), &fakeCSI{}
	h.on["vm-1"], h.disks["vm-1"] = true, map[string]string{serial: "/dev/x"}
	h.detachErr = hypervisor.ErrBusy // the guest ignores the unplug
	now := time.Date(2026, 11, 24, 12, 0, 0, 0, time.UTC)
	r := &Reconciler{Client: c, Node: "host-a", Hypervisor: h, CSI: fc, StateDir: t.TempDir(),
		UnplugTimeout: time.Minute, now: func() time.Time { return now }}
	_, err := r.publish(t.Context(), filepath.Join(r.StateDir, vmv1.AttachmentName("tenant", "vm-1", "data")), pvName, serial, nil)
	g.Expect(err).NotTo(HaveOccurred())
	fc.calls = nil
	req := ctrl.Request{NamespacedName: client.ObjectKeyFromObject(vm)}
	readyOf := func() *metav1.Condition {
		got := &vmv1.VirtualMachine{}
		g.Expect(c.Get(t.Context(), req.NamespacedName, got)).To(Succeed())
		return meta.FindStatusCondition(got.Status.Conditions, vmv1.ReadyCondition)
	}

	// Within the timeout the agent waits, and says until when.
	for _, at := range []time.Duration{0, 59 * time.Second} {
		now = now.Add(at)
		res, err := r.Reconcile(t.Context(), req)
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(res.RequeueAfter).To(Equal(retryAfter))
		g.Expect(h.forced).To(BeZero())
		g.Expect(readyOf().Message).To(Equal("detaching volumes before powering off; forced off at 2026-11-24T12:01:00Z if the guest still holds them"))
	}

	// Then it pulls the plug: the disk goes with the VM, and the volume is released on the host.
	forcedBefore := testutil.ToFloat64(forcedOff.WithLabelValues(vm.Namespace, vm.Name))
	now = now.Add(time.Second)
	_, err = r.Reconcile(t.Context(), req)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(h.forced).To(Equal(1))
	g.Expect(testutil.ToFloat64(forcedOff.WithLabelValues(vm.Namespace, vm.Name))).To(Equal(forcedBefore + 1))
	g.Expect(h.disks["vm-1"]).To(BeEmpty())
	g.Expect(fc.calls).To(Equal([]string{"unpublish pvc-1", "unstage pvc-1"}))
	g.Expect(readyOf()).To(HaveField("Reason", vmv1.PoweredOffReason))
	got := &vmv1.VirtualMachine{}
	g.Expect(c.Get(t.Context(), req.NamespacedName, got)).To(Succeed())
	g.Expect(got.Status.Volumes).To(BeEmpty())
}

// A running VM's guest may refuse an unplug for ever: the agent retries, less and less often,
// and starts over once the guest lets go.
func TestRefusedUnplugOfARunningVMBacksOff(t *testing.T) {
	g := NewWithT(t)
	serial := SerialFor(pvName)
	vm := virtualMachine(nil, []vmv1.VirtualMachineVolumeStatus{{Name: "data", Attached: true, DiskSerial: serial}})
	c := newClient(g, vm, true)
	h, fc := newFakeHypervisor(), &fakeCSI{}
	h.disks["vm-1"] = map[string]string{serial: "/dev/x"}
	h.detachErr = hypervisor.ErrBusy
	r := &Reconciler{Client: c, Node: "host-a", Hypervisor: h, CSI: fc, StateDir: t.TempDir()}
	_, err := r.publish(t.Context(), filepath.Join(r.StateDir, vmv1.AttachmentName("tenant", "vm-1", "data")), pvName, serial, nil)
	g.Expect(err).NotTo(HaveOccurred())
	req := ctrl.Request{NamespacedName: client.ObjectKeyFromObject(vm)}

	var delays []time.Duration
	for range 7 {
		res, err := r.Reconcile(t.Context(), req)
		g.Expect(err).NotTo(HaveOccurred())
		delays = append(delays, res.RequeueAfter)
	}
	g.Expect(delays).To(Equal([]time.Duration{
		retryAfter, 2 * retryAfter, 4 * retryAfter, 8 * retryAfter, 16 * retryAfter, maxBusyRetry, maxBusyRetry,
	}))

	h.detachErr = nil // the guest lets go
	res, err := r.Reconcile(t.Context(), req)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(res.RequeueAfter).To(BeZero())
	g.Expect(r.busy).To(BeEmpty(), "the next refusal starts over")
}

// A running VM's addresses are its guest's: asked every guestPoll while it does not answer (it
// boots), recorded once it does, and dropped when the VM is powered off.
func TestVMStatusHasTheAddressesItsGuestReports(t *testing.T) {
	g := NewWithT(t)
	vm := virtualMachine(nil, nil)
	c := newClient(g, vm, false)
	h := newFakeHypervisor()
	h.silent = true
	r := &Reconciler{Client: c, Node: "host-a", Hypervisor: h, CSI: &fakeCSI{}, StateDir: t.TempDir()}
	req := ctrl.Request{NamespacedName: client.ObjectKeyFromObject(vm)}
	addresses := func() []string {
		got := &vmv1.VirtualMachine{}
		g.Expect(c.Get(t.Context(), req.NamespacedName, got)).To(Succeed())
		return got.Status.Addresses
	}

	res, err := r.Reconcile(t.Context(), req)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(res.RequeueAfter).To(Equal(guestPoll))
	g.Expect(addresses()).To(BeEmpty())

	h.silent, h.addresses = false, map[string][]string{vm.Name: {"10.0.7.12", "fd00::12"}}
	res, err = r.Reconcile(t.Context(), req)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(res.RequeueAfter).To(BeZero())
	g.Expect(addresses()).To(Equal([]string{"10.0.7.12", "fd00::12"}))

	g.Expect(c.Get(t.Context(), req.NamespacedName, vm)).To(Succeed())
	vm.Spec.PowerState = vmv1.PowerStateOff
	g.Expect(c.Update(t.Context(), vm)).To(Succeed())
	_, err = r.Reconcile(t.Context(), req)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(addresses()).To(BeEmpty(), "a new boot brings its own")
}

// A VM whose image is not in the host's store waits for it, tried again at a steady pace
// rather than the backoff of a failure, and boots that image once it is there.
func TestVMWaitsForItsImage(t *testing.T) {
	g := NewWithT(t)
	vm := virtualMachine(nil, nil)
	vm.Spec.Image = "node-v1"
	c := newClient(g, vm, false)
	h := newFakeHypervisor()
	r := &Reconciler{Client: c, Node: "host-a", Hypervisor: h, CSI: &fakeCSI{}, StateDir: t.TempDir()}
	req := ctrl.Request{NamespacedName: client.ObjectKeyFromObject(vm)}

	res, err := r.Reconcile(t.Context(), req)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(res.RequeueAfter).To(Equal(retryAfter))
	g.Expect(h.started).NotTo(HaveKey(vm.Name))
	got := &vmv1.VirtualMachine{}
	g.Expect(c.Get(t.Context(), req.NamespacedName, got)).To(Succeed())
	g.Expect(meta.FindStatusCondition(got.Status.Conditions, vmv1.ReadyCondition)).To(And(
		HaveField("Status", metav1.ConditionFalse), HaveField("Reason", vmv1.ImageNotFoundReason), HaveField("Message", ContainSubstring("node-v1"))))

	h.images = []string{"node-v1"}
	_, err = r.Reconcile(t.Context(), req)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(h.started).To(HaveKeyWithValue(vm.Name, HaveField("Image", "node-v1")))
}

func TestHypervisorErrorNamesWhyTheVMIsNotReady(t *testing.T) {
	tests := []struct {
		err    error
		reason string
	}{
		{errors.New("QMP: connection reset"), vmv1.HypervisorErrorReason},
		{fmt.Errorf("%w: VM ns/vm-1 boots with 512 MiB, the host has 200 MiB available", hypervisor.ErrInsufficientMemory), vmv1.InsufficientMemoryReason},
		{fmt.Errorf("%w: VM ns/vm-1 boots image node-v1, and /images has no node-v1/disk.qcow2", hypervisor.ErrImageNotFound), vmv1.ImageNotFoundReason},
	}
	for _, tt := range tests {
		t.Run(tt.reason, func(t *testing.T) {
			vm := &vmv1.VirtualMachine{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "vm-1", Generation: 3}}
			c := hypervisorError(vm, "power on", tt.err)
			g := NewWithT(t)
			g.Expect(c.Status).To(Equal(metav1.ConditionFalse))
			g.Expect(c.Reason).To(Equal(tt.reason))
			g.Expect(c.Message).To(Equal("power on: " + tt.err.Error()))
			g.Expect(c.ObservedGeneration).To(Equal(int64(3)))
		})
	}
}
