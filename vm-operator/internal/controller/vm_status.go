package controller

import (
	"fmt"
	"slices"
	"strings"
	"unicode/utf8"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/pkg/names"
	"pvbridge.io/vm-operator/internal/vmstatus"
)

// vmPhase derives status.phase, which only the controller writes, from status.host and the
// Ready condition that the host agent keeps: Pending until the VirtualMachine has a host and the
// host agent has reported, then Running (Ready because PoweredOn), Stopped (PoweredOff, whether
// asked for or not) or Failed (HypervisorError).
func vmPhase(status vmv1.VirtualMachineStatus) vmv1.Phase {
	ready := meta.FindStatusCondition(status.Conditions, vmv1.ReadyCondition)
	switch {
	case status.Host == "" || ready == nil:
		return vmv1.PhasePending
	case ready.Reason == vmv1.HypervisorErrorReason || ready.Reason == vmv1.HostLostReason:
		return vmv1.PhaseFailed
	case ready.Reason == vmv1.PoweredOffReason:
		return vmv1.PhaseStopped
	case ready.Reason == vmv1.PoweredOnReason && ready.Status == metav1.ConditionTrue:
		return vmv1.PhaseRunning
	}
	return vmv1.PhasePending
}

// Who writes status.volumes.
//
// The host agent owns status.volumes: it takes up a volume once its VolumeAttachment is
// attached, reports attached/diskSerial or its own failure (staging, hot-plug), unplugs and
// unstages a volume that left spec.volumes, and then removes its entry. The controller must
// still tell the guest why a volume never gets that far (the PVC is missing or unbound, the PV
// is not a PMEM volume or lives on another host, the attach failed), and the guest only reads
// status.volumes. So the controller writes only entries of its own, and only while the host
// agent cannot have touched the volume:
//
//   - the entry carries an error and says attached=false, with no diskSerial (the host agent's
//     claim, {name} alone, is never the controller's: CI caught the controller dropping one
//     while the host agent staged the volume, which then stayed published on the host), and
//   - the volume's VolumeAttachment does not exist or is not attached (the host agent acts only
//     on attached ones), as read afresh from the API server before the controller changes an
//     entry (confirmAttachments): its cache may not have seen the attach yet.
//
// In that stage the controller makes the entry say exactly its own verdict: it adds {name,
// error} for a volume without an entry that it finds an error for, rewrites the error of its
// entry, and removes its entry once there is no error. Its entry whose volume has left
// spec.volumes (or whose VirtualMachine is being deleted) and that has no VolumeAttachment at
// all is removed too: there is nothing on the host to undo. Every other entry is the host
// agent's and is left exactly as it is. The host agent's claim replaces an entry of the
// controller, so that a volume being staged always has an entry the controller leaves alone.
//
// Neither write carries the resourceVersion (vmstatus): each tests the entries it changes at
// the indices it read them at, and compares and swaps each whole, so the writers, and the
// guest's writes of spec.volumes, do not fail each other's writes, but a write made from an
// entry that changed since fails, and its writer recomputes from the new object. Neither loses
// an update. The one known window: an attach error the controller wrote stays until the host
// agent writes the entry, because once the VolumeAttachment is attached the controller can no
// longer tell its own stale error from a hot-plug error of the host agent.

// maxErrorLength is the API's limit on status.volumes[].error.
const maxErrorLength = 1024

// volumeInputs is what the controller knows about the volumes of one VirtualMachine.
type volumeInputs struct {
	// Namespace is the VirtualMachine's namespace (claims are looked up there).
	Namespace string
	// Host is status.host; empty while the VirtualMachine is not placed.
	Host string
	// Volumes are spec.volumes; nil while the VirtualMachine is being deleted.
	Volumes []vmv1.VirtualMachineVolume
	// Status is status.volumes as read.
	Status []vmv1.VirtualMachineVolumeStatus
	// Claims are the PersistentVolumeClaims named by Volumes that exist, by name.
	Claims map[string]*corev1.PersistentVolumeClaim
	// PVs are the PersistentVolumes those claims are bound to that exist, by name.
	PVs map[string]*corev1.PersistentVolume
	// Attachments are the VirtualMachine's VolumeAttachments that exist, by volume name.
	Attachments map[string]*storagev1.VolumeAttachment
	// Elsewhere maps a PersistentVolume to another VirtualMachine of the namespace that has a
	// VolumeAttachment of it: a volume is attached to one VirtualMachine at a time.
	Elsewhere map[string]string
	// Unconfirmed are the volumes, by name, whose claim (the cache does not show it bound) or
	// VolumeAttachment (before its entry changes) could not be read from the API server for
	// want of the guest cluster's read budget (newReadBudget): they wait, without a new error, and
	// their entries stay as they are.
	Unconfirmed map[string]bool
}

