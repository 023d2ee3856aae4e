package controller

import (
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/pkg/names"
)

// makeInputs files objs (claims, volumes, attachments of vm-1) into volumeInputs.
func makeInputs(host string, vols []vmv1.VirtualMachineVolume, status []vmv1.VirtualMachineVolumeStatus, objs ...client.Object) volumeInputs {
	in := volumeInputs{
		Namespace: testNamespace, Host: host, Volumes: vols, Status: status,
		Claims:      map[string]*corev1.PersistentVolumeClaim{},
		PVs:         map[string]*corev1.PersistentVolume{},
		Attachments: map[string]*storagev1.VolumeAttachment{},
	}
	for _, o := range objs {
		switch o := o.(type) {
		case *corev1.PersistentVolumeClaim:
			in.Claims[o.Name] = o
		case *corev1.PersistentVolume:
			in.PVs[o.Name] = o
		case *storagev1.VolumeAttachment:
			in.Attachments[o.Annotations[vmv1.VolumeAnnotation]] = o
		}
	}
	return in
}

// elsewhere records that VirtualMachine vm of the namespace has a VolumeAttachment of pv.
func elsewhere(in volumeInputs, pv, vm string) volumeInputs {
	in.Elsewhere = map[string]string{pv: vm}
	return in
}

// unconfirmed records volumes whose claim or attachment no live read confirmed.
func unconfirmed(in volumeInputs, volumes ...string) volumeInputs {
	in.Unconfirmed = map[string]bool{}
	for _, v := range volumes {
		in.Unconfirmed[v] = true
	}
	return in
}

func TestVMPhase(t *testing.T) {
	tests := []struct {
		name   string
		status vmv1.VirtualMachineStatus
		want   vmv1.Phase
	}{
		{name: "not placed: Pending", want: vmv1.PhasePending},
		{
			name:   "not placed, whatever Ready says: Pending",
			status: vmv1.VirtualMachineStatus{Conditions: []metav1.Condition{ready(metav1.ConditionTrue, vmv1.PoweredOnReason)}},
			want:   vmv1.PhasePending,
		},
		{name: "placed, the host agent has not reported: Pending", status: vmv1.VirtualMachineStatus{Host: "host-a"}, want: vmv1.PhasePending},
		{
			name:   "powered on: Running",
			status: vmv1.VirtualMachineStatus{Host: "host-a", Conditions: []metav1.Condition{ready(metav1.ConditionTrue, vmv1.PoweredOnReason)}},
			want:   vmv1.PhaseRunning,
		},
		{
			name:   "powered off as asked: Stopped",
			status: vmv1.VirtualMachineStatus{Host: "host-a", Conditions: []metav1.Condition{ready(metav1.ConditionTrue, vmv1.PoweredOffReason)}},
			want:   vmv1.PhaseStopped,
		},
		{
			name:   "powered off while it should run: still Stopped",
			status: vmv1.VirtualMachineStatus{Host: "host-a", Conditions: []metav1.Condition{ready(metav1.ConditionFalse, vmv1.PoweredOffReason)}},
			want:   vmv1.PhaseStopped,
		},
		{
			name:   "the hypervisor fails: Failed",
			status: vmv1.VirtualMachineStatus{Host: "host-a", Conditions: []metav1.Condition{ready(metav1.ConditionFalse, vmv1.HypervisorErrorReason)}},
			want:   vmv1.PhaseFailed,
		},
		{
			name:   "an unknown reason: Pending",
			status: vmv1.VirtualMachineStatus{Host: "host-a", Conditions: []metav1.Condition{ready(metav1.ConditionFalse, "Booting")}},
			want:   vmv1.PhasePending,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			NewWithT(t).Expect(vmPhase(tt.status)).To(Equal(tt.want))
		})
	}
}

