package hostagent

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/pkg/hold"
	"pvbridge.io/pkg/tenancy"
	"pvbridge.io/vm-operator/internal/hypervisor"
)

// The host agent is the holder of its host's writers (package pvbridge.io/pkg/hold): while
// mgmt-csi's node agent cuts the members of a group snapshot, the VMs that write to them are
// held by their hypervisor driver (Freeze: qemu pauses the VM, local freezes the guest's
// filesystems), so that every member shows the same instant.
//
// A hold and the hot-plugs exclude each other through holdGate: a hot-plug calls the
// hypervisor under its read lock, after checking that its volume is not in the active hold; a
// hold takes the write lock to install its volumes. Every hot-plug therefore either finished
// before the hold looked for the members' disks (and is found and held), or sees the hold and
// waits for its release: a VM never starts writing to a member while the others are held.

var _ hold.Holder = (*Reconciler)(nil)

// heldVM is a VM whose writes a hold holds.
type heldVM struct {
	vm  *vmv1.VirtualMachine
	ref hypervisor.VM
	// serials are the disks of members the VM has plugged, volumeIDs their volumes.
	serials, volumeIDs []string
	// since is when its Freeze began: its guest's I/O stalls from then.
	since time.Time
}

// Hold implements hold.Holder: it freezes, through the hypervisor driver, the disks of the
// volumes volumeIDs (CSI volume IDs, the PVs' spec.csi.volumeHandle) that the VMs of this
// host have plugged, and returns those volumes' IDs; a volume no VM of the host has plugged is
// not held (no writer here). Until the release, an attach of any of volumeIDs waits. When a
// VM cannot be frozen, those frozen are thawed and Hold returns the error: nothing is held.
// The release thaws them and records how long each VM was held in an Event (WritesHeld).
func (r *Reconciler) Hold(ctx context.Context, volumeIDs []string) ([]string, func(context.Context) error, error) {
	log := klog.FromContext(ctx).WithName("hold")
	r.holdGate.Lock()
	if r.holding != nil {
		r.holdGate.Unlock()
		return nil, nil, errors.New("another hold is active")
	}
	r.holding = map[string]bool{}
	for _, id := range volumeIDs {
		r.holding[id] = true
	}
	r.holdGate.Unlock()

	members, err := r.members(ctx, volumeIDs)
	if err != nil {
		r.endHold()
		return nil, nil, fmt.Errorf("find the VMs that write to volumes %q: %w", volumeIDs, err)
	}
	var frozen []heldVM
	var held []string
	for _, m := range members {
		m.since = time.Now()
		if err := r.Hypervisor.Freeze(ctx, m.ref, m.serials); err != nil {
			err = fmt.Errorf("hold the writes of VM %s/%s to disks %q: %w", m.ref.Namespace, m.ref.Name, m.serials, err)
			r.event(m.vm, corev1.EventTypeWarning, "WritesNotHeld", "The writes to disks %s could not be held for a group snapshot: %v", strings.Join(m.serials, ", "), err)
			err = errors.Join(err, r.thaw(ctx, frozen))
			r.endHold()
			return nil, nil, err
		}
		frozen = append(frozen, m)
		held = append(held, m.volumeIDs...)
	}
	slices.Sort(held)
	held = slices.Compact(held)
	log.V(2).Info("Holding the writes of VMs", "volumeIDs", volumeIDs, "held", held, "vms", len(frozen))
	release := func(ctx context.Context) error {
		err := r.thaw(ctx, frozen)
		released := time.Now()
		r.endHold()
		if len(frozen) == 0 {
			return err
		}
		// The first VM frozen was held the longest.
		writesHeld.Observe(released.Sub(frozen[0].since).Seconds())
		for _, m := range frozen {
			r.event(m.vm, corev1.EventTypeNormal, "WritesHeld", "The writes to volumes %s were held for %s while a group snapshot cut them",
				strings.Join(volumeNames(m.vm, m.serials), ", "), released.Sub(m.since).Round(time.Microsecond))
		}
		log.V(2).Info("Released the writes of VMs", "held", held, "heldFor", released.Sub(frozen[0].since))
		return err
	}
	return held, release, nil
}

// endHold ends the active hold: the attaches of its volumes go on.
func (r *Reconciler) endHold() {
	r.holdGate.Lock()
	defer r.holdGate.Unlock()
	r.holding = nil
}

