// Package vmoperator_test proves vm-operator against a real management control plane: three
// hosts, each a real kubelet with mgmt-csi over emulated PMEM and a vm-operator host agent, with
// the local hypervisor on host-a and host-b and the qemu hypervisor on host-q (qemu_test.go), plus mgmt-csi's controller with the real sidecars and vm-operator's
// controller. A VM's volumes go spec.volumes → VolumeAttachment → csi-attacher → host agent
// (stage, publish, hot-plug) → status.volumes, and back.
package vmoperator_test

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/util/retry"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pvbridge.io/e2e/cluster"
	"pvbridge.io/e2e/deploy"
	"pvbridge.io/e2e/polling"
	pmemv1 "pvbridge.io/pkg/apis/pmem/v1alpha1"
	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
)

// soak is how long TestControllerManagerRestartDetachesNothing watches after the restart. CI
// watches the attach-detach controller's start-up and two of its syncs (restarted with a sync
// period of 10 s instead of a minute); `make soak` watches ten minutes.
var soak = flag.Duration("soak", 30*time.Second, "how long to watch VM volumes after kube-controller-manager restarts")

// adcSyncPeriod is how often the restarted attach-detach controller checks what it believes
// attached; every sync is a chance for it to detach a volume it did not attach.
const adcSyncPeriod = "--attach-detach-reconcile-sync-period=10s"

var (
	lab  *cluster.Lab
	mgmt *deploy.Management
	vmop *deploy.VMOperator
	c    client.WithWatch
)

func TestMain(m *testing.M) {
	polling.Set()
	flag.Parse()
	os.Exit(run(m))
}

func run(m *testing.M) int {
	return cluster.RunTests(m, func(ctx context.Context, l *cluster.Lab) error {
		lab = l
		cp, err := lab.StartControlPlane(ctx, "mgmt")
		if err != nil {
			return err
		}
		if mgmt, err = deploy.StartManagement(ctx, lab, cp, deploy.MgmtOptions{
			Hosts: []string{"host-a", "host-b", qemuHost}, PmemSize: 4 << 30, HostLabels: deploy.VMHostLabels,
		}); err != nil {
			return err
		}
		qemu, err := qemuHosts(lab)
		if err != nil {
			return err
		}
		if vmop, err = deploy.StartVMOperator(lab, mgmt, qemu); err != nil {
			return err
		}
		scheme := runtime.NewScheme()
		for _, add := range []func(*runtime.Scheme) error{clientgoscheme.AddToScheme, pmemv1.AddToScheme, vmv1.AddToScheme} {
			if err := add(scheme); err != nil {
				return err
			}
		}
		c, err = client.NewWithWatch(cp.RESTConfig(), client.Options{Scheme: scheme})
		return err
	})
}

const timeout = 2 * time.Minute

func namespace(t *testing.T) string {
	t.Helper()
	ns, err := deploy.CreateNamespace(t.Context(), mgmt.CP.Client(), "t")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx := context.WithoutCancel(t.Context())
		g := NewWithT(t)
		g.Expect(c.DeleteAllOf(ctx, &vmv1.VirtualMachine{}, client.InNamespace(ns))).To(Succeed())
		g.Expect(c.DeleteAllOf(ctx, &corev1.PersistentVolumeClaim{}, client.InNamespace(ns))).To(Succeed())
		// What the next test could meet is waited for: the VMs (whose finalizer detaches their
		// volumes) and the volumes. The namespace goes in the background: the namespace
		// controller's backoff made its deletion take about ten seconds more.
		g.Eventually(func(g Gomega) {
			vms := &vmv1.VirtualMachineList{}
			g.Expect(c.List(ctx, vms, client.InNamespace(ns))).To(Succeed())
			g.Expect(vms.Items).To(BeEmpty())
			pvs := &corev1.PersistentVolumeList{}
			g.Expect(c.List(ctx, pvs)).To(Succeed())
			for _, pv := range pvs.Items {
				g.Expect(pv.Spec.ClaimRef).NotTo(HaveField("Namespace", ns), "PV %s", pv.Name)
			}
		}).WithTimeout(timeout).Should(Succeed())
		g.Expect(c.Delete(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}})).To(Succeed())
	})
	return ns
}

