// Package guestcsi_test proves guest-csi against the whole system: a management cluster (two
// hosts with mgmt-csi over emulated PMEM and vm-operator, all real sidecars) and a guest cluster
// whose three nodes are VirtualMachines of namespace tenant-a, each a real kubelet with the
// guest-csi node plugin looking at its VM's device tree. A guest pod's volume goes guest PVC →
// management PVC → PMEM volume → VM spec.volumes → VolumeAttachment → hot-plug → disk found by
// serial → mounted, and back.
package guestcsi_test

import (
	"context"
	"crypto/sha256"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	. "github.com/onsi/gomega"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pvbridge.io/e2e/cluster"
	"pvbridge.io/e2e/deploy"
	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/pkg/mounter"
	"pvbridge.io/pkg/tenancy"
)

var (
	lab   *cluster.Lab
	mgmt  *deploy.Management
	guest *deploy.Guest
	mc    client.Client        // management, admin
	gc    kubernetes.Interface // guest, admin
)

var guestOptions = deploy.GuestOptions{
	Name: "alpha", Namespace: "tenant-a",
	VMs: map[string]string{"vm-1": "host-a", "vm-2": "host-b", "vm-3": "host-a"},
}

func TestMain(m *testing.M) {
	os.Exit(cluster.RunTests(m, func(ctx context.Context, l *cluster.Lab) error {
		lab = l
		mcp, err := lab.StartControlPlane(ctx, "mgmt")
		if err != nil {
			return err
		}
		if mgmt, err = deploy.StartManagement(ctx, lab, mcp, deploy.MgmtOptions{
			Hosts: []string{"host-a", "host-b"}, PmemSize: 4 << 30, HostLabels: deploy.VMHostLabels,
		}); err != nil {
			return err
		}
		op, err := deploy.StartVMOperator(lab, mgmt)
		if err != nil {
			return err
		}
		gcp, err := lab.StartControlPlane(ctx, "guest")
		if err != nil {
			return err
		}
		if guest, err = deploy.StartGuest(ctx, lab, mgmt, op, gcp, guestOptions); err != nil {
			return err
		}
		scheme, err := deploy.MgmtScheme()
		if err != nil {
			return err
		}
		mc, err = client.New(mcp.RESTConfig(), client.Options{Scheme: scheme})
		gc = gcp.Client()
		return err
	}))
}

const timeout = 2 * time.Minute

// namespace makes a guest namespace for one test. When the test ends it deletes the
// namespace's pods and claims and checks that nothing of them is left in the management
// cluster: no management PVC of the cluster, no PMEM volume, no VM volume.
func namespace(t *testing.T) string {
	t.Helper()
	ns, err := deploy.CreateNamespace(t.Context(), gc, "t")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx := context.WithoutCancel(t.Context())
		g := NewWithT(t)
		g.Expect(gc.CoreV1().Pods(ns).DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{})).To(Succeed())
		g.Expect(gc.CoreV1().PersistentVolumeClaims(ns).DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{})).To(Succeed())
		g.Eventually(func(g Gomega) {
			pvs, err := gc.CoreV1().PersistentVolumes().List(ctx, metav1.ListOptions{})
			g.Expect(err).NotTo(HaveOccurred())
			for _, pv := range pvs.Items {
				g.Expect(pv.Spec.ClaimRef).NotTo(HaveField("Namespace", ns), "guest PV %s", pv.Name)
			}
			pvcs := &corev1.PersistentVolumeClaimList{}
			g.Expect(mc.List(ctx, pvcs, client.InNamespace(guestOptions.Namespace), client.MatchingLabels{tenancy.ClusterUIDLabel: guest.UID})).To(Succeed())
			for _, pvc := range pvcs.Items {
				g.Expect(pvc.Annotations[tenancy.GuestPVCAnnotation]).NotTo(HavePrefix(ns+"/"), "management PVC %s", pvc.Name)
			}
			for vm := range guestOptions.VMs {
				obj := &vmv1.VirtualMachine{}
				g.Expect(mc.Get(ctx, client.ObjectKey{Namespace: guestOptions.Namespace, Name: vm}, obj)).To(Succeed())
				g.Expect(obj.Status.Volumes).To(BeEmpty(), "volumes of %s", vm)
			}
		}).WithContext(ctx).WithTimeout(timeout).Should(Succeed())
	})
	return ns
}

