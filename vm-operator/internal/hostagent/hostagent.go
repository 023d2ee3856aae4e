// Package hostagent is the vm-operator host agent: on one host it is the CSI consumer of the
// volumes of the VirtualMachines placed there, the way kubelet is for pods. For each volume
// whose management VolumeAttachment is attached it stages and publishes the volume as a raw
// block device through the host's mgmt-csi node plugin, hot-plugs it into the VM with its disk
// serial, and reports it in status.volumes; for a volume that left spec.volumes it unplugs,
// unpublishes and unstages, then drops the status entry (which lets the controller delete the
// VolumeAttachment). It also drives the VMs' power state, and holds the VMs' writes while
// mgmt-csi cuts a group snapshot of their volumes (hold.go).
//
// Every step is idempotent and the agent keeps no state beyond a small file per volume, so an
// agent killed at any step converges by reconciling again.
package hostagent

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/resourceversion"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/metrics"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"
	"sigs.k8s.io/controller-runtime/pkg/recorder"

	infrav1 "pvbridge.io/pkg/apis/infrastructure/v1alpha1"
	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/pkg/qos"
	"pvbridge.io/vm-operator/internal/hypervisor"
	"pvbridge.io/vm-operator/internal/vmstatus"
)

// retryAfter is how soon a volume that is waiting (for the guest to let go of a disk, for a
// busy CSI call) is tried again.
const retryAfter = 2 * time.Second

// guestPoll is how often the host agent asks a running VM's guest for its addresses until it
// says.
const guestPoll = 10 * time.Second

// maxBusyRetry caps the backoff of the retries of an unplug that a running VM's guest refuses:
// it may refuse for ever (nothing forces a running VM off), and each retry is a hypervisor call
// on a host that other tenants share.
const maxBusyRetry = time.Minute

// Reconciler realizes the volumes and power state of the VirtualMachines on one host.
type Reconciler struct {
	Client     client.Client
	Node       string
	Hypervisor hypervisor.Driver
	// CSI is the Node service of the host's mgmt-csi node plugin.
	CSI csi.NodeClient
	// APIReader reads around the cache, after a write conflict.
	APIReader client.Reader
	// StateDir holds, per volume, the staging directory, the published device file and the
	// volume ID: <StateDir>/<VolumeAttachment name>/.
	StateDir string
	Recorder recorder.EventRecorder
	// UnplugTimeout is how long the guest of a VM that must stop (powered off or deleted) has
	// to release its disks before the VM is forced off; zero waits for ever. A guest that
	// ignores hot-unplug would otherwise keep its VM, its volumes and its cluster's deletion
	// forever. The wait is counted from when the agent first saw the stop, so an agent restart
	// starts it again: a VM is never forced off early.
	UnplugTimeout time.Duration

	// now is the clock (time.Now when nil).
	now func() time.Time
	// written holds, per VM, the resourceVersion of the agent's last status write until the
	// cache has it (see current).
	writtenMu sync.Mutex
	written   map[types.NamespacedName]string
	// stops records when the agent first saw each VM that must stop still holding disks.
	stopsMu sync.Mutex
	stops   map[types.UID]time.Time
	// busy counts, per running VM, the passes in a row whose unplug its guest refused.
	busyMu sync.Mutex
	busy   map[types.UID]int
	// holding is the set of volume IDs of the active hold of the host's writers (hold.go), nil
	// when there is none. holdGate guards it; a hot-plug holds its read lock (see plug).
	holdGate sync.RWMutex
	holding  map[string]bool
}

func (r *Reconciler) clock() time.Time {
	if r.now != nil {
		return r.now()
	}
	return time.Now()
}

// stopDeadline returns when the VM uid, which must stop and still holds disks, is forced off,
// starting its wait if this is the first time it is seen; zero without an unplug timeout.
func (r *Reconciler) stopDeadline(uid types.UID) time.Time {
	if r.UnplugTimeout <= 0 {
		return time.Time{}
	}
	r.stopsMu.Lock()
	defer r.stopsMu.Unlock()
	if r.stops == nil {
		r.stops = map[types.UID]time.Time{}
	}
	since, ok := r.stops[uid]
	if !ok {
		since = r.clock()
		r.stops[uid] = since
	}
	return since.Add(r.UnplugTimeout)
}

// unplugOverdue reports whether the guest of VM uid has had its unplug timeout.
func (r *Reconciler) unplugOverdue(uid types.UID) bool {
	r.stopsMu.Lock()
	since, ok := r.stops[uid]
	r.stopsMu.Unlock()
	return ok && r.UnplugTimeout > 0 && !r.clock().Before(since.Add(r.UnplugTimeout))
}

func (r *Reconciler) forgetStop(uid types.UID) {
	r.stopsMu.Lock()
	defer r.stopsMu.Unlock()
	delete(r.stops, uid)
}

