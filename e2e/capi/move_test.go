package capi_test

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pvbridge.io/e2e/deploy"
	infrav1 "pvbridge.io/pkg/apis/infrastructure/v1alpha1"
	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
)

// blockedLine is what clusterctl move says when an object of the move carries block-move.
const blockedLine = "Move blocked by " + infrav1.BlockMoveAnnotation + " annotation"

// clusterctlMoveIsRefused runs clusterctl move (v1.14.2, the real binary) of the guest's
// namespace to the guest itself, the pivot users try (the guest given Cluster API's Cluster CRD
// and clusterctl's inventory, which clusterctl checks a target for). The move stops at the provider's block-move annotation
// and waits there: nothing is created in the target, nothing deleted here, every VM the same.
// It is interrupted, and the Cluster it paused is resumed as docs/deployment.md says.
func clusterctlMoveIsRefused(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	mc := mgmtClient(g)
	ns := in.Options.Guest.Namespace
	vms := func() map[string]types.UID {
		list := &vmv1.VirtualMachineList{}
		g.Expect(mc.List(ctx, list, client.InNamespace(ns))).To(Succeed())
		uids := map[string]types.UID{}
		for _, vm := range list.Items {
			uids[vm.Name] = vm.UID
		}
		return uids
	}
	before := vms()
	g.Expect(before).NotTo(BeEmpty())

	_, err := kubectl(ctx, "apply", "--server-side", "-f", filepath.Join(lab.Binaries().Repo, "manifests", "crd", "capi", "cluster.x-k8s.io_clusters.yaml"))
	g.Expect(err).NotTo(HaveOccurred())
	copyInventory(ctx, g)
	bin, err := lab.Binaries().Tool("clusterctl")
	g.Expect(err).NotTo(HaveOccurred())
	moveCtx, stop := context.WithCancel(ctx)
	defer stop()
	cmd := exec.CommandContext(moveCtx, bin, "move", "--kubeconfig", in.Mgmt.Kubeconfig, "--to-kubeconfig", in.Guest.Kubeconfig, "--namespace", ns)
	cmd.Env = append(os.Environ(), "CLUSTERCTL_DISABLE_VERSIONCHECK=true", "XDG_CONFIG_HOME="+t.TempDir())
	out := &lockedBuffer{}
	cmd.Stdout, cmd.Stderr = out, out
	g.Expect(cmd.Start()).To(Succeed())
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	start := time.Now()
	g.Eventually(func(g Gomega) {
		g.Expect(exited).NotTo(Receive(), "clusterctl move ended:\n%s", out)
		g.Expect(out.String()).To(ContainSubstring(blockedLine))
	}).WithContext(ctx).WithTimeout(3 * time.Minute).WithPolling(time.Second).Should(Succeed())
	t.Logf("clusterctl move blocked by the PVBridgeCluster's %s %.0f s after its start:\n%s", infrav1.BlockMoveAnnotation, time.Since(start).Seconds(), out)
	stop()
	<-exited

	list, err := kubectl(ctx, "get", "clusters.cluster.x-k8s.io", "--all-namespaces", "-o", "name")
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(list).To(BeEmpty(), "nothing was moved to the target")
	g.Expect(vms()).To(Equal(before), "every VM is still there, the same")

	// Resumed as deployment.md says: the provider reconciles the guest again.
	capiCluster := &unstructured.Unstructured{}
	capiCluster.SetGroupVersionKind(clusterGVK)
	capiCluster.SetNamespace(ns)
	capiCluster.SetName(in.Options.Guest.Name)
	g.Expect(mc.Get(ctx, client.ObjectKeyFromObject(capiCluster), capiCluster)).To(Succeed())
	paused, _, _ := unstructured.NestedBool(capiCluster.Object, "spec", "paused")
	g.Expect(paused).To(BeTrue(), "clusterctl paused the Cluster before it waited")
	g.Expect(mc.Patch(ctx, capiCluster, client.RawPatch(types.MergePatchType, []byte(`{"spec":{"paused":null}}`)))).To(Succeed())
	g.Eventually(func(g Gomega) {
		ic := &infrav1.PVBridgeCluster{}
		g.Expect(mc.Get(ctx, client.ObjectKey{Namespace: ns, Name: in.Options.Guest.Name}, ic)).To(Succeed())
		g.Expect(meta.IsStatusConditionFalse(ic.Status.Conditions, infrav1.PausedCondition)).To(BeTrue())
		g.Expect(ic.Annotations).To(HaveKey(infrav1.BlockMoveAnnotation))
	}).WithContext(ctx).WithTimeout(time.Minute).Should(Succeed())
}

// copyInventory gives the guest, the move's target, clusterctl's inventory of the management
// cluster (its CRD and Provider objects), as clusterctl init would have left it there: move
// compares the two inventories before anything else, and refuses a target without the
// source's providers.
func copyInventory(ctx context.Context, g Gomega) {
	from, err := dynamic.NewForConfig(in.Mgmt.RESTConfig())
	g.Expect(err).NotTo(HaveOccurred())
	to, err := dynamic.NewForConfig(in.Guest.RESTConfig())
	g.Expect(err).NotTo(HaveOccurred())
	crds := schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}
	providers := deploy.ProviderGVR
	namespaces := schema.GroupVersionResource{Version: "v1", Resource: "namespaces"}
	copied := func(o *unstructured.Unstructured) *unstructured.Unstructured {
		o = &unstructured.Unstructured{Object: map[string]any{
			"apiVersion": o.GetAPIVersion(), "kind": o.GetKind(),
			"metadata": map[string]any{"name": o.GetName(), "namespace": o.GetNamespace(), "labels": o.GetLabels()},
			"spec":     o.Object["spec"], "providerName": o.Object["providerName"], "type": o.Object["type"], "version": o.Object["version"],
		}}
		for k, v := range o.Object {
			if v == nil {
				delete(o.Object, k)
			}
		}
		return o
	}
	crd, err := from.Resource(crds).Get(ctx, providers.GroupResource().String(), metav1.GetOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	_, err = to.Resource(crds).Create(ctx, copied(crd), metav1.CreateOptions{})
	g.Expect(client.IgnoreAlreadyExists(err)).To(Succeed())
	list, err := from.Resource(providers).List(ctx, metav1.ListOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(list.Items).NotTo(BeEmpty())
	for _, p := range list.Items {
		ns := &unstructured.Unstructured{Object: map[string]any{"apiVersion": "v1", "kind": "Namespace", "metadata": map[string]any{"name": p.GetNamespace()}}}
		_, err := to.Resource(namespaces).Create(ctx, ns, metav1.CreateOptions{})
		g.Expect(client.IgnoreAlreadyExists(err)).To(Succeed())
		g.Eventually(func() error { // until the new CRD is served
			_, err := to.Resource(providers).Namespace(p.GetNamespace()).Create(ctx, copied(&p), metav1.CreateOptions{})
			return client.IgnoreAlreadyExists(err)
		}).WithContext(ctx).WithTimeout(time.Minute).Should(Succeed(), "Provider %s", p.GetName())
	}
}

// lockedBuffer collects a command's output, to be read while it runs.
type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}
