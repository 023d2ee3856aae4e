package controller

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/tools/events"
	"k8s.io/klog/v2"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/pkg/budget"
	"pvbridge.io/pkg/hostloss"
	"pvbridge.io/pkg/listpatch"
	"pvbridge.io/pkg/names"
	"pvbridge.io/pkg/tenancy"
)

// volumeFailedEvent is the Event reason of a volume that cannot be attached; the note says why.
// The steps that go as planned (a VolumeAttachment created or deleted) are logged, not recorded:
// the VolumeAttachments show them, and the host agent records the two a user waits for
// (Attached, Detached: the disk in and out of the VM). Two more Events per volume were a third
// of the management cluster's Events in a burst (issue 53).
const volumeFailedEvent = "VolumeFailed"

// hostLostEvent tells that a deleted VirtualMachine's volumes were released without its host
// agent, whose host is lost (vmv1.HostLost).
const hostLostEvent = "HostLost"

// attachmentReconciles bounds the VirtualMachines whose attachments are worked on at once.
const attachmentReconciles = 4

// AttachmentReconciler turns every volume of a VirtualMachine into a management
// VolumeAttachment, and removes the VolumeAttachments of volumes that are gone.
//
// A volume gets its VolumeAttachment (attacher pmem.csi.pvbridge.io, nodeName = status.host,
// source = the PersistentVolume, named by vmv1.AttachmentName, labelled by vmv1.AttachmentLabels) once the
// VirtualMachine has a host and its claim is Bound to a Block PersistentVolume of that driver
// that may live on that host. The attachment is got or created, never deleted and recreated. It
// is deleted only when its volume is neither in spec.volumes nor in status.volumes, that is
// after the host agent has unplugged and unstaged it, and that decision is taken on a fresh read
// of the VirtualMachine, never on the cache alone. The finalizer vm.pvbridge.io/volumes keeps a
// deleted VirtualMachine until status.volumes is empty and its VolumeAttachments are gone; on a
// lost host (hostloss.Lost), whose agent will never unplug anything, the controller empties
// status.volumes itself: the disks went with the host.
type AttachmentReconciler struct {
	Client client.Client
	// APIReader reads from the API server, bypassing the cache: the VirtualMachine before a
	// VolumeAttachment is deleted, a claim or volume before its absence is reported.
	APIReader client.Reader
	// liveReads bounds, per guest cluster, the reads that bypass the cache (claims,
	// attachments): newReadBudget; nil for none.
	liveReads *budget.Keyed
	Recorder  events.EventRecorder
}

// +kubebuilder:rbac:groups=vm.pvbridge.io,resources=virtualmachines,verbs=get;list;watch;update;patch
// +kubebuilder:rbac:groups=vm.pvbridge.io,resources=virtualmachines/status,verbs=get;update;patch
// +kubebuilder:rbac:groups=storage.k8s.io,resources=volumeattachments,verbs=get;list;watch;create;delete
// +kubebuilder:rbac:groups="",resources=persistentvolumeclaims;persistentvolumes,verbs=get;list;watch
// +kubebuilder:rbac:groups="",resources=nodes,verbs=get;list;watch
// +kubebuilder:rbac:groups=events.k8s.io,resources=events,verbs=create;patch

// SetupWithManager registers the reconciler. Besides VirtualMachines it watches the labelled
// VolumeAttachments (attach results, deletions), the claims and volumes that VirtualMachines
// name (binding, deletion), and the hosts that are lost.
func (r *AttachmentReconciler) SetupWithManager(mgr ctrl.Manager) error {
	return ctrl.NewControllerManagedBy(mgr).
		For(&vmv1.VirtualMachine{}).
		Named("vm-attachments").
		Watches(&storagev1.VolumeAttachment{}, handler.EnqueueRequestsFromMapFunc(r.vmOfAttachment)).
		Watches(&corev1.PersistentVolumeClaim{}, handler.EnqueueRequestsFromMapFunc(r.vmsOfClaim)).
		Watches(&corev1.PersistentVolume{}, handler.EnqueueRequestsFromMapFunc(r.vmsOfPV)).
		Watches(&corev1.Node{}, handler.EnqueueRequestsFromMapFunc(r.deletedVMsOnHost), builder.WithPredicates(hostloss.Changed())).
		WithOptions(controller.Options{MaxConcurrentReconciles: attachmentReconciles}).
		Complete(r)
}