// blockClaim creates a raw block claim provisioned at once on host.
func blockClaim(ctx context.Context, g Gomega, ns, name, host string) *corev1.PersistentVolume {
	return blockClaims(ctx, g, ns, host, name)[0]
}

// blockClaims creates the block claims names on host at once, and returns their volumes once
// every one is bound.
func blockClaims(ctx context.Context, g Gomega, ns, host string, names ...string) []*corev1.PersistentVolume {
	pvcs := make([]*corev1.PersistentVolumeClaim, len(names))
	for i, name := range names {
		pvcs[i] = deploy.PVC(ns, name, deploy.StorageClassPmemImmediate, "64Mi", true)
		pvcs[i].Annotations = map[string]string{"volume.kubernetes.io/selected-node": host}
		g.Expect(c.Create(ctx, pvcs[i])).To(Succeed())
	}
	pvs := make([]*corev1.PersistentVolume, len(names))
	for i, pvc := range pvcs {
		g.Eventually(func(g Gomega) {
			g.Expect(c.Get(ctx, client.ObjectKeyFromObject(pvc), pvc)).To(Succeed())
			g.Expect(pvc.Status.Phase).To(Equal(corev1.ClaimBound))
		}).WithContext(ctx).WithTimeout(timeout).Should(Succeed())
		pvs[i] = &corev1.PersistentVolume{}
		g.Expect(c.Get(ctx, client.ObjectKey{Name: pvc.Spec.VolumeName}, pvs[i])).To(Succeed())
	}
	return pvs
}

func virtualMachine(ns, name, host string, claims ...string) *vmv1.VirtualMachine {
	vm := &vmv1.VirtualMachine{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec:       vmv1.VirtualMachineSpec{Host: host, PowerState: vmv1.PowerStateOn},
	}
	for _, claim := range claims {
		vm.Spec.Volumes = append(vm.Spec.Volumes, vmv1.VirtualMachineVolume{
			Name: claim, PersistentVolumeClaim: vmv1.PersistentVolumeClaimVolumeSource{ClaimName: claim},
		})
	}
	return vm
}

// volumeStatus waits until the VM reports volume name satisfying match and returns the entry.
func volumeStatus(ctx context.Context, g Gomega, vm *vmv1.VirtualMachine, name string, match func(vmv1.VirtualMachineVolumeStatus) bool) vmv1.VirtualMachineVolumeStatus {
	var got vmv1.VirtualMachineVolumeStatus
	g.Eventually(func(g Gomega) {
		g.Expect(c.Get(ctx, client.ObjectKeyFromObject(vm), vm)).To(Succeed())
		found := false
		for _, e := range vm.Status.Volumes {
			if e.Name == name && match(e) {
				got, found = e, true
			}
		}
		g.Expect(found).To(BeTrue(), "status.volumes: %+v", vm.Status.Volumes)
	}).WithContext(ctx).WithTimeout(timeout).WithPolling(100 * time.Millisecond).Should(Succeed())
	return got
}

func attached(e vmv1.VirtualMachineVolumeStatus) bool { return e.Attached && e.DiskSerial != "" }

// readyOf reads vm afresh and returns its Ready condition, which must be there.
func readyOf(ctx context.Context, g Gomega, vm *vmv1.VirtualMachine) *metav1.Condition {
	g.Expect(c.Get(ctx, client.ObjectKeyFromObject(vm), vm)).To(Succeed())
	ready := meta.FindStatusCondition(vm.Status.Conditions, vmv1.ReadyCondition)
	g.Expect(ready).NotTo(BeNil())
	return ready
}

// diskInVM checks that the VM's device tree shows the disk by serial, as the device of the
// volume on its host.
func diskInVM(g Gomega, host string, vm *vmv1.VirtualMachine, serial, volumeID string) {
	byID := filepath.Join(vmop.VMRoots[host], vm.Namespace, vm.Name, "dev", "disk", "by-id", "virtio-"+serial)
	var inVM unix.Stat_t
	g.Expect(unix.Stat(byID, &inVM)).To(Succeed())
	g.Expect(inVM.Mode & unix.S_IFMT).To(Equal(uint32(unix.S_IFBLK)))
	pmv := &pmemv1.PmemVolume{}
	g.Expect(c.Get(context.Background(), client.ObjectKey{Name: volumeID}, pmv)).To(Succeed())
	var onHost unix.Stat_t
	g.Expect(unix.Stat(pmv.Status.Device, &onHost)).To(Succeed())
	g.Expect(inVM.Rdev).To(Equal(onHost.Rdev), "the VM's disk is the PMEM volume's device")
}