// volumeErrors returns, for each volume of in.Volumes that cannot be attached, why, in words a
// tenant can act on. A volume without an entry has nothing wrong that the controller can see
// (it may still wait for placement or for the attacher).
func volumeErrors(in volumeInputs) map[string]string {
	errs := map[string]string{}
	claimedBy := map[string]string{}
	for _, v := range in.Volumes {
		claim := v.PersistentVolumeClaim.ClaimName
		if first, ok := claimedBy[claim]; ok {
			errs[v.Name] = fmt.Sprintf("PersistentVolumeClaim %s is already used by volume %s of this VirtualMachine", claim, first)
			continue
		}
		claimedBy[claim] = v.Name
		if msg := volumeError(in, v); msg != "" {
			errs[v.Name] = truncate(msg, maxErrorLength)
		}
	}
	return errs
}

// volumeError checks one volume, from the claim to the attachment.
func volumeError(in volumeInputs, v vmv1.VirtualMachineVolume) string {
	claimName := v.PersistentVolumeClaim.ClaimName
	pvc, ok := in.Claims[claimName]
	switch {
	case !ok && in.Unconfirmed[v.Name]:
		return ""
	case !ok:
		return fmt.Sprintf("PersistentVolumeClaim %s not found in namespace %s", claimName, in.Namespace)
	case pvc.DeletionTimestamp != nil:
		return fmt.Sprintf("PersistentVolumeClaim %s is being deleted", claimName)
	case pvc.Status.Phase != corev1.ClaimBound || pvc.Spec.VolumeName == "":
		phase := pvc.Status.Phase
		if phase == "" {
			phase = corev1.ClaimPending
		}
		return fmt.Sprintf("PersistentVolumeClaim %s is not bound (phase %s)", claimName, phase)
	}
	pvName := pvc.Spec.VolumeName
	pv, ok := in.PVs[pvName]
	switch {
	case !ok:
		return fmt.Sprintf("PersistentVolume %s of PersistentVolumeClaim %s not found", pvName, claimName)
	case pv.Spec.CSI == nil:
		return fmt.Sprintf("PersistentVolume %s is not a %s volume", pvName, names.PmemDriver)
	case pv.Spec.CSI.Driver != names.PmemDriver:
		return fmt.Sprintf("PersistentVolume %s is a %s volume, not a %s volume", pvName, pv.Spec.CSI.Driver, names.PmemDriver)
	case pv.Spec.VolumeMode == nil || *pv.Spec.VolumeMode != corev1.PersistentVolumeBlock:
		// The host agent hands the VM the raw device; a filesystem volume would be formatted by
		// the guest under whoever else mounts it.
		return fmt.Sprintf("PersistentVolume %s has volumeMode Filesystem; a VirtualMachine disk needs volumeMode Block", pvName)
	}
	if hosts := pvHosts(pv); in.Host != "" && len(hosts) > 0 && !slices.Contains(hosts, in.Host) {
		return fmt.Sprintf("PersistentVolume %s is on host %s, but the VirtualMachine runs on host %s; a volume cannot follow a VirtualMachine to another host",
			pvName, strings.Join(hosts, ", "), in.Host)
	}
	va := in.Attachments[v.Name]
	switch {
	case va == nil && in.Elsewhere[pvName] != "":
		// Two VirtualMachines on one host could otherwise both write to it (a volume shared
		// with several clusters of the namespace); the host's mgmt-csi refuses a second
		// publication too, this says why first.
		return fmt.Sprintf("PersistentVolume %s of PersistentVolumeClaim %s is attached to VirtualMachine %s; a volume is attached to one VirtualMachine at a time, add it here once it has left that VirtualMachine's status.volumes",
			pvName, claimName, in.Elsewhere[pvName])
	case va == nil:
		return ""
	case va.Spec.Source.PersistentVolumeName == nil || *va.Spec.Source.PersistentVolumeName != pvName ||
		(in.Host != "" && va.Spec.NodeName != in.Host):
		// The claim was recreated and bound to another volume under the same volume name (or
		// the attachment outlived an earlier VirtualMachine of this name). A VolumeAttachment
		// cannot change, and it is never deleted while its volume is in spec.
		return fmt.Sprintf("VolumeAttachment %s attaches another PersistentVolume than %s or to another host than %s; remove the volume, wait until it has left status.volumes, then add it again",
			va.Name, pvName, in.Host)
	case va.Status.AttachError != nil && !va.Status.Attached:
		return "attach failed: " + va.Status.AttachError.Message
	}
	return ""
}

