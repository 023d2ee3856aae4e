package controller

import (
	"context"
	"fmt"
	"strings"
	"testing"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/events"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/pkg/tenancy"
)

func TestAttachmentReconciler(t *testing.T) {
	a := volume("a", "claim-a")
	boundA := []client.Object{newPVC("claim-a", "pv-a"), newPV("pv-a", "host-a")}
	attachedA := vmv1.VirtualMachineVolumeStatus{Name: "a", Attached: true, DiskSerial: "pvb0123456789abcdef0"}
	vaA := func(mutate ...func(*storagev1.VolumeAttachment)) *storagev1.VolumeAttachment {
		return newVA("vm-1", "a", "pv-a", "host-a", mutate...)
	}
	tests := []struct {
		name string
		vm   *vmv1.VirtualMachine
		objs []client.Object
		// live, when set, is what the API server holds while the cache still shows vm and objs.
		live []client.Object
		// wantVAs are the names of the VolumeAttachments afterwards, mapped to their PV.
		wantVAs       map[string]string
		wantStatus    []vmv1.VirtualMachineVolumeStatus
		wantCondition string // reason of VolumesAttached; "" for none
		wantFinalizer bool
		wantGone      bool
		wantEvents    []string
	}{
		{
			name:    "the finalizer comes first, in its own write",
			vm:      newVM("vm-1", onHost("host-a"), withVolumes(a)),
			objs:    boundA,
			wantVAs: map[string]string{}, wantFinalizer: true,
		},
		{
			name:          "a bound volume of a placed VirtualMachine gets its VolumeAttachment",
			vm:            newVM("vm-1", withFinalizer, onHost("host-a"), withVolumes(a)),
			objs:          boundA,
			wantVAs:       map[string]string{vmv1.AttachmentName(testNamespace, "vm-1", "a"): "pv-a"},
			wantCondition: vmv1.AttachPendingReason, wantFinalizer: true,
		},
		{
			name:          "nothing is attached before the VirtualMachine has a host",
			vm:            newVM("vm-1", withFinalizer, withVolumes(a)),
			objs:          boundA,
			wantVAs:       map[string]string{},
			wantCondition: vmv1.AttachPendingReason, wantFinalizer: true,
		},
		{
			name:    "an unbound claim gets no attachment, and its error reaches status",
			vm:      newVM("vm-1", withFinalizer, onHost("host-a"), withVolumes(a)),
			objs:    []client.Object{newPVC("claim-a", "")},
			wantVAs: map[string]string{},
			wantStatus: []vmv1.VirtualMachineVolumeStatus{
				{Name: "a", Error: "PersistentVolumeClaim claim-a is not bound (phase Pending)"},
			},
			wantCondition: vmv1.AttachFailedReason, wantFinalizer: true,
			wantEvents: []string{"Warning VolumeFailed volume a: PersistentVolumeClaim claim-a is not bound (phase Pending)"},
		},
		{
			name:          "a claim bound a moment ago is attached although the cache has not seen the bind",
			vm:            newVM("vm-1", withFinalizer, onHost("host-a"), withVolumes(a)),
			objs:          []client.Object{newPVC("claim-a", "")},
			live:          []client.Object{newPVC("claim-a", "pv-a"), newPV("pv-a", "host-a")},
			wantVAs:       map[string]string{vmv1.AttachmentName(testNamespace, "vm-1", "a"): "pv-a"},
			wantCondition: vmv1.AttachPendingReason, wantFinalizer: true,
		},
		{
			name:          "a claim the cache has not seen yet is no error",
			vm:            newVM("vm-1", withFinalizer, withVolumes(a)),
			live:          []client.Object{newPVC("claim-a", "pv-a"), newPV("pv-a", "host-a")},
			wantVAs:       map[string]string{},
			wantCondition: vmv1.AttachPendingReason, wantFinalizer: true,
		},
		{
			name:    "a volume on another host gets no attachment",
			vm:      newVM("vm-1", withFinalizer, onHost("host-b"), withVolumes(a)),
			objs:    boundA,
			wantVAs: map[string]string{},
			wantStatus: []vmv1.VirtualMachineVolumeStatus{{Name: "a",
				Error: "PersistentVolume pv-a is on host host-a, but the VirtualMachine runs on host host-b; a volume cannot follow a VirtualMachine to another host"}},
			wantCondition: vmv1.AttachFailedReason, wantFinalizer: true,
			wantEvents: []string{"Warning VolumeFailed volume a: PersistentVolume pv-a is on host host-a, but the VirtualMachine runs on host host-b; " +
				"a volume cannot follow a VirtualMachine to another host"},
		},
		{
			name:          "an existing attachment is kept as it is",
			vm:            newVM("vm-1", withFinalizer, onHost("host-a"), withVolumes(a), withStatusVolumes(attachedA)),
			objs:          append([]client.Object{vaA(attached)}, boundA...),
			wantVAs:       map[string]string{vmv1.AttachmentName(testNamespace, "vm-1", "a"): "pv-a"},
			wantStatus:    []vmv1.VirtualMachineVolumeStatus{attachedA},
			wantCondition: vmv1.AttachedReason, wantFinalizer: true,
		},
		{
			name:    "an attach error reaches status",
			vm:      newVM("vm-1", withFinalizer, onHost("host-a"), withVolumes(a)),
			objs:    append([]client.Object{vaA(attachError("rpc error: code = FailedPrecondition desc = not on this node"))}, boundA...),
			wantVAs: map[string]string{vmv1.AttachmentName(testNamespace, "vm-1", "a"): "pv-a"},
			wantStatus: []vmv1.VirtualMachineVolumeStatus{
				{Name: "a", Error: "attach failed: rpc error: code = FailedPrecondition desc = not on this node"},
			},
			wantCondition: vmv1.AttachFailedReason, wantFinalizer: true,
			wantEvents: []string{"Warning VolumeFailed volume a: attach failed: rpc error: code = FailedPrecondition desc = not on this node"},
		},
		{
			name:          "the attachment of a removed volume stays while status lists the volume",
			vm:            newVM("vm-1", withFinalizer, onHost("host-a"), withStatusVolumes(attachedA)),
			objs:          []client.Object{vaA(attached)},
			wantVAs:       map[string]string{vmv1.AttachmentName(testNamespace, "vm-1", "a"): "pv-a"},
			wantStatus:    []vmv1.VirtualMachineVolumeStatus{attachedA},
			wantCondition: vmv1.AttachPendingReason, wantFinalizer: true,
		},
		{
			name:          "the attachment of a removed volume goes once status no longer lists it",
			vm:            newVM("vm-1", withFinalizer, onHost("host-a")),
			objs:          []client.Object{vaA(attached)},
			wantVAs:       map[string]string{},
			wantCondition: vmv1.AttachedReason, wantFinalizer: true,
		},
		{
			name: "an attachment is deleted only on a fresh read of the VirtualMachine",
			vm:   newVM("vm-1", withFinalizer, onHost("host-a")),
			objs: []client.Object{vaA(attached)},
			// The host agent has just taken the volume up; the cache does not show it yet.
			live:          []client.Object{newVM("vm-1", withFinalizer, onHost("host-a"), withStatusVolumes(vmv1.VirtualMachineVolumeStatus{Name: "a"}))},
			wantVAs:       map[string]string{vmv1.AttachmentName(testNamespace, "vm-1", "a"): "pv-a"},
			wantCondition: vmv1.AttachedReason, wantFinalizer: true,
		},
		{
			name: "the attachments of another VirtualMachine are not touched",
			vm:   newVM("vm-1", withFinalizer, onHost("host-a")),
			objs: []client.Object{newVA("vm-2", "a", "pv-a", "host-a", attached)},
			wantVAs: map[string]string{
				vmv1.AttachmentName(testNamespace, "vm-2", "a"): "pv-a",
			},
			wantCondition: vmv1.AttachedReason, wantFinalizer: true,
		},
		{
			name:          "a deleted VirtualMachine is kept while status lists a volume",
			vm:            newVM("vm-1", deleted, onHost("host-a"), withVolumes(a), withStatusVolumes(attachedA)),
			objs:          append([]client.Object{vaA(attached), newNode("host-a")}, boundA...),
			wantVAs:       map[string]string{vmv1.AttachmentName(testNamespace, "vm-1", "a"): "pv-a"},
			wantStatus:    []vmv1.VirtualMachineVolumeStatus{attachedA},
			wantCondition: vmv1.AttachPendingReason, wantFinalizer: true,
		},
		{
			name: "a deleted VirtualMachine on a host tainted out of service loses its volumes from status, without the host agent",
			vm:   newVM("vm-1", deleted, onHost("host-a"), withVolumes(a), withStatusVolumes(attachedA)),
			objs: append([]client.Object{vaA(attached), newNode("host-a", func(n *corev1.Node) {
				n.Spec.Taints = []corev1.Taint{{Key: corev1.TaintNodeOutOfService, Value: "nodeshutdown", Effect: corev1.TaintEffectNoExecute}}
			})}, boundA...),
			// The attachment goes on the next pass, which reads the emptied status afresh.
			wantVAs:       map[string]string{vmv1.AttachmentName(testNamespace, "vm-1", "a"): "pv-a"},
			wantCondition: vmv1.AttachedReason, wantFinalizer: true,
			wantEvents: []string{"Warning HostLost host host-a is lost (its Node gone or tainted node.kubernetes.io/out-of-service): its 1 volume(s) released without its host agent"},
		},
		{
			name:          "a deleted VirtualMachine whose host's Node is gone loses its volumes from status",
			vm:            newVM("vm-1", deleted, onHost("host-a"), withVolumes(a), withStatusVolumes(attachedA)),
			objs:          append([]client.Object{vaA(attached)}, boundA...),
			wantVAs:       map[string]string{vmv1.AttachmentName(testNamespace, "vm-1", "a"): "pv-a"},
			wantCondition: vmv1.AttachedReason, wantFinalizer: true,
			wantEvents: []string{"Warning HostLost host host-a is lost (its Node gone or tainted node.kubernetes.io/out-of-service): its 1 volume(s) released without its host agent"},
		},
		{
			name:          "a VirtualMachine that is not deleted keeps its volumes on a lost host",
			vm:            newVM("vm-1", withFinalizer, onHost("host-a"), withVolumes(a), withStatusVolumes(attachedA)),
			objs:          append([]client.Object{vaA(attached)}, boundA...),
			wantVAs:       map[string]string{vmv1.AttachmentName(testNamespace, "vm-1", "a"): "pv-a"},
			wantStatus:    []vmv1.VirtualMachineVolumeStatus{attachedA},
			wantCondition: vmv1.AttachedReason, wantFinalizer: true,
		},
		{
			name:          "a deleted VirtualMachine whose volumes left status loses its attachments, then its finalizer",
			vm:            newVM("vm-1", deleted, onHost("host-a"), withVolumes(a)),
			objs:          append([]client.Object{vaA(attached)}, boundA...),
			wantVAs:       map[string]string{},
			wantCondition: vmv1.AttachedReason, wantFinalizer: true,
		},
		{
			name:    "a deleted VirtualMachine without volumes and attachments is released",
			vm:      newVM("vm-1", deleted, onHost("host-a"), withVolumes(a)),
			objs:    boundA,
			wantVAs: map[string]string{}, wantGone: true,
		},
		{
			name:          "a deleted VirtualMachine drops the errors the controller wrote, then is released",
			vm:            newVM("vm-1", deleted, withVolumes(a), withStatusVolumes(vmv1.VirtualMachineVolumeStatus{Name: "a", Error: "PVC missing"})),
			wantVAs:       map[string]string{},
			wantCondition: vmv1.AttachedReason, wantFinalizer: true,
		},
		{
			name: "a deleted VirtualMachine waits for an attachment that is being detached",
			vm:   newVM("vm-1", deleted, onHost("host-a")),
			objs: []client.Object{vaA(attached, func(va *storagev1.VolumeAttachment) {
				va.Finalizers = []string{"external-attacher/pmem-csi-pvbridge-io"}
				va.DeletionTimestamp = &metav1.Time{Time: metav1.Now().Time}
			})},
			wantVAs:       map[string]string{vmv1.AttachmentName(testNamespace, "vm-1", "a"): "pv-a"},
			wantCondition: vmv1.AttachedReason, wantFinalizer: true,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			ctx := t.Context()
			c := newFakeClient(g, nil, append(tt.objs, tt.vm)...)
			reader := client.Reader(c)
			if tt.live != nil {
				reader = newFakeClient(g, nil, tt.live...)
			}
			rec := events.NewFakeRecorder(10)
			r := &AttachmentReconciler{Client: c, APIReader: reader, Recorder: rec}

			_, err := r.Reconcile(ctx, ctrl.Request{NamespacedName: client.ObjectKeyFromObject(tt.vm)})
			g.Expect(err).NotTo(HaveOccurred())

			vas := &storagev1.VolumeAttachmentList{}
			g.Expect(c.List(ctx, vas)).To(Succeed())
			gotVAs := map[string]string{}
			for _, va := range vas.Items {
				gotVAs[va.Name] = ptr.Deref(va.Spec.Source.PersistentVolumeName, "")
			}
			g.Expect(gotVAs).To(Equal(tt.wantVAs))
			g.Expect(drain(rec)).To(Equal(tt.wantEvents))

			got := &vmv1.VirtualMachine{}
			err = c.Get(ctx, client.ObjectKeyFromObject(tt.vm), got)
			if tt.wantGone {
				g.Expect(apierrors.IsNotFound(err)).To(BeTrue(), "VirtualMachine still there: %v", err)
				return
			}
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(got.Finalizers).To(Equal(map[bool][]string{true: {vmv1.VolumesFinalizer}}[tt.wantFinalizer]))
			g.Expect(got.Status.Volumes).To(Equal(tt.wantStatus))
			cond := meta.FindStatusCondition(got.Status.Conditions, vmv1.VolumesAttachedCondition)
			if tt.wantCondition == "" {
				g.Expect(cond).To(BeNil())
			} else {
				g.Expect(cond).NotTo(BeNil())
				g.Expect(cond.Reason).To(Equal(tt.wantCondition))
			}
		})
	}
}

