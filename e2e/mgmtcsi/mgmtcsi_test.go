// Package mgmtcsi_test proves mgmt-csi against a real management control plane: two hosts, each a
// real kubelet with an emulated PMEM region (xfs on a loop device) and the mgmt-csi node agent,
// plus the mgmt-csi controller with the real csi-provisioner, csi-attacher, csi-resizer,
// csi-snapshotter and snapshot-controller.
package mgmtcsi_test

import (
	"context"
	"crypto/sha256"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pvbridge.io/e2e/cluster"
	"pvbridge.io/e2e/deploy"
	"pvbridge.io/e2e/polling"
	pmemv1 "pvbridge.io/pkg/apis/pmem/v1alpha1"
	"pvbridge.io/pkg/hold"
	"pvbridge.io/pkg/names"
)

const pmemSize = 4 << 30 // per host

var (
	lab  *cluster.Lab
	mgmt *deploy.Management
	c    client.Client
)

func TestMain(m *testing.M) {
	polling.Set()
	os.Exit(run(m))
}

func run(m *testing.M) int {
	return cluster.RunTests(m, func(ctx context.Context, l *cluster.Lab) error {
		lab = l
		start := time.Now()
		cp, err := lab.StartControlPlane(ctx, "mgmt")
		if err != nil {
			return err
		}
		if mgmt, err = deploy.StartManagement(ctx, lab, cp, deploy.MgmtOptions{Hosts: []string{"host-a", "host-b"}, PmemSize: pmemSize}); err != nil {
			return err
		}
		fmt.Printf("management cluster with mgmt-csi up in %.1fs (%s)\n", time.Since(start).Seconds(), lab.Root)
		scheme := runtime.NewScheme()
		for _, add := range []func(*runtime.Scheme) error{clientgoscheme.AddToScheme, pmemv1.AddToScheme} {
			if err := add(scheme); err != nil {
				return err
			}
		}
		c, err = client.New(cp.RESTConfig(), client.Options{Scheme: scheme})
		return err
	})
}

// namespace creates a namespace for the test and deletes it, with everything in it, when the
// test ends. A test that passed deleted what it made and waited for it, and its namespace goes
// in the background (the namespace controller's backoff took about five seconds more); after a
// failure the deletion is waited for, so that a failed test leaves nothing to the next one.
func namespace(t *testing.T) string {
	t.Helper()
	ns, err := deploy.CreateNamespace(t.Context(), mgmt.CP.Client(), "t")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx := context.WithoutCancel(t.Context())
		obj := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}
		if !t.Failed() {
			NewWithT(t).Expect(c.Delete(ctx, obj)).To(Succeed())
			return
		}
		deleteAndWait(ctx, NewWithT(t), obj)
	})
	return ns
}

func create(ctx context.Context, g Gomega, obj client.Object) {
	g.Expect(c.Create(ctx, obj)).To(Succeed())
}

// boundVolume waits until the claim is Bound and returns its PmemVolume.
func boundVolume(ctx context.Context, g Gomega, ns, claim string) *pmemv1.PmemVolume {
	pvc := &corev1.PersistentVolumeClaim{}
	g.Eventually(func(g Gomega) {
		g.Expect(c.Get(ctx, client.ObjectKey{Namespace: ns, Name: claim}, pvc)).To(Succeed())
		g.Expect(pvc.Status.Phase).To(Equal(corev1.ClaimBound))
	}).WithContext(ctx).WithTimeout(2 * time.Minute).WithPolling(100 * time.Millisecond).Should(Succeed())
	pv := &corev1.PersistentVolume{}
	g.Expect(c.Get(ctx, client.ObjectKey{Name: pvc.Spec.VolumeName}, pv)).To(Succeed())
	vol := &pmemv1.PmemVolume{}
	g.Expect(c.Get(ctx, client.ObjectKey{Name: pv.Spec.CSI.VolumeHandle}, vol)).To(Succeed())
	return vol
}

// runningPod waits until the pod is Running and returns it.
func runningPod(ctx context.Context, g Gomega, ns, name string) *corev1.Pod {
	pod := &corev1.Pod{}
	g.Eventually(func(g Gomega) {
		g.Expect(c.Get(ctx, client.ObjectKey{Namespace: ns, Name: name}, pod)).To(Succeed())
		g.Expect(pod.Status.Phase).To(Equal(corev1.PodRunning))
	}).WithContext(ctx).WithTimeout(2 * time.Minute).WithPolling(100 * time.Millisecond).Should(Succeed())
	return pod
}