// SetupWithManager registers the reconciler. The manager's cache holds only the
// VirtualMachines placed on this host (a field selector on status.host).
func (r *Reconciler) SetupWithManager(mgr ctrl.Manager) error {
	if err := metrics.Registry.Register(&volumesCollector{reader: r.Client, node: r.Node}); err != nil {
		return fmt.Errorf("register the volume count: %w", err)
	}
	return ctrl.NewControllerManagedBy(mgr).
		For(&vmv1.VirtualMachine{}).
		Named("hostagent").
		// VMs are independent; the hypervisor serializes what concerns one VM.
		WithOptions(controller.Options{MaxConcurrentReconciles: 4}).
		Watches(&storagev1.VolumeAttachment{}, handler.EnqueueRequestsFromMapFunc(r.vmsOfAttachment)).
		// A volume's VolumeAttributesClass and capacity change on its PV (csi-resizer writes
		// them once the driver accepted the class or grew the volume): its disk's I/O limits
		// and, as the hypervisor lists the disk (hypervisor.Driver.Disks), its size follow.
		Watches(&corev1.PersistentVolume{}, handler.EnqueueRequestsFromMapFunc(r.vmsOfVolume)).
		Watches(&vmv1.VirtualMachineClass{}, handler.EnqueueRequestsFromMapFunc(r.vmsOfClass)).
		Complete(r)
}

// vmsOfVolume maps a PersistentVolume to the VMs on this host that have its claim in spec.
func (r *Reconciler) vmsOfVolume(ctx context.Context, obj client.Object) []reconcile.Request {
	claim := obj.(*corev1.PersistentVolume).Spec.ClaimRef
	if claim == nil {
		return nil
	}
	return r.vmsWhere(ctx, func(vm *vmv1.VirtualMachine) bool {
		return slices.ContainsFunc(vm.Spec.Volumes, func(v vmv1.VirtualMachineVolume) bool { return v.PersistentVolumeClaim.ClaimName == claim.Name })
	}, client.InNamespace(claim.Namespace))
}

// vmsOfAttachment maps a VolumeAttachment to the VMs on this host whose labels it carries.
func (r *Reconciler) vmsOfAttachment(ctx context.Context, obj client.Object) []reconcile.Request {
	return r.vmsWhere(ctx, func(vm *vmv1.VirtualMachine) bool {
		matches := true
		for k, v := range vmv1.AttachmentLabels(vm) {
			matches = matches && obj.GetLabels()[k] == v
		}
		return matches
	})
}

// vmsWhere maps the VMs on this host (the cache holds no others), listed with opts, for which
// match holds to their requests.
func (r *Reconciler) vmsWhere(ctx context.Context, match func(*vmv1.VirtualMachine) bool, opts ...client.ListOption) []reconcile.Request {
	vms := &vmv1.VirtualMachineList{}
	if err := r.Client.List(ctx, vms, opts...); err != nil {
		return nil
	}
	var reqs []reconcile.Request
	for i := range vms.Items {
		if match(&vms.Items[i]) {
			reqs = append(reqs, reconcile.Request{NamespacedName: client.ObjectKeyFromObject(&vms.Items[i])})
		}
	}
	return reqs
}

// SerialFor is the disk serial of a management PV inside a VM: "pvb" and the first 17 hex
// digits of SHA-256 of the PV name, 20 characters, the virtio-blk limit.
func SerialFor(pvName string) string {
	sum := sha256.Sum256([]byte(pvName))
	return "pvb" + hex.EncodeToString(sum[:])[:17]
}