func TestAttachmentReconcilerCreatesTheAttachmentTheContractDescribes(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	vm := newVM("vm-1", withFinalizer, onHost("host-a"), withVolumes(volume("a", "claim-a")))
	c := newFakeClient(g, nil, vm, newPVC("claim-a", "pv-a"), newPV("pv-a", "host-a"))
	r := &AttachmentReconciler{Client: c, APIReader: c, Recorder: events.NewFakeRecorder(10)}
	_, err := r.Reconcile(ctx, ctrl.Request{NamespacedName: client.ObjectKeyFromObject(vm)})
	g.Expect(err).NotTo(HaveOccurred())

	va := &storagev1.VolumeAttachment{}
	g.Expect(c.Get(ctx, client.ObjectKey{Name: vmv1.AttachmentName(testNamespace, "vm-1", "a")}, va)).To(Succeed())
	g.Expect(va.Labels).To(Equal(map[string]string{vmv1.VMNamespaceLabel: testNamespace, vmv1.VMNameLabel: "vm-1"}))
	g.Expect(va.Annotations).To(Equal(map[string]string{vmv1.VolumeAnnotation: "a"}))
	g.Expect(va.Spec).To(Equal(storagev1.VolumeAttachmentSpec{
		Attacher: "pmem.csi.pvbridge.io", NodeName: "host-a",
		Source: storagev1.VolumeAttachmentSource{PersistentVolumeName: ptr.To("pv-a")},
	}))
}

