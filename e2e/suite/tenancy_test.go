package suite_test

import (
	"bytes"
	"context"
	"encoding/pem"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strings"
	"time"

	groupsnapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumegroupsnapshot/v1"
	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pvbridge.io/e2e/cluster"
	"pvbridge.io/e2e/deploy"
	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/pkg/names"
	"pvbridge.io/pkg/tenancy"
)

// identity is a client of the management cluster as guest g's guest-csi: with the credential
// the tenants controller delivered into the guest.
func identity(g *guestCluster) client.Client {
	GinkgoHelper()
	cfg, err := clientcmd.BuildConfigFromFlags("", g.MgmtKubeconfig)
	Expect(err).NotTo(HaveOccurred())
	c, err := client.New(cfg, client.Options{Scheme: mc.Scheme()})
	Expect(err).NotTo(HaveOccurred())
	return c
}

// allowClass adds a management class to guest g's allow-list of its kind (the Cluster's
// annotation, such as tenancy.StorageClassesAnnotation) for the spec, and waits until the
// admission policy's parameters have it (under param, such as tenancy.ParamStorageClasses).
func allowClass(ctx context.Context, g *guestCluster, annotation, param, class string) {
	GinkgoHelper()
	capi := &unstructured.Unstructured{}
	capi.SetAPIVersion("cluster.x-k8s.io/v1beta2")
	capi.SetKind("Cluster")
	Expect(mc.Get(ctx, client.ObjectKey{Namespace: g.Options.Namespace, Name: g.Options.Name}, capi)).To(Succeed())
	set := func(ctx context.Context, classes string) {
		GinkgoHelper()
		patch := client.MergeFrom(capi.DeepCopy())
		annotations := capi.GetAnnotations()
		annotations[annotation] = classes
		capi.SetAnnotations(annotations)
		Expect(mc.Patch(ctx, capi, patch)).To(Succeed())
	}
	before := capi.GetAnnotations()[annotation]
	set(ctx, before+","+class)
	DeferCleanup(func(ctx SpecContext) { set(ctx, before) })
	Eventually(func(g2 Gomega) {
		params := &corev1.ConfigMap{}
		g2.Expect(mc.Get(ctx, client.ObjectKey{Namespace: g.Options.Namespace, Name: tenancy.ParamsConfigMap}, params)).To(Succeed())
		g2.Expect(strings.Split(params.Data[g.Options.Name+param], ",")).To(ContainElement(class))
	}).WithContext(ctx).WithTimeout(timeout).Should(Succeed())
}

// quota limits resource to limit in namespace ns of the management cluster until the spec
// ends, once the quota controller has counted the namespace.
func quota(ctx context.Context, ns, name string, resourceName corev1.ResourceName, limit string) *corev1.ResourceQuota {
	GinkgoHelper()
	q := &corev1.ResourceQuota{
		ObjectMeta: metaName(ns, name),
		Spec:       corev1.ResourceQuotaSpec{Hard: corev1.ResourceList{resourceName: resource.MustParse(limit)}},
	}
	Expect(mc.Create(ctx, q)).To(Succeed())
	DeferCleanup(func(ctx SpecContext) { Expect(client.IgnoreNotFound(mc.Delete(ctx, q))).To(Succeed()) })
	Eventually(func(g Gomega) {
		g.Expect(mc.Get(ctx, client.ObjectKeyFromObject(q), q)).To(Succeed())
		g.Expect(q.Status.Used).To(HaveKey(resourceName), "the quota controller has counted the namespace")
	}).WithContext(ctx).WithTimeout(timeout).Should(Succeed())
	return q
}