// runPod creates pod name with claim on vm ("" lets the scheduler choose) and waits until it
// runs.
func runPod(ctx context.Context, g Gomega, ns, name, claim, vm string, block bool) *corev1.Pod {
	pod, err := gc.CoreV1().Pods(ns).Create(ctx, deploy.Pod(ns, name, claim, vm, block), metav1.CreateOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	g.Eventually(func(g Gomega) {
		pod, err = gc.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(pod.Status.Phase).To(Equal(corev1.PodRunning))
	}).WithContext(ctx).WithTimeout(timeout).Should(Succeed())
	return pod
}

// deletePod deletes a pod and waits until its volumes are detached from its VM.
func deletePod(ctx context.Context, g Gomega, pod *corev1.Pod) {
	g.Expect(gc.CoreV1().Pods(pod.Namespace).Delete(ctx, pod.Name, metav1.DeleteOptions{})).To(Succeed())
	g.Eventually(func(g Gomega) {
		vas, err := gc.StorageV1().VolumeAttachments().List(ctx, metav1.ListOptions{})
		g.Expect(err).NotTo(HaveOccurred())
		for _, va := range vas.Items {
			g.Expect(va.Spec.NodeName).NotTo(Equal(pod.Spec.NodeName), "VolumeAttachment %s", va.Name)
		}
	}).WithContext(ctx).WithTimeout(timeout).Should(Succeed())
}

// boundClaim returns the guest PVC and PV of claim.
func boundClaim(ctx context.Context, g Gomega, ns, claim string) (*corev1.PersistentVolumeClaim, *corev1.PersistentVolume) {
	pvc, err := gc.CoreV1().PersistentVolumeClaims(ns).Get(ctx, claim, metav1.GetOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	pv, err := gc.CoreV1().PersistentVolumes().Get(ctx, pvc.Spec.VolumeName, metav1.GetOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	return pvc, pv
}

func TestDynamicProvisioning(t *testing.T) {
	for _, tc := range []struct {
		name, class string
		block       bool
		vm          string
		fsType      string
	}{
		{"ext4 on a chosen VM", deploy.StorageClassGuest, false, "vm-2", "ext4"},
		{"xfs where the scheduler puts it", deploy.StorageClassGuestXFS, false, "", "xfs"},
		{"raw block", deploy.StorageClassGuest, true, "vm-3", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			ctx, ns := t.Context(), namespace(t)
			_, err := gc.CoreV1().PersistentVolumeClaims(ns).Create(ctx, deploy.PVC(ns, "data", tc.class, "320Mi", tc.block), metav1.CreateOptions{})
			g.Expect(err).NotTo(HaveOccurred())
			pod := runPod(ctx, g, ns, "app", "data", tc.vm, tc.block)
			pvc, pv := boundClaim(ctx, g, ns, "data")

			// The volume lives on the host of the pod's VM.
			host := guestOptions.VMs[pod.Spec.NodeName]
			g.Expect(pv.Spec.NodeAffinity.Required.NodeSelectorTerms).To(HaveExactElements(
				HaveField("MatchExpressions", HaveExactElements(And(HaveField("Key", deploy.GuestTopologyKey), HaveField("Values", Equal([]string{host}))))),
			))
			mpvc := &corev1.PersistentVolumeClaim{}
			g.Expect(mc.Get(ctx, client.ObjectKey{Namespace: guestOptions.Namespace, Name: pv.Spec.CSI.VolumeHandle}, mpvc)).To(Succeed())
			g.Expect(mpvc.Labels).To(HaveKeyWithValue(tenancy.ClusterUIDLabel, guest.UID))
			g.Expect(mpvc.Annotations).To(HaveKeyWithValue(tenancy.GuestPVCAnnotation, ns+"/data"))
			g.Expect(mpvc.Annotations).To(HaveKeyWithValue("volume.kubernetes.io/selected-node", host))
			g.Expect(mpvc.Spec.VolumeMode).To(HaveValue(Equal(corev1.PersistentVolumeBlock)))

			path := deploy.PodVolumePath(guest.Nodes[pod.Spec.NodeName], pod.UID, pvc.Spec.VolumeName, tc.block)
			if tc.block {
				var st unix.Stat_t
				g.Expect(unix.Stat(path, &st)).To(Succeed())
				g.Expect(st.Mode & unix.S_IFMT).To(Equal(uint32(unix.S_IFBLK)))
			} else {
				g.Expect(mounter.FilesystemType(path)).To(Equal(tc.fsType))
				g.Expect(os.WriteFile(filepath.Join(path, "data"), []byte("hello"), 0o644)).To(Succeed())
			}
		})
	}
}

// Data written through a pod survives the pod's deletion, the detach from its VM and the attach
// to another VM of the same host.
func TestDataFollowsToAnotherVMOfTheHost(t *testing.T) {
	g := NewWithT(t)
	ctx, ns := t.Context(), namespace(t)
	_, err := gc.CoreV1().PersistentVolumeClaims(ns).Create(ctx, deploy.PVC(ns, "data", "", "256Mi", false), metav1.CreateOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	first := runPod(ctx, g, ns, "writer", "data", "vm-1", false)
	pvc, _ := boundClaim(ctx, g, ns, "data")
	content := make([]byte, 4<<20)
	for i := range content {
		content[i] = byte(i * 7)
	}
	want := sha256.Sum256(content)
	g.Expect(os.WriteFile(filepath.Join(deploy.PodVolumePath(guest.Nodes["vm-1"], first.UID, pvc.Spec.VolumeName, false), "blob"), content, 0o644)).To(Succeed())
	deletePod(ctx, g, first)

	second := runPod(ctx, g, ns, "reader", "data", "vm-3", false)
	got, err := os.ReadFile(filepath.Join(deploy.PodVolumePath(guest.Nodes["vm-3"], second.UID, pvc.Spec.VolumeName, false), "blob"))
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(sha256.Sum256(got)).To(Equal(want))
}

// staticClaim creates a management PVC as a platform admin imports a volume: bound at once on
// host-a, shared with the clusters named (or none).
func staticClaim(ctx context.Context, g Gomega, name, sharedWith string) *corev1.PersistentVolumeClaim {
	pvc := deploy.PVC(guestOptions.Namespace, name, deploy.StorageClassPmemImmediate, "256Mi", true)
	pvc.Annotations = map[string]string{"volume.kubernetes.io/selected-node": "host-a"}
	if sharedWith != "" {
		pvc.Annotations[tenancy.SharedWithAnnotation] = sharedWith
	}
	g.Expect(mc.Create(ctx, pvc)).To(Succeed())
	g.Eventually(func(g Gomega) {
		g.Expect(mc.Get(ctx, client.ObjectKeyFromObject(pvc), pvc)).To(Succeed())
		g.Expect(pvc.Status.Phase).To(Equal(corev1.ClaimBound))
	}).WithContext(ctx).WithTimeout(timeout).Should(Succeed())
	return pvc
}

// staticVolume creates a guest PV naming management PVC handle (on host-a, as the docs show)
// and a guest PVC bound to it.
func staticVolume(ctx context.Context, g Gomega, ns, handle string) {
	pv := &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: "static-" + ns},
		Spec: corev1.PersistentVolumeSpec{
			Capacity:                      corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("256Mi")},
			AccessModes:                   []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			PersistentVolumeReclaimPolicy: corev1.PersistentVolumeReclaimDelete,
			StorageClassName:              "",
			ClaimRef:                      &corev1.ObjectReference{Namespace: ns, Name: "data"},
			PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{
				Driver: deploy.GuestDriver, VolumeHandle: handle, FSType: "ext4",
			}},
			NodeAffinity: &corev1.VolumeNodeAffinity{Required: &corev1.NodeSelector{NodeSelectorTerms: []corev1.NodeSelectorTerm{{
				MatchExpressions: []corev1.NodeSelectorRequirement{{Key: deploy.GuestTopologyKey, Operator: corev1.NodeSelectorOpIn, Values: []string{"host-a"}}},
			}}}},
		},
	}
	_, err := gc.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	pvc := deploy.PVC(ns, "data", "", "256Mi", false)
	pvc.Spec.StorageClassName = ptr.To("")
	pvc.Spec.VolumeName = pv.Name
	_, err = gc.CoreV1().PersistentVolumeClaims(ns).Create(ctx, pvc, metav1.CreateOptions{})
	g.Expect(err).NotTo(HaveOccurred())
}

