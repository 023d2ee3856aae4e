package suite_test

import (
	"context"
	"errors"
	"fmt"
	"os/exec"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pvbridge.io/e2e/deploy"
	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/pkg/mounter"
	"pvbridge.io/pkg/names"
	"pvbridge.io/pkg/tenancy"
)

var _ = Describe("Dynamic provisioning", Label("provisioning"), func() {
	DescribeTable("a guest PVC gets a volume on the host of its pod's VM",
		func(ctx SpecContext, class string, block bool, vmName, fsType string) {
			ns := alpha.namespace(ctx)
			alpha.create(ctx, deploy.PVC(ns, "data", class, "320Mi", block))
			pod := alpha.runPod(ctx, ns, "app", "data", vmName, block)
			pvc, pv := alpha.bound(ctx, ns, "data")

			host := alpha.Options.VMs[pod.Spec.NodeName]
			Expect(pv.Spec.NodeAffinity.Required.NodeSelectorTerms).To(HaveExactElements(
				HaveField("MatchExpressions", HaveExactElements(And(HaveField("Key", names.GuestTopologyKey), HaveField("Values", Equal([]string{host}))))),
			))
			mpvc := mgmtClaim(ctx, alpha, pv)
			Expect(mpvc.Labels).To(HaveKeyWithValue(tenancy.ClusterUIDLabel, alpha.UID))
			Expect(mpvc.Annotations).To(HaveKeyWithValue(tenancy.GuestPVCAnnotation, ns+"/data"))
			Expect(mpvc.Annotations).To(HaveKeyWithValue("volume.kubernetes.io/selected-node", host))
			Expect(mpvc.Spec.VolumeMode).To(HaveValue(Equal(corev1.PersistentVolumeBlock)))

			path := deploy.PodVolumePath(alpha.Nodes[pod.Spec.NodeName], pod.UID, pvc.Spec.VolumeName, block)
			if block {
				var st unix.Stat_t
				Expect(unix.Stat(path, &st)).To(Succeed())
				Expect(st.Mode & unix.S_IFMT).To(Equal(uint32(unix.S_IFBLK)))
				return
			}
			Expect(mounter.FilesystemType(path)).To(Equal(fsType))
			alpha.writeBlob(pod, pv.Name, 1)
		},
		Entry("ext4 on a chosen VM", deploy.StorageClassGuest, false, "vm-2", "ext4"),
		Entry("xfs where the scheduler puts it", deploy.StorageClassGuestXFS, false, "", "xfs"),
		Entry("raw block", deploy.StorageClassGuest, true, "vm-3", ""),
	)

	It("keeps data through pod deletion, detach and attach to another VM of the host", Label("data"), func(ctx SpecContext) {
		ns := alpha.namespace(ctx)
		alpha.create(ctx, deploy.PVC(ns, "data", "", "256Mi", false))
		first := alpha.runPod(ctx, ns, "writer", "data", "vm-1", false)
		_, pv := alpha.bound(ctx, ns, "data")
		want := alpha.writeBlob(first, pv.Name, 2)
		alpha.deletePod(ctx, first)

		second := alpha.runPod(ctx, ns, "reader", "data", "vm-3", false)
		Expect(alpha.readBlob(second, pv.Name)).To(Equal(want))
	})

	It("gives each replica of a StatefulSet its own volume, and a recreated replica its data", func(ctx SpecContext) {
		ns := alpha.namespace(ctx)
		sts := deploy.StatefulSet(ns, "web", 3, "128Mi")
		alpha.create(ctx, sts)
		DeferCleanup(func(ctx SpecContext) { // before the namespace's cleanup: no pod comes back
			Expect(alpha.c.Delete(ctx, sts)).To(Succeed())
			gone(ctx, alpha.c, sts)
		})

		pods, pvs := make([]*corev1.Pod, 3), make([]string, 3)
		sums := make([][32]byte, 3)
		for i := range 3 {
			pods[i] = alpha.running(ctx, ns, fmt.Sprintf("web-%d", i))
			Expect(pods[i].Spec.Volumes).To(ContainElement(HaveField("Projected", Not(BeNil()))), "the service account token")
			_, pv := alpha.bound(ctx, ns, fmt.Sprintf("data-web-%d", i))
			pvs[i] = pv.Name
			sums[i] = alpha.writeBlob(pods[i], pv.Name, byte(i+1))
		}
		Expect(pvs[0]).NotTo(BeElementOf(pvs[1:]))
		Expect(pvs[1]).NotTo(Equal(pvs[2]))

		// The replica's volume follows it wherever the scheduler puts it (possibly another VM,
		// through a detach and an attach).
		Expect(alpha.c.Delete(ctx, pods[1])).To(Succeed())
		again := &corev1.Pod{}
		Eventually(func(g Gomega) {
			g.Expect(alpha.c.Get(ctx, client.ObjectKeyFromObject(pods[1]), again)).To(Succeed())
			g.Expect(again.UID).NotTo(Equal(pods[1].UID))
			g.Expect(again.Status.Phase).To(Equal(corev1.PodRunning))
		}).WithContext(ctx).WithTimeout(timeout).Should(Succeed())
		Expect(alpha.readBlob(again, pvs[1])).To(Equal(sums[1]))
	})
})