// isHeld reports whether volumeID is in the active hold.
func (r *Reconciler) isHeld(volumeID string) bool {
	r.holdGate.RLock()
	defer r.holdGate.RUnlock()
	return r.holding[volumeID]
}

// plug hot-plugs disk, the volume volumeID's, into the VM ref, unless volumeID is in the active
// hold: then it returns false and does nothing.
func (r *Reconciler) plug(ctx context.Context, ref hypervisor.VM, volumeID string, disk hypervisor.Disk) (bool, error) {
	r.holdGate.RLock()
	defer r.holdGate.RUnlock()
	if r.holding[volumeID] {
		return false, nil
	}
	return true, r.Hypervisor.Attach(ctx, ref, disk)
}

// members returns the VMs of this host that have a disk of volumeIDs plugged, with those
// disks' serials: what the hypervisor has plugged, not what the status says, which a
// hot-plug whose status write is under way has not reached yet.
func (r *Reconciler) members(ctx context.Context, volumeIDs []string) ([]heldVM, error) {
	pvs := &corev1.PersistentVolumeList{}
	if err := r.Client.List(ctx, pvs); err != nil {
		return nil, err
	}
	volumeOf := map[string]string{}                 // disk serial → volume ID
	claimOf := map[string]*corev1.ObjectReference{} // disk serial → the PV's claim
	for _, pv := range pvs.Items {
		if pv.Spec.CSI != nil && slices.Contains(volumeIDs, pv.Spec.CSI.VolumeHandle) {
			volumeOf[SerialFor(pv.Name)] = pv.Spec.CSI.VolumeHandle
			claimOf[SerialFor(pv.Name)] = pv.Spec.ClaimRef
		}
	}
	if len(volumeOf) == 0 {
		return nil, nil
	}
	vms := &vmv1.VirtualMachineList{}
	if err := r.Client.List(ctx, vms); err != nil {
		return nil, err
	}
	// In a stable order, so that holds of the same VMs freeze them in the same order.
	slices.SortFunc(vms.Items, func(a, b vmv1.VirtualMachine) int {
		return cmp.Or(strings.Compare(a.Namespace, b.Namespace), strings.Compare(a.Name, b.Name))
	})
	var members []heldVM
	for i := range vms.Items {
		vm := &vms.Items[i]
		if vm.Status.Host != r.Node {
			continue
		}
		ref := vmRef(vm)
		disks, err := r.Hypervisor.Disks(ctx, ref)
		if err != nil {
			return nil, fmt.Errorf("list the disks of VM %s: %w", klog.KObj(vm), err)
		}
		m := heldVM{vm: vm, ref: ref}
		for _, d := range disks {
			if id, ok := volumeOf[d.Serial]; ok {
				m.serials = append(m.serials, d.Serial)
				m.volumeIDs = append(m.volumeIDs, id)
			}
		}
		if len(m.serials) == 0 {
			continue
		}
		if err := r.sameCluster(ctx, vm, m.serials, claimOf); err != nil {
			return nil, err
		}
		members = append(members, m)
	}
	return members, nil
}

// sameCluster refuses to hold vm when a disk of serials is the volume of a claim of another
// guest cluster than vm's: a claim a platform admin shared with vm's cluster, which its owner
// groups. Holding vm would pause another tenant's VM at the owner's will. The claims are read
// around the cache (the agent caches no claims): one read per held disk.
func (r *Reconciler) sameCluster(ctx context.Context, vm *vmv1.VirtualMachine, serials []string, claimOf map[string]*corev1.ObjectReference) error {
	var reader client.Reader = r.Client
	if r.APIReader != nil {
		reader = r.APIReader
	}
	for _, serial := range serials {
		ref := claimOf[serial]
		if ref == nil {
			continue
		}
		claim := &corev1.PersistentVolumeClaim{}
		if err := reader.Get(ctx, client.ObjectKey{Namespace: ref.Namespace, Name: ref.Name}, claim); err != nil {
			if apierrors.IsNotFound(err) {
				continue
			}
			return fmt.Errorf("read claim %s/%s of disk %s: %w", ref.Namespace, ref.Name, serial, err)
		}
		owner, vmCluster := claim.Labels[tenancy.ClusterNameLabel], vm.Labels[tenancy.CAPIClusterNameLabel]
		if owner != "" && (claim.Namespace != vm.Namespace || owner != vmCluster) {
			return fmt.Errorf("volume of claim %s/%s (guest cluster %s) is plugged into VM %s of cluster %q: "+
				"a group snapshot holds only the VMs of the cluster that owns its volumes", claim.Namespace, claim.Name, owner, klog.KObj(vm), vmCluster)
		}
	}
	return nil
}