var _ = Describe("Tenancy", Label("tenancy"), func() {
	It("refuses, with the reason on the guest PVC, a management StorageClass outside the allow-list and a claim beyond the quota", func(ctx SpecContext) {
		ns := alpha.namespace(ctx)
		By("a guest StorageClass naming a management class the cluster may not use")
		// The premium class exists (so the guest sees its capacity and schedules the pod); it is
		// only not on alpha's allow-list.
		storageClass(ctx, mc, "pmem-premium", names.PmemDriver, corev1.PersistentVolumeReclaimDelete, map[string]string{"csi.storage.k8s.io/fstype": "ext4"})
		storageClass(ctx, alpha.c, "premium", names.GuestDriver, corev1.PersistentVolumeReclaimDelete, map[string]string{names.MgmtStorageClassParam: "pmem-premium"})
		alpha.create(ctx, deploy.PVC(ns, "premium", "premium", "64Mi", false))
		alpha.create(ctx, deploy.Pod(ns, "premium", "premium", "vm-1", false))
		Eventually(events).WithContext(ctx).WithArguments(alpha.c, ns, "premium").WithTimeout(timeout).Should(ContainElement(And(
			ContainSubstring("ProvisioningFailed"), ContainSubstring("names StorageClass pmem-premium, which guest cluster alpha may not use"))))

		By("a claim beyond the tenant's quota of the class")
		quota(ctx, alpha.Options.Namespace, "pmem", corev1.ResourceName(deploy.StorageClassPmem+".storageclass.storage.k8s.io/requests.storage"), "1Gi")
		alpha.create(ctx, deploy.PVC(ns, "big", "", "2Gi", false))
		alpha.create(ctx, deploy.Pod(ns, "big", "big", "vm-1", false))
		Eventually(events).WithContext(ctx).WithArguments(alpha.c, ns, "big").WithTimeout(timeout).Should(ContainElement(And(
			ContainSubstring("ProvisioningFailed"), ContainSubstring("exceeded quota"))))
		Expect(ownedClaims(ctx, alpha)).To(BeEmpty(), "nothing half-created")
	})

	It("counts a tenant's snapshots against its quota (a snapshot takes its source's size on the source's host)", func(ctx SpecContext) {
		ns := alpha.namespace(ctx)
		alpha.create(ctx, deploy.PVC(ns, "data", "", "64Mi", false))
		alpha.runPod(ctx, ns, "writer", "data", "vm-1", false)
		alpha.bound(ctx, ns, "data")
		q := quota(ctx, alpha.Options.Namespace, "snapshots", "count/volumesnapshots.snapshot.storage.k8s.io", "1")

		alpha.readySnapshot(ctx, alpha.snapshot(ctx, ns, "first", "data"))
		second := alpha.snapshot(ctx, ns, "second", "data")
		alpha.refused(ctx, second, ContainSubstring("exceeded quota: snapshots"))
		msnaps := &snapshotv1.VolumeSnapshotList{}
		Expect(mc.List(ctx, msnaps, client.InNamespace(alpha.Options.Namespace), client.MatchingLabels{tenancy.ClusterUIDLabel: alpha.UID})).To(Succeed())
		Expect(msnaps.Items).To(HaveLen(1), "the refused snapshot left nothing behind")

		// ResourceExhausted is not final: the sidecar retries, and takes it once the quota allows.
		// (Until then deleting the refused snapshot waits too: csi-snapshotter keeps a creation
		// that may still succeed in progress.)
		Expect(mc.Delete(ctx, q)).To(Succeed())
		alpha.readySnapshot(ctx, second)
	})

	It("refuses a guest identity's writes labelled for another cluster and attaches of claims it may not use", func(ctx SpecContext) {
		me := identity(alpha)
		stolen := deploy.PVC(alpha.Options.Namespace, alpha.UID+"-stolen", deploy.StorageClassPmem, "64Mi", true)
		stolen.Labels = map[string]string{tenancy.ClusterNameLabel: "beta", tenancy.ClusterUIDLabel: beta.UID}
		err := me.Create(ctx, stolen)
		Expect(apierrors.IsForbidden(err)).To(BeTrue(), "%v", err)
		Expect(err.Error()).To(ContainSubstring("must be labelled pvbridge.io/cluster=alpha"))

		foreign := staticClaim(ctx, alpha.Options.Namespace, "not-shared", "")
		target := vm(ctx, alpha.Options.Namespace, "vm-1")
		patch := client.MergeFrom(target.DeepCopy())
		target.Spec.Volumes = append(target.Spec.Volumes, vmv1.VirtualMachineVolume{Name: foreign.Name, PersistentVolumeClaim: vmv1.PersistentVolumeClaimVolumeSource{ClaimName: foreign.Name}})
		err = me.Patch(ctx, target, patch)
		Expect(apierrors.IsForbidden(err)).To(BeTrue(), "%v", err)
		Expect(err.Error()).To(ContainSubstring("only claims it owns"))
	})

	It("lets a second cluster of alpha's namespace, with the credential delivered into it, read alpha's objects and change none", func(ctx SpecContext) {
		ns := alpha.Options.Namespace
		By("guest cluster delta, with a control plane of its own, opted in to alpha's namespace")
		gcp, err := lab.StartControlPlane(ctx, "guest-d")
		Expect(err).NotTo(HaveOccurred())
		DeferCleanup(gcp.Stop)
		kubeconfig, err := os.ReadFile(gcp.Kubeconfig)
		Expect(err).NotTo(HaveOccurred())
		uid, err := deploy.CreateTenant(ctx, mc, deploy.GuestOptions{Namespace: ns, Name: "delta"}, gcp.Server, kubeconfig, nil)
		Expect(err).NotTo(HaveOccurred())
		DeferCleanup(deleteCluster, ns, "delta")
		// Its VM, as Cluster API makes it; powered off: only what admission decides is tried.
		deltaVM := &vmv1.VirtualMachine{
			ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "vm-d1", Labels: map[string]string{tenancy.CAPIClusterNameLabel: "delta"}},
			Spec:       vmv1.VirtualMachineSpec{Host: "host-a", PowerState: vmv1.PowerStateOff},
		}
		Expect(mc.Create(ctx, deltaVM)).To(Succeed())
		DeferCleanup(func(ctx SpecContext) {
			Expect(client.IgnoreNotFound(mc.Delete(ctx, deltaVM))).To(Succeed())
			gone(ctx, mc, deltaVM)
		})
		var delivered []byte
		Eventually(func(g Gomega) {
			var err error
			delivered, err = deploy.DeliveredCredential(ctx, gcp)
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(delivered).NotTo(BeEmpty())
		}).WithContext(ctx).WithTimeout(timeout).Should(Succeed())
		cfg, err := clientcmd.RESTConfigFromKubeConfig(delivered)
		Expect(err).NotTo(HaveOccurred())
		delta, err := client.New(cfg, client.Options{Scheme: mc.Scheme()})
		Expect(err).NotTo(HaveOccurred())
		mine := map[string]string{tenancy.ClusterNameLabel: "delta", tenancy.ClusterUIDLabel: uid}
		forbidden := func(err error, message string) {
			GinkgoHelper()
			Expect(apierrors.IsForbidden(err)).To(BeTrue(), "%v", err)
			Expect(err.Error()).To(ContainSubstring(message))
		}

		By("a claim of alpha's, bound on host-a")
		claim := staticClaim(ctx, ns, alpha.UID+"-walk", "")
		labelled := client.MergeFrom(claim.DeepCopy())
		claim.Labels = map[string]string{tenancy.ClusterNameLabel: "alpha", tenancy.ClusterUIDLabel: alpha.UID}
		Expect(mc.Patch(ctx, claim, labelled)).To(Succeed())

		By("delta reads the namespace's claims and VMs, alpha's among them: RBAC cannot filter reads by label (docs/security.md)")
		claims := &corev1.PersistentVolumeClaimList{}
		Expect(delta.List(ctx, claims, client.InNamespace(ns))).To(Succeed())
		Expect(claims.Items).To(ContainElement(HaveField("Name", claim.Name)))
		vms := &vmv1.VirtualMachineList{}
		Expect(delta.List(ctx, vms, client.InNamespace(ns))).To(Succeed())
		Expect(vms.Items).To(ContainElement(HaveField("Name", "vm-1")))

		By("and writes its own (server-side dry run), so that each refusal below is about alpha's objects")
		own := deploy.PVC(ns, uid+"-own", deploy.StorageClassPmem, "64Mi", true)
		own.Labels = mine
		Expect(delta.Create(ctx, own, client.DryRunAll)).To(Succeed())
		plug := client.MergeFrom(deltaVM.DeepCopy())
		deltaVM.Spec.Volumes = []vmv1.VirtualMachineVolume{{Name: own.Name, PersistentVolumeClaim: vmv1.PersistentVolumeClaimVolumeSource{ClaimName: own.Name}}}
		Expect(delta.Patch(ctx, deltaVM.DeepCopy(), plug, client.DryRunAll)).To(Succeed())

		By("alpha's claim: relabelled or deleted")
		relabel := client.MergeFrom(claim.DeepCopy())
		stolen := claim.DeepCopy()
		stolen.Labels = mine
		belongs := fmt.Sprintf("PersistentVolumeClaim %s/%s belongs to cluster alpha (pvbridge.io/cluster-uid=%s), not to guest cluster delta (uid %s)", ns, claim.Name, alpha.UID, uid)
		forbidden(delta.Patch(ctx, stolen, relabel), belongs+": it may not change it")
		forbidden(delta.Delete(ctx, claim.DeepCopy()), belongs+": it may not delete it")

		By("a claim named after alpha's UID")
		named := deploy.PVC(ns, alpha.UID+"-mine", deploy.StorageClassPmem, "64Mi", true)
		named.Labels = mine
		forbidden(delta.Create(ctx, named), fmt.Sprintf("guest cluster delta may create only objects named %s-…", uid))

		By("a snapshot of alpha's claim, and a group snapshot selecting alpha's claims")
		snap := &snapshotv1.VolumeSnapshot{
			ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: uid + "-walk", Labels: mine},
			Spec: snapshotv1.VolumeSnapshotSpec{
				Source: snapshotv1.VolumeSnapshotSource{PersistentVolumeClaimName: ptr.To(claim.Name)}, VolumeSnapshotClassName: ptr.To(deploy.SnapshotClassPmem),
			},
		}
		forbidden(delta.Create(ctx, snap), fmt.Sprintf("its source PersistentVolumeClaim %s/%s is neither owned by guest cluster delta", ns, claim.Name))
		group := &groupsnapshotv1.VolumeGroupSnapshot{
			ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: uid + "-walk", Labels: mine},
			Spec: groupsnapshotv1.VolumeGroupSnapshotSpec{
				Source: groupsnapshotv1.VolumeGroupSnapshotSource{Selector: &metav1.LabelSelector{
					MatchLabels: map[string]string{tenancy.ClusterUIDLabel: alpha.UID, tenancy.VolumeGroupLabel: "walk"}}},
				VolumeGroupSnapshotClassName: ptr.To(deploy.SnapshotClassPmem),
			},
		}
		forbidden(delta.Create(ctx, group), "must select its claims by exactly the labels pvbridge.io/cluster-uid="+uid)

		By("alpha's VM, and alpha's claim in delta's own VM")
		target := vm(ctx, ns, "vm-1")
		add := client.MergeFrom(target.DeepCopy())
		target.Spec.Volumes = append(target.Spec.Volumes, vmv1.VirtualMachineVolume{Name: claim.Name, PersistentVolumeClaim: vmv1.PersistentVolumeClaimVolumeSource{ClaimName: claim.Name}})
		forbidden(delta.Patch(ctx, target, add), fmt.Sprintf("VirtualMachine %s/vm-1 belongs to cluster alpha (label cluster.x-k8s.io/cluster-name), not to guest cluster delta", ns))
		Expect(mc.Get(ctx, client.ObjectKeyFromObject(deltaVM), deltaVM)).To(Succeed())
		plug = client.MergeFrom(deltaVM.DeepCopy())
		deltaVM.Spec.Volumes = []vmv1.VirtualMachineVolume{{Name: claim.Name, PersistentVolumeClaim: vmv1.PersistentVolumeClaimVolumeSource{ClaimName: claim.Name}}}
		forbidden(delta.Patch(ctx, deltaVM, plug), fmt.Sprintf("guest cluster delta may attach to VirtualMachine %s/vm-d1 only claims it owns (named %s-…)", ns, uid))

		By("nothing of alpha's changed")
		Expect(mc.Get(ctx, client.ObjectKeyFromObject(claim), claim)).To(Succeed())
		Expect(claim.Labels).To(HaveKeyWithValue(tenancy.ClusterUIDLabel, alpha.UID))
		Expect(claim.DeletionTimestamp).To(BeNil())
		Expect(vm(ctx, ns, "vm-1").Spec.Volumes).NotTo(ContainElement(HaveField("Name", claim.Name)))
	})

	It("attaches another cluster's volume while a guest floods its VM with entries for claims that do not exist", func(ctx SpecContext) {
		quiet, flooded := attachBesideVMFlood(ctx, 1)
		AddReportEntry("beta's attach", fmt.Sprintf("quiet %v, while alpha floods %v (make bench times 3 rounds)", quiet, flooded))
	})

	It("takes another cluster's snapshot and attaches its volume while a guest floods group snapshots whose holds overrun", Label("groupsnapshot"), func(ctx SpecContext) {
		quiet, flooded := snapshotBesideGroupFlood(ctx, 1)
		AddReportEntry("beta's snapshot and attach", fmt.Sprintf("quiet %v, while alpha floods %v (make bench times 3 rounds)", quiet, flooded))
	})

	It("installs the guest side with every image from the platform's registry mirror", func(ctx SpecContext) {
		var templates []corev1.PodTemplateSpec
		deployments := &appsv1.DeploymentList{}
		Expect(alpha.c.List(ctx, deployments, client.InNamespace(deploy.GuestInstallNamespace))).To(Succeed())
		for _, d := range deployments.Items {
			templates = append(templates, d.Spec.Template)
		}
		daemonSets := &appsv1.DaemonSetList{}
		Expect(alpha.c.List(ctx, daemonSets, client.InNamespace(deploy.GuestInstallNamespace))).To(Succeed())
		for _, d := range daemonSets.Items {
			templates = append(templates, d.Spec.Template)
		}
		var images []string
		for _, t := range templates {
			for _, c := range append(t.Spec.InitContainers, t.Spec.Containers...) {
				images = append(images, c.Image)
			}
		}
		Expect(images).To(ContainElements(guestMirror+"/pvbridge/guest-csi:v0.1.0", guestMirror+"/sig-storage/csi-provisioner:v6.4.0"))
		Expect(images).To(HaveEach(HavePrefix(guestMirror + "/")))
	})

	It("rotates a revoked credential without a failed RPC beyond retries", func(ctx SpecContext) {
		switched := logged(alpha.Controller.LogPath, credentialSwitched)
		before, restarts := switched(), alpha.Controller.Restarts()
		ns := alpha.namespace(ctx)
		alpha.create(ctx, deploy.PVC(ns, "before", "", "64Mi", false))
		alpha.runPod(ctx, ns, "before", "before", "vm-3", false)

		By("revoking every token of alpha's identity: its ServiceAccount is deleted")
		renewed := revokeIdentity(ctx, alpha)
		alpha.create(ctx, deploy.PVC(ns, "during", "", "64Mi", false))
		alpha.create(ctx, deploy.Pod(ns, "during", "during", "vm-3", false))

		By("the tenants controller makes a new identity, delivers its token, and guest-csi switches")
		renewed()
		Eventually(switched).WithContext(ctx).WithTimeout(timeout).Should(BeNumerically(">", before))
		Eventually(func(g Gomega) {
			pod := &corev1.Pod{}
			g.Expect(alpha.c.Get(ctx, client.ObjectKey{Namespace: ns, Name: "during"}, pod)).To(Succeed())
			g.Expect(pod.Status.Phase).To(Equal(corev1.PodRunning))
		}).WithContext(ctx).WithTimeout(timeout).Should(Succeed())
		Expect(alpha.Controller.Restarts()).To(Equal(restarts), "guest-csi was not restarted")
	})

	It("reads a hostile guest apiserver's endless answer up to 4 MiB, and delivers another cluster's renewed credential beside a guest that answers a byte a second", func(ctx SpecContext) {
		By("a guest whose apiserver answers every request with a body that never ends")
		// As one trying to hold the tenants controller's memory and workers would.
		hostileGuest(ctx, "tenant-h", "hostile", func(w http.ResponseWriter, r *http.Request) {
			_, _ = io.WriteString(w, `{"apiVersion":"v1","kind":"Secret","metadata":{"name":"`)
			chunk := bytes.Repeat([]byte("x"), 64<<10)
			for r.Context().Err() == nil {
				if _, err := w.Write(chunk); err != nil {
					return
				}
			}
		})
		Eventually(func(g Gomega) {
			l := &corev1.EventList{}
			g.Expect(mc.List(ctx, l, client.InNamespace("tenant-h"))).To(Succeed())
			g.Expect(l.Items).To(ContainElement(And(HaveField("Reason", "GuestUnreachable"),
				HaveField("Message", ContainSubstring("the guest apiserver's response is larger than 4194304 bytes")))))
		}).WithContext(ctx).WithTimeout(timeout).Should(Succeed())

		quiet, beside := credentialBesideSlowGuest(ctx, 1)
		AddReportEntry("beta's credential delivery", fmt.Sprintf("quiet %v, beside the slow guest %v (make bench times 3 rounds)", quiet, beside))
	})

	It("cleans up after a deleted guest Cluster once its VMs are gone, and touches nothing else", func(ctx SpecContext) {
		const ns, name = "tenant-c", "gamma"
		Expect(mc.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns, Labels: map[string]string{tenancy.TenancyNamespaceLabel: "enforced"}}})).To(Succeed())
		DeferCleanup(func(ctx SpecContext) {
			Expect(mc.Delete(ctx, &corev1.Namespace{ObjectMeta: metaName("", ns)})).To(Succeed())
		})
		// A guest whose control plane never came up: no kubeconfig Secret, nothing delivered.
		capi := deploy.NewCluster(ns, name, deploy.StorageClassPmemImmediate, "127.0.0.1", 1)
		Expect(mc.Create(ctx, capi)).To(Succeed())
		uid := string(capi.GetUID())
		Eventually(func(g Gomega) {
			g.Expect(mc.Get(ctx, client.ObjectKeyFromObject(capi), capi)).To(Succeed())
			g.Expect(capi.GetFinalizers()).To(ContainElement("pvbridge.io/cleanup"))
		}).WithContext(ctx).WithTimeout(timeout).Should(Succeed())

		By("a VM of the cluster with a volume it owns attached, and a volume shared with it")
		machine := &vmv1.VirtualMachine{
			ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "vm-c1", Labels: map[string]string{tenancy.CAPIClusterNameLabel: name}},
			Spec:       vmv1.VirtualMachineSpec{Host: "host-a", PowerState: vmv1.PowerStateOn}, // where staticClaim puts volumes
		}
		owned := staticClaim(ctx, ns, uid+"-data", "")
		labelled := client.MergeFrom(owned.DeepCopy())
		owned.Labels = map[string]string{tenancy.ClusterNameLabel: name, tenancy.ClusterUIDLabel: uid}
		Expect(mc.Patch(ctx, owned, labelled)).To(Succeed())
		shared := staticClaim(ctx, ns, "shared", name+",delta")
		machine.Spec.Volumes = []vmv1.VirtualMachineVolume{{Name: "data", PersistentVolumeClaim: vmv1.PersistentVolumeClaimVolumeSource{ClaimName: owned.Name}}}
		Expect(mc.Create(ctx, machine)).To(Succeed())
		Eventually(func(g Gomega) {
			g.Expect(mc.Get(ctx, client.ObjectKeyFromObject(machine), machine)).To(Succeed())
			g.Expect(machine.Status.Volumes).To(ContainElement(HaveField("Attached", BeTrue())))
		}).WithContext(ctx).WithTimeout(timeout).Should(Succeed())
		alphaClaims := len(ownedClaims(ctx, alpha))

		By("deleting the Cluster: its volumes stay while its VM runs")
		Expect(mc.Delete(ctx, capi)).To(Succeed())
		Eventually(func(g Gomega) {
			l := &corev1.EventList{}
			g.Expect(mc.List(ctx, l, client.InNamespace(ns))).To(Succeed())
			g.Expect(l.Items).To(ContainElement(HaveField("Reason", "WaitingForVirtualMachines")))
		}).WithContext(ctx).WithTimeout(timeout).Should(Succeed())
		Expect(mc.Get(ctx, client.ObjectKeyFromObject(owned), owned)).To(Succeed())
		Expect(owned.DeletionTimestamp).To(BeNil())

		By("once Cluster API has deleted the VM, the owned volume goes (PVC, PV, PMEM) and the shared one is released")
		pv := &corev1.PersistentVolume{ObjectMeta: metaName("", owned.Spec.VolumeName)}
		Expect(mc.Delete(ctx, machine)).To(Succeed())
		gone(ctx, mc, capi)
		gone(ctx, mc, owned)
		gone(ctx, mc, pv)
		// Its PMEM is free again: the leak check after the spec compares every host's.
		Expect(mc.Get(ctx, client.ObjectKeyFromObject(shared), shared)).To(Succeed())
		Expect(shared.DeletionTimestamp).To(BeNil())
		Expect(shared.Annotations).To(HaveKeyWithValue(tenancy.SharedWithAnnotation, "delta"))
		Expect(ownedClaims(ctx, alpha)).To(HaveLen(alphaClaims), "another cluster's volumes are untouched")
	})
})