var _ = Describe("Static provisioning", Label("static"), func() {
	It("uses a management PVC shared with the cluster and only releases it", func(ctx SpecContext) {
		ns := alpha.namespace(ctx)
		mpvc := staticClaim(ctx, alpha.Options.Namespace, "imported-"+ns, "alpha")
		staticVolume(ctx, alpha, ns, "static-"+ns, "", mpvc.Name)
		pod := alpha.runPod(ctx, ns, "app", "data", "", false)
		Expect(alpha.Options.VMs[pod.Spec.NodeName]).To(Equal("host-a"))

		By("the operator CLI shows every step of the volume done")
		Eventually(func(g Gomega) {
			out, code := trace(ctx, alpha, "pvc", "data", "-n", ns)
			g.Expect(code).To(Equal(0), "%s", out)
			g.Expect(out).To(ContainSubstring("management namespace %s (from Cluster %s/alpha", alpha.Options.Namespace, alpha.Options.Namespace))
			g.Expect(out).To(ContainSubstring("management PVC %s/%s", alpha.Options.Namespace, mpvc.Name))
			g.Expect(out).To(MatchRegexp(`VirtualMachine %s/%s +done +attached on host host-a as disk pvb`, alpha.Options.Namespace, pod.Spec.NodeName))
		}).WithContext(ctx).WithTimeout(timeout).Should(Succeed())
		By("and its view of the VM shows the claim attached to host-a and hot-plugged")
		out, code := kubectlPvbridge(ctx, "vm", pod.Spec.NodeName, "-n", alpha.Options.Namespace, "--kubeconfig="+mgmt.CP.Kubeconfig)
		Expect(code).To(Equal(0), "%s", out)
		Expect(out).To(ContainSubstring("VirtualMachine %s/%s on host-a: Running", alpha.Options.Namespace, pod.Spec.NodeName))
		Expect(out).To(MatchRegexp(`(?m)^\S+ +%s +\S+ +\S+ +true +true +pvb`, mpvc.Name))
		alpha.deletePod(ctx, pod)

		Expect(alpha.c.Delete(ctx, &corev1.PersistentVolumeClaim{ObjectMeta: metaName(ns, "data")})).To(Succeed())
		gone(ctx, alpha.c, &corev1.PersistentVolume{ObjectMeta: metaName("", "static-"+ns)})
		Expect(mc.Get(ctx, client.ObjectKeyFromObject(mpvc), mpvc)).To(Succeed())
		Expect(mpvc.DeletionTimestamp).To(BeNil(), "the shared management PVC is released, not deleted")
	})

	It("refuses a management PVC that is not shared with the cluster, with the reason", func(ctx SpecContext) {
		ns := alpha.namespace(ctx)
		mpvc := staticClaim(ctx, alpha.Options.Namespace, "foreign-"+ns, "")
		staticVolume(ctx, alpha, ns, "static-"+ns, "", mpvc.Name)
		alpha.create(ctx, deploy.Pod(ns, "app", "data", "vm-1", false))
		Eventually(attachErrors).WithContext(ctx).WithArguments(alpha, "static-"+ns).WithTimeout(timeout).
			Should(ContainElement(ContainSubstring("was not created for cluster alpha and is not shared with it")))
		Expect(vm(ctx, alpha.Options.Namespace, "vm-1").Spec.Volumes).NotTo(ContainElement(HaveField("Name", mpvc.Name)), "never attached")

		By("the operator CLI names the guest VolumeAttachment as what holds the volume, with the reason")
		out, code := trace(ctx, alpha, "pv", "static-"+ns)
		Expect(code).To(Equal(3), "%s", out)
		Expect(out).To(MatchRegexp(`(?m)^held by guest VolumeAttachment \S+ \(node vm-1\): .*was not created for cluster alpha and is not shared with it`))
	})
})