func pmemNode(ctx context.Context, g Gomega, name string) *pmemv1.PmemNode {
	n := &pmemv1.PmemNode{}
	g.Expect(c.Get(ctx, client.ObjectKey{Name: name}, n)).To(Succeed())
	return n
}

func free(ctx context.Context, g Gomega, name string) int64 {
	return pmemNode(ctx, g, name).Status.Free.Value()
}

// deleteAndWait deletes the objects and waits until they are gone.
func deleteAndWait(ctx context.Context, g Gomega, objs ...client.Object) {
	for _, o := range objs {
		g.Expect(client.IgnoreNotFound(c.Delete(ctx, o))).To(Succeed())
	}
	for _, o := range objs {
		g.Eventually(func() bool {
			err := c.Get(ctx, client.ObjectKeyFromObject(o), o.DeepCopyObject().(client.Object))
			return client.IgnoreNotFound(err) == nil && err != nil
		}).WithContext(ctx).WithTimeout(2*time.Minute).WithPolling(100*time.Millisecond).Should(BeTrue(), "%s is gone", o.GetName())
	}
}

// noVolumesLeft waits until no PmemVolume remains and each host's free space is back to total.
func noVolumesLeft(ctx context.Context, g Gomega) {
	g.Eventually(func(g Gomega) {
		list := &pmemv1.PmemVolumeList{}
		g.Expect(c.List(ctx, list)).To(Succeed())
		g.Expect(list.Items).To(BeEmpty())
		for _, h := range mgmt.Hosts {
			n := pmemNode(ctx, g, h.Node.Name)
			g.Expect(n.Status.Free.Value()).To(Equal(n.Status.Total.Value()), h.Node.Name)
		}
	}).WithContext(ctx).WithTimeout(2 * time.Minute).WithPolling(200 * time.Millisecond).Should(Succeed())
}

func TestWaitForFirstConsumerVolumeLandsOnThePodsHost(t *testing.T) {
	g := NewWithT(t)
	ctx, ns := t.Context(), namespace(t)
	for _, tc := range []struct {
		host  string
		block bool
	}{{"host-b", false}, {"host-a", true}} {
		name := fmt.Sprintf("on-%s", tc.host)
		create(ctx, g, deploy.PVC(ns, name, deploy.StorageClassPmem, "64Mi", tc.block))
		create(ctx, g, deploy.Pod(ns, name, name, tc.host, tc.block))
		pod := runningPod(ctx, g, ns, name)
		g.Expect(pod.Spec.NodeName).To(Equal(tc.host))
		vol := boundVolume(ctx, g, ns, name)
		g.Expect(vol.Spec.Node).To(Equal(tc.host), "the volume is in the PMEM of the pod's host")

		pvc := &corev1.PersistentVolumeClaim{}
		g.Expect(c.Get(ctx, client.ObjectKey{Namespace: ns, Name: name}, pvc)).To(Succeed())
		path := deploy.PodVolumePath(mgmt.Host(tc.host).Node, pod.UID, pvc.Spec.VolumeName, tc.block)
		if tc.block {
			fi, err := os.Stat(path)
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(fi.Mode()&os.ModeDevice).NotTo(BeZero(), "a raw block volume is a device file")
		} else {
			g.Expect(os.WriteFile(filepath.Join(path, "hello"), []byte("pmem"), 0o644)).To(Succeed(), "the volume is mounted writable")
		}
		deleteAndWait(ctx, g, pod, pvc)
	}
	noVolumesLeft(ctx, g)
}