// thaw lets the writes of vms go; it tries every one.
func (r *Reconciler) thaw(ctx context.Context, vms []heldVM) error {
	var errs []error
	for _, m := range vms {
		if err := r.Hypervisor.Thaw(ctx, m.ref); err != nil {
			r.event(m.vm, corev1.EventTypeWarning, "ThawFailed", "The writes held for a group snapshot could not be let go: %v", err)
			errs = append(errs, fmt.Errorf("let the writes of VM %s/%s go: %w", m.ref.Namespace, m.ref.Name, err))
		}
	}
	return errors.Join(errs...)
}

// volumeNames names the disks serials of vm by their volumes' names in its status, or by
// their serials where the status does not have them yet.
func volumeNames(vm *vmv1.VirtualMachine, serials []string) []string {
	names := make([]string, 0, len(serials))
	for _, s := range serials {
		name := s
		if i := slices.IndexFunc(vm.Status.Volumes, func(e vmv1.VirtualMachineVolumeStatus) bool { return e.DiskSerial == s }); i >= 0 {
			name = vm.Status.Volumes[i].Name
		}
		names = append(names, name)
	}
	return names
}

// vmRef is the hypervisor's view of vm.
func vmRef(vm *vmv1.VirtualMachine) hypervisor.VM {
	ref := hypervisor.VM{Namespace: vm.Namespace, Name: vm.Name, UID: vm.Status.UniqueID, Slots: int(ptr.Deref(vm.Spec.MaxVolumes, 0)), Image: vm.Spec.Image}
	if res := vm.Spec.Resources; res != nil {
		// Rounded up: a VM never boots smaller than it asked.
		if res.CPU != nil {
			ref.CPUs = int(res.CPU.Value())
		}
		if res.Memory != nil {
			ref.MemoryMiB = mib(res.Memory.Value())
		}
	}
	return ref
}

// HoldServer serves the host agent's holds on the hold socket, as a manager Runnable. Before
// it serves, it thaws every VM of the host: an agent that died during a hold must not leave a
// VM held.
type HoldServer struct {
	// Agent is the host agent, the holder.
	Agent *Reconciler
	// Path is the socket's path, hold.SocketBeside(the mgmt-csi node socket).
	Path string
	// MaxHold bounds a hold; 0 means hold.DefaultMaxHold.
	MaxHold time.Duration
}

// NeedLeaderElection is false: every host agent serves its own host.
func (s *HoldServer) NeedLeaderElection() bool { return false }

// Start thaws the VMs of the host, then serves holds until ctx ends.
func (s *HoldServer) Start(ctx context.Context) error {
	log := klog.FromContext(ctx)
	if err := s.Agent.thawHost(ctx); err != nil {
		return err
	}
	// The directory is mgmt-csi's node plugin's, which may start after the agent.
	if err := os.MkdirAll(filepath.Dir(s.Path), 0o750); err != nil {
		return fmt.Errorf("create the hold socket's directory: %w", err)
	}
	l, err := hold.Listen(s.Path)
	if err != nil {
		return err
	}
	log.Info("Serving holds of the host's writers", "socket", s.Path)
	return (&hold.Server{Holder: s.Agent, MaxHold: s.MaxHold}).Serve(ctx, l)
}

// thawHost thaws every VM of this host. A VM that cannot be thawed is reported (log and
// Event) and the others still are: it does not keep the host from serving.
func (r *Reconciler) thawHost(ctx context.Context) error {
	vms := &vmv1.VirtualMachineList{}
	if err := r.Client.List(ctx, vms); err != nil {
		return fmt.Errorf("list the VMs of the host to thaw them: %w", err)
	}
	for i := range vms.Items {
		vm := &vms.Items[i]
		if vm.Status.Host != r.Node {
			continue
		}
		if err := r.Hypervisor.Thaw(ctx, vmRef(vm)); err != nil {
			klog.FromContext(ctx).Error(err, "Cannot let the writes of a VM go", "vm", klog.KObj(vm))
			r.event(vm, corev1.EventTypeWarning, "ThawFailed", "The writes an earlier run of the host agent held could not be let go: %v", err)
		}
	}
	return nil
}