// Reconcile makes the disks of a VM on this host match its spec.volumes, in phases of one
// concern each: power on, claim, attach (a VM that should run); force off when the guest
// overstayed its unplug time, detach what the spec no longer holds, power off (a VM being
// stopped or deleted); then one status write of every decision and the Ready condition.
func (r *Reconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	vm := &vmv1.VirtualMachine{}
	if err := r.Client.Get(ctx, req.NamespacedName, vm); err != nil {
		if !apierrors.IsNotFound(err) {
			return ctrl.Result{}, err
		}
		r.wrote(req.NamespacedName, "")
		// Gone for good: what the hypervisor still has of it goes too. Its QEMU runs on when
		// the object went before the power-off (the controller removes the last finalizer as
		// soon as no volume is left, and a VM without volumes has none to wait for).
		return ctrl.Result{}, r.Hypervisor.Delete(ctx, hypervisor.VM{Namespace: req.Namespace, Name: req.Name})
	}
	if vm.Status.Host != r.Node {
		return ctrl.Result{}, nil
	}
	if ready := meta.FindStatusCondition(vm.Status.Conditions, vmv1.ReadyCondition); ready != nil && ready.Reason == vmv1.HostLostReason {
		// This host is declared lost (the controller's word): the VM is taken for gone, and
		// this agent, which should not run at all, does not say otherwise.
		return ctrl.Result{}, nil
	}
	if err := r.current(ctx, vm); err != nil {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	ref := vmRef(vm)
	// A VM being deleted or powered off keeps no disk.
	wantOn := vm.DeletionTimestamp.IsZero() && vm.Spec.PowerState != vmv1.PowerStateOff
	d := &decisions{set: map[string]vmv1.VirtualMachineVolumeStatus{}}
	if wantOn {
		if cond, err := r.sized(ctx, vm, &ref); err != nil {
			return ctrl.Result{}, err
		} else if cond != nil {
			// A VM that runs already keeps the size it started with; one that does not waits.
			if running, err := r.Hypervisor.Running(ctx, ref); err != nil || !running {
				return ctrl.Result{}, r.writeStatus(ctx, vm, &decisions{}, cond)
			}
		}
		if err := r.bootstrap(ctx, vm, &ref); err != nil {
			cond := readyCondition(vm, metav1.ConditionFalse, vmv1.BootstrapDataUnavailableReason, err.Error())
			return ctrl.Result{RequeueAfter: retryAfter}, errors.Join(err, r.writeStatus(ctx, vm, &decisions{}, cond))
		}
		if err := r.Hypervisor.PowerOn(ctx, ref); err != nil {
			cond := hypervisorError(vm, "power on", err)
			if errors.Is(err, hypervisor.ErrImageNotFound) {
				// An admin puts the image in the host's store; the VM starts soon after.
				return ctrl.Result{RequeueAfter: retryAfter}, r.writeStatus(ctx, vm, &decisions{}, cond)
			}
			return ctrl.Result{}, errors.Join(err, r.writeStatus(ctx, vm, &decisions{}, cond))
		}
		r.slots(ctx, ref, d)
		r.addresses(ctx, vm, ref, d)
		if err := r.claim(ctx, vm); err != nil {
			return ctrl.Result{}, err
		}
		r.attachAll(ctx, vm, ref, d)
	} else if len(vm.Status.Volumes) > 0 && r.unplugOverdue(vm.UID) {
		if err := r.forceOff(ctx, vm, ref); err != nil {
			return ctrl.Result{RequeueAfter: retryAfter}, r.writeStatus(ctx, vm, &decisions{}, hypervisorError(vm, "force off", err))
		}
	}
	r.detachRemoved(ctx, vm, ref, wantOn, d)
	holding := len(applyDecisions(vm.Status.Volumes, d)) > 0
	ready := readyCondition(vm, metav1.ConditionTrue, vmv1.PoweredOnReason, "")
	if !wantOn {
		ready = r.powerOff(ctx, vm, ref, holding, d)
		if ready.Reason == vmv1.PoweredOffReason {
			d.addresses = &[]string{} // a new boot brings its own
		}
	}
	if wantOn || !holding {
		r.forgetStop(vm.UID)
	}
	if err := r.writeStatus(ctx, vm, d, ready); err != nil {
		return ctrl.Result{}, err
	}
	delay := r.busyRetry(vm.UID, wantOn && d.busy)
	switch {
	case d.waiting:
		return ctrl.Result{RequeueAfter: delay}, nil
	case d.askGuest:
		return ctrl.Result{RequeueAfter: guestPoll}, nil
	}
	return ctrl.Result{}, nil
}

// bootstrap adds the VM's bootstrap data to ref when the VM is about to start, so that PowerOn
// hands it to the hypervisor: the user data is the key "value" of the Secret the VM names (as
// Cluster API's bootstrap providers write it), the meta-data is made here (BootstrapMetaData).
// The Secret is read from the API server, and only while the VM does not run: the agent
// caches no Secret, and may only get them (docs/security.md says why).
func (r *Reconciler) bootstrap(ctx context.Context, vm *vmv1.VirtualMachine, ref *hypervisor.VM) error {
	if vm.Spec.Bootstrap == nil {
		return nil
	}
	running, err := r.Hypervisor.Running(ctx, *ref)
	if err != nil || running {
		return err
	}
	key := types.NamespacedName{Namespace: vm.Namespace, Name: vm.Spec.Bootstrap.DataSecretName}
	secret := &corev1.Secret{}
	if err := r.apiReader().Get(ctx, key, secret); err != nil {
		return fmt.Errorf("read bootstrap data secret %s: %w", key, err)
	}
	data, ok := secret.Data["value"]
	if !ok {
		return fmt.Errorf("bootstrap data secret %s has no key \"value\"", key)
	}
	ref.Bootstrap = &hypervisor.Bootstrap{UserData: data, MetaData: BootstrapMetaData(vm)}
	return nil
}

// BootstrapMetaData is the NoCloud meta-data of a VM: its instance ID (the VM's UID, so a
// recreated VM of the same name boots as a new instance), its host name (the VM's name, which
// is the guest Node's), and, for the kubelet's --provider-id, its namespace and provider ID
// (pvbridge://<namespace>/<name>). cloud-init's templates read them as ds.meta_data.local_hostname,
// ds.meta_data.namespace and ds.meta_data.provider_id.
func BootstrapMetaData(vm *vmv1.VirtualMachine) []byte {
	uid := vm.Status.UniqueID
	if uid == "" {
		uid = string(vm.UID)
	}
	return fmt.Appendf(nil, "instance-id: %q\nlocal-hostname: %q\nnamespace: %q\nprovider-id: %q\n",
		uid, vm.Name, vm.Namespace, infrav1.ProviderID(vm.Namespace, vm.Name))
}

// busyRetry returns when to look again at VM uid: retryAfter, doubled for each pass in a row in
// which its running guest refused an unplug (busy), up to maxBusyRetry. A pass without a refusal
// starts over.
func (r *Reconciler) busyRetry(uid types.UID, busy bool) time.Duration {
	r.busyMu.Lock()
	defer r.busyMu.Unlock()
	if !busy {
		delete(r.busy, uid)
		return retryAfter
	}
	if r.busy == nil {
		r.busy = map[types.UID]int{}
	}
	n := r.busy[uid]
	r.busy[uid] = n + 1
	return min(retryAfter<<min(n, 5), maxBusyRetry) // retryAfter<<5 is past maxBusyRetry
}

// decisions are what one reconcile decided about status.volumes: entries to set, entries to
// drop, and volumes to claim (see claim). Only these are written, so an entry the controller
// wrote meanwhile (an error for a volume not attached yet) survives. waiting asks for another
// reconcile soon.
type decisions struct {
	set     map[string]vmv1.VirtualMachineVolumeStatus
	drop    []string
	claim   []string
	waiting bool
	// busy: the guest refused to release a disk.
	busy bool
	// slots, when set, is the VM's status.maxVolumes: what its hypervisor says it holds.
	slots *int32
	// addresses, when set, are the VM's status.addresses; askGuest: the guest has not said yet.
	addresses *[]string
	askGuest  bool
}

// slots records how many disks the running VM can hold, as its hypervisor says: its guest
// cluster's scheduler counts on that number (the node's CSI volume limit). A VM that cannot
// tell keeps the number it had.
func (r *Reconciler) slots(ctx context.Context, ref hypervisor.VM, d *decisions) {
	n, err := r.Hypervisor.Slots(ctx, ref)
	if err != nil {
		ctrl.LoggerFrom(ctx).V(1).Info("Cannot read the VM's hot-plug slots", "err", err)
		return
	}
	if n > 0 && n <= hypervisor.MaxSlots {
		d.slots = ptr.To(int32(n))
	}
}

// addresses records the addresses of the running VM as its guest reports them, once: while
// status.addresses is empty the guest is asked at each reconcile and, until it says (it boots),
// again every guestPoll. A guest whose address changes later shows it after the VM's next
// power-on.
func (r *Reconciler) addresses(ctx context.Context, vm *vmv1.VirtualMachine, ref hypervisor.VM, d *decisions) {
	if len(vm.Status.Addresses) > 0 {
		return
	}
	addrs, err := r.Hypervisor.Addresses(ctx, ref)
	switch {
	case errors.Is(err, hypervisor.ErrGuestAgent):
		d.askGuest = true
	case err != nil:
		ctrl.LoggerFrom(ctx).V(1).Info("Cannot read the VM's addresses", "err", err)
	case len(addrs) > 0:
		d.addresses = &addrs
	}
}

// claim records in status, in one write, the volumes about to be staged: while an entry of the
// host agent exists the controller keeps the VolumeAttachment, so a volume removed from spec
// meanwhile is unstaged before it is detached (kubelet's volumesInUse does the same for pods).
// A claim adds an entry where there is none and replaces an entry of the controller (an error
// it wrote before the volume was attached), which the controller would otherwise still rewrite
// or remove; it never replaces an entry of the host agent.
func (r *Reconciler) claim(ctx context.Context, vm *vmv1.VirtualMachine) error {
	d := &decisions{}
	for _, v := range vm.Spec.Volumes {
		i := slices.IndexFunc(vm.Status.Volumes, func(e vmv1.VirtualMachineVolumeStatus) bool { return e.Name == v.Name })
		if (i < 0 || vmstatus.ControllerEntry(vm.Status.Volumes[i])) && r.attachmentReady(ctx, vm, v.Name) {
			d.claim = append(d.claim, v.Name)
		}
	}
	if len(d.claim) == 0 {
		return nil
	}
	return r.writeStatus(ctx, vm, d, nil)
}

// attachAll attaches every volume of the spec. What the VM has plugged now decides what is left
// to do: a volume recorded attached whose disk is plugged from its published device is settled,
// and costs no CSI call. A listing error only means every volume takes the full (idempotent) way.
func (r *Reconciler) attachAll(ctx context.Context, vm *vmv1.VirtualMachine, ref hypervisor.VM, d *decisions) {
	plugged, err := r.Hypervisor.Disks(ctx, ref)
	if err != nil {
		ctrl.LoggerFrom(ctx).V(1).Info("Cannot list the VM's disks", "err", err)
	}
	for _, v := range vm.Spec.Volumes {
		entry, done := r.attach(ctx, vm, ref, v.Name, plugged)
		if entry != nil {
			d.set[v.Name] = *entry
		}
		d.waiting = d.waiting || !done
	}
}

// forceOff pulls the plug of a VM whose guest had its time to release its disks; the disks go
// with it.
func (r *Reconciler) forceOff(ctx context.Context, vm *vmv1.VirtualMachine, ref hypervisor.VM) error {
	if err := r.Hypervisor.ForceOff(ctx, ref); err != nil {
		return err
	}
	forcedOff.WithLabelValues(vm.Namespace, vm.Name).Inc()
	ctrl.LoggerFrom(ctx).Info("Forced the VM off: its guest did not release its disks in time", "unplugTimeout", r.UnplugTimeout)
	r.event(vm, corev1.EventTypeWarning, "ForcedOff", "The guest did not release its disks within %s of being asked to; the VM was forced off", r.UnplugTimeout)
	return nil
}

// detachRemoved detaches every volume of the status that the VM should not have: all of them
// when it should not run.
func (r *Reconciler) detachRemoved(ctx context.Context, vm *vmv1.VirtualMachine, ref hypervisor.VM, wantOn bool, d *decisions) {
	for _, e := range vm.Status.Volumes {
		if wantOn && slices.ContainsFunc(vm.Spec.Volumes, func(v vmv1.VirtualMachineVolume) bool { return v.Name == e.Name }) {
			continue
		}
		if err := r.detach(ctx, vm, ref, e); err != nil {
			e.Error = err.Error()
			d.set[e.Name] = e
			d.waiting = true
			d.busy = d.busy || errors.Is(err, hypervisor.ErrBusy)
			continue
		}
		d.drop = append(d.drop, e.Name)
	}
}

// powerOff powers the VM off once it holds no volume, and returns its Ready condition.
func (r *Reconciler) powerOff(ctx context.Context, vm *vmv1.VirtualMachine, ref hypervisor.VM, holding bool, d *decisions) *metav1.Condition {
	if holding {
		msg := "detaching volumes before powering off"
		if deadline := r.stopDeadline(vm.UID); !deadline.IsZero() {
			msg += fmt.Sprintf("; forced off at %s if the guest still holds them", deadline.UTC().Format(time.RFC3339))
		}
		return readyCondition(vm, metav1.ConditionFalse, vmv1.PoweredOnReason, msg)
	}
	if err := r.Hypervisor.PowerOff(ctx, ref); err != nil {
		d.waiting = true
		return hypervisorError(vm, "power off", err)
	}
	return readyCondition(vm, metav1.ConditionTrue, vmv1.PoweredOffReason, "")
}

// readyCondition is the VM's Ready condition, of its generation.
func readyCondition(vm *vmv1.VirtualMachine, status metav1.ConditionStatus, reason, message string) *metav1.Condition {
	return &metav1.Condition{Type: vmv1.ReadyCondition, Status: status, Reason: reason, Message: message, ObservedGeneration: vm.Generation}
}

// hypervisorError is the Ready condition of a VM whose hypervisor call op failed.
func hypervisorError(vm *vmv1.VirtualMachine, op string, err error) *metav1.Condition {
	reason := vmv1.HypervisorErrorReason
	switch {
	case errors.Is(err, hypervisor.ErrInsufficientMemory):
		reason = vmv1.InsufficientMemoryReason
	case errors.Is(err, hypervisor.ErrImageNotFound):
		reason = vmv1.ImageNotFoundReason
	}
	return readyCondition(vm, metav1.ConditionFalse, reason, op+": "+err.Error())
}

// attachmentReady reports whether the VolumeAttachment of volume name is attached.
func (r *Reconciler) attachmentReady(ctx context.Context, vm *vmv1.VirtualMachine, name string) bool {
	va := &storagev1.VolumeAttachment{}
	err := r.Client.Get(ctx, client.ObjectKey{Name: vmv1.AttachmentName(vm.Namespace, vm.Name, name)}, va)
	return err == nil && va.Status.Attached
}

// attach makes volume name a disk of the VM once its VolumeAttachment is attached, unless the
// disk is among the plugged ones with its serial and published device: then only its status
// entry may be missing (its write lost a race, or the cache does not show it yet), and it is
// recorded without a CSI call or a second hot-plug. It returns the status entry to record
// (nil: leave the entry as it is, the controller reports why the volume is not attached yet)
// and whether the volume is settled.
func (r *Reconciler) attach(ctx context.Context, vm *vmv1.VirtualMachine, ref hypervisor.VM, name string, plugged []hypervisor.Disk) (*vmv1.VirtualMachineVolumeStatus, bool) {
	log := ctrl.LoggerFrom(ctx).WithValues("volume", name)
	vaName := vmv1.AttachmentName(vm.Namespace, vm.Name, name)
	va := &storagev1.VolumeAttachment{}
	if err := r.Client.Get(ctx, client.ObjectKey{Name: vaName}, va); err != nil || !va.Status.Attached || va.Spec.Source.PersistentVolumeName == nil {
		return nil, true // the VolumeAttachment's watch brings us back
	}
	pv := &corev1.PersistentVolume{}
	if err := r.Client.Get(ctx, client.ObjectKey{Name: *va.Spec.Source.PersistentVolumeName}, pv); err != nil || pv.Spec.CSI == nil {
		return failed(name, fmt.Errorf("persistent volume %s: %w", *va.Spec.Source.PersistentVolumeName, errOr(err, "not a CSI volume"))), false
	}

	serial := SerialFor(pv.Name)
	dir := filepath.Join(r.StateDir, vaName)
	limits, class, limitsErr := r.limits(ctx, pv)
	if i := slices.IndexFunc(plugged, func(d hypervisor.Disk) bool {
		return d.Serial == serial && d.Device == filepath.Join(dir, "device")
	}); i >= 0 {
		return r.settle(ctx, vm, ref, name, plugged[i], limits, class, limitsErr)
	}
	if limitsErr != nil {
		return failed(name, limitsErr), false
	}
	// A volume whose writers are held for a group snapshot gets no new writer until the
	// release: the entry stays as it is, and the volume is tried again.
	volumeID := pv.Spec.CSI.VolumeHandle
	if r.isHeld(volumeID) {
		log.V(1).Info("Waiting for the release of the volume's writers to hot-plug it")
		return nil, false
	}
	device, err := r.publish(ctx, dir, volumeID, serial, va.Status.AttachmentMetadata)
	if err != nil {
		log.Error(err, "Cannot publish the volume on the host")
		return failed(name, err), false
	}
	done, err := r.plug(ctx, ref, volumeID, hypervisor.Disk{Serial: serial, Device: device, Limits: limits})
	if err != nil {
		log.Error(err, "Cannot hot-plug the volume")
		r.event(vm, corev1.EventTypeWarning, "HotPlugFailed", "Hot-plug of volume %s failed: %v", name, err)
		return failed(name, fmt.Errorf("hot-plug: %w", err)), false
	}
	if !done {
		log.V(1).Info("Waiting for the release of the volume's writers to hot-plug it")
		return nil, false
	}
	if e := vm.Status.Volumes; !slices.ContainsFunc(e, func(s vmv1.VirtualMachineVolumeStatus) bool { return s.Name == name && s.Attached }) {
		log.Info("Hot-plugged volume", "diskSerial", serial, "device", device, "volumeAttributesClass", class)
		msg := fmt.Sprintf("Volume %s attached as disk %s", name, serial)
		if limits != nil {
			msg += fmt.Sprintf(" with the I/O limits of VolumeAttributesClass %s (%s)", class, *limits)
		}
		r.event(vm, corev1.EventTypeNormal, "Attached", "%s", msg)
	}
	return &vmv1.VirtualMachineVolumeStatus{Name: name, Attached: true, DiskSerial: serial, VolumeAttributesClassName: class}, true
}

// limits returns the I/O limits of a volume's VolumeAttributesClass and the class's name: nil
// and "" for a volume without a class. Its PV names the class the driver accepted last
// (csi-provisioner and csi-resizer write it), not one the claim asks for and the driver may
// still refuse.
func (r *Reconciler) limits(ctx context.Context, pv *corev1.PersistentVolume) (*hypervisor.Limits, string, error) {
	class := ptr.Deref(pv.Spec.VolumeAttributesClassName, "")
	if class == "" {
		return nil, "", nil
	}
	vac := &storagev1.VolumeAttributesClass{}
	if err := r.Client.Get(ctx, client.ObjectKey{Name: class}, vac); err != nil {
		return nil, class, fmt.Errorf("VolumeAttributesClass %s of persistent volume %s: %w", class, pv.Name, err)
	}
	l, err := qos.Parse(vac.Parameters)
	if err != nil {
		return nil, class, fmt.Errorf("VolumeAttributesClass %s of persistent volume %s: %w", class, pv.Name, err)
	}
	return &l, class, nil
}

// settle returns the status entry of a volume whose disk is plugged, first giving the disk the
// limits of the volume's class if it has others: live, or, where the hypervisor cannot, with
// the entry saying that they apply at the next attach. The entry names the class whose
// limits the disk has; it keeps the one it had while the new class is not applied.
func (r *Reconciler) settle(ctx context.Context, vm *vmv1.VirtualMachine, ref hypervisor.VM, name string, disk hypervisor.Disk, want *hypervisor.Limits, class string, limitsErr error) (*vmv1.VirtualMachineVolumeStatus, bool) {
	var prev vmv1.VirtualMachineVolumeStatus
	if i := slices.IndexFunc(vm.Status.Volumes, func(e vmv1.VirtualMachineVolumeStatus) bool { return e.Name == name }); i >= 0 {
		prev = vm.Status.Volumes[i]
	}
	entry := vmv1.VirtualMachineVolumeStatus{Name: name, Attached: true, DiskSerial: disk.Serial, VolumeAttributesClassName: prev.VolumeAttributesClassName}
	if limitsErr != nil {
		entry.Error = limitsErr.Error()
		return &entry, false
	}
	if ptr.Deref(disk.Limits, hypervisor.Limits{}) == ptr.Deref(want, hypervisor.Limits{}) {
		entry.VolumeAttributesClassName = class
		return &entry, true
	}
	l := ptr.Deref(want, hypervisor.Limits{})
	err := r.Hypervisor.SetLimits(ctx, ref, disk.Serial, l)
	switch {
	case errors.Is(err, hypervisor.ErrNotLive):
		entry.Error = fmt.Sprintf("%s (%s): %v", vmv1.LimitsAtNextAttach(class), l, err)
		if prev.Error != entry.Error {
			r.event(vm, corev1.EventTypeWarning, "IOLimitsNotApplied", "Volume %s: %s", name, entry.Error)
		}
		return &entry, true
	case err != nil:
		entry.Error = fmt.Sprintf("set the I/O limits of VolumeAttributesClass %s: %v", class, err)
		r.event(vm, corev1.EventTypeWarning, "IOLimitsNotApplied", "Volume %s: %s", name, entry.Error)
		return &entry, false
	}
	ctrl.LoggerFrom(ctx).Info("Changed the disk's I/O limits", "volume", name, "volumeAttributesClass", class, "iops", l.IOPS, "bytesPerSecond", l.BytesPerSecond)
	r.event(vm, corev1.EventTypeNormal, "IOLimitsChanged", "Volume %s now has the I/O limits of VolumeAttributesClass %s (%s), applied live", name, class, l)
	entry.VolumeAttributesClassName = class
	return &entry, true
}

// publish stages and publishes the volume as a raw block device file <dir>/device, to be
// plugged into the VM as disk serial.
func (r *Reconciler) publish(ctx context.Context, dir, volumeID, serial string, publishContext map[string]string) (string, error) {
	staging, device := filepath.Join(dir, "staging"), filepath.Join(dir, "device")
	if err := os.MkdirAll(staging, 0o750); err != nil {
		return "", err
	}
	// Detach needs the volume ID after the PV may be gone, and the serial when the agent died
	// between the hot-plug and the status write that records it: keep both beside the paths.
	for name, value := range map[string]string{volumeIDFile: volumeID, diskSerialFile: serial} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(value), 0o600); err != nil {
			return "", err
		}
	}
	// One VM at a time: mgmt-csi publishes a SINGLE_NODE_SINGLE_WRITER volume once, under its
	// per-volume lock, so two VMs of the host can never both write to it.
	block := &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER},
	}
	if _, err := r.CSI.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{
		VolumeId: volumeID, StagingTargetPath: staging, VolumeCapability: block, PublishContext: publishContext,
	}); err != nil {
		return "", fmt.Errorf("stage volume %s: %w", volumeID, err)
	}
	if _, err := r.CSI.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{
		VolumeId: volumeID, StagingTargetPath: staging, TargetPath: device, VolumeCapability: block, PublishContext: publishContext,
	}); err != nil {
		return "", fmt.Errorf("publish volume %s: %w", volumeID, err)
	}
	return device, nil
}

