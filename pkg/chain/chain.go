// Package chain follows a guest volume through both clusters, as an operator would by hand with
// kubectl: guest PVC → guest PV → management PVC → management PV → PmemVolume on its host, and,
// for every guest VolumeAttachment of the volume, its VirtualMachine's spec.volumes and
// status.volumes entries and the management VolumeAttachment vm-operator made. Each step says
// whether it is done and, when it is not, which object holds it and the latest warning Event
// about that object.
package chain

import (
	"context"
	"fmt"
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	pmemv1 "pvbridge.io/pkg/apis/pmem/v1alpha1"
	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/pkg/events"
	"pvbridge.io/pkg/names"
)

// State is where a step stands.
type State string

const (
	// Done means the step is complete.
	Done State = "done"
	// Waiting means the step is not complete yet; Why says what it waits for.
	Waiting State = "waiting"
	// Failed means the step was refused or failed; Why says why.
	Failed State = "failed"
)

// Step is one object of the chain.
type Step struct {
	// Object names the object: its kind, cluster and name, e.g. "management PVC tenant-a/x".
	Object string `json:"object"`
	State  State  `json:"state"`
	// Detail is what the object says when the step is done, e.g. "Bound to pvc-1".
	Detail string `json:"detail,omitempty"`
	// Why is what holds a step that is not done, with the latest warning Event about the
	// object.
	Why string `json:"why,omitempty"`
}

// Tracer reads both clusters.
type Tracer struct {
	// Guest reads the guest cluster.
	Guest client.Reader
	// Mgmt reads the management cluster: PVCs, VirtualMachines and Events in the guest's
	// namespace, PVs, PmemVolumes and VolumeAttachments (an admin's credential).
	Mgmt client.Reader
	// MgmtNamespace is the guest cluster's namespace in the management cluster.
	MgmtNamespace string
}

// PVC traces the volume of guest claim namespace/name.
func (t *Tracer) PVC(ctx context.Context, namespace, name string) ([]Step, error) {
	pvc := &corev1.PersistentVolumeClaim{}
	object := fmt.Sprintf("guest PVC %s/%s", namespace, name)
	if err := t.Guest.Get(ctx, client.ObjectKey{Namespace: namespace, Name: name}, pvc); err != nil {
		return nil, fmt.Errorf("%s: %w", object, err)
	}
	step := Step{Object: object}
	switch {
	case pvc.Spec.VolumeName == "":
		step.State, step.Why = Waiting, "no volume yet"+t.warning(ctx, t.Guest, pvc)
		return []Step{step}, nil
	case pvc.Status.Phase != corev1.ClaimBound:
		step.State, step.Why = Waiting, fmt.Sprintf("%s, volume %s", pvc.Status.Phase, pvc.Spec.VolumeName)+t.warning(ctx, t.Guest, pvc)
	default:
		step.State, step.Detail = Done, "Bound to "+pvc.Spec.VolumeName
	}
	rest, err := t.PV(ctx, pvc.Spec.VolumeName)
	return append([]Step{step}, rest...), err
}

// PV traces guest PersistentVolume name.
func (t *Tracer) PV(ctx context.Context, name string) ([]Step, error) {
	pv := &corev1.PersistentVolume{}
	object := "guest PV " + name
	if err := t.Guest.Get(ctx, client.ObjectKey{Name: name}, pv); err != nil {
		return []Step{{Object: object, State: Failed, Why: err.Error()}}, nil
	}
	if pv.Spec.CSI == nil || pv.Spec.CSI.Driver != names.GuestDriver {
		return nil, fmt.Errorf("%s is not a volume of %s", object, names.GuestDriver)
	}
	// A guest volume's handle is the name of its management PVC in the guest's namespace.
	handle := pv.Spec.CSI.VolumeHandle
	step := Step{Object: object, State: Done, Detail: fmt.Sprintf("%s, management PVC %s", pv.Status.Phase, handle)}
	if pv.Status.Phase == corev1.VolumeFailed || pv.Status.Phase == corev1.VolumePending {
		step.State, step.Detail, step.Why = Waiting, "", string(pv.Status.Phase)+": "+pv.Status.Message+t.warning(ctx, t.Guest, pv)
	}
	steps := append([]Step{step}, t.management(ctx, handle)...)
	attachments, err := t.attachments(ctx, name, handle)
	return append(steps, attachments...), err
}

