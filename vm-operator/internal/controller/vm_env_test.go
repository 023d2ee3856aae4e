package controller

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/util/retry"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/config"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/pkg/names"
	"pvbridge.io/pkg/testenv"
)

// These tests run the real reconcilers in a manager against the package's test apiserver. No
// other controller runs there, so the tests play the others: the PV binder (claims are created
// Bound), csi-attacher (VolumeAttachment status) and the host agent (status.volumes).

// envTest is one test's view of the apiserver: a manager running the controller role, an
// uncached client, and a namespace of its own.
type envTest struct {
	g  *WithT
	c  client.Client
	ns string
}

func newEnvTest(t *testing.T) *envTest {
	t.Helper()
	g := NewWithT(t)
	g.SetDefaultEventuallyTimeout(20 * time.Second)
	g.SetDefaultEventuallyPollingInterval(50 * time.Millisecond)
	scheme := newScheme(g)
	mgr, err := ctrl.NewManager(testEnv, ctrl.Options{
		Scheme:                 scheme,
		Metrics:                metricsserver.Options{BindAddress: "0"},
		HealthProbeBindAddress: "0",
		// Every test starts the same controllers again.
		Controller: config.Controller{SkipNameValidation: ptr.To(true)},
	})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(SetupWithManager(mgr)).To(Succeed())
	testenv.RunManager(t, mgr)

	c, err := client.New(testEnv, client.Options{Scheme: scheme})
	g.Expect(err).NotTo(HaveOccurred())
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{GenerateName: "vmop-"}}
	g.Expect(c.Create(t.Context(), ns)).To(Succeed())
	return &envTest{g: g, c: c, ns: ns.Name}
}

// createHost creates a Ready Node labelled as a VirtualMachine host, deleted when the test ends.
func (e *envTest) createHost(t *testing.T, name string) {
	node := newNode(name)
	status := node.Status
	e.g.Expect(e.c.Create(t.Context(), node)).To(Succeed())
	node.Status = status
	e.g.Expect(e.c.Status().Update(t.Context(), node)).To(Succeed())
	t.Cleanup(func() { _ = e.c.Delete(context.Background(), node) })
}

// createBoundClaim creates a PMEM PersistentVolume on host and a claim Bound to it.
func (e *envTest) createBoundClaim(ctx context.Context, claim, host string) string {
	pvName := e.ns + "-" + claim
	pv := newPV(pvName, host)
	pv.Spec.ClaimRef = &corev1.ObjectReference{Namespace: e.ns, Name: claim}
	e.g.Expect(e.c.Create(ctx, pv)).To(Succeed())
	pvc := newPVC(claim, pvName)
	pvc.Namespace = e.ns
	status := pvc.Status
	e.g.Expect(e.c.Create(ctx, pvc)).To(Succeed())
	pvc.Status = status
	e.g.Expect(e.c.Status().Update(ctx, pvc)).To(Succeed())
	return pvName
}

// update changes the VirtualMachine the way every writer must: read, change, write with the
// resourceVersion read, and start again on a conflict. status selects the status subresource.
func (e *envTest) update(ctx context.Context, name string, status bool, change func(*vmv1.VirtualMachine), backoff wait.Backoff) error {
	return retry.RetryOnConflict(backoff, func() error {
		vm := &vmv1.VirtualMachine{}
		if err := e.c.Get(ctx, client.ObjectKey{Namespace: e.ns, Name: name}, vm); err != nil {
			return err
		}
		change(vm)
		if status {
			return e.c.Status().Update(ctx, vm)
		}
		return e.c.Update(ctx, vm)
	})
}

// hostAgent plays the host agent: it sets status.volumes with change.
func (e *envTest) hostAgent(ctx context.Context, name string, change func([]vmv1.VirtualMachineVolumeStatus) []vmv1.VirtualMachineVolumeStatus) {
	e.g.Expect(e.update(ctx, name, true, func(vm *vmv1.VirtualMachine) {
		vm.Status.Volumes = change(vm.Status.Volumes)
	}, retry.DefaultRetry)).To(Succeed())
}