// trace runs the operator CLI, `kubectl pvbridge trace <args>`, against guest g and the
// management cluster as its admin (whose context's namespace is default: the CLI finds the
// guest's namespace by itself), and returns its output and exit code.
func trace(ctx context.Context, g *guestCluster, args ...string) (string, int) {
	GinkgoHelper()
	return kubectlPvbridge(ctx, append([]string{"trace"}, append(args,
		"--kubeconfig="+g.CP.Kubeconfig, "--mgmt-kubeconfig="+mgmt.CP.Kubeconfig)...)...)
}

// kubectlPvbridge runs the operator CLI with args and returns its output and exit code.
func kubectlPvbridge(ctx context.Context, args ...string) (string, int) {
	GinkgoHelper()
	bin, err := lab.Binaries().Own("./pkg/cmd/kubectl-pvbridge")
	Expect(err).NotTo(HaveOccurred())
	cmd := exec.CommandContext(ctx, bin, args...)
	out, err := cmd.CombinedOutput()
	var exit *exec.ExitError
	if err != nil && !errors.As(err, &exit) {
		Fail(fmt.Sprintf("kubectl-pvbridge: %v: %s", err, out))
	}
	return string(out), cmd.ProcessState.ExitCode()
}

// attachErrors returns the attach errors of the guest VolumeAttachments of PV pv.
func attachErrors(ctx context.Context, g *guestCluster, pv string) ([]string, error) {
	vas := &storagev1.VolumeAttachmentList{}
	if err := g.c.List(ctx, vas); err != nil {
		return nil, err
	}
	var messages []string
	for _, va := range vas.Items {
		if ptr.Deref(va.Spec.Source.PersistentVolumeName, "") == pv && va.Status.AttachError != nil {
			messages = append(messages, va.Status.AttachError.Message)
		}
	}
	return messages, nil
}

// staticClaim creates a management PVC in namespace ns as a platform admin imports a volume:
// bound at once on host-a, shared with the clusters named (or none). It is deleted when the
// spec ends.
func staticClaim(ctx context.Context, ns, name, sharedWith string) *corev1.PersistentVolumeClaim {
	GinkgoHelper()
	pvc := deploy.PVC(ns, name, deploy.StorageClassPmemImmediate, "256Mi", true)
	pvc.Annotations = map[string]string{"volume.kubernetes.io/selected-node": "host-a"}
	if sharedWith != "" {
		pvc.Annotations[tenancy.SharedWithAnnotation] = sharedWith
	}
	Expect(mc.Create(ctx, pvc)).To(Succeed())
	DeferCleanup(func(ctx SpecContext) { Expect(client.IgnoreNotFound(mc.Delete(ctx, pvc))).To(Succeed()) })
	Eventually(func(g Gomega) {
		g.Expect(mc.Get(ctx, client.ObjectKeyFromObject(pvc), pvc)).To(Succeed())
		g.Expect(pvc.Status.Phase).To(Equal(corev1.ClaimBound))
	}).WithContext(ctx).WithTimeout(timeout).Should(Succeed())
	return pvc
}