func TestAttachmentReconcilerReleasesADeletedVirtualMachineInTwoPasses(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	vm := newVM("vm-1", deleted, withVolumes(volume("a", "claim-a")),
		withStatusVolumes(vmv1.VirtualMachineVolumeStatus{Name: "a", Error: "PVC missing"}))
	c := newFakeClient(g, nil, vm)
	r := &AttachmentReconciler{Client: c, APIReader: c, Recorder: events.NewFakeRecorder(10)}
	for range 2 {
		_, err := r.Reconcile(ctx, ctrl.Request{NamespacedName: client.ObjectKeyFromObject(vm)})
		g.Expect(err).NotTo(HaveOccurred())
	}
	g.Expect(apierrors.IsNotFound(c.Get(ctx, client.ObjectKeyFromObject(vm), &vmv1.VirtualMachine{}))).To(BeTrue())
}

func TestAttachmentReconcilerMapsWatchedObjectsToVirtualMachines(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	long := "machine-" + strings.Repeat("0123456789", 7)
	c := newFakeClient(g, nil,
		newVM("vm-1", withVolumes(volume("a", "claim-a"))),
		newVM("vm-2", withVolumes(volume("x", "claim-a"), volume("y", "claim-b"))),
		newVM("vm-3", withVolumes(volume("b", "claim-b"))),
		newVM(long),
	)
	r := &AttachmentReconciler{Client: c, APIReader: c, Recorder: events.NewFakeRecorder(10)}
	names := func(reqs []ctrl.Request) []string {
		var out []string
		for _, req := range reqs {
			g.Expect(req.Namespace).To(Equal(testNamespace))
			out = append(out, req.Name)
		}
		return out
	}

	g.Expect(names(r.vmsOfClaim(ctx, newPVC("claim-a", "pv-a")))).To(ConsistOf("vm-1", "vm-2"))
	g.Expect(names(r.vmsOfClaim(ctx, newPVC("claim-z", "pv-z")))).To(BeEmpty())
	pv := newPV("pv-b", "host-a")
	g.Expect(names(r.vmsOfPV(ctx, pv))).To(BeEmpty(), "an unbound PV names no claim")
	pv.Spec.ClaimRef = &corev1.ObjectReference{Namespace: testNamespace, Name: "claim-b"}
	g.Expect(names(r.vmsOfPV(ctx, pv))).To(ConsistOf("vm-2", "vm-3"))
	g.Expect(names(r.vmOfAttachment(ctx, newVA("vm-1", "a", "pv-a", "host-a")))).To(ConsistOf("vm-1"))
	longVA := newVA(long, "a", "pv-a", "host-a")
	longVA.Labels = vmv1.AttachmentLabels(newVM(long))
	g.Expect(names(r.vmOfAttachment(ctx, longVA))).To(ConsistOf(long))
	g.Expect(r.vmOfAttachment(ctx, &storagev1.VolumeAttachment{})).To(BeEmpty())

	// A lost host maps to its deleted VirtualMachines that still list volumes.
	attached := withStatusVolumes(vmv1.VirtualMachineVolumeStatus{Name: "a", Attached: true})
	c = newFakeClient(g, nil,
		newVM("going", deleted, onHost("host-a"), attached),
		newVM("going-empty", deleted, onHost("host-a")),
		newVM("running", withFinalizer, onHost("host-a"), attached),
		newVM("elsewhere", deleted, onHost("host-b"), attached),
	)
	r = &AttachmentReconciler{Client: c, APIReader: c, Recorder: events.NewFakeRecorder(10)}
	g.Expect(names(r.deletedVMsOnHost(ctx, newNode("host-a")))).To(ConsistOf("going"))
}