func (e *envTest) attachments(ctx context.Context, vm string) map[string]storagev1.VolumeAttachment {
	vas := &storagev1.VolumeAttachmentList{}
	e.g.Expect(e.c.List(ctx, vas, client.MatchingLabels{vmv1.VMNamespaceLabel: e.ns, vmv1.VMNameLabel: vm})).To(Succeed())
	out := map[string]storagev1.VolumeAttachment{}
	for _, va := range vas.Items {
		out[va.Annotations[vmv1.VolumeAnnotation]] = va
	}
	return out
}

func (e *envTest) vm(ctx context.Context, name string) func() (*vmv1.VirtualMachine, error) {
	return func() (*vmv1.VirtualMachine, error) {
		vm := &vmv1.VirtualMachine{}
		err := e.c.Get(ctx, client.ObjectKey{Namespace: e.ns, Name: name}, vm)
		return vm, err
	}
}

func conditionReason(typ string) func(*vmv1.VirtualMachine) string {
	return func(vm *vmv1.VirtualMachine) string {
		if c := meta.FindStatusCondition(vm.Status.Conditions, typ); c != nil {
			return string(c.Status) + "/" + c.Reason
		}
		return ""
	}
}

func attachedEntry(name string) vmv1.VirtualMachineVolumeStatus {
	return vmv1.VirtualMachineVolumeStatus{Name: name, Attached: true, DiskSerial: "pvb0123456789abcdef0"}
}

// withoutEntry removes the entry of volume name, as the host agent does after unstaging it.
func withoutEntry(name string) func([]vmv1.VirtualMachineVolumeStatus) []vmv1.VirtualMachineVolumeStatus {
	return func(in []vmv1.VirtualMachineVolumeStatus) []vmv1.VirtualMachineVolumeStatus {
		return slices.DeleteFunc(in, func(e vmv1.VirtualMachineVolumeStatus) bool { return e.Name == name })
	}
}