func TestImmediateVolumeLandsWhereItFits(t *testing.T) {
	g := NewWithT(t)
	ctx, ns := t.Context(), namespace(t)
	// Fill host-a so that the next volume fits only on host-b.
	filler := deploy.PVC(ns, "filler", deploy.StorageClassPmem, "3Gi", false)
	create(ctx, g, filler)
	fillerPod := deploy.Pod(ns, "filler", "filler", "host-a", false)
	create(ctx, g, fillerPod)
	g.Expect(boundVolume(ctx, g, ns, "filler").Spec.Node).To(Equal("host-a"))

	pvc := deploy.PVC(ns, "immediate", deploy.StorageClassPmemImmediate, "2Gi", false)
	create(ctx, g, pvc)
	g.Expect(boundVolume(ctx, g, ns, "immediate").Spec.Node).To(Equal("host-b"))
	deleteAndWait(ctx, g, fillerPod, filler, pvc)
	noVolumesLeft(ctx, g)
}

func TestStorageCapacityFollowsPmemNode(t *testing.T) {
	g := NewWithT(t)
	ctx, ns := t.Context(), namespace(t)
	capacityOf := func(g Gomega, node string) int64 {
		list := &storagev1.CSIStorageCapacityList{}
		g.Expect(c.List(ctx, list, client.InNamespace(deploy.CSINamespace))).To(Succeed())
		for _, sc := range list.Items {
			if sc.StorageClassName == deploy.StorageClassPmem && sc.NodeTopology != nil &&
				sc.NodeTopology.MatchLabels[names.PmemTopologyKey] == node && sc.Capacity != nil {
				return sc.Capacity.Value()
			}
		}
		return -1
	}
	before := free(ctx, g, "host-a")
	g.Eventually(func(g Gomega) { g.Expect(capacityOf(g, "host-a")).To(Equal(before)) }).
		WithContext(ctx).WithTimeout(time.Minute).WithPolling(200 * time.Millisecond).Should(Succeed())

	pvc := deploy.PVC(ns, "cap", deploy.StorageClassPmemImmediate, "1Gi", false)
	pvc.Annotations = map[string]string{"volume.kubernetes.io/selected-node": "host-a"}
	create(ctx, g, pvc)
	vol := boundVolume(ctx, g, ns, "cap")
	after := free(ctx, g, vol.Spec.Node)
	g.Expect(after).To(BeNumerically("<", pmemSize))
	g.Eventually(func(g Gomega) { g.Expect(capacityOf(g, vol.Spec.Node)).To(Equal(after)) }).
		WithContext(ctx).WithTimeout(time.Minute).WithPolling(200*time.Millisecond).Should(Succeed(), "CSIStorageCapacity shows the PmemNode's free space")
	deleteAndWait(ctx, g, pvc)
	noVolumesLeft(ctx, g)
}

func TestExhaustedHostLeavesPodPendingWithoutPartialVolume(t *testing.T) {
	g := NewWithT(t)
	ctx, ns := t.Context(), namespace(t)
	freeBefore := free(ctx, g, "host-a")
	pvc := deploy.PVC(ns, "huge", deploy.StorageClassPmem, "5Gi", false)
	create(ctx, g, pvc)
	pod := deploy.Pod(ns, "huge", "huge", "host-a", false)
	create(ctx, g, pod)

	g.Eventually(func(g Gomega) {
		events := &corev1.EventList{}
		g.Expect(c.List(ctx, events, client.InNamespace(ns))).To(Succeed())
		var msgs []string
		for _, e := range events.Items {
			if e.InvolvedObject.Name == "huge" && e.Type == corev1.EventTypeWarning {
				msgs = append(msgs, e.Message)
			}
		}
		g.Expect(msgs).To(ContainElement(ContainSubstring("storage")), "the scheduler says the node lacks storage")
	}).WithContext(ctx).WithTimeout(time.Minute).WithPolling(200 * time.Millisecond).Should(Succeed())
	g.Expect(c.Get(ctx, client.ObjectKeyFromObject(pvc), pvc)).To(Succeed())
	g.Expect(pvc.Status.Phase).To(Equal(corev1.ClaimPending))
	list := &pmemv1.PmemVolumeList{}
	g.Expect(c.List(ctx, list)).To(Succeed())
	g.Expect(list.Items).To(BeEmpty(), "no partial volume")
	g.Expect(free(ctx, g, "host-a")).To(Equal(freeBefore))
	deleteAndWait(ctx, g, pod, pvc)
}

