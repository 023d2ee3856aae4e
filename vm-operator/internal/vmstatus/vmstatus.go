// Package vmstatus writes a VirtualMachine's status for its several writers: the controller's
// placement and attachment reconcilers and the host agent of its host.
//
// What a writer changed in status.volumes and status.conditions is written entry by entry with
// a JSON patch (listpatch): each entry tested at the index it was read at, without the
// resourceVersion, so that the writers, and the guest's writes of spec.volumes, do not fail each
// other's writes in a burst (a 100-volume burst counted 12 conflicts per volume when every
// write carried the resourceVersion). Each entry is compared and swapped whole: a write fails
// when the entry changed since it was read. Anything else (status.host, uniqueID, phase), and a list
// read empty, which may not exist, is written by a merge patch under the resourceVersion read.
// Either way a write made from a stale read fails: Conflict or Invalid (see Stale).
package vmstatus

import (
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/pkg/listpatch"
)

// Patch returns the patch that writes what vm's status changed since base, as read; nil when
// nothing changed. Every status.volumes entry it changes or removes must still be as base read
// it.
func Patch(base, vm *vmv1.VirtualMachine) (client.Patch, error) {
	rest, restBase := vm.Status, base.Status
	rest.Volumes, rest.Conditions, restBase.Volumes, restBase.Conditions = nil, nil, nil, nil
	volumes, ok := listpatch.Diff("/status/volumes", "name", base.Status.Volumes, vm.Status.Volumes,
		func(e vmv1.VirtualMachineVolumeStatus) string { return e.Name }, true).Ops()
	conditions, ok2 := listpatch.Diff("/status/conditions", "type", base.Status.Conditions, vm.Status.Conditions,
		func(c metav1.Condition) string { return c.Type }, false).Ops()
	switch {
	case !ok || !ok2 || !equality.Semantic.DeepEqual(rest, restBase):
		return client.MergeFromWithOptions(base, client.MergeFromWithOptimisticLock{}), nil
	case len(volumes) == 0 && len(conditions) == 0:
		return nil, nil // nothing changed but, maybe, the order of entries
	}
	return listpatch.Patch(append(volumes, conditions...)...)
}

// Stale reports whether err says that a patch of Patch was made from a VirtualMachine that has
// changed since it was read: a Conflict for the merge patch, Invalid for a JSON patch whose test
// failed (or that appended an entry someone else had added meanwhile).
func Stale(err error) bool { return apierrors.IsConflict(err) || apierrors.IsInvalid(err) }

// ControllerEntry reports whether e can be an entry of the controller's: one with an error and
// nothing that only the host agent records (attached, diskSerial). The controller writes no
// other entry, and the host agent's claim replaces such an entry (see the controller's
// vm_status.go).
func ControllerEntry(e vmv1.VirtualMachineVolumeStatus) bool {
	return e.Error != "" && !e.Attached && e.DiskSerial == ""
}