// Files of a volume's state directory.
const (
	volumeIDFile   = "volume-id"
	diskSerialFile = "disk-serial"
)

// detach unplugs a volume from the VM and releases it on the host. It returns an error, to be
// shown in the status entry, while the guest still holds the disk: the volume is never reported
// detached before the hypervisor let go of it.
func (r *Reconciler) detach(ctx context.Context, vm *vmv1.VirtualMachine, ref hypervisor.VM, e vmv1.VirtualMachineVolumeStatus) error {
	dir := filepath.Join(r.StateDir, vmv1.AttachmentName(vm.Namespace, vm.Name, e.Name))
	serial := e.DiskSerial
	if serial == "" {
		// An entry without a serial may still have a disk: the agent plugged it and died
		// before writing the status. Unplug it, or it outlives its volume in the VM.
		b, err := os.ReadFile(filepath.Join(dir, diskSerialFile))
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			return err
		}
		serial = strings.TrimSpace(string(b))
	}
	if serial != "" {
		err := r.Hypervisor.Detach(ctx, ref, serial)
		if errors.Is(err, hypervisor.ErrBusy) {
			return fmt.Errorf("waiting for the guest to release disk %s: %w", serial, err)
		}
		if err != nil {
			return fmt.Errorf("hot-unplug of disk %s: %w", serial, err)
		}
	}
	id, err := os.ReadFile(filepath.Join(dir, volumeIDFile))
	if errors.Is(err, os.ErrNotExist) {
		return nil // never published on this host
	}
	if err != nil {
		return err
	}
	volumeID := strings.TrimSpace(string(id))
	if _, err := r.CSI.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: volumeID, TargetPath: filepath.Join(dir, "device")}); err != nil {
		return fmt.Errorf("unpublish volume %s: %w", volumeID, err)
	}
	if _, err := r.CSI.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: volumeID, StagingTargetPath: filepath.Join(dir, "staging")}); err != nil {
		return fmt.Errorf("unstage volume %s: %w", volumeID, err)
	}
	ctrl.LoggerFrom(ctx).Info("Detached volume", "volume", e.Name, "diskSerial", serial)
	r.event(vm, corev1.EventTypeNormal, "Detached", "Volume %s detached", e.Name)
	return os.RemoveAll(dir)
}