func TestOnlineExpansionGrowsTheFilesystem(t *testing.T) {
	g := NewWithT(t)
	ctx, ns := t.Context(), namespace(t)
	pvc := deploy.PVC(ns, "grow", deploy.StorageClassPmemXFS, "320Mi", false)
	create(ctx, g, pvc)
	pod := deploy.Pod(ns, "grow", "grow", "host-b", false)
	create(ctx, g, pod)
	pod = runningPod(ctx, g, ns, "grow")
	boundVolume(ctx, g, ns, "grow")
	g.Expect(c.Get(ctx, client.ObjectKeyFromObject(pvc), pvc)).To(Succeed())
	path := deploy.PodVolumePath(mgmt.Host("host-b").Node, pod.UID, pvc.Spec.VolumeName, false)
	sizeBefore := fsSize(g, path)

	patch := client.MergeFrom(pvc.DeepCopy())
	pvc.Spec.Resources.Requests[corev1.ResourceStorage] = resource.MustParse("1Gi")
	g.Expect(c.Patch(ctx, pvc, patch)).To(Succeed())
	g.Eventually(func(g Gomega) {
		g.Expect(c.Get(ctx, client.ObjectKeyFromObject(pvc), pvc)).To(Succeed())
		g.Expect(pvc.Status.Capacity.Storage().Value()).To(BeNumerically(">=", 1<<30))
		g.Expect(fsSize(g, path)).To(BeNumerically(">", 3*sizeBefore), "the mounted filesystem grew")
	}).WithContext(ctx).WithTimeout(2 * time.Minute).WithPolling(200 * time.Millisecond).Should(Succeed())
	deleteAndWait(ctx, g, pod, pvc)
	noVolumesLeft(ctx, g)
}

// fsSize is the size of the filesystem mounted at path.
func fsSize(g Gomega, path string) int64 {
	var st unix.Statfs_t
	g.Expect(unix.Statfs(path, &st)).To(Succeed())
	return int64(st.Blocks) * st.Bsize
}

// syncFS flushes the filesystem at path, so that a snapshot of its device sees what was written.
func syncFS(g Gomega, path string) {
	f, err := os.Open(path)
	g.Expect(err).NotTo(HaveOccurred())
	defer f.Close()
	g.Expect(unix.Syncfs(int(f.Fd()))).To(Succeed())
}

func TestSnapshotRestoreHasIdenticalData(t *testing.T) {
	g := NewWithT(t)
	ctx, ns := t.Context(), namespace(t)
	src := deploy.PVC(ns, "src", deploy.StorageClassPmem, "64Mi", false)
	create(ctx, g, src)
	srcPod := deploy.Pod(ns, "src", "src", "host-a", false)
	create(ctx, g, srcPod)
	srcPod = runningPod(ctx, g, ns, "src")
	boundVolume(ctx, g, ns, "src")
	g.Expect(c.Get(ctx, client.ObjectKeyFromObject(src), src)).To(Succeed())
	data := make([]byte, 4<<20)
	for i := range data {
		data[i] = byte(i * 7)
	}
	srcPath := deploy.PodVolumePath(mgmt.Host("host-a").Node, srcPod.UID, src.Spec.VolumeName, false)
	g.Expect(os.WriteFile(filepath.Join(srcPath, "data"), data, 0o644)).To(Succeed())
	syncFS(g, srcPath)

	snap := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshot",
		"metadata": map[string]any{"namespace": ns, "name": "snap"},
		"spec": map[string]any{
			"volumeSnapshotClassName": deploy.SnapshotClassPmem,
			"source":                  map[string]any{"persistentVolumeClaimName": "src"},
		},
	}}
	create(ctx, g, snap)
	readyToUse(ctx, g, snap)

	restored := deploy.PVC(ns, "restored", deploy.StorageClassPmem, "64Mi", false)
	restored.Spec.DataSource = &corev1.TypedLocalObjectReference{APIGroup: ptr.To("snapshot.storage.k8s.io"), Kind: "VolumeSnapshot", Name: "snap"}
	create(ctx, g, restored)
	pod := deploy.Pod(ns, "restored", "restored", "host-a", false)
	create(ctx, g, pod)
	pod = runningPod(ctx, g, ns, "restored")
	g.Expect(boundVolume(ctx, g, ns, "restored").Spec.Node).To(Equal("host-a"))
	g.Expect(c.Get(ctx, client.ObjectKeyFromObject(restored), restored)).To(Succeed())
	got, err := os.ReadFile(filepath.Join(deploy.PodVolumePath(mgmt.Host("host-a").Node, pod.UID, restored.Spec.VolumeName, false), "data"))
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(sha256.Sum256(got)).To(Equal(sha256.Sum256(data)), "the restored volume has the snapshot's data")

	deleteAndWait(ctx, g, pod, srcPod, restored, snap, src)
	noVolumesLeft(ctx, g)
	g.Eventually(func(g Gomega) {
		list := &pmemv1.PmemSnapshotList{}
		g.Expect(c.List(ctx, list)).To(Succeed())
		g.Expect(list.Items).To(BeEmpty())
	}).WithContext(ctx).WithTimeout(time.Minute).WithPolling(200 * time.Millisecond).Should(Succeed())
}