// pvHosts returns the hosts a PersistentVolume's node affinity allows through names.PmemDriver's
// topology key; nil when it does not restrict it.
func pvHosts(pv *corev1.PersistentVolume) []string {
	if pv.Spec.NodeAffinity == nil || pv.Spec.NodeAffinity.Required == nil {
		return nil
	}
	var hosts []string
	for _, term := range pv.Spec.NodeAffinity.Required.NodeSelectorTerms {
		for _, expr := range term.MatchExpressions {
			if expr.Key == names.PmemTopologyKey && expr.Operator == corev1.NodeSelectorOpIn {
				hosts = append(hosts, expr.Values...)
			}
		}
	}
	slices.Sort(hosts)
	return slices.Compact(hosts)
}

// volumeStatus returns status.volumes after the controller has written what it owns under the
// rule at the top of this file; errs comes from volumeErrors.
func volumeStatus(in volumeInputs, errs map[string]string) []vmv1.VirtualMachineVolumeStatus {
	inSpec := make(map[string]bool, len(in.Volumes))
	for _, v := range in.Volumes {
		inSpec[v.Name] = true
	}
	var out []vmv1.VirtualMachineVolumeStatus
	seen := make(map[string]bool, len(in.Status))
	for _, e := range in.Status {
		seen[e.Name] = true
		switch {
		case !vmstatus.ControllerEntry(e) || attachmentAttached(in, e.Name) || in.Unconfirmed[e.Name]:
			// The host agent's, confirmed attached, or kept as it is until read again.
			out = append(out, e)
		case !inSpec[e.Name]:
			if in.Attachments[e.Name] != nil {
				// The host agent unstages it (if it ever staged it) and removes the entry.
				out = append(out, e)
			}
		case errs[e.Name] != "":
			e.Error = errs[e.Name]
			out = append(out, e)
		}
	}
	for _, v := range in.Volumes {
		if msg := errs[v.Name]; !seen[v.Name] && msg != "" && !attachmentAttached(in, v.Name) && !in.Unconfirmed[v.Name] {
			out = append(out, vmv1.VirtualMachineVolumeStatus{Name: v.Name, Error: msg})
		}
	}
	return out
}

// attachmentAttached reports whether volume name's VolumeAttachment is attached, as in read.
func attachmentAttached(in volumeInputs, name string) bool {
	va := in.Attachments[name]
	return va != nil && va.Status.Attached
}

// volumesAttachedCondition summarizes status.volumes against spec.volumes: True when every
// volume in spec is attached and none is detaching, False with AttachFailed when any entry
// reports an error (the message names each), False with AttachPending otherwise.
//
// The condition changes only when that summary does: the message of a pending one does not
// count or list the volumes, and it carries no observedGeneration, because in a burst every
// attach and every edit of spec.volumes would otherwise rewrite it (about six status writes per
// volume, measured); status.volumes says where each volume stands.
func volumesAttachedCondition(volumes []vmv1.VirtualMachineVolume, status []vmv1.VirtualMachineVolumeStatus) metav1.Condition {
	entries := make(map[string]vmv1.VirtualMachineVolumeStatus, len(status))
	for _, e := range status {
		entries[e.Name] = e
	}
	inSpec := make(map[string]bool, len(volumes))
	var failed []string
	pending, detaching := false, false
	for _, v := range volumes {
		inSpec[v.Name] = true
		e, ok := entries[v.Name]
		switch {
		case ok && e.Error != "":
			failed = append(failed, fmt.Sprintf("volume %s: %s", v.Name, e.Error))
		case !ok || !e.Attached:
			pending = true
		}
	}
	for _, e := range status {
		switch {
		case inSpec[e.Name]:
		case e.Error != "":
			failed = append(failed, fmt.Sprintf("volume %s (detaching): %s", e.Name, e.Error))
		default:
			detaching = true
		}
	}

	c := metav1.Condition{Type: vmv1.VolumesAttachedCondition, Status: metav1.ConditionFalse, Reason: vmv1.AttachPendingReason}
	switch {
	case len(failed) > 0:
		c.Reason, c.Message = vmv1.AttachFailedReason, strings.Join(failed, "; ")
	case pending && detaching:
		c.Message = "attaching and detaching volumes; status.volumes shows each"
	case pending:
		c.Message = "attaching volumes; status.volumes shows each"
	case detaching:
		c.Message = "detaching volumes; status.volumes shows each"
	default:
		c.Status, c.Reason, c.Message = metav1.ConditionTrue, vmv1.AttachedReason, "every volume is attached"
	}
	// A condition message is limited to 32768 bytes.
	c.Message = truncate(c.Message, 32768)
	return c
}

// truncate shortens s to at most n bytes, marking the cut; it never splits a UTF-8 sequence.
func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	const mark = "..."
	cut := n - len(mark)
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + mark
}
