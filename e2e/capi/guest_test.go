package capi_test

import (
	"context"
	"fmt"
	"os/exec"
	"strings"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pvbridge.io/e2e/deploy"
	infrav1 "pvbridge.io/pkg/apis/infrastructure/v1alpha1"
	pmemv1 "pvbridge.io/pkg/apis/pmem/v1alpha1"
	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
)

// TestClusterAPIGuest runs two tracks on the one guest at once, then tries to move it with
// clusterctl and deletes it: the QEMU worker's (minutes of an emulated CPU's boot, then its
// step) beside the steps of the Machines on the local hosts, which run in order, each on what
// the one before left.
func TestClusterAPIGuest(t *testing.T) {
	t.Run("OnTheGuest", func(t *testing.T) {
		t.Run("QEMUWorkerRunsAStatefulSet", beside(qemuWorkerRunsAStatefulSet))
		t.Run("Steps", beside(func(t *testing.T) {
			for _, step := range []struct {
				name string
				run  func(*testing.T)
			}{
				{"MachineHealthCheckWatchesTheWorkers", machineHealthCheckWatchesTheWorkers},
				{"StatefulSetKeepsItsData", statefulSetKeepsItsData},
				{"ClusterctlUpgradesTheProvider", clusterctlUpgradesTheProvider},
				{"StorageOnTheGuest", storageOnTheGuest},
				{"ScaleDownMovesVolumes", scaleDownMovesVolumes},
				{"RollingReplacementMovesVolumes", rollingReplacementMovesVolumes},
				{"WorkerDeletedWhileAPodWrites", workerDeletedWhileAPodWrites},
				{"HostLostWhileAPodWrites", hostLostWhileAPodWrites},
				{"ClusterClassMakesAGuest", clusterClassMakesAGuest},
				{"ClusterAPISpecs", clusterAPISpecs},
			} {
				if !t.Run(step.name, step.run) {
					return // the next steps build on this one
				}
			}
		}))
	})
	if !t.Failed() {
		t.Run("ClusterctlMoveIsRefused", clusterctlMoveIsRefused)
		t.Run("ClusterDeletionLeavesNothing", clusterDeletionLeavesNothing)
	}
}

// beside runs a track beside the other tracks of its parent test.
func beside(track func(*testing.T)) func(*testing.T) {
	return func(t *testing.T) {
		t.Parallel()
		track(t)
	}
}

// statefulSetKeepsItsData: a StatefulSet of 3 with a volume each on the guest that Cluster API
// made; each pod writes its name to its volume; every pod is deleted and comes back, and each
// reads its own data back in its container.
func statefulSetKeepsItsData(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	t.Logf("the guest made by Cluster API: its template applied → %d Machines Running with Ready Nodes and guest-csi on the workers after %.0f s", 1+in.Options.Workers, in.GuestReadyAfter.Seconds())
	c := in.Guest.Client()
	ns, err := deploy.CreateNamespace(ctx, c, "sts")
	g.Expect(err).NotTo(HaveOccurred())

	start := time.Now()
	_, err = c.AppsV1().StatefulSets(ns).Create(ctx, deploy.StatefulSet(ns, "web", 3, "64Mi"), metav1.CreateOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	pods := waitPodsRunning(ctx, g, ns, "web", 3)
	t.Logf("StatefulSet of 3: every pod Running with its volume %.0f s after its creation", time.Since(start).Seconds())
	writeNames(ctx, g, ns, pods)

	g.Expect(c.CoreV1().Pods(ns).DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{LabelSelector: "app=web"})).To(Succeed())
	g.Eventually(func(g Gomega) {
		list, err := c.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: "app=web"})
		g.Expect(err).NotTo(HaveOccurred())
		for _, p := range list.Items {
			g.Expect(p.UID).NotTo(BeElementOf(uids(pods)), "pod %s not recreated yet", p.Name)
		}
	}).WithContext(ctx).WithTimeout(2 * time.Minute).Should(Succeed())
	readNamesBack(ctx, g, waitPodsRunning(ctx, g, ns, "web", 3))
}

// writeNames has each pod write its name to its volume, synced.
func writeNames(ctx context.Context, g Gomega, ns string, pods []corev1.Pod) {
	for _, p := range pods {
		g.Expect(kubectl(ctx, "exec", "-n", ns, p.Name, "--", "sh", "-c", "echo "+p.Name+" > /data/name && sync")).To(BeEmpty())
	}
}

// readNamesBack has each pod read its name back from its volume, in its container.
func readNamesBack(ctx context.Context, g Gomega, pods []corev1.Pod) {
	for _, p := range pods {
		g.Expect(kubectl(ctx, "exec", "-n", p.Namespace, p.Name, "--", "cat", "/data/name")).To(Equal(p.Name+"\n"), "pod %s on %s", p.Name, p.Spec.NodeName)
	}
}