func noDiskInVM(g Gomega, host string, vm *vmv1.VirtualMachine, serial string) {
	byID := filepath.Join(vmop.VMRoots[host], vm.Namespace, vm.Name, "dev", "disk", "by-id", "virtio-"+serial)
	g.Expect(byID).NotTo(BeAnExistingFile())
}

func attachmentsOf(ctx context.Context, g Gomega, vm *vmv1.VirtualMachine) []storagev1.VolumeAttachment {
	list := &storagev1.VolumeAttachmentList{}
	g.Expect(c.List(ctx, list, client.MatchingLabels{vmv1.VMNamespaceLabel: vm.Namespace, vmv1.VMNameLabel: vm.Name})).To(Succeed())
	return list.Items
}

// detachAll empties a VM's spec.volumes. vm-operator writes the VM too (finalizer, status), so the
// update retries on a conflict the way any client of a controller-owned object must.
func detachAll(ctx context.Context, g Gomega, vm *vmv1.VirtualMachine) {
	g.Expect(retry.RetryOnConflict(retry.DefaultRetry, func() error {
		if err := c.Get(ctx, client.ObjectKeyFromObject(vm), vm); err != nil {
			return err
		}
		vm.Spec.Volumes = nil
		return c.Update(ctx, vm)
	})).To(Succeed())
}

func TestAttachDetachAndReattachToASecondVM(t *testing.T) {
	g := NewWithT(t)
	ctx, ns := t.Context(), namespace(t)
	pv := blockClaim(ctx, g, ns, "data", "host-a")

	vm1 := virtualMachine(ns, "vm-1", "host-a", "data")
	g.Expect(c.Create(ctx, vm1)).To(Succeed())
	e := volumeStatus(ctx, g, vm1, "data", attached)
	diskInVM(g, "host-a", vm1, e.DiskSerial, pv.Spec.CSI.VolumeHandle)
	vas := attachmentsOf(ctx, g, vm1)
	g.Expect(vas).To(HaveLen(1))
	g.Expect(vas[0].Spec.NodeName).To(Equal("host-a"))
	g.Expect(*vas[0].Spec.Source.PersistentVolumeName).To(Equal(pv.Name))

	// Detach: remove the volume from spec.
	detachAll(ctx, g, vm1)
	g.Eventually(func(g Gomega) {
		g.Expect(c.Get(ctx, client.ObjectKeyFromObject(vm1), vm1)).To(Succeed())
		g.Expect(vm1.Status.Volumes).To(BeEmpty())
		g.Expect(attachmentsOf(ctx, g, vm1)).To(BeEmpty())
	}).WithContext(ctx).WithTimeout(timeout).Should(Succeed())
	noDiskInVM(g, "host-a", vm1, e.DiskSerial)

	// Re-attach the same volume to a second VM on the same host.
	vm2 := virtualMachine(ns, "vm-2", "host-a", "data")
	g.Expect(c.Create(ctx, vm2)).To(Succeed())
	e2 := volumeStatus(ctx, g, vm2, "data", attached)
	g.Expect(e2.DiskSerial).To(Equal(e.DiskSerial), "the serial follows the volume")
	diskInVM(g, "host-a", vm2, e2.DiskSerial, pv.Spec.CSI.VolumeHandle)
}

func TestVolumeOnAnotherHostIsRefusedWithAClearError(t *testing.T) {
	g := NewWithT(t)
	ctx, ns := t.Context(), namespace(t)
	blockClaim(ctx, g, ns, "far", "host-b")
	vm := virtualMachine(ns, "vm-a", "host-a", "far")
	g.Expect(c.Create(ctx, vm)).To(Succeed())
	e := volumeStatus(ctx, g, vm, "far", func(e vmv1.VirtualMachineVolumeStatus) bool { return e.Error != "" })
	g.Expect(e.Attached).To(BeFalse())
	g.Expect(e.Error).To(ContainSubstring("host-b"))
	g.Expect(attachmentsOf(ctx, g, vm)).To(BeEmpty())
}