// Reconcile makes the VolumeAttachments of one VirtualMachine match its volumes.
func (r *AttachmentReconciler) Reconcile(ctx context.Context, req ctrl.Request) (res ctrl.Result, reterr error) {
	vm := &vmv1.VirtualMachine{}
	if err := r.Client.Get(ctx, req.NamespacedName, vm); err != nil {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	deleting := !vm.DeletionTimestamp.IsZero()
	if !controllerutil.ContainsFinalizer(vm, vmv1.VolumesFinalizer) {
		if deleting {
			return ctrl.Result{}, nil
		}
		// In its own write, before any VolumeAttachment exists that it must protect.
		return r.addFinalizer(ctx, vm)
	}

	base := vm.DeepCopy()
	defer func() {
		if finishStatus(ctx, r.Client, base, vm, &res, &reterr) {
			r.recordVolumeErrors(base, vm)
		}
	}()
	if deleting {
		return r.reconcileDelete(ctx, vm)
	}
	return r.reconcileNormal(ctx, vm)
}

func (r *AttachmentReconciler) addFinalizer(ctx context.Context, vm *vmv1.VirtualMachine) (ctrl.Result, error) {
	patch := client.MergeFromWithOptions(vm.DeepCopy(), client.MergeFromWithOptimisticLock{})
	controllerutil.AddFinalizer(vm, vmv1.VolumesFinalizer)
	err := r.Client.Patch(ctx, vm, patch, client.FieldOwner(fieldManager))
	switch {
	case err == nil, apierrors.IsNotFound(err):
		return ctrl.Result{}, nil
	case apierrors.IsConflict(err):
		return ctrl.Result{RequeueAfter: conflictRetry}, nil
	}
	return ctrl.Result{}, fmt.Errorf("add finalizer to VirtualMachine %s: %w", klog.KObj(vm), err)
}

func (r *AttachmentReconciler) reconcileNormal(ctx context.Context, vm *vmv1.VirtualMachine) (ctrl.Result, error) {
	in, unneeded, err := r.inputs(ctx, vm, false)
	if err != nil {
		return ctrl.Result{}, err
	}
	errs := volumeErrors(in)
	var failed []error
	for _, v := range vm.Spec.Volumes {
		if in.Host == "" || errs[v.Name] != "" || in.Attachments[v.Name] != nil || in.Unconfirmed[v.Name] {
			continue
		}
		pv := in.Claims[v.PersistentVolumeClaim.ClaimName].Spec.VolumeName
		if err := r.createAttachment(ctx, vm, v.Name, pv); err != nil {
			failed = append(failed, err)
		}
	}
	if err := r.deleteAttachments(ctx, vm, unneeded); err != nil {
		failed = append(failed, err)
	}
	if err := r.confirmAttachments(ctx, vm, &in, volumeStatus(in, errs)); err != nil {
		return ctrl.Result{}, errors.Join(append(failed, err)...)
	}
	errs = volumeErrors(in)
	vm.Status.Volumes = volumeStatus(in, errs)
	meta.SetStatusCondition(&vm.Status.Conditions, volumesAttachedCondition(vm.Spec.Volumes, vm.Status.Volumes))
	return in.retry(), errors.Join(failed...)
}

// reconcileDelete detaches everything: the host agent unplugs and unstages every volume of a
// deleted VirtualMachine and removes its entries; the attachments go as their entries do; the
// finalizer goes last.
func (r *AttachmentReconciler) reconcileDelete(ctx context.Context, vm *vmv1.VirtualMachine) (ctrl.Result, error) {
	if len(vm.Status.Volumes) > 0 && vm.Status.Host != "" {
		lost, err := hostloss.Lost(ctx, r.Client, r.APIReader, vm.Status.Host)
		if err != nil {
			return ctrl.Result{}, err
		}
		if lost {
			// Written first, on its own: the attachments go on the next pass, which reads the
			// VirtualMachine afresh before deleting any.
			ctrl.LoggerFrom(ctx).Info("Host lost: releasing the volumes its agent will never unplug", "host", vm.Status.Host, "volumes", len(vm.Status.Volumes))
			r.Recorder.Eventf(vm, nil, corev1.EventTypeWarning, hostLostEvent, "Release",
				"host %s is lost (its Node gone or tainted %s): its %d volume(s) released without its host agent", vm.Status.Host, corev1.TaintNodeOutOfService, len(vm.Status.Volumes))
			vm.Status.Volumes = nil
			meta.SetStatusCondition(&vm.Status.Conditions, volumesAttachedCondition(nil, nil))
			return ctrl.Result{}, nil
		}
	}
	in, unneeded, err := r.inputs(ctx, vm, true)
	if err != nil {
		return ctrl.Result{}, err
	}
	if err := r.deleteAttachments(ctx, vm, unneeded); err != nil {
		return ctrl.Result{}, err
	}
	if len(in.Status) > 0 || len(in.Attachments) > 0 || len(unneeded) > 0 {
		// Waiting for the host agent, the attacher, or the status written below: each one's
		// progress triggers the next reconcile.
		if err := r.confirmAttachments(ctx, vm, &in, volumeStatus(in, nil)); err != nil {
			return ctrl.Result{}, err
		}
		vm.Status.Volumes = volumeStatus(in, nil)
		meta.SetStatusCondition(&vm.Status.Conditions, volumesAttachedCondition(nil, vm.Status.Volumes))
		return in.retry(), nil
	}
	// Nothing left: the object goes with the finalizer, its status needs no last write.
	patch := client.MergeFromWithOptions(vm.DeepCopy(), client.MergeFromWithOptimisticLock{})
	controllerutil.RemoveFinalizer(vm, vmv1.VolumesFinalizer)
	if err := r.Client.Patch(ctx, vm, patch, client.FieldOwner(fieldManager)); err != nil {
		if apierrors.IsNotFound(err) {
			return ctrl.Result{}, nil
		}
		if apierrors.IsConflict(err) {
			return ctrl.Result{RequeueAfter: conflictRetry}, nil
		}
		return ctrl.Result{}, fmt.Errorf("remove finalizer of VirtualMachine %s: %w", klog.KObj(vm), err)
	}
	ctrl.LoggerFrom(ctx).Info("Every volume detached, VirtualMachine released")
	return ctrl.Result{}, nil
}

// deletedVMsOnHost maps a lost host to the deleted VirtualMachines that still list volumes on it.
func (r *AttachmentReconciler) deletedVMsOnHost(ctx context.Context, node client.Object) []reconcile.Request {
	var reqs []reconcile.Request
	for _, vm := range hostloss.VMsOn(ctx, r.Client, node.GetName()) {
		if !vm.DeletionTimestamp.IsZero() && len(vm.Status.Volumes) > 0 {
			reqs = append(reqs, reconcile.Request{NamespacedName: client.ObjectKeyFromObject(vm)})
		}
	}
	return reqs
}

// inputs reads what the volumes of vm depend on, and returns the VirtualMachine's
// VolumeAttachments that no volume in spec (none while deleting) or status names.
func (r *AttachmentReconciler) inputs(ctx context.Context, vm *vmv1.VirtualMachine, deleting bool) (volumeInputs, []*storagev1.VolumeAttachment, error) {
	in := volumeInputs{
		Namespace:   vm.Namespace,
		Host:        vm.Status.Host,
		Status:      vm.Status.Volumes,
		Claims:      map[string]*corev1.PersistentVolumeClaim{},
		PVs:         map[string]*corev1.PersistentVolume{},
		Attachments: map[string]*storagev1.VolumeAttachment{},
		Elsewhere:   map[string]string{},
		Unconfirmed: map[string]bool{},
	}
	if !deleting {
		in.Volumes = vm.Spec.Volumes
	}

	// The attachments of every VirtualMachine of the namespace: this one's, and those that
	// hold a volume elsewhere.
	all := &storagev1.VolumeAttachmentList{}
	if err := r.Client.List(ctx, all, client.MatchingLabels{vmv1.VMNamespaceLabel: vmv1.LabelValue(vm.Namespace)}); err != nil {
		return in, nil, fmt.Errorf("list VolumeAttachments: %w", err)
	}
	vas := &storagev1.VolumeAttachmentList{}
	byName := make(map[string]*storagev1.VolumeAttachment, len(all.Items))
	for _, va := range all.Items {
		if other := va.Labels[vmv1.VMNameLabel]; other != vmv1.LabelValue(vm.Name) {
			if pv := va.Spec.Source.PersistentVolumeName; pv != nil {
				in.Elsewhere[*pv] = other
			}
			continue
		}
		vas.Items = append(vas.Items, va)
	}
	for i := range vas.Items {
		byName[vas.Items[i].Name] = &vas.Items[i]
	}
	named := map[string]bool{}
	for _, name := range volumeNames(in.Volumes, in.Status) {
		va := vmv1.AttachmentName(vm.Namespace, vm.Name, name)
		named[va] = true
		if byName[va] != nil {
			in.Attachments[name] = byName[va]
		}
	}
	var unneeded []*storagev1.VolumeAttachment
	for i := range vas.Items {
		if !named[vas.Items[i].Name] {
			unneeded = append(unneeded, &vas.Items[i])
		}
	}

	for _, v := range in.Volumes {
		key := client.ObjectKey{Namespace: vm.Namespace, Name: v.PersistentVolumeClaim.ClaimName}
		pvc, err := r.claim(ctx, key, budgetKey(vm))
		if errors.Is(err, errUnconfirmed) {
			in.Unconfirmed[v.Name] = true
			continue
		}
		if err != nil {
			return in, nil, err
		}
		if pvc == nil {
			continue
		}
		in.Claims[pvc.Name] = pvc
		if pvc.Spec.VolumeName == "" || in.PVs[pvc.Spec.VolumeName] != nil {
			continue
		}
		pv, err := r.persistentVolume(ctx, pvc.Spec.VolumeName)
		if err != nil {
			return in, nil, err
		}
		if pv != nil {
			in.PVs[pv.Name] = pv
		}
	}
	return in, unneeded, nil
}

// retry asks for another pass when some volume is Unconfirmed.
func (in volumeInputs) retry() ctrl.Result {
	if len(in.Unconfirmed) > 0 {
		return ctrl.Result{RequeueAfter: unconfirmedRetry}
	}
	return ctrl.Result{}
}

// budgetKey names the guest cluster of vm, whose budget its live reads come from.
func budgetKey(vm *vmv1.VirtualMachine) string {
	return vm.Namespace + "/" + vm.Labels[tenancy.CAPIClusterNameLabel]
}

// errUnconfirmed: the cache does not show the claim bound, and the guest cluster's budget of
// reads from the API server is spent for now.
var errUnconfirmed = errors.New("claim not confirmed: no live read left in the cluster's budget")

// claim returns the claim at key, nil when it does not exist. A claim that the cache shows
// missing or unbound is read again from the API server, from the budget of the guest cluster
// named by cluster (budgetKey): a claim bound a moment ago must not reach the guest as an
// error. Without budget it returns errUnconfirmed, and the volume waits, without an error, for
// the claim's watch event or the retry.
func (r *AttachmentReconciler) claim(ctx context.Context, key client.ObjectKey, cluster string) (*corev1.PersistentVolumeClaim, error) {
	pvc := &corev1.PersistentVolumeClaim{}
	err := r.Client.Get(ctx, key, pvc)
	if err == nil && pvc.Status.Phase == corev1.ClaimBound && pvc.Spec.VolumeName != "" {
		return pvc, nil
	}
	if err == nil || apierrors.IsNotFound(err) {
		if !r.liveReads.Allow(cluster) {
			return nil, errUnconfirmed
		}
		pvc = &corev1.PersistentVolumeClaim{}
		err = r.APIReader.Get(ctx, key, pvc)
	}
	switch {
	case apierrors.IsNotFound(err):
		return nil, nil
	case err != nil:
		return nil, fmt.Errorf("get PersistentVolumeClaim %s: %w", key, err)
	}
	return pvc, nil
}

// persistentVolume returns the named PersistentVolume, nil when it does not exist; like claim,
// it confirms a miss of the cache with the API server.
func (r *AttachmentReconciler) persistentVolume(ctx context.Context, name string) (*corev1.PersistentVolume, error) {
	pv := &corev1.PersistentVolume{}
	err := r.Client.Get(ctx, client.ObjectKey{Name: name}, pv)
	if apierrors.IsNotFound(err) {
		err = r.APIReader.Get(ctx, client.ObjectKey{Name: name}, pv)
	}
	switch {
	case apierrors.IsNotFound(err):
		return nil, nil
	case err != nil:
		return nil, fmt.Errorf("get PersistentVolume %s: %w", name, err)
	}
	return pv, nil
}

// confirmAttachments reads afresh from the API server the VolumeAttachments of the entries
// that want adds, changes or removes from in.Status, and puts them in in.Attachments: the
// controller writes an entry only while its VolumeAttachment is not attached, and the cache may
// not have seen the attach yet. It costs a read only when the controller is about to write an
// entry, which is rare: an error appears or goes. The reads come from the guest cluster's
// budget; an entry whose read is refused is Unconfirmed and stays as it is for now.
func (r *AttachmentReconciler) confirmAttachments(ctx context.Context, vm *vmv1.VirtualMachine, in *volumeInputs, want []vmv1.VirtualMachineVolumeStatus) error {
	edit := listpatch.Diff("", "name", in.Status, want, func(e vmv1.VirtualMachineVolumeStatus) string { return e.Name }, false)
	changed := slices.Concat(slices.Collect(maps.Keys(edit.Set)), edit.Remove)
	for _, name := range changed {
		if !r.liveReads.Allow(budgetKey(vm)) {
			in.Unconfirmed[name] = true
			continue
		}
		va := &storagev1.VolumeAttachment{}
		err := r.APIReader.Get(ctx, client.ObjectKey{Name: vmv1.AttachmentName(vm.Namespace, vm.Name, name)}, va)
		switch {
		case apierrors.IsNotFound(err):
			delete(in.Attachments, name)
		case err != nil:
			return fmt.Errorf("read the VolumeAttachment of volume %s: %w", name, err)
		default:
			in.Attachments[name] = va
		}
	}
	return nil
}

// volumeNames lists the names of spec and status volumes.
func volumeNames(volumes []vmv1.VirtualMachineVolume, status []vmv1.VirtualMachineVolumeStatus) []string {
	names := make([]string, 0, len(volumes)+len(status))
	for _, v := range volumes {
		names = append(names, v.Name)
	}
	for _, e := range status {
		names = append(names, e.Name)
	}
	return names
}

// createAttachment gets or creates the VolumeAttachment of volume; one that exists already
// (the cache had not seen it yet) is success.
func (r *AttachmentReconciler) createAttachment(ctx context.Context, vm *vmv1.VirtualMachine, volume, pv string) error {
	va := &storagev1.VolumeAttachment{
		ObjectMeta: metav1.ObjectMeta{
			Name:        vmv1.AttachmentName(vm.Namespace, vm.Name, volume),
			Labels:      vmv1.AttachmentLabels(vm),
			Annotations: map[string]string{vmv1.VolumeAnnotation: volume},
		},
		Spec: storagev1.VolumeAttachmentSpec{
			Attacher: names.PmemDriver,
			NodeName: vm.Status.Host,
			Source:   storagev1.VolumeAttachmentSource{PersistentVolumeName: &pv},
		},
	}
	if err := r.Client.Create(ctx, va, client.FieldOwner(fieldManager)); err != nil {
		if apierrors.IsAlreadyExists(err) {
			return nil
		}
		return fmt.Errorf("create VolumeAttachment %s for volume %s: %w", va.Name, volume, err)
	}
	ctrl.LoggerFrom(ctx).Info("Created VolumeAttachment", "volumeAttachment", va.Name, "volume", volume,
		"persistentVolume", pv, "host", vm.Status.Host)
	return nil
}

// deleteAttachments deletes those of vas that the VirtualMachine, read afresh from the API
// server, names neither in spec.volumes (unless it is being deleted) nor in status.volumes. A
// cache that has not yet seen the host agent take up a volume must not detach it under the
// agent.
func (r *AttachmentReconciler) deleteAttachments(ctx context.Context, vm *vmv1.VirtualMachine, vas []*storagev1.VolumeAttachment) error {
	var pending []*storagev1.VolumeAttachment
	for _, va := range vas {
		if va.DeletionTimestamp.IsZero() {
			pending = append(pending, va)
		}
	}
	if len(pending) == 0 {
		return nil
	}
	live := &vmv1.VirtualMachine{}
	if err := r.APIReader.Get(ctx, client.ObjectKeyFromObject(vm), live); err != nil {
		return client.IgnoreNotFound(fmt.Errorf("read VirtualMachine %s: %w", klog.KObj(vm), err))
	}
	keep := map[string]bool{}
	volumes := live.Spec.Volumes
	if !live.DeletionTimestamp.IsZero() {
		volumes = nil
	}
	for _, name := range volumeNames(volumes, live.Status.Volumes) {
		keep[vmv1.AttachmentName(vm.Namespace, vm.Name, name)] = true
	}
	log := ctrl.LoggerFrom(ctx)
	var failed []error
	for _, va := range pending {
		if keep[va.Name] {
			continue
		}
		err := r.Client.Delete(ctx, va, client.Preconditions{UID: &va.UID})
		switch {
		case apierrors.IsNotFound(err), apierrors.IsConflict(err):
			// Gone already, or replaced by another object of that name: the next event tells.
			continue
		case err != nil:
			failed = append(failed, fmt.Errorf("delete VolumeAttachment %s: %w", va.Name, err))
			continue
		}
		log.Info("Deleted VolumeAttachment", "volumeAttachment", va.Name, "volume", va.Annotations[vmv1.VolumeAnnotation])
	}
	return errors.Join(failed...)
}

// recordVolumeErrors tells each error the controller has just written in an Event.
func (r *AttachmentReconciler) recordVolumeErrors(base, vm *vmv1.VirtualMachine) {
	before := make(map[string]string, len(base.Status.Volumes))
	for _, e := range base.Status.Volumes {
		before[e.Name] = e.Error
	}
	for _, e := range vm.Status.Volumes {
		if e.Error != "" && e.Error != before[e.Name] {
			r.Recorder.Eventf(vm, nil, corev1.EventTypeWarning, volumeFailedEvent, "Attach", "volume %s: %s", e.Name, e.Error)
		}
	}
}

// vmOfAttachment maps a VolumeAttachment to the VirtualMachine its labels name, and to the
// VirtualMachines that name its volume's claim (which wait for it to go).
func (r *AttachmentReconciler) vmOfAttachment(ctx context.Context, obj client.Object) []reconcile.Request {
	namespace, name := obj.GetLabels()[vmv1.VMNamespaceLabel], obj.GetLabels()[vmv1.VMNameLabel]
	if namespace == "" || name == "" {
		return nil
	}
	var waiting []reconcile.Request
	if va, ok := obj.(*storagev1.VolumeAttachment); ok && va.Spec.Source.PersistentVolumeName != nil {
		pv := &corev1.PersistentVolume{}
		if err := r.Client.Get(ctx, client.ObjectKey{Name: *va.Spec.Source.PersistentVolumeName}, pv); err == nil {
			waiting = r.vmsOfPV(ctx, pv)
		}
	}
	if len(name) < validation.LabelValueMaxLength {
		return append(waiting, reconcile.Request{NamespacedName: client.ObjectKey{Namespace: namespace, Name: name}})
	}
	// Maybe a shortened name: find the VirtualMachine whose label it is.
	vms := &vmv1.VirtualMachineList{}
	if err := r.Client.List(ctx, vms, client.InNamespace(namespace)); err != nil {
		ctrl.LoggerFrom(ctx).Error(err, "Cannot list VirtualMachines", "namespace", namespace)
		return nil
	}
	reqs := waiting
	for i := range vms.Items {
		if vmv1.LabelValue(vms.Items[i].Name) == name {
			reqs = append(reqs, reconcile.Request{NamespacedName: client.ObjectKeyFromObject(&vms.Items[i])})
		}
	}
	return reqs
}

// vmsOfClaim maps a PersistentVolumeClaim to the VirtualMachines of its namespace that name it.
func (r *AttachmentReconciler) vmsOfClaim(ctx context.Context, obj client.Object) []reconcile.Request {
	return r.vmsNaming(ctx, obj.GetNamespace(), obj.GetName())
}

// vmsOfPV maps a PersistentVolume to the VirtualMachines that name its claim.
func (r *AttachmentReconciler) vmsOfPV(ctx context.Context, obj client.Object) []reconcile.Request {
	pv, ok := obj.(*corev1.PersistentVolume)
	if !ok || pv.Spec.ClaimRef == nil {
		return nil
	}
	return r.vmsNaming(ctx, pv.Spec.ClaimRef.Namespace, pv.Spec.ClaimRef.Name)
}

func (r *AttachmentReconciler) vmsNaming(ctx context.Context, namespace, claim string) []reconcile.Request {
	vms := &vmv1.VirtualMachineList{}
	if err := r.Client.List(ctx, vms, client.InNamespace(namespace)); err != nil {
		ctrl.LoggerFrom(ctx).Error(err, "Cannot list VirtualMachines", "namespace", namespace)
		return nil
	}
	var reqs []reconcile.Request
	for i := range vms.Items {
		for _, v := range vms.Items[i].Spec.Volumes {
			if v.PersistentVolumeClaim.ClaimName == claim {
				reqs = append(reqs, reconcile.Request{NamespacedName: client.ObjectKeyFromObject(&vms.Items[i])})
				break
			}
		}
	}
	return reqs
}