// A management PVC shared with the cluster can be used by a static guest PV, and deleting the
// guest PV releases it without deleting it; one that is not shared is refused, with the
// reason, and never attached.
func TestStaticProvisioning(t *testing.T) {
	t.Run("shared", func(t *testing.T) {
		g := NewWithT(t)
		ctx, ns := t.Context(), namespace(t)
		mpvc := staticClaim(ctx, g, "imported-"+ns, "alpha")
		t.Cleanup(func() { _ = mc.Delete(context.WithoutCancel(ctx), mpvc) })
		staticVolume(ctx, g, ns, mpvc.Name)
		pod := runPod(ctx, g, ns, "app", "data", "", false)
		g.Expect(guestOptions.VMs[pod.Spec.NodeName]).To(Equal("host-a"))
		deletePod(ctx, g, pod)

		g.Expect(gc.CoreV1().PersistentVolumeClaims(ns).Delete(ctx, "data", metav1.DeleteOptions{})).To(Succeed())
		g.Eventually(func() error {
			_, err := gc.CoreV1().PersistentVolumes().Get(ctx, "static-"+ns, metav1.GetOptions{})
			return err
		}).WithContext(ctx).WithTimeout(timeout).Should(MatchError(ContainSubstring("not found")), "reclaim Delete of the guest PV")
		g.Expect(mc.Get(ctx, client.ObjectKeyFromObject(mpvc), mpvc)).To(Succeed())
		g.Expect(mpvc.DeletionTimestamp).To(BeNil(), "the shared management PVC is released, not deleted")
	})
	t.Run("not shared", func(t *testing.T) {
		g := NewWithT(t)
		ctx, ns := t.Context(), namespace(t)
		mpvc := staticClaim(ctx, g, "foreign-"+ns, "")
		t.Cleanup(func() { _ = mc.Delete(context.WithoutCancel(ctx), mpvc) })
		staticVolume(ctx, g, ns, mpvc.Name)
		t.Cleanup(func() {
			_ = gc.CoreV1().PersistentVolumes().Delete(context.WithoutCancel(ctx), "static-"+ns, metav1.DeleteOptions{})
		})
		_, err := gc.CoreV1().Pods(ns).Create(ctx, deploy.Pod(ns, "app", "data", "vm-1", false), metav1.CreateOptions{})
		g.Expect(err).NotTo(HaveOccurred())
		g.Eventually(func(g Gomega) {
			vas, err := gc.StorageV1().VolumeAttachments().List(ctx, metav1.ListOptions{})
			g.Expect(err).NotTo(HaveOccurred())
			var messages []string
			for _, va := range vas.Items {
				if ptr.Deref(va.Spec.Source.PersistentVolumeName, "") == "static-"+ns && va.Status.AttachError != nil {
					messages = append(messages, va.Status.AttachError.Message)
				}
			}
			g.Expect(messages).To(ContainElement(ContainSubstring("was not created for cluster alpha and is not shared with it")))
		}).WithContext(ctx).WithTimeout(timeout).Should(Succeed())
		vm := &vmv1.VirtualMachine{}
		g.Expect(mc.Get(ctx, client.ObjectKey{Namespace: guestOptions.Namespace, Name: "vm-1"}, vm)).To(Succeed())
		g.Expect(vm.Spec.Volumes).NotTo(ContainElement(HaveField("Name", mpvc.Name)), "never attached")
	})
}