func TestDeletingAVMDetachesItsVolumes(t *testing.T) {
	g := NewWithT(t)
	ctx, ns := t.Context(), namespace(t)
	pv := blockClaim(ctx, g, ns, "data", "host-b")
	vm := virtualMachine(ns, "doomed", "host-b", "data")
	g.Expect(c.Create(ctx, vm)).To(Succeed())
	e := volumeStatus(ctx, g, vm, "data", attached)

	g.Expect(c.Delete(ctx, vm)).To(Succeed())
	g.Eventually(func() error {
		return c.Get(ctx, client.ObjectKeyFromObject(vm), &vmv1.VirtualMachine{})
	}).WithContext(ctx).WithTimeout(timeout).Should(MatchError(ContainSubstring("not found")))
	g.Expect(attachmentsOf(ctx, g, vm)).To(BeEmpty())
	noDiskInVM(g, "host-b", vm, e.DiskSerial)
	// The volume itself stays, unpublished.
	pmv := &pmemv1.PmemVolume{}
	g.Expect(c.Get(ctx, client.ObjectKey{Name: pv.Spec.CSI.VolumeHandle}, pmv)).To(Succeed())
}

func TestAVolumeIsAttachedToOneVMAtATime(t *testing.T) {
	g := NewWithT(t)
	ctx, ns := t.Context(), namespace(t)
	pv := blockClaim(ctx, g, ns, "data", "host-a")
	vm1 := virtualMachine(ns, "vm-1", "host-a", "data")
	g.Expect(c.Create(ctx, vm1)).To(Succeed())
	volumeStatus(ctx, g, vm1, "data", attached)

	// A second VM of the namespace on the same host (a cluster the volume is shared with)
	// asks for it too: refused, with the holder named.
	vm2 := virtualMachine(ns, "vm-2", "host-a", "data")
	g.Expect(c.Create(ctx, vm2)).To(Succeed())
	e := volumeStatus(ctx, g, vm2, "data", func(e vmv1.VirtualMachineVolumeStatus) bool { return e.Error != "" })
	g.Expect(e.Error).To(Equal(fmt.Sprintf("PersistentVolume %s of PersistentVolumeClaim data is attached to VirtualMachine vm-1; a volume is "+
		"attached to one VirtualMachine at a time, add it here once it has left that VirtualMachine's status.volumes", pv.Name)))
	g.Expect(attachmentsOf(ctx, g, vm2)).To(BeEmpty())

	// Once the first has let go, the second gets it.
	detachAll(ctx, g, vm1)
	e = volumeStatus(ctx, g, vm2, "data", attached)
	diskInVM(g, "host-a", vm2, e.DiskSerial, pv.Spec.CSI.VolumeHandle)
}

func TestAVMWhoseGuestKeepsItsDiskIsForcedOffWhenDeleted(t *testing.T) {
	g := NewWithT(t)
	ctx, ns := t.Context(), namespace(t)
	pv := blockClaim(ctx, g, ns, "data", "host-b")
	vm := virtualMachine(ns, "stubborn", "host-b", "data")
	g.Expect(c.Create(ctx, vm)).To(Succeed())
	e := volumeStatus(ctx, g, vm, "data", attached)

	// The guest mounts the disk and never lets go of it.
	byID := filepath.Join(vmop.VMRoots["host-b"], ns, vm.Name, "dev", "disk", "by-id", "virtio-"+e.DiskSerial)
	mnt := filepath.Join(t.TempDir(), "guest-mount")
	g.Expect(os.Mkdir(mnt, 0o755)).To(Succeed())
	for _, cmd := range [][]string{{"mkfs.ext4", "-q", byID}, {"mount", byID, mnt}} {
		out, err := exec.CommandContext(ctx, cmd[0], cmd[1:]...).CombinedOutput()
		g.Expect(err).NotTo(HaveOccurred(), "%v: %s", cmd, out)
	}
	t.Cleanup(func() { _ = unix.Unmount(mnt, unix.MNT_DETACH) })

	g.Expect(c.Delete(ctx, vm)).To(Succeed())
	// The host agent waits, and says until when ...
	g.Eventually(func(g Gomega) {
		g.Expect(readyOf(ctx, g, vm).Message).To(MatchRegexp(`^detaching volumes before powering off; forced off at \S+ if the guest still holds them$`))
	}).WithContext(ctx).WithTimeout(timeout).Should(Succeed())
	// ... then forces the VM off: the guest's mount goes with it, the VM and its attachment go.
	g.Eventually(func() error {
		return c.Get(ctx, client.ObjectKeyFromObject(vm), &vmv1.VirtualMachine{})
	}).WithContext(ctx).WithTimeout(deploy.UnplugTimeout + timeout).Should(MatchError(ContainSubstring("not found")))
	g.Expect(attachmentsOf(ctx, g, vm)).To(BeEmpty())
	mounts, err := os.ReadFile("/proc/self/mountinfo")
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(string(mounts)).NotTo(ContainSubstring(mnt + " "))
	events := &corev1.EventList{}
	g.Expect(c.List(ctx, events, client.InNamespace(ns))).To(Succeed())
	g.Expect(events.Items).To(ContainElement(And(
		HaveField("Reason", "ForcedOff"),
		HaveField("Message", fmt.Sprintf("The guest did not release its disks within %s of being asked to; the VM was forced off", deploy.UnplugTimeout)),
	)))
	// The volume stays, released on the host.
	pmv := &pmemv1.PmemVolume{}
	g.Expect(c.Get(ctx, client.ObjectKey{Name: pv.Spec.CSI.VolumeHandle}, pmv)).To(Succeed())
}