func TestDeletionFreesExactlyTheSpaceItTook(t *testing.T) {
	g := NewWithT(t)
	ctx, ns := t.Context(), namespace(t)
	before := free(ctx, g, "host-b")
	pvc := deploy.PVC(ns, "exact", deploy.StorageClassPmemImmediate, "100Mi", true)
	pvc.Annotations = map[string]string{"volume.kubernetes.io/selected-node": "host-b"}
	create(ctx, g, pvc)
	vol := boundVolume(ctx, g, ns, "exact")
	g.Eventually(func() int64 { return before - free(ctx, g, vol.Spec.Node) }).WithContext(ctx).
		WithTimeout(time.Minute).Should(Equal(vol.Status.AllocatedSize.Value()), "the volume took its allocated size")
	deleteAndWait(ctx, g, pvc)
	g.Eventually(func() int64 { return free(ctx, g, vol.Spec.Node) }).WithContext(ctx).
		WithTimeout(time.Minute).Should(Equal(before), "and gave exactly that back")
}

// TestCrashesDuringConcurrentCreatesLoseNothing kills -9 the controller and a node agent while
// 50 claims are provisioned, restarts them, and checks that every claim binds to exactly one
// volume, with no volume left over on any host.
func TestCrashesDuringConcurrentCreatesLoseNothing(t *testing.T) {
	g := NewWithT(t)
	ctx, ns := t.Context(), namespace(t)
	const n = 50
	for i := range n {
		create(ctx, g, deploy.PVC(ns, fmt.Sprintf("c%02d", i), deploy.StorageClassPmemImmediate, "16Mi", i%2 == 0))
	}
	// Kill once provisioning is under way, then restart.
	g.Eventually(func() int {
		list := &pmemv1.PmemVolumeList{}
		g.Expect(c.List(ctx, list)).To(Succeed())
		return len(list.Items)
	}).WithContext(ctx).WithTimeout(time.Minute).WithPolling(20 * time.Millisecond).Should(BeNumerically(">=", 5))
	// Both restart as their containers would; the sidecars, which exit with their driver, too.
	g.Expect(mgmt.Controller.Kill()).To(Succeed())
	g.Expect(mgmt.Host("host-a").Agent.Kill()).To(Succeed())

	handles := map[string]bool{}
	for i := range n {
		vol := boundVolume(ctx, g, ns, fmt.Sprintf("c%02d", i))
		g.Expect(handles[vol.Name]).To(BeFalse(), "one volume per claim")
		handles[vol.Name] = true
	}
	list := &pmemv1.PmemVolumeList{}
	g.Expect(c.List(ctx, list)).To(Succeed())
	g.Expect(list.Items).To(HaveLen(n), "no leaked PmemVolume")
	onDisk := 0
	for _, h := range mgmt.Hosts {
		files, err := filepath.Glob(filepath.Join(h.PmemDir, "volumes", "*"))
		g.Expect(err).NotTo(HaveOccurred())
		onDisk += len(files)
	}
	g.Expect(onDisk).To(Equal(n), "no leaked or duplicate volume on the hosts")

	var pvcs []client.Object
	for i := range n {
		pvcs = append(pvcs, &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: fmt.Sprintf("c%02d", i)}})
	}
	deleteAndWait(ctx, g, pvcs...)
	noVolumesLeft(ctx, g)
}