// countingReader counts the reads that bypass the cache.
type countingReader struct {
	client.Reader
	reads int
}

func (c *countingReader) Get(ctx context.Context, key client.ObjectKey, obj client.Object, opts ...client.GetOption) error {
	c.reads++
	return c.Reader.Get(ctx, key, obj, opts...)
}

// A cluster that fills its VirtualMachine with entries for claims that do not exist spends its
// own budget of live reads, not the operator's client rate limit that its neighbours share: a
// neighbour's claim that only the API server shows yet is still read and attached.
func TestAttachmentReconcilerBoundsTheLiveReadsOfEachCluster(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	inCluster := func(name string) func(*vmv1.VirtualMachine) {
		return func(vm *vmv1.VirtualMachine) { vm.Labels = map[string]string{tenancy.CAPIClusterNameLabel: name} }
	}
	var flood []vmv1.VirtualMachineVolume
	for i := range 64 {
		flood = append(flood, volume(fmt.Sprintf("missing-%d", i), fmt.Sprintf("missing-%d", i)))
	}
	flooder := newVM("vm-flood", withFinalizer, onHost("host-a"), inCluster("a1"), withVolumes(flood...))
	neighbour := newVM("vm-2", withFinalizer, onHost("host-a"), inCluster("a2"), withVolumes(volume("b", "claim-b")))
	c := newFakeClient(g, nil, flooder, neighbour)
	live := &countingReader{Reader: newFakeClient(g, nil, newPVC("claim-b", "pv-b"), newPV("pv-b", "host-a"))}
	r := &AttachmentReconciler{Client: c, APIReader: live, liveReads: newReadBudget(), Recorder: events.NewFakeRecorder(100)}

	for range 3 {
		res, err := r.Reconcile(ctx, ctrl.Request{NamespacedName: client.ObjectKeyFromObject(flooder)})
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(res.RequeueAfter).To(Equal(unconfirmedRetry), "the claims left unconfirmed are looked at again")
	}
	g.Expect(live.reads).To(BeNumerically("<=", liveReadsBurst+1), "three passes over 64 missing claims")

	reads := live.reads
	_, err := r.Reconcile(ctx, ctrl.Request{NamespacedName: client.ObjectKeyFromObject(neighbour)})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(live.reads).To(BeNumerically(">", reads), "the neighbour's cache miss is read from its own budget")
	g.Expect(c.Get(ctx, client.ObjectKey{Name: vmv1.AttachmentName(testNamespace, "vm-2", "b")}, &storagev1.VolumeAttachment{})).To(Succeed())

	got := &vmv1.VirtualMachine{}
	g.Expect(c.Get(ctx, client.ObjectKeyFromObject(flooder), got)).To(Succeed())
	g.Expect(len(got.Status.Volumes)).To(BeNumerically("<=", liveReadsBurst+1), "only confirmed misses are reported")
}