// clusterDeletionLeavesNothing deletes the guest's Cluster while the
// StatefulSet's volumes are attached: Cluster API deletes its Machines (no drain while the Cluster
// goes), the provider powers their VMs off and deletes them, and then every management object of
// the guest is gone: its VirtualMachines, claims, volumes and PMEM volumes, VolumeAttachments, and
// the credential the tenants controller made for it.
func clusterDeletionLeavesNothing(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	mc := mgmtClient(g)
	ns := in.Options.Guest.Namespace
	var vmNames []string
	for _, m := range machines(ctx, g, mc, "") {
		vmNames = append(vmNames, m.GetName())
	}

	// The guest's volumes in the management cluster, attached to its VMs.
	claims := &corev1.PersistentVolumeClaimList{}
	g.Expect(mc.List(ctx, claims, client.InNamespace(ns))).To(Succeed())
	g.Expect(claims.Items).NotTo(BeEmpty(), "the StatefulSet's volumes")
	volumes := map[string]string{} // PV → volume handle, the PmemVolume's name
	for _, pvc := range claims.Items {
		pv := &corev1.PersistentVolume{}
		g.Expect(mc.Get(ctx, client.ObjectKey{Name: pvc.Spec.VolumeName}, pv)).To(Succeed())
		volumes[pv.Name] = pv.Spec.CSI.VolumeHandle
	}
	g.Expect(vmAttachments(ctx, g, mc, ns)).NotTo(BeEmpty())

	start := time.Now()
	capiCluster := &unstructured.Unstructured{}
	capiCluster.SetGroupVersionKind(clusterGVK)
	capiCluster.SetNamespace(ns)
	capiCluster.SetName(in.Options.Guest.Name)
	g.Expect(mc.Delete(ctx, capiCluster)).To(Succeed())
	g.Eventually(func(g Gomega) {
		g.Expect(machines(ctx, g, mc, "")).To(BeEmpty(), "Machines")
		vms := &vmv1.VirtualMachineList{}
		g.Expect(mc.List(ctx, vms, client.InNamespace(ns))).To(Succeed())
		g.Expect(vms.Items).To(BeEmpty(), "VirtualMachines")
		g.Expect(mc.List(ctx, claims, client.InNamespace(ns))).To(Succeed())
		g.Expect(claims.Items).To(BeEmpty(), "management claims")
		g.Expect(vmAttachments(ctx, g, mc, ns)).To(BeEmpty(), "VolumeAttachments")
		for pv, handle := range volumes {
			g.Expect(apierrors.IsNotFound(mc.Get(ctx, client.ObjectKey{Name: pv}, &corev1.PersistentVolume{}))).To(BeTrue(), "PV %s", pv)
			g.Expect(apierrors.IsNotFound(mc.Get(ctx, client.ObjectKey{Name: handle}, &pmemv1.PmemVolume{}))).To(BeTrue(), "PmemVolume %s", handle)
		}
		accounts := &corev1.ServiceAccountList{}
		g.Expect(mc.List(ctx, accounts, client.InNamespace(ns))).To(Succeed())
		for _, a := range accounts.Items {
			g.Expect(a.OwnerReferences).NotTo(ContainElement(HaveField("UID", types.UID(in.UID))), "ServiceAccount %s of the guest", a.Name)
		}
	}).WithContext(ctx).WithTimeout(5 * time.Minute).WithPolling(time.Second).Should(Succeed())
	t.Logf("Cluster deleted with %d volumes attached: everything of the guest gone %.0f s after", len(volumes), time.Since(start).Seconds())
	for host, vmm := range in.VMMs {
		for _, name := range vmNames {
			vm, err := vmm.VM(ns, name)
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(vm).To(BeNil(), "VM %s still runs on %s", name, host)
		}
	}
}

// vmAttachments lists the VolumeAttachments of the VMs of namespace ns.
func vmAttachments(ctx context.Context, g Gomega, mc client.Client, ns string) []storagev1.VolumeAttachment {
	list := &storagev1.VolumeAttachmentList{}
	g.Expect(mc.List(ctx, list, client.MatchingLabels{vmv1.VMNamespaceLabel: ns})).To(Succeed())
	return list.Items
}

// mgmtClient is a client of the management cluster that knows pvbridge's objects; Cluster
// API's are unstructured.
func mgmtClient(g Gomega) client.Client {
	s, err := deploy.MgmtScheme()
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(infrav1.AddToScheme(s)).To(Succeed())
	mc, err := client.New(in.Mgmt.RESTConfig(), client.Options{Scheme: s})
	g.Expect(err).NotTo(HaveOccurred())
	return mc
}

// waitPodsRunning waits until n pods of app run in ns, and returns them.
func waitPodsRunning(ctx context.Context, g Gomega, ns, app string, n int) []corev1.Pod {
	var pods []corev1.Pod
	g.Eventually(func(g Gomega) {
		list, err := in.Guest.Client().CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: "app=" + app})
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(list.Items).To(HaveLen(n))
		for _, p := range list.Items {
			g.Expect(p.DeletionTimestamp).To(BeNil(), "pod %s is being deleted", p.Name)
			g.Expect(p.Status.Phase).To(Equal(corev1.PodRunning), "pod %s", p.Name)
		}
		pods = list.Items
	}).WithContext(ctx).WithTimeout(10 * time.Minute).WithPolling(time.Second).Should(Succeed()) // a QEMU worker's pods emulate their CPU
	return pods
}

func uids(pods []corev1.Pod) []any {
	var u []any
	for _, p := range pods {
		u = append(u, p.UID)
	}
	return u
}

// kubectl runs kubectl against the guest and returns its output.
func kubectl(ctx context.Context, args ...string) (string, error) {
	bin, err := lab.Binaries().Tool("kubectl")
	if err != nil {
		return "", err
	}
	out, err := exec.CommandContext(ctx, bin, append([]string{"--kubeconfig", in.Guest.Kubeconfig}, args...)...).CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("kubectl %s: %w: %s", strings.Join(args, " "), err, out)
	}
	return string(out), nil
}