// TestSnapshotterStartedWhileTheAPIServerIsAwayKeepsGroupSnapshots starts the real
// csi-snapshotter while the API server is stopped, as a sidecar restarted during an API server
// restart is. It looks at the group snapshot CRDs once, when the driver's Probe answers ready,
// and turns group snapshots off for its whole run if that look fails; mgmt-csi's Probe answers
// not ready while its API server does not answer, so the sidecar waits, and once the API server
// is back a VolumeGroupSnapshot is cut.
func TestSnapshotterStartedWhileTheAPIServerIsAwayKeepsGroupSnapshots(t *testing.T) {
	g := NewWithT(t)
	ctx, ns := t.Context(), namespace(t)
	snapshotter := mgmt.Sidecars["csi-snapshotter"]
	notReady := logged(snapshotter.LogPath, "CSI driver is not ready")
	disabled := logged(snapshotter.LogPath, "disabling the VolumeGroupSnapshot feature")
	before, disabledBefore := notReady(g), disabled(g)

	g.Expect(snapshotter.Stop()).To(Succeed())
	g.Expect(mgmt.CP.StopAPIServer()).To(Succeed())
	apiserverUp := false
	t.Cleanup(func() {
		if !apiserverUp {
			_ = mgmt.CP.StartAPIServer(context.WithoutCancel(ctx))
		}
	})
	respawned, err := snapshotter.Respawn()
	g.Expect(err).NotTo(HaveOccurred())
	mgmt.Sidecars["csi-snapshotter"] = respawned
	g.Eventually(notReady).WithContext(ctx).WithTimeout(time.Minute).Should(BeNumerically(">", before), "the sidecar waits on the driver's Probe")
	g.Expect(mgmt.CP.StartAPIServer(ctx)).To(Succeed())
	apiserverUp = true

	pvc := deploy.PVC(ns, "member", deploy.StorageClassPmemImmediate, "16Mi", false)
	pvc.Labels = map[string]string{"group": "g"}
	create(ctx, g, pvc)
	volume := boundVolume(ctx, g, ns, "member")
	// The holder of VM writers (vm-operator's host agent) of a host with no VM: it holds
	// nothing, and the node agent cuts a member that no writer uses.
	l, err := hold.Listen(hold.SocketBeside(filepath.Join(mgmt.Host(volume.Spec.Node).Node.PluginDir(names.PmemDriver), "csi.sock")))
	g.Expect(err).NotTo(HaveOccurred())
	go func() { _ = (&hold.Server{Holder: noVMs{}}).Serve(ctx, l) }()
	group := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "groupsnapshot.storage.k8s.io/v1", "kind": "VolumeGroupSnapshot",
		"metadata": map[string]any{"namespace": ns, "name": "g"},
		"spec": map[string]any{
			"volumeGroupSnapshotClassName": deploy.SnapshotClassPmem,
			"source":                       map[string]any{"selector": map[string]any{"matchLabels": map[string]any{"group": "g"}}},
		},
	}}
	create(ctx, g, group)
	readyToUse(ctx, g, group)
	g.Expect(disabled(g)).To(Equal(disabledBefore), "csi-snapshotter kept group snapshots on")
	deleteAndWait(ctx, g, group, pvc)
}

// readyToUse waits until the snapshot or group snapshot obj says it is ready to use.
func readyToUse(ctx context.Context, g Gomega, obj *unstructured.Unstructured) {
	g.Eventually(func(g Gomega) {
		g.Expect(c.Get(ctx, client.ObjectKeyFromObject(obj), obj)).To(Succeed())
		ready, _, _ := unstructured.NestedBool(obj.Object, "status", "readyToUse")
		g.Expect(ready).To(BeTrue(), "status: %v", obj.Object["status"])
	}).WithContext(ctx).WithTimeout(2 * time.Minute).WithPolling(200 * time.Millisecond).Should(Succeed())
}

// noVMs is the holder of a host with no VM: it holds no volume's writers.
type noVMs struct{}

func (noVMs) Hold(context.Context, []string) ([]string, func(context.Context) error, error) {
	return nil, func(context.Context) error { return nil }, nil
}

// logged counts the lines of the log at path that say line, at each call.
func logged(path, line string) func(g Gomega) int {
	return func(g Gomega) int {
		n, err := cluster.CountInLog(path, line)
		g.Expect(err).NotTo(HaveOccurred())
		return n
	}
}