// credentialSwitched is what guest-csi logs when it takes a new management credential.
const credentialSwitched = "The management credential changed; switched to a new session"

// logged counts the lines of the log at path that say line, at each call.
func logged(path, line string) func() int {
	return func() int {
		GinkgoHelper()
		n, err := cluster.CountInLog(path, line)
		Expect(err).NotTo(HaveOccurred())
		return n
	}
}

// revokeIdentity revokes every token of guest g's management identity by deleting its
// ServiceAccount; the returned wait returns once the tenants controller has made it anew.
func revokeIdentity(ctx context.Context, g *guestCluster) (wait func()) {
	GinkgoHelper()
	sa := &corev1.ServiceAccount{ObjectMeta: metaName(g.Options.Namespace, g.Options.Name+"-pvbridge")}
	Expect(mc.Get(ctx, client.ObjectKeyFromObject(sa), sa)).To(Succeed())
	old := sa.UID
	Expect(mc.Delete(ctx, sa)).To(Succeed())
	return func() {
		GinkgoHelper()
		Eventually(func(g Gomega) {
			g.Expect(mc.Get(ctx, client.ObjectKeyFromObject(sa), sa)).To(Succeed())
			g.Expect(sa.UID).NotTo(Equal(old))
		}).WithContext(ctx).WithTimeout(timeout).Should(Succeed())
	}
}