// controllerClient dials the guest-csi controller as its sidecars do.
func controllerClient(t *testing.T) csi.ControllerClient {
	conn, err := grpc.NewClient("unix://"+filepath.Join(guest.CP.Dir, "guest-csi", "csi.sock"), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return csi.NewControllerClient(conn)
}

// retried calls rpc until it succeeds or fails with a code the sidecars do not expect to pass.
func retried[Req, Resp any](ctx context.Context, rpc func(context.Context, Req, ...grpc.CallOption) (Resp, error), req Req) (Resp, error) {
	for {
		cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		resp, err := rpc(cctx, req)
		cancel()
		if err == nil || ctx.Err() != nil || !retryable(err) {
			return resp, err
		}
	}
}

// retryable reports whether a sidecar retries an error as work in progress.
func retryable(err error) bool {
	switch status.Code(err) {
	case codes.Unavailable, codes.DeadlineExceeded, codes.Aborted:
		return true
	}
	return false
}

// Fifty volumes published at once to one VM through the real vm-operator, then the VM is
// deleted: unpublishing from a VM that is gone succeeds, and nothing is left attached.
func TestConcurrentPublishesAndADeletedVM(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	const vmName = "vm-extra"
	vm := &vmv1.VirtualMachine{
		ObjectMeta: metav1.ObjectMeta{Namespace: guestOptions.Namespace, Name: vmName, Labels: map[string]string{tenancy.CAPIClusterNameLabel: guestOptions.Name}},
		Spec:       vmv1.VirtualMachineSpec{Host: "host-b", PowerState: vmv1.PowerStateOn},
	}
	g.Expect(mc.Create(ctx, vm)).To(Succeed())
	ctrl := controllerClient(t)
	capability := &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
	}
	const n = 50
	ids := make([]string, n)
	var wg sync.WaitGroup
	errs := make(chan error, 3*n)
	for i := range n {
		wg.Go(func() {
			resp, err := retried(ctx, ctrl.CreateVolume, &csi.CreateVolumeRequest{
				Name: fmt.Sprintf("pvc-e2e-%d", i), CapacityRange: &csi.CapacityRange{RequiredBytes: 16 << 20},
				VolumeCapabilities:        []*csi.VolumeCapability{capability},
				AccessibilityRequirements: &csi.TopologyRequirement{Requisite: []*csi.Topology{{Segments: map[string]string{deploy.GuestTopologyKey: "host-b"}}}},
			})
			if err != nil {
				errs <- err
				return
			}
			ids[i] = resp.GetVolume().GetVolumeId()
			if _, err := retried(ctx, ctrl.ControllerPublishVolume, &csi.ControllerPublishVolumeRequest{VolumeId: ids[i], NodeId: vmName, VolumeCapability: capability}); err != nil {
				errs <- err
			}
		})
	}
	wg.Wait()
	g.Expect(errs).To(BeEmpty())
	g.Expect(mc.Get(ctx, client.ObjectKeyFromObject(vm), vm)).To(Succeed())
	g.Expect(vm.Spec.Volumes).To(HaveLen(n), "no entry is lost")
	g.Expect(vm.Status.Volumes).To(HaveEach(HaveField("Attached", BeTrue())))

	g.Expect(mc.Delete(ctx, vm)).To(Succeed())
	g.Eventually(func() error {
		return mc.Get(ctx, client.ObjectKeyFromObject(vm), vm)
	}).WithContext(ctx).WithTimeout(timeout).Should(MatchError(ContainSubstring("not found")), "vm-operator detaches every disk of a deleted VM")
	for _, id := range ids {
		wg.Go(func() {
			if _, err := retried(ctx, ctrl.ControllerUnpublishVolume, &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: vmName}); err != nil {
				errs <- err
			}
			if _, err := retried(ctx, ctrl.DeleteVolume, &csi.DeleteVolumeRequest{VolumeId: id}); err != nil {
				errs <- err
			}
		})
	}
	wg.Wait()
	g.Expect(errs).To(BeEmpty())
	pvcs := &corev1.PersistentVolumeClaimList{}
	g.Expect(mc.List(ctx, pvcs, client.InNamespace(guestOptions.Namespace), client.MatchingLabels{tenancy.ClusterUIDLabel: guest.UID})).To(Succeed())
	g.Expect(pvcs.Items).To(BeEmpty())
}