func TestVolumeErrors(t *testing.T) {
	one := []vmv1.VirtualMachineVolume{volume("a", "claim-a")}
	tests := []struct {
		name string
		in   volumeInputs
		// want maps each volume with an error to a part of its message.
		want map[string]string
	}{
		{
			name: "a bound PMEM block volume on the VirtualMachine's host has nothing wrong",
			in:   makeInputs("host-a", one, nil, newPVC("claim-a", "pv-a"), newPV("pv-a", "host-a")),
			want: map[string]string{},
		},
		{
			name: "a missing claim is named with its namespace",
			in:   makeInputs("host-a", one, nil),
			want: map[string]string{"a": "PersistentVolumeClaim claim-a not found in namespace tenant-a"},
		},
		{
			name: "a claim the cache misses and the cluster's read budget could not confirm waits without an error",
			in:   unconfirmed(makeInputs("host-a", one, nil), "a"),
			want: map[string]string{},
		},
		{
			name: "a claim being deleted is not attached",
			in: makeInputs("host-a", one, nil, newPVC("claim-a", "pv-a", func(c *corev1.PersistentVolumeClaim) {
				c.DeletionTimestamp = &metav1.Time{Time: time.Now()}
			}), newPV("pv-a", "host-a")),
			want: map[string]string{"a": "PersistentVolumeClaim claim-a is being deleted"},
		},
		{
			name: "a pending claim says its phase",
			in:   makeInputs("host-a", one, nil, newPVC("claim-a", "")),
			want: map[string]string{"a": "PersistentVolumeClaim claim-a is not bound (phase Pending)"},
		},
		{
			name: "a lost claim says its phase",
			in: makeInputs("host-a", one, nil, newPVC("claim-a", "pv-a", func(c *corev1.PersistentVolumeClaim) {
				c.Status.Phase = corev1.ClaimLost
			})),
			want: map[string]string{"a": "is not bound (phase Lost)"},
		},
		{
			name: "a claim bound to a missing volume",
			in:   makeInputs("host-a", one, nil, newPVC("claim-a", "pv-a")),
			want: map[string]string{"a": "PersistentVolume pv-a of PersistentVolumeClaim claim-a not found"},
		},
		{
			name: "a volume that is not CSI is not a PMEM volume",
			in: makeInputs("host-a", one, nil, newPVC("claim-a", "pv-a"), newPV("pv-a", "host-a", func(pv *corev1.PersistentVolume) {
				pv.Spec.PersistentVolumeSource = corev1.PersistentVolumeSource{HostPath: &corev1.HostPathVolumeSource{Path: "/x"}}
			})),
			want: map[string]string{"a": "PersistentVolume pv-a is not a pmem.csi.pvbridge.io volume"},
		},
		{
			name: "a volume of another CSI driver is named with its driver",
			in: makeInputs("host-a", one, nil, newPVC("claim-a", "pv-a"), newPV("pv-a", "host-a", func(pv *corev1.PersistentVolume) {
				pv.Spec.CSI.Driver = "ebs.csi.aws.com"
			})),
			want: map[string]string{"a": "is a ebs.csi.aws.com volume, not a pmem.csi.pvbridge.io volume"},
		},
		{
			name: "a filesystem volume is refused",
			in: makeInputs("host-a", one, nil, newPVC("claim-a", "pv-a"), newPV("pv-a", "host-a", func(pv *corev1.PersistentVolume) {
				pv.Spec.VolumeMode = ptr.To(corev1.PersistentVolumeFilesystem)
			})),
			want: map[string]string{"a": "needs volumeMode Block"},
		},
		{
			name: "a volume on another host names both hosts",
			in:   makeInputs("host-a", one, nil, newPVC("claim-a", "pv-a"), newPV("pv-a", "host-b")),
			want: map[string]string{"a": "PersistentVolume pv-a is on host host-b, but the VirtualMachine runs on host host-a"},
		},
		{
			name: "a volume whose affinity allows the host among others is accepted",
			in: makeInputs("host-a", one, nil, newPVC("claim-a", "pv-a"), newPV("pv-a", "host-b", func(pv *corev1.PersistentVolume) {
				terms := &pv.Spec.NodeAffinity.Required.NodeSelectorTerms
				*terms = append(*terms, corev1.NodeSelectorTerm{MatchExpressions: []corev1.NodeSelectorRequirement{
					{Key: names.PmemTopologyKey, Operator: corev1.NodeSelectorOpIn, Values: []string{"host-a"}},
				}})
			})),
			want: map[string]string{},
		},
		{
			name: "a volume without node affinity is accepted",
			in: makeInputs("host-a", one, nil, newPVC("claim-a", "pv-a"), newPV("pv-a", "host-b", func(pv *corev1.PersistentVolume) {
				pv.Spec.NodeAffinity = nil
			})),
			want: map[string]string{},
		},
		{
			name: "the host is not checked before placement",
			in:   makeInputs("", one, nil, newPVC("claim-a", "pv-a"), newPV("pv-a", "host-b")),
			want: map[string]string{},
		},
		{
			name: "an attach error of the attachment is reported",
			in: makeInputs("host-a", one, nil, newPVC("claim-a", "pv-a"), newPV("pv-a", "host-a"),
				newVA("vm-1", "a", "pv-a", "host-a", attachError("rpc error: code = FailedPrecondition desc = volume is on node host-b"))),
			want: map[string]string{"a": "attach failed: rpc error: code = FailedPrecondition desc = volume is on node host-b"},
		},
		{
			name: "an attached attachment has no error",
			in: makeInputs("host-a", one, nil, newPVC("claim-a", "pv-a"), newPV("pv-a", "host-a"),
				newVA("vm-1", "a", "pv-a", "host-a", attached, attachError("old"))),
			want: map[string]string{},
		},
		{
			name: "an attachment of another volume than the claim's asks for a remove and add",
			in: makeInputs("host-a", one, nil, newPVC("claim-a", "pv-new"), newPV("pv-new", "host-a"),
				newVA("vm-1", "a", "pv-old", "host-a", attached)),
			want: map[string]string{"a": "remove the volume, wait until it has left status.volumes, then add it again"},
		},
		{
			name: "a volume attached to another VirtualMachine waits until it has left it",
			in:   elsewhere(makeInputs("host-a", one, nil, newPVC("claim-a", "pv-a"), newPV("pv-a", "host-a")), "pv-a", "vm-2"),
			want: map[string]string{"a": "PersistentVolume pv-a of PersistentVolumeClaim claim-a is attached to VirtualMachine vm-2; a volume is attached to one VirtualMachine at a time"},
		},
		{
			name: "an attachment this VirtualMachine has already is kept (the host refuses a second writer)",
			in: elsewhere(makeInputs("host-a", one, nil, newPVC("claim-a", "pv-a"), newPV("pv-a", "host-a"),
				newVA("vm-1", "a", "pv-a", "host-a", attached)), "pv-a", "vm-2"),
			want: map[string]string{},
		},
		{
			name: "a claim named by two volumes is attached once",
			in: makeInputs("host-a", []vmv1.VirtualMachineVolume{volume("a", "claim-a"), volume("b", "claim-a")}, nil,
				newPVC("claim-a", "pv-a"), newPV("pv-a", "host-a")),
			want: map[string]string{"b": "PersistentVolumeClaim claim-a is already used by volume a of this VirtualMachine"},
		},
		{
			name: "each volume is judged on its own",
			in: makeInputs("host-a", []vmv1.VirtualMachineVolume{volume("a", "claim-a"), volume("b", "claim-b"), volume("c", "claim-c")}, nil,
				newPVC("claim-a", "pv-a"), newPV("pv-a", "host-a"), newPVC("claim-c", "")),
			want: map[string]string{"b": "claim-b not found", "c": "claim-c is not bound"},
		},
		{
			name: "a volume being deleted has nothing to report",
			in:   makeInputs("host-a", nil, []vmv1.VirtualMachineVolumeStatus{{Name: "a"}}),
			want: map[string]string{},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			got := volumeErrors(tt.in)
			g.Expect(got).To(HaveLen(len(tt.want)), "errors: %v", got)
			for name, part := range tt.want {
				g.Expect(got).To(HaveKeyWithValue(name, ContainSubstring(part)))
			}
		})
	}
}