// writeStatus writes the agent's decisions in status.volumes and the Ready condition when ready
// is set (vmstatus): the entries it sets, drops and claims, each compared and swapped at the
// index it read it at, without the resourceVersion, so that the controller's and the guest's
// writes of other entries do not fail it. When its read was stale (an entry changed or moved,
// or a claimed entry was added meanwhile) it reads the VM from the API server and applies the
// decisions to that.
func (r *Reconciler) writeStatus(ctx context.Context, vm *vmv1.VirtualMachine, d *decisions, ready *metav1.Condition) error {
	start := time.Now()
	for attempt := 0; ; attempt++ {
		base := vm.DeepCopy()
		vm.Status.Volumes = applyDecisions(vm.Status.Volumes, d)
		if d.slots != nil {
			vm.Status.MaxVolumes = d.slots
		}
		if d.addresses != nil {
			vm.Status.Addresses = *d.addresses
		}
		if ready != nil {
			meta.SetStatusCondition(&vm.Status.Conditions, *ready)
		}
		patch, err := vmstatus.Patch(base, vm)
		if patch == nil || err != nil {
			return err
		}
		err = r.Client.Status().Patch(ctx, vm, patch)
		switch {
		case err == nil:
			r.wrote(client.ObjectKeyFromObject(vm), vm.ResourceVersion)
			ctrl.LoggerFrom(ctx).V(2).Info("Wrote status", "patch", patch.Type(), "attempts", attempt+1, "took", time.Since(start))
			return nil
		case apierrors.IsNotFound(err):
			return nil
		case !vmstatus.Stale(err) || attempt == statusAttempts:
			return err
		}
		if err := r.readLive(ctx, vm); err != nil {
			return client.IgnoreNotFound(err)
		}
	}
}