// management traces the management PVC handle, its PV and its PmemVolume.
func (t *Tracer) management(ctx context.Context, handle string) []Step {
	pvc := &corev1.PersistentVolumeClaim{}
	step := Step{Object: fmt.Sprintf("management PVC %s/%s", t.MgmtNamespace, handle)}
	if err := t.Mgmt.Get(ctx, client.ObjectKey{Namespace: t.MgmtNamespace, Name: handle}, pvc); err != nil {
		step.State, step.Why = Failed, err.Error()
		return []Step{step}
	}
	if pvc.Status.Phase != corev1.ClaimBound || pvc.Spec.VolumeName == "" {
		step.State, step.Why = Waiting, string(pvc.Status.Phase)+t.warning(ctx, t.Mgmt, pvc)
		return []Step{step}
	}
	step.State, step.Detail = Done, "Bound to "+pvc.Spec.VolumeName
	steps := []Step{step}

	pv := &corev1.PersistentVolume{}
	step = Step{Object: "management PV " + pvc.Spec.VolumeName}
	if err := t.Mgmt.Get(ctx, client.ObjectKey{Name: pvc.Spec.VolumeName}, pv); err != nil {
		step.State, step.Why = Failed, err.Error()
		return append(steps, step)
	}
	if pv.Spec.CSI == nil || pv.Spec.CSI.Driver != names.PmemDriver {
		step.State, step.Detail = Done, "not a PMEM volume"
		return append(steps, step)
	}
	step.State, step.Detail = Done, fmt.Sprintf("%s, PmemVolume %s on host %s", pv.Status.Phase, pv.Spec.CSI.VolumeHandle, hostOf(pv))
	steps = append(steps, step)

	vol := &pmemv1.PmemVolume{}
	step = Step{Object: "PmemVolume " + pv.Spec.CSI.VolumeHandle}
	if err := t.Mgmt.Get(ctx, client.ObjectKey{Name: pv.Spec.CSI.VolumeHandle}, vol); err != nil {
		step.State, step.Why = Failed, err.Error()
		return append(steps, step)
	}
	c := meta.FindStatusCondition(vol.Status.Conditions, pmemv1.ReadyCondition)
	if vol.Spec.Replicas > 1 {
		return append(steps, replicatedStep(step, vol, c))
	}
	switch {
	case c != nil && c.Status == metav1.ConditionTrue:
		step.State, step.Detail = Done, fmt.Sprintf("Ready: %s on host %s", vol.Status.Device, vol.Spec.Node)
	case c == nil:
		step.State, step.Why = Waiting, "the node agent of host "+vol.Spec.Node+" has not reported it yet"
	default:
		step.State, step.Why = Waiting, fmt.Sprintf("host %s: %s: %s", vol.Spec.Node, c.Reason, c.Message)
	}
	return append(steps, step)
}

// replicatedStep fills step of a replicated volume, whose Ready condition is ready: how many
// replicas, the host that serves it, and whether it runs degraded.
func replicatedStep(step Step, vol *pmemv1.PmemVolume, ready *metav1.Condition) Step {
	if ready == nil || ready.Status != metav1.ConditionTrue {
		step.State, step.Why = Waiting, fmt.Sprintf("its %d replicas are not all made yet (kubectl get pmemreplicas -l %s=%s)", vol.Spec.Replicas, pmemv1.VolumeLabel, vol.Name)
		return step
	}
	step.State, step.Detail = Done, fmt.Sprintf("Ready: %d replicas", vol.Spec.Replicas)
	if vol.Status.Target != "" {
		step.Detail += ", served by host " + vol.Status.Target
	}
	if d := meta.FindStatusCondition(vol.Status.Conditions, pmemv1.DegradedCondition); d != nil && d.Status == metav1.ConditionTrue {
		step.Detail += "; degraded: " + d.Message
	}
	return step
}

// hostOf is the host of a PMEM PV's node affinity; a replicated volume's PV has none.
func hostOf(pv *corev1.PersistentVolume) string {
	if pv.Spec.NodeAffinity == nil || pv.Spec.NodeAffinity.Required == nil {
		return "any (replicated)"
	}
	for _, term := range pv.Spec.NodeAffinity.Required.NodeSelectorTerms {
		for _, e := range term.MatchExpressions {
			if e.Key == names.PmemTopologyKey && len(e.Values) > 0 {
				return strings.Join(e.Values, ",")
			}
		}
	}
	return "?"
}