func TestVolumeErrorsCutAnAttachErrorToTheAPILimit(t *testing.T) {
	g := NewWithT(t)
	in := makeInputs("host-a", []vmv1.VirtualMachineVolume{volume("a", "claim-a")}, nil,
		newPVC("claim-a", "pv-a"), newPV("pv-a", "host-a"),
		newVA("vm-1", "a", "pv-a", "host-a", attachError(strings.Repeat("é", 2000))))
	got := volumeErrors(in)["a"]
	g.Expect(len(got)).To(BeNumerically("<=", maxErrorLength))
	g.Expect(got).To(HavePrefix("attach failed: é"))
	g.Expect(got).To(HaveSuffix("..."))
	g.Expect(utf8.ValidString(got)).To(BeTrue())
}

func TestVolumeStatus(t *testing.T) {
	a := []vmv1.VirtualMachineVolume{volume("a", "claim-a")}
	tests := []struct {
		name string
		in   volumeInputs
		errs map[string]string
		want []vmv1.VirtualMachineVolumeStatus
	}{
		{
			name: "an error is reported in a new entry",
			in:   makeInputs("host-a", a, nil),
			errs: map[string]string{"a": "PVC missing"},
			want: []vmv1.VirtualMachineVolumeStatus{{Name: "a", Error: "PVC missing"}},
		},
		{
			name: "the entry of an unconfirmed volume stays as it was until it is read again",
			in:   unconfirmed(makeInputs("host-a", a, []vmv1.VirtualMachineVolumeStatus{{Name: "a", Error: "PVC missing"}}), "a"),
			want: []vmv1.VirtualMachineVolumeStatus{{Name: "a", Error: "PVC missing"}},
		},
		{
			name: "an unconfirmed volume gets no new entry, even with an error",
			in:   unconfirmed(makeInputs("host-a", a, nil), "a"),
			errs: map[string]string{"a": "PVC missing"},
			want: nil,
		},
		{
			name: "a volume without error gets no entry from the controller",
			in:   makeInputs("host-a", a, nil),
			want: nil,
		},
		{
			name: "the controller's previous error is replaced",
			in:   makeInputs("host-a", a, []vmv1.VirtualMachineVolumeStatus{{Name: "a", Error: "PVC missing"}}),
			errs: map[string]string{"a": "PVC not bound"},
			want: []vmv1.VirtualMachineVolumeStatus{{Name: "a", Error: "PVC not bound"}},
		},
		{
			name: "an entry that only carried a cleared error is removed",
			in: makeInputs("host-a", a, []vmv1.VirtualMachineVolumeStatus{{Name: "a", Error: "attach failed: x"}},
				newVA("vm-1", "a", "pv-a", "host-a")),
			want: nil,
		},
		{
			name: "an entry with a disk serial is the host agent's, error and all",
			in:   makeInputs("host-a", a, []vmv1.VirtualMachineVolumeStatus{{Name: "a", DiskSerial: "pvb0123456789abcdef0", Error: "hot-plug failed"}}),
			want: []vmv1.VirtualMachineVolumeStatus{{Name: "a", DiskSerial: "pvb0123456789abcdef0", Error: "hot-plug failed"}},
		},
		{
			name: "the host agent's claim stays, even while the attachment looks unattached",
			in:   makeInputs("host-a", a, []vmv1.VirtualMachineVolumeStatus{{Name: "a"}}, newVA("vm-1", "a", "pv-a", "host-a")),
			want: []vmv1.VirtualMachineVolumeStatus{{Name: "a"}},
		},
		{
			name: "the host agent's claim of a removed volume stays until the agent removes it",
			in:   makeInputs("host-a", nil, []vmv1.VirtualMachineVolumeStatus{{Name: "a"}}),
			want: []vmv1.VirtualMachineVolumeStatus{{Name: "a"}},
		},
		{
			name: "an attach error appears while the attachment is not attached",
			in: makeInputs("host-a", a, nil,
				newVA("vm-1", "a", "pv-a", "host-a", attachError("x"))),
			errs: map[string]string{"a": "attach failed: x"},
			want: []vmv1.VirtualMachineVolumeStatus{{Name: "a", Error: "attach failed: x"}},
		},
		{
			name: "once the attachment is attached the entry is the host agent's: no new entry",
			in:   makeInputs("host-a", a, nil, newVA("vm-1", "a", "pv-a", "host-a", attached)),
			errs: map[string]string{"a": "PVC is being deleted"},
			want: nil,
		},
		{
			name: "a hot-plug error of the host agent is never overwritten",
			in: makeInputs("host-a", a, []vmv1.VirtualMachineVolumeStatus{{Name: "a", Error: "hot-plug failed: busy"}},
				newVA("vm-1", "a", "pv-a", "host-a", attached)),
			want: []vmv1.VirtualMachineVolumeStatus{{Name: "a", Error: "hot-plug failed: busy"}},
		},
		{
			name: "an attached entry is the host agent's even when its attachment is gone",
			in:   makeInputs("host-a", a, []vmv1.VirtualMachineVolumeStatus{{Name: "a", Attached: true, DiskSerial: "pvb0123456789abcdef0"}}),
			errs: map[string]string{"a": "PVC missing"},
			want: []vmv1.VirtualMachineVolumeStatus{{Name: "a", Attached: true, DiskSerial: "pvb0123456789abcdef0"}},
		},
		{
			name: "the entry of a removed volume that was never attached is removed",
			in:   makeInputs("host-a", nil, []vmv1.VirtualMachineVolumeStatus{{Name: "a", Error: "PVC missing"}}),
			want: nil,
		},
		{
			name: "the entry of a removed volume with an attachment waits for the host agent",
			in: makeInputs("host-a", nil, []vmv1.VirtualMachineVolumeStatus{{Name: "a", Error: "attach failed: x"}},
				newVA("vm-1", "a", "pv-a", "host-a", attachError("x"))),
			want: []vmv1.VirtualMachineVolumeStatus{{Name: "a", Error: "attach failed: x"}},
		},
		{
			name: "a detaching entry of the host agent is left alone",
			in: makeInputs("host-a", nil, []vmv1.VirtualMachineVolumeStatus{{Name: "a", Attached: true, DiskSerial: "pvb0123456789abcdef0", Error: "unplug: busy"}},
				newVA("vm-1", "a", "pv-a", "host-a", attached)),
			want: []vmv1.VirtualMachineVolumeStatus{{Name: "a", Attached: true, DiskSerial: "pvb0123456789abcdef0", Error: "unplug: busy"}},
		},
		{
			name: "entries keep their order, new ones follow",
			in: makeInputs("host-a", []vmv1.VirtualMachineVolume{volume("c", "claim-c"), volume("b", "claim-b"), volume("a", "claim-a")},
				[]vmv1.VirtualMachineVolumeStatus{{Name: "b", Attached: true, DiskSerial: "pvb0123456789abcdef0"}}),
			errs: map[string]string{"a": "err a", "c": "err c"},
			want: []vmv1.VirtualMachineVolumeStatus{
				{Name: "b", Attached: true, DiskSerial: "pvb0123456789abcdef0"},
				{Name: "c", Error: "err c"},
				{Name: "a", Error: "err a"},
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			g.Expect(volumeStatus(tt.in, tt.errs)).To(Equal(tt.want))
		})
	}
}