// staticVolume creates in guest g a PV named pv of StorageClass class ("" for none) for
// management PVC handle (on host-a, as the docs show) and a claim "data" in ns bound to it. The
// PV is deleted when the spec ends.
func staticVolume(ctx context.Context, g *guestCluster, ns, pv, class, handle string) {
	GinkgoHelper()
	pvc := deploy.PVC(ns, "data", "", "256Mi", false)
	pvc.Spec.StorageClassName = ptr.To(class)
	pvc.Spec.VolumeName = pv
	obj := deploy.ImportedPV(pv, handle, "host-a", pvc)
	g.create(ctx, obj)
	// The namespace's cleanup, which runs next, waits until it is gone.
	DeferCleanup(func(ctx SpecContext) { Expect(client.IgnoreNotFound(g.c.Delete(ctx, obj))).To(Succeed()) })
	g.create(ctx, pvc)
}

var _ = Describe("Attach", Label("provisioning"), func() {
	// Through the controller's CSI socket, as the sidecars call it: fifty volumes published at
	// once to one VM through the real vm-operator, then the VM is deleted: unpublishing from a VM
	// that is gone succeeds, and nothing is left attached.
	It("publishes fifty volumes at once to one VM, and unpublishes them all once it is deleted", func(ctx SpecContext) {
		const vmName = "vm-extra"
		obj := &vmv1.VirtualMachine{
			ObjectMeta: metaName(alpha.Options.Namespace, vmName),
			Spec:       vmv1.VirtualMachineSpec{Host: "host-b", PowerState: vmv1.PowerStateOn},
		}
		obj.Labels = map[string]string{tenancy.CAPIClusterNameLabel: alpha.Options.Name}
		Expect(mc.Create(ctx, obj)).To(Succeed())
		ctrl := controllerClient(alpha.Guest)
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
					AccessibilityRequirements: &csi.TopologyRequirement{Requisite: []*csi.Topology{{Segments: map[string]string{names.GuestTopologyKey: "host-b"}}}},
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
		Expect(errs).To(BeEmpty())
		Expect(mc.Get(ctx, client.ObjectKeyFromObject(obj), obj)).To(Succeed())
		Expect(obj.Spec.Volumes).To(HaveLen(n), "no entry is lost")
		Expect(obj.Status.Volumes).To(HaveEach(HaveField("Attached", BeTrue())))

		Expect(mc.Delete(ctx, obj)).To(Succeed())
		gone(ctx, mc, obj) // vm-operator detaches every disk of a deleted VM first
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
		Expect(errs).To(BeEmpty())
		Expect(ownedClaims(ctx, alpha)).To(BeEmpty())
	})
})

// controllerClient dials guest g's guest-csi controller as its sidecars do.
func controllerClient(g *deploy.Guest) csi.ControllerClient {
	GinkgoHelper()
	conn, err := grpc.NewClient("unix://"+g.ControllerSocket(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	Expect(err).NotTo(HaveOccurred())
	DeferCleanup(conn.Close)
	return csi.NewControllerClient(conn)
}

// retried calls rpc, each call bounded by the sidecars' 30 s, until it succeeds or fails with a
// code the sidecars do not retry as work in progress. Its backoff doubles from 100 ms to 1 s:
// an Aborted answer comes at once, and a thousand callers must not spin on it.
func retried[Req, Resp any](ctx context.Context, rpc func(context.Context, Req, ...grpc.CallOption) (Resp, error), req Req) (Resp, error) {
	backoff := 100 * time.Millisecond
	for {
		cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		resp, err := rpc(cctx, req)
		cancel()
		if err == nil || !retryable(err) {
			return resp, err
		}
		select {
		case <-ctx.Done():
			return resp, err
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, time.Second)
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