// attachments traces every guest VolumeAttachment of guest PV pv (management PVC handle), then
// the guest node's VirtualMachine and the management VolumeAttachment of the volume.
func (t *Tracer) attachments(ctx context.Context, pv, handle string) ([]Step, error) {
	vas := &storagev1.VolumeAttachmentList{}
	if err := t.Guest.List(ctx, vas); err != nil {
		return nil, fmt.Errorf("guest VolumeAttachments: %w", err)
	}
	var steps []Step
	for _, va := range vas.Items {
		if va.Spec.Source.PersistentVolumeName == nil || *va.Spec.Source.PersistentVolumeName != pv {
			continue
		}
		step := Step{Object: fmt.Sprintf("guest VolumeAttachment %s (node %s)", va.Name, va.Spec.NodeName)}
		switch {
		case va.Status.AttachError != nil:
			step.State, step.Why = Failed, va.Status.AttachError.Message
		case va.DeletionTimestamp != nil && va.Status.DetachError != nil:
			step.State, step.Why = Waiting, "detaching: "+va.Status.DetachError.Message
		case va.DeletionTimestamp != nil:
			step.State, step.Why = Waiting, "detaching"
		case va.Status.Attached:
			step.State, step.Detail = Done, "attached"
		default:
			step.State, step.Why = Waiting, "attaching"
		}
		steps = append(steps, step)
		steps = append(steps, t.vm(ctx, va.Spec.NodeName, handle)...)
	}
	if len(steps) == 0 {
		steps = append(steps, Step{Object: "guest VolumeAttachment", State: Done, Detail: "none: no pod on a node uses the volume"})
	}
	return steps, nil
}

// vm traces volume handle in VirtualMachine name (the guest node's) and its management
// VolumeAttachment.
func (t *Tracer) vm(ctx context.Context, name, handle string) []Step {
	vm := &vmv1.VirtualMachine{}
	step := Step{Object: fmt.Sprintf("VirtualMachine %s/%s", t.MgmtNamespace, name)}
	if err := t.Mgmt.Get(ctx, client.ObjectKey{Namespace: t.MgmtNamespace, Name: name}, vm); err != nil {
		step.State, step.Why = Failed, err.Error()
		return []Step{step}
	}
	inSpec := slices.ContainsFunc(vm.Spec.Volumes, func(v vmv1.VirtualMachineVolume) bool { return v.Name == handle })
	i := slices.IndexFunc(vm.Status.Volumes, func(e vmv1.VirtualMachineVolumeStatus) bool { return e.Name == handle })
	switch {
	case !inSpec && i < 0:
		step.State, step.Why = Waiting, "the volume is not in spec.volumes: guest-csi has not attached it (see the guest VolumeAttachment)"
	case i >= 0 && vm.Status.Volumes[i].Error != "":
		step.State, step.Why = Waiting, "status.volumes: "+vm.Status.Volumes[i].Error+t.warning(ctx, t.Mgmt, vm)
	case !inSpec:
		step.State, step.Why = Waiting, "detaching: still in status.volumes"
	case i < 0 || !vm.Status.Volumes[i].Attached:
		step.State, step.Why = Waiting, fmt.Sprintf("in spec.volumes, not attached yet by the host agent of %s", vm.Status.Host)+t.warning(ctx, t.Mgmt, vm)
	default:
		step.State, step.Detail = Done, fmt.Sprintf("attached on host %s as disk %s", vm.Status.Host, vm.Status.Volumes[i].DiskSerial)
	}
	steps := []Step{step}
	if !inSpec && i < 0 {
		return steps
	}

	va := &storagev1.VolumeAttachment{}
	vaName := vmv1.AttachmentName(vm.Namespace, vm.Name, handle)
	step = Step{Object: "management VolumeAttachment " + vaName}
	switch err := t.Mgmt.Get(ctx, client.ObjectKey{Name: vaName}, va); {
	case apierrors.IsNotFound(err) && inSpec:
		step.State, step.Why = Waiting, "not created yet by vm-operator"+t.warning(ctx, t.Mgmt, vm)
	case apierrors.IsNotFound(err):
		step.State, step.Detail = Done, "deleted"
	case err != nil:
		step.State, step.Why = Failed, err.Error()
	case va.Status.AttachError != nil:
		step.State, step.Why = Failed, va.Status.AttachError.Message
	case va.Status.Attached:
		step.State, step.Detail = Done, "attached to host "+va.Spec.NodeName
	default:
		step.State, step.Why = Waiting, "csi-attacher has not attached it to host "+va.Spec.NodeName+" yet"
	}
	return append(steps, step)
}

// warning returns "; latest warning: <reason>: <message>" of the latest Warning Event about
// obj, "" if there is none.
func (t *Tracer) warning(ctx context.Context, r client.Reader, obj client.Object) string {
	if w := events.LatestWarning(ctx, r, obj); w != "" {
		return "; latest warning" + w
	}
	return ""
}

// Stuck returns the step that holds the chain: the first that failed, else the first that
// waits; nil if every step is done. A guest VolumeAttachment that failed holds its VM's steps,
// which wait for guest-csi.
func Stuck(steps []Step) *Step {
	first := -1
	for i := range steps {
		switch {
		case steps[i].State == Failed:
			return &steps[i]
		case steps[i].State != Done && first < 0:
			first = i
		}
	}
	if first < 0 {
		return nil
	}
	return &steps[first]
}