// hostileGuest makes a guest Cluster in namespace ns (a new one) whose kubeconfig names a TLS
// server of this process answering every request with answer: a guest apiserver under its
// tenant's control. Cleaned up when the spec ends.
func hostileGuest(ctx context.Context, ns, name string, answer http.HandlerFunc) {
	GinkgoHelper()
	server := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		answer(w, r)
	}))
	DeferCleanup(func() {
		server.CloseClientConnections()
		server.Close()
	})
	kubeconfig := clientcmdapi.NewConfig()
	kubeconfig.Clusters[name] = &clientcmdapi.Cluster{Server: server.URL,
		CertificateAuthorityData: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: server.Certificate().Raw})}
	kubeconfig.AuthInfos["admin"] = &clientcmdapi.AuthInfo{Token: name}
	kubeconfig.Contexts[name] = &clientcmdapi.Context{Cluster: name, AuthInfo: "admin"}
	kubeconfig.CurrentContext = name
	data, err := clientcmd.Write(*kubeconfig)
	Expect(err).NotTo(HaveOccurred())
	_, err = deploy.CreateTenant(ctx, mc, deploy.GuestOptions{Namespace: ns, Name: name}, server.URL, data, nil)
	Expect(err).NotTo(HaveOccurred())
	DeferCleanup(func(ctx SpecContext) {
		deleteCluster(ctx, ns, name)
		Expect(mc.Delete(ctx, &corev1.Namespace{ObjectMeta: metaName("", ns)})).To(Succeed())
	})
}