func TestVirtualMachineIsPlacedAttachedAndDetachedAgainstARealAPIServer(t *testing.T) {
	e := newEnvTest(t)
	g, ctx := e.g, t.Context()
	hostA, hostB := e.ns+"-host-a", e.ns+"-host-b"
	e.createHost(t, hostA)
	e.createHost(t, hostB)
	// host-a already runs a VirtualMachine, so host-b is the least loaded.
	busy := newVM("busy", func(vm *vmv1.VirtualMachine) { vm.Namespace = e.ns; vm.Spec.Host = hostA; vm.UID = "" })
	g.Expect(e.c.Create(ctx, busy)).To(Succeed())
	g.Eventually(e.vm(ctx, "busy")).Should(HaveField("Status.Host", hostA))

	pvs := map[string]string{
		"disk-a": e.createBoundClaim(ctx, "claim-a", hostB),
		"disk-b": e.createBoundClaim(ctx, "claim-b", hostB),
	}
	vm := newVM("vm-1", func(vm *vmv1.VirtualMachine) { vm.Namespace = e.ns; vm.UID = "" },
		withVolumes(volume("disk-a", "claim-a"), volume("disk-b", "claim-b")))
	g.Expect(e.c.Create(ctx, vm)).To(Succeed())

	// Placement: the least-loaded host, a unique ID, Pending, Placed.
	g.Eventually(e.vm(ctx, "vm-1")).Should(And(
		HaveField("Status.Host", hostB),
		HaveField("Status.UniqueID", string(vm.UID)),
		HaveField("Status.Phase", vmv1.PhasePending),
		WithTransform(conditionReason(vmv1.PlacedCondition), Equal("True/"+vmv1.HostAssignedReason)),
		HaveField("Finalizers", ContainElement(vmv1.VolumesFinalizer)),
	))

	// One VolumeAttachment per volume, on the VirtualMachine's host, of the claim's PV.
	g.Eventually(func() map[string]storagev1.VolumeAttachment { return e.attachments(ctx, "vm-1") }).Should(HaveLen(2))
	for volume, va := range e.attachments(ctx, "vm-1") {
		g.Expect(va.Name).To(Equal(vmv1.AttachmentName(e.ns, "vm-1", volume)))
		g.Expect(va.Spec.Attacher).To(Equal(names.PmemDriver))
		g.Expect(va.Spec.NodeName).To(Equal(hostB))
		g.Expect(va.Spec.Source.PersistentVolumeName).To(HaveValue(Equal(pvs[volume])))
	}

	// csi-attacher and the host agent attach both volumes.
	for _, va := range e.attachments(ctx, "vm-1") {
		va.Status.Attached = true
		g.Expect(e.c.Status().Update(ctx, &va)).To(Succeed())
	}
	e.hostAgent(ctx, "vm-1", func([]vmv1.VirtualMachineVolumeStatus) []vmv1.VirtualMachineVolumeStatus {
		return []vmv1.VirtualMachineVolumeStatus{attachedEntry("disk-a"), attachedEntry("disk-b")}
	})
	g.Eventually(e.vm(ctx, "vm-1")).Should(WithTransform(conditionReason(vmv1.VolumesAttachedCondition), Equal("True/"+vmv1.AttachedReason)))

	// A removed volume keeps its VolumeAttachment while status lists it.
	g.Expect(e.update(ctx, "vm-1", false, func(vm *vmv1.VirtualMachine) {
		vm.Spec.Volumes = vm.Spec.Volumes[:1]
	}, retry.DefaultRetry)).To(Succeed())
	g.Eventually(e.vm(ctx, "vm-1")).Should(WithTransform(conditionReason(vmv1.VolumesAttachedCondition), Equal("False/"+vmv1.AttachPendingReason)))
	g.Consistently(func() map[string]storagev1.VolumeAttachment { return e.attachments(ctx, "vm-1") }, 2*time.Second).Should(HaveLen(2))

	// The VolumeAttachment goes once the host agent removed the entry.
	e.hostAgent(ctx, "vm-1", withoutEntry("disk-b"))
	g.Eventually(func() map[string]storagev1.VolumeAttachment { return e.attachments(ctx, "vm-1") }).Should(And(HaveLen(1), HaveKey("disk-a")))
	g.Eventually(e.vm(ctx, "vm-1")).Should(WithTransform(conditionReason(vmv1.VolumesAttachedCondition), Equal("True/"+vmv1.AttachedReason)))

	// A deleted VirtualMachine is kept while a volume is attached. csi-attacher holds its
	// finalizer on the VolumeAttachment until ControllerUnpublishVolume succeeded.
	const attacherFinalizer = "external-attacher/pmem-csi-pvbridge-io"
	va := e.attachments(ctx, "vm-1")["disk-a"]
	va.Finalizers = append(va.Finalizers, attacherFinalizer)
	g.Expect(e.c.Update(ctx, &va)).To(Succeed())
	g.Expect(e.c.Delete(ctx, vm)).To(Succeed())
	g.Consistently(e.vm(ctx, "vm-1"), 2*time.Second).Should(HaveField("DeletionTimestamp", Not(BeNil())))
	g.Expect(e.attachments(ctx, "vm-1")).To(HaveKeyWithValue("disk-a", HaveField("DeletionTimestamp", BeNil())))

	// Once the host agent has detached the volume, its VolumeAttachment is deleted, and the
	// VirtualMachine waits until it is gone.
	e.hostAgent(ctx, "vm-1", withoutEntry("disk-a"))
	g.Eventually(func() map[string]storagev1.VolumeAttachment { return e.attachments(ctx, "vm-1") }).Should(
		HaveKeyWithValue("disk-a", HaveField("DeletionTimestamp", Not(BeNil()))))
	g.Consistently(e.vm(ctx, "vm-1"), time.Second).Should(HaveField("Status.Volumes", BeEmpty()))

	// csi-attacher detaches: the VolumeAttachment goes, and with it the VirtualMachine.
	va = e.attachments(ctx, "vm-1")["disk-a"]
	va.Finalizers = slices.DeleteFunc(va.Finalizers, func(f string) bool { return f == attacherFinalizer })
	g.Expect(e.c.Update(ctx, &va)).To(Succeed())
	g.Eventually(func() map[string]storagev1.VolumeAttachment { return e.attachments(ctx, "vm-1") }).Should(BeEmpty())
	g.Eventually(func() bool {
		_, err := e.vm(ctx, "vm-1")()
		return apierrors.IsNotFound(err)
	}).Should(BeTrue())
}