// current replaces vm, as the cache has it, with the VM as the API server has it while the cache
// has not yet seen the agent's last status write of it. Deciding from such a VM would undo that
// write: a reconcile that saw a volume still in spec and its entry still there (both gone since)
// re-published and re-plugged the volume without recording it, and the controller then deleted
// its VolumeAttachment under it (CI, the kill -9 churn).
func (r *Reconciler) current(ctx context.Context, vm *vmv1.VirtualMachine) error {
	key := client.ObjectKeyFromObject(vm)
	r.writtenMu.Lock()
	rv, ok := r.written[key]
	r.writtenMu.Unlock()
	if !ok {
		return nil
	}
	if cmp, err := resourceversion.CompareResourceVersion(vm.ResourceVersion, rv); err == nil && cmp >= 0 {
		r.wrote(key, "") // the cache has caught up
		return nil
	}
	return r.readLive(ctx, vm)
}

// readLive replaces vm with the VM as the API server has it.
func (r *Reconciler) readLive(ctx context.Context, vm *vmv1.VirtualMachine) error {
	live := &vmv1.VirtualMachine{}
	if err := r.apiReader().Get(ctx, client.ObjectKeyFromObject(vm), live); err != nil {
		return err
	}
	*vm = *live
	return nil
}

// wrote records rv as the resourceVersion of the agent's last status write of the VM at key
// (see current); "" forgets it. The reconciles of one VM never run at once.
func (r *Reconciler) wrote(key types.NamespacedName, rv string) {
	r.writtenMu.Lock()
	defer r.writtenMu.Unlock()
	if rv == "" {
		delete(r.written, key)
		return
	}
	if r.written == nil {
		r.written = map[types.NamespacedName]string{}
	}
	r.written[key] = rv
}