func TestHostAgentKilledMidAttachAndMidDetachConverges(t *testing.T) {
	g := NewWithT(t)
	ctx, ns := t.Context(), namespace(t)
	var claims []string
	for i := range 5 {
		name := fmt.Sprintf("v%d", i)
		blockClaim(ctx, g, ns, name, "host-a")
		claims = append(claims, name)
	}
	vm := virtualMachine(ns, "crash", "host-a", claims...)
	g.Expect(c.Create(ctx, vm)).To(Succeed())
	volumeStatus(ctx, g, vm, "v0", func(vmv1.VirtualMachineVolumeStatus) bool { return true })
	g.Expect(vmop.Agents["host-a"].Kill()).To(Succeed()) // it restarts, as its container would
	serials := map[string]string{}
	for _, name := range claims {
		serials[name] = volumeStatus(ctx, g, vm, name, attached).DiskSerial
	}
	g.Expect(attachmentsOf(ctx, g, vm)).To(HaveLen(len(claims)))

	// And mid-detach.
	detachAll(ctx, g, vm)
	g.Eventually(func() int {
		g.Expect(c.Get(ctx, client.ObjectKeyFromObject(vm), vm)).To(Succeed())
		return len(vm.Status.Volumes)
	}).WithContext(ctx).WithTimeout(timeout).WithPolling(10 * time.Millisecond).Should(BeNumerically("<", len(claims)))
	g.Expect(vmop.Agents["host-a"].Kill()).To(Succeed())
	g.Eventually(func(g Gomega) {
		g.Expect(c.Get(ctx, client.ObjectKeyFromObject(vm), vm)).To(Succeed())
		g.Expect(vm.Status.Volumes).To(BeEmpty())
		g.Expect(attachmentsOf(ctx, g, vm)).To(BeEmpty())
	}).WithContext(ctx).WithTimeout(timeout).Should(Succeed())
	for _, serial := range serials {
		noDiskInVM(g, "host-a", vm, serial)
	}
	g.Expect(cluster.MountsBelow(filepath.Join(mgmt.Hosts[0].Node.Dir, "host-agent"))).To(BeEmpty(), "nothing stays published")
}