func TestVolumeErrorReachesStatusAndClearsAgainstARealAPIServer(t *testing.T) {
	e := newEnvTest(t)
	g, ctx := e.g, t.Context()
	host := e.ns + "-host"
	vm := newVM("vm-1", func(vm *vmv1.VirtualMachine) { vm.Namespace = e.ns; vm.UID = ""; vm.Spec.Host = host },
		withVolumes(volume("disk-a", "claim-a")))
	g.Expect(e.c.Create(ctx, vm)).To(Succeed())

	g.Eventually(e.vm(ctx, "vm-1")).Should(And(
		HaveField("Status.Volumes", ConsistOf(vmv1.VirtualMachineVolumeStatus{
			Name: "disk-a", Error: fmt.Sprintf("PersistentVolumeClaim claim-a not found in namespace %s", e.ns),
		})),
		WithTransform(conditionReason(vmv1.VolumesAttachedCondition), Equal("False/"+vmv1.AttachFailedReason)),
	))
	g.Expect(e.attachments(ctx, "vm-1")).To(BeEmpty())

	// The claim appears and binds: the error goes, the VolumeAttachment comes.
	pv := e.createBoundClaim(ctx, "claim-a", host)
	g.Eventually(e.vm(ctx, "vm-1")).Should(And(
		HaveField("Status.Volumes", BeEmpty()),
		WithTransform(conditionReason(vmv1.VolumesAttachedCondition), Equal("False/"+vmv1.AttachPendingReason)),
	))
	g.Eventually(func() map[string]storagev1.VolumeAttachment { return e.attachments(ctx, "vm-1") }).Should(
		HaveKeyWithValue("disk-a", HaveField("Spec.Source.PersistentVolumeName", HaveValue(Equal(pv)))))

	// The attacher fails: its error reaches status.
	va := e.attachments(ctx, "vm-1")["disk-a"]
	va.Status.AttachError = &storagev1.VolumeError{Message: "rpc error: code = FailedPrecondition desc = volume is not on node"}
	g.Expect(e.c.Status().Update(ctx, &va)).To(Succeed())
	g.Eventually(e.vm(ctx, "vm-1")).Should(HaveField("Status.Volumes", ConsistOf(vmv1.VirtualMachineVolumeStatus{
		Name: "disk-a", Error: "attach failed: rpc error: code = FailedPrecondition desc = volume is not on node",
	})))
}