// deleteCluster deletes guest Cluster ns/name and waits until it is gone: the tenants
// controller has cleaned up after it.
func deleteCluster(ctx context.Context, ns, name string) {
	GinkgoHelper()
	capi := deploy.NewCluster(ns, name, "", "", 0)
	Expect(client.IgnoreNotFound(mc.Delete(ctx, capi))).To(Succeed())
	gone(ctx, mc, capi)
}

// floodVM makes guest g, with its own credential, replace the volume entries it added to its VM
// twice a second by 60 entries for claims of its own names that do not exist, as a tenant
// trying to slow vm-operator for everyone would. The returned stop ends the flood, removes the
// entries and tells how many patches were accepted.
func floodVM(ctx context.Context, g *guestCluster, name string) (stop func() int) {
	GinkgoHelper()
	me := identity(g)
	ghost := g.UID + "-ghost-"
	keep := func(v vmv1.VirtualMachineVolume) bool { return !strings.HasPrefix(v.Name, ghost) }
	set := func(ctx context.Context, generation int) error {
		obj := &vmv1.VirtualMachine{}
		if err := me.Get(ctx, client.ObjectKey{Namespace: g.Options.Namespace, Name: name}, obj); err != nil {
			return err
		}
		patch := client.MergeFromWithOptions(obj.DeepCopy(), client.MergeFromWithOptimisticLock{})
		volumes := slices.DeleteFunc(slices.Clone(obj.Spec.Volumes), func(v vmv1.VirtualMachineVolume) bool { return !keep(v) })
		for i := 0; generation >= 0 && len(volumes) < 60; i++ {
			claim := fmt.Sprintf("%s%d-%d", ghost, generation, i)
			volumes = append(volumes, vmv1.VirtualMachineVolume{Name: claim, PersistentVolumeClaim: vmv1.PersistentVolumeClaimVolumeSource{ClaimName: claim}})
		}
		obj.Spec.Volumes = volumes
		return me.Patch(ctx, obj, patch)
	}
	floodCtx, cancel := context.WithCancel(ctx)
	done := make(chan int)
	go func() {
		defer GinkgoRecover()
		accepted := 0
		for generation := 0; floodCtx.Err() == nil; generation++ {
			if err := set(floodCtx, generation); err == nil {
				accepted++
			} else if floodCtx.Err() == nil && !apierrors.IsConflict(err) {
				Expect(err).NotTo(HaveOccurred(), "the guest's own entries are its right")
			}
			select {
			case <-floodCtx.Done():
			case <-time.After(500 * time.Millisecond):
			}
		}
		done <- accepted
	}()
	return func() int {
		cancel()
		accepted := <-done
		Eventually(func() error { return set(ctx, -1) }).WithContext(ctx).WithTimeout(timeout).Should(Succeed())
		return accepted
	}
}