// apiReader reads around the cache.
func (r *Reconciler) apiReader() client.Reader {
	if r.APIReader != nil {
		return r.APIReader
	}
	return r.Client
}

// statusAttempts bounds the rereads of a status write: each one means another writer moved the
// entries between a read and a write.
const statusAttempts = 10

// applyDecisions returns status with the entries of d.set replacing or added to those of the
// same name, an entry {name} for each name of d.claim that has none or one of the controller's
// (see claim), and the entries named in d.drop removed; entries keep their order, new ones
// follow by name.
func applyDecisions(status []vmv1.VirtualMachineVolumeStatus, d *decisions) []vmv1.VirtualMachineVolumeStatus {
	out := make([]vmv1.VirtualMachineVolumeStatus, 0, len(status)+len(d.set)+len(d.claim))
	have := make(map[string]bool, len(status))
	for _, e := range status {
		have[e.Name] = true
		if slices.Contains(d.drop, e.Name) {
			continue
		}
		if s, ok := d.set[e.Name]; ok {
			e = s
		} else if slices.Contains(d.claim, e.Name) && vmstatus.ControllerEntry(e) {
			e = vmv1.VirtualMachineVolumeStatus{Name: e.Name}
		}
		out = append(out, e)
	}
	var added []vmv1.VirtualMachineVolumeStatus
	for name, e := range d.set {
		if !have[name] {
			added = append(added, e)
		}
	}
	for _, name := range d.claim {
		if !have[name] && d.set[name] == (vmv1.VirtualMachineVolumeStatus{}) {
			added = append(added, vmv1.VirtualMachineVolumeStatus{Name: name})
		}
	}
	slices.SortFunc(added, func(a, b vmv1.VirtualMachineVolumeStatus) int { return strings.Compare(a.Name, b.Name) })
	return append(out, added...)
}

func (r *Reconciler) event(vm *vmv1.VirtualMachine, eventType, reason, format string, args ...any) {
	if r.Recorder != nil {
		r.Recorder.Eventf(vm, nil, eventType, reason, reason, format, args...)
	}
}

func failed(name string, err error) *vmv1.VirtualMachineVolumeStatus {
	return &vmv1.VirtualMachineVolumeStatus{Name: name, Error: err.Error()}
}

func errOr(err error, msg string) error {
	if err != nil {
		return err
	}
	return errors.New(msg)
}