func TestOneVirtualMachineAtATimeAgainstARealAPIServer(t *testing.T) {
	e := newEnvTest(t)
	g, ctx := e.g, t.Context()
	host := e.ns + "-host"
	pv := e.createBoundClaim(ctx, "claim-a", host)
	inNamespace := func(vm *vmv1.VirtualMachine) { vm.Namespace = e.ns; vm.UID = ""; vm.Spec.Host = host }
	g.Expect(e.c.Create(ctx, newVM("vm-1", inNamespace, withVolumes(volume("claim-a", "claim-a"))))).To(Succeed())
	g.Eventually(func() map[string]storagev1.VolumeAttachment { return e.attachments(ctx, "vm-1") }).Should(HaveKey("claim-a"))

	// A second VirtualMachine of the namespace (another cluster the volume is shared with, say)
	// asks for the same volume: refused, with the holder named, and no VolumeAttachment.
	g.Expect(e.c.Create(ctx, newVM("vm-2", inNamespace, withVolumes(volume("claim-a", "claim-a"))))).To(Succeed())
	g.Eventually(e.vm(ctx, "vm-2")).Should(HaveField("Status.Volumes", ConsistOf(vmv1.VirtualMachineVolumeStatus{
		Name: "claim-a",
		Error: fmt.Sprintf("PersistentVolume %s of PersistentVolumeClaim claim-a is attached to VirtualMachine vm-1; a volume is attached to one "+
			"VirtualMachine at a time, add it here once it has left that VirtualMachine's status.volumes", pv),
	})))
	g.Expect(e.attachments(ctx, "vm-2")).To(BeEmpty())

	// The first lets go: the second gets it.
	g.Expect(e.update(ctx, "vm-1", false, func(vm *vmv1.VirtualMachine) { vm.Spec.Volumes = nil }, retry.DefaultRetry)).To(Succeed())
	g.Eventually(func() map[string]storagev1.VolumeAttachment { return e.attachments(ctx, "vm-1") }).Should(BeEmpty())
	g.Eventually(func() map[string]storagev1.VolumeAttachment { return e.attachments(ctx, "vm-2") }).Should(HaveKey("claim-a"))
	g.Eventually(e.vm(ctx, "vm-2")).Should(HaveField("Status.Volumes", BeEmpty()))
}

func TestConcurrentWritersLoseNoVolumeAgainstARealAPIServer(t *testing.T) {
	const writers = 50
	e := newEnvTest(t)
	g, ctx := e.g, t.Context()
	host := e.ns + "-host"
	e.createBoundClaim(ctx, "claim-old", host)
	vm := newVM("vm-1", func(vm *vmv1.VirtualMachine) { vm.Namespace = e.ns; vm.UID = ""; vm.Spec.Host = host },
		withVolumes(volume("old", "claim-old")))
	g.Expect(e.c.Create(ctx, vm)).To(Succeed())
	g.Eventually(func() map[string]storagev1.VolumeAttachment { return e.attachments(ctx, "vm-1") }).Should(HaveKey("old"))
	pvs := map[string]string{}
	for i := range writers {
		pvs[fmt.Sprintf("disk-%02d", i)] = e.createBoundClaim(ctx, fmt.Sprintf("claim-%02d", i), host)
	}

	// 50 writers add a volume each while one more removes "old", all at once, each with
	// optimistic concurrency; the controller writes status meanwhile.
	// A steady, jittered pace: wait.Backoff stops at its Cap, and 51 writers on one object need
	// many rounds.
	backoff := wait.Backoff{Steps: 500, Duration: 10 * time.Millisecond, Factor: 1, Jitter: 2}
	start := make(chan struct{})
	var wg sync.WaitGroup
	errs := make(chan error, writers+1)
	for i := range writers {
		wg.Go(func() {
			<-start
			errs <- e.update(ctx, "vm-1", false, func(vm *vmv1.VirtualMachine) {
				vm.Spec.Volumes = append(vm.Spec.Volumes, volume(fmt.Sprintf("disk-%02d", i), fmt.Sprintf("claim-%02d", i)))
			}, backoff)
		})
	}
	wg.Go(func() {
		<-start
		errs <- e.update(ctx, "vm-1", false, func(vm *vmv1.VirtualMachine) {
			vm.Spec.Volumes = slices.DeleteFunc(vm.Spec.Volumes, func(v vmv1.VirtualMachineVolume) bool { return v.Name == "old" })
		}, backoff)
	})
	close(start)
	wg.Wait()
	close(errs)
	for err := range errs {
		g.Expect(err).NotTo(HaveOccurred())
	}

	got, err := e.vm(ctx, "vm-1")()
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(got.Spec.Volumes).To(HaveLen(writers))
	g.Eventually(func() map[string]storagev1.VolumeAttachment { return e.attachments(ctx, "vm-1") }).Should(HaveLen(writers))
	for volume, va := range e.attachments(ctx, "vm-1") {
		g.Expect(pvs).To(HaveKeyWithValue(volume, *va.Spec.Source.PersistentVolumeName))
		g.Expect(va.Spec.NodeName).To(Equal(host))
	}
}