// TestControllerManagerRestartDetachesNothing restarts kube-controller-manager while a VM's
// volume is attached: the volume must stay attached. The CSIDriver declares
// attachRequired=false, so the attach-detach controller leaves it alone (with true, it tries to
// detach it and deletes a VolumeAttachment of another name, which does not exist: this test
// passes then too; docs/design.md).
func TestControllerManagerRestartDetachesNothing(t *testing.T) {
	g := NewWithT(t)
	ctx, ns := t.Context(), namespace(t)
	blockClaim(ctx, g, ns, "data", "host-a")
	vm := virtualMachine(ns, "steady", "host-a", "data")
	g.Expect(c.Create(ctx, vm)).To(Succeed())
	volumeStatus(ctx, g, vm, "data", attached)
	vas := attachmentsOf(ctx, g, vm)
	g.Expect(vas).To(HaveLen(1))

	g.Expect(mgmt.CP.StopControllerManager()).To(Succeed())
	g.Expect(mgmt.CP.StartControllerManager(adcSyncPeriod)).To(Succeed())
	// The attach-detach controller acts at start-up and at every sync. It learns which volumes a
	// node has in use from the node's updates, and until one comes it takes every volume it
	// tracks for mounted and leaves it be. Kubelets report every few minutes when nothing
	// changes; the watch touches the hosts' Nodes every second instead, so that a wrong detach
	// would come at once.
	g.Consistently(func(g Gomega) {
		for _, h := range mgmt.Hosts {
			touched := fmt.Sprintf(`{"metadata":{"annotations":{"e2e.pvbridge.io/touched":%q}}}`, time.Now().Format(time.RFC3339Nano))
			node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: h.Node.Name}}
			g.Expect(c.Patch(ctx, node, client.RawPatch(types.MergePatchType, []byte(touched)))).To(Succeed())
		}
		va := &storagev1.VolumeAttachment{}
		g.Expect(c.Get(ctx, client.ObjectKey{Name: vas[0].Name}, va)).To(Succeed())
		g.Expect(va.DeletionTimestamp).To(BeNil())
		g.Expect(va.Status.Attached).To(BeTrue())
		g.Expect(c.Get(ctx, client.ObjectKeyFromObject(vm), vm)).To(Succeed())
		g.Expect(vm.Status.Volumes).To(ContainElement(HaveField("Attached", true)))
	}).WithContext(ctx).WithTimeout(*soak).WithPolling(time.Second).Should(Succeed())
}

// TestConcurrentWritersLoseNoVolume adds 50 volumes to one VM from 50 writers at once, each with
// optimistic concurrency (read, append, update, retry on conflict), then removes one: all 50 end
// attached as disks of the VM, and the removal drops exactly that one.
func TestConcurrentWritersLoseNoVolume(t *testing.T) {
	g := NewWithT(t)
	ctx, ns := t.Context(), namespace(t)
	const n = 50
	names := make([]string, n)
	for i := range names {
		names[i] = fmt.Sprintf("w%02d", i)
	}
	blockClaims(ctx, g, ns, "host-b", names...)
	vm := virtualMachine(ns, "busy", "host-b")
	g.Expect(c.Create(ctx, vm)).To(Succeed())

	// 50 writers and the status writers conflict far more often than client-go's default 4
	// tries. (No Cap: wait.Backoff stops stepping once it reaches its cap.)
	patient := wait.Backoff{Steps: 1000, Duration: 50 * time.Millisecond, Factor: 1, Jitter: 1}
	var wg sync.WaitGroup
	for _, name := range names {
		wg.Go(func() {
			err := retry.RetryOnConflict(patient, func() error {
				cur := &vmv1.VirtualMachine{}
				if err := c.Get(ctx, client.ObjectKeyFromObject(vm), cur); err != nil {
					return err
				}
				cur.Spec.Volumes = append(cur.Spec.Volumes, vmv1.VirtualMachineVolume{
					Name: name, PersistentVolumeClaim: vmv1.PersistentVolumeClaimVolumeSource{ClaimName: name},
				})
				return c.Update(ctx, cur)
			})
			g.Expect(err).NotTo(HaveOccurred(), "writer %s: %v", name, err)
		})
	}
	wg.Wait()
	for _, name := range names {
		volumeStatus(ctx, g, vm, name, attached)
	}

	g.Expect(retry.RetryOnConflict(patient, func() error {
		if err := c.Get(ctx, client.ObjectKeyFromObject(vm), vm); err != nil {
			return err
		}
		vm.Spec.Volumes = slices.DeleteFunc(vm.Spec.Volumes, func(v vmv1.VirtualMachineVolume) bool { return v.Name == "w07" })
		return c.Update(ctx, vm)
	})).To(Succeed())
	g.Eventually(func(g Gomega) {
		g.Expect(c.Get(ctx, client.ObjectKeyFromObject(vm), vm)).To(Succeed())
		g.Expect(vm.Status.Volumes).To(HaveLen(n - 1))
		g.Expect(vm.Status.Volumes).To(HaveEach(HaveField("Attached", true)))
		g.Expect(vm.Status.Volumes).NotTo(ContainElement(HaveField("Name", "w07")))
		g.Expect(attachmentsOf(ctx, g, vm)).To(HaveLen(n - 1))
	}).WithContext(ctx).WithTimeout(timeout).Should(Succeed())
}