func TestVolumesAttachedCondition(t *testing.T) {
	ab := []vmv1.VirtualMachineVolume{volume("a", "claim-a"), volume("b", "claim-b")}
	ok := func(name string) vmv1.VirtualMachineVolumeStatus {
		return vmv1.VirtualMachineVolumeStatus{Name: name, Attached: true, DiskSerial: "pvb0123456789abcdef0"}
	}
	tests := []struct {
		name        string
		volumes     []vmv1.VirtualMachineVolume
		status      []vmv1.VirtualMachineVolumeStatus
		wantStatus  metav1.ConditionStatus
		wantReason  string
		wantMessage string
	}{
		{
			name:       "no volumes: all attached",
			wantStatus: metav1.ConditionTrue, wantReason: vmv1.AttachedReason, wantMessage: "every volume is attached",
		},
		{
			name: "every volume attached", volumes: ab, status: []vmv1.VirtualMachineVolumeStatus{ok("a"), ok("b")},
			wantStatus: metav1.ConditionTrue, wantReason: vmv1.AttachedReason, wantMessage: "every volume is attached",
		},
		{
			name: "a volume without entry is pending", volumes: ab, status: []vmv1.VirtualMachineVolumeStatus{ok("a")},
			wantStatus: metav1.ConditionFalse, wantReason: vmv1.AttachPendingReason, wantMessage: "attaching volumes; status.volumes shows each",
		},
		{
			name: "an error wins over pending", volumes: ab, status: []vmv1.VirtualMachineVolumeStatus{{Name: "b", Error: "PVC missing"}},
			wantStatus: metav1.ConditionFalse, wantReason: vmv1.AttachFailedReason, wantMessage: "volume b: PVC missing",
		},
		{
			name: "a volume still in status but not in spec is detaching", volumes: ab[:1],
			status:     []vmv1.VirtualMachineVolumeStatus{ok("a"), ok("b")},
			wantStatus: metav1.ConditionFalse, wantReason: vmv1.AttachPendingReason, wantMessage: "detaching volumes; status.volumes shows each",
		},
		{
			name: "attaching one volume while detaching another", volumes: ab[:1],
			status:     []vmv1.VirtualMachineVolumeStatus{{Name: "a"}, ok("b")},
			wantStatus: metav1.ConditionFalse, wantReason: vmv1.AttachPendingReason, wantMessage: "attaching and detaching volumes; status.volumes shows each",
		},
		{
			name: "a detach error is a failure", volumes: ab[:1],
			status:     []vmv1.VirtualMachineVolumeStatus{ok("a"), {Name: "b", Attached: true, Error: "unplug: busy"}},
			wantStatus: metav1.ConditionFalse, wantReason: vmv1.AttachFailedReason, wantMessage: "volume b (detaching): unplug: busy",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			c := volumesAttachedCondition(tt.volumes, tt.status)
			g.Expect(c.Type).To(Equal(vmv1.VolumesAttachedCondition))
			g.Expect(c.Status).To(Equal(tt.wantStatus))
			g.Expect(c.Reason).To(Equal(tt.wantReason))
			g.Expect(c.Message).To(Equal(tt.wantMessage))
			g.Expect(c.ObservedGeneration).To(BeZero(), "no rewrite for each edit of spec.volumes")
		})
	}
}
