package tenants

import (
	"context"
	"testing"
	"time"

	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	. "github.com/onsi/gomega"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	eventsv1 "k8s.io/api/events/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/utils/ptr"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pvbridge.io/pkg/names"
	"pvbridge.io/pkg/tenancy"
)

// The install's objects in the guest.
var (
	installNamespace  = "pvbridge-system"
	controllerKey     = client.ObjectKey{Namespace: installNamespace, Name: "guest-csi-controller"}
	clusterConfigKey  = client.ObjectKey{Namespace: installNamespace, Name: tenancy.GuestIdentityConfigMap}
	defaultClassKey   = client.ObjectKey{Name: "pvbridge"}
	xfsClassKey       = client.ObjectKey{Name: "pvbridge-xfs"}
	snapshotClassKey  = client.ObjectKey{Name: "pvbridge"}
	installSkipReason = "not installed: StorageClass pvbridge, StorageClass pvbridge-xfs: the cluster may use no management StorageClass"
)

// TestGuestInstallContent: the embedded install is the guest overlay's guest-csi side — driver,
// RBAC, controller, node plugin, metrics Services, classes, the cluster's identity — without the snapshot CRDs and
// snapshot-controller, which belong to the guest cluster.
func TestGuestInstallContent(t *testing.T) {
	g := NewWithT(t)
	objs, err := guestInstall()
	g.Expect(err).NotTo(HaveOccurred())
	var names []string
	for _, obj := range objs {
		names = append(names, objectName(obj))
	}
	g.Expect(names).To(ConsistOf(
		"Namespace pvbridge-system",
		"CSIDriver guest.csi.pvbridge.io",
		"ServiceAccount pvbridge-system/guest-csi-controller",
		"ServiceAccount pvbridge-system/guest-csi-node",
		"ClusterRole pvbridge-guest-csi-controller",
		"ClusterRole pvbridge-guest-csi-provisioner",
		"ClusterRole pvbridge-guest-csi-attacher",
		"ClusterRole pvbridge-guest-csi-resizer",
		"ClusterRole pvbridge-guest-csi-snapshotter",
		"ClusterRole pvbridge-guest-csi-node",
		"ClusterRoleBinding pvbridge-guest-csi-controller",
		"ClusterRoleBinding pvbridge-guest-csi-provisioner",
		"ClusterRoleBinding pvbridge-guest-csi-attacher",
		"ClusterRoleBinding pvbridge-guest-csi-resizer",
		"ClusterRoleBinding pvbridge-guest-csi-snapshotter",
		"ClusterRoleBinding pvbridge-guest-csi-node",
		"Role pvbridge-system/guest-csi-controller",
		"RoleBinding pvbridge-system/guest-csi-controller",
		"ConfigMap pvbridge-system/pvbridge-cluster",
		"Deployment pvbridge-system/guest-csi-controller",
		"DaemonSet pvbridge-system/guest-csi-node",
		"Service pvbridge-system/guest-csi-controller-metrics",
		"Service pvbridge-system/guest-csi-node-metrics",
		"StorageClass pvbridge",
		"StorageClass pvbridge-xfs",
		"VolumeSnapshotClass pvbridge",
		"VolumeGroupSnapshotClass pvbridge",
	))
	g.Expect(objs[0].GetKind()).To(Equal("Namespace"), "the namespace is applied before what lives in it")
}

// TestRenderInstall: the cluster's name and UID go into the ConfigMap the guest-csi controller
// reads its --cluster-name and --cluster-uid from, and onto the pod template that reads it; the
// first allowed class into every StorageClass; without one the StorageClasses are left out and
// named. The parsed install is not changed.
func TestRenderInstall(t *testing.T) {
	base, err := guestInstall()
	if err != nil {
		t.Fatal(err)
	}
	cluster := &clusterv1.Cluster{ObjectMeta: metav1.ObjectMeta{Namespace: "tenant-a", Name: "alpha", UID: "1234-uid"}}
	for _, tc := range []struct {
		name, class string
		replicated  bool
		classes     []string // names of the StorageClasses rendered
		skipped     []string
	}{
		{name: "allowed class", class: "fast", classes: []string{"pvbridge", "pvbridge-xfs"}},
		{name: "replicated class", class: "fast", replicated: true, classes: []string{"pvbridge", "pvbridge-xfs"}},
		{name: "no allowed class", class: "", skipped: []string{"StorageClass pvbridge", "StorageClass pvbridge-xfs"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			objs, skipped, err := renderInstall(base, cluster, tc.class, tc.replicated, "")
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(skipped).To(Equal(tc.skipped))
			g.Expect(objs).To(HaveLen(len(base) - len(tc.skipped)))
			var classes []string
			for _, obj := range objs {
				g.Expect(obj.GetLabels()).To(HaveKeyWithValue(ManagedByLabel, fieldManager), objectName(obj))
				annotations, _, _ := unstructured.NestedStringMap(obj.Object, "spec", "template", "metadata", "annotations")
				switch objectName(obj) {
				case "ConfigMap pvbridge-system/pvbridge-cluster":
					data, _, _ := unstructured.NestedStringMap(obj.Object, "data")
					g.Expect(data).To(Equal(map[string]string{"cluster-name": "alpha", "cluster-uid": "1234-uid"}))
				case "Deployment pvbridge-system/guest-csi-controller":
					g.Expect(annotations).To(Equal(map[string]string{tenancy.ClusterNameLabel: "alpha", tenancy.ClusterUIDLabel: "1234-uid"}),
						"the controller's pods restart when the identity they read changes")
				case "DaemonSet pvbridge-system/guest-csi-node":
					g.Expect(annotations).To(BeEmpty(), "the node plugin does not read the identity")
				}
				if obj.GetKind() == "StorageClass" {
					classes = append(classes, obj.GetName())
					param, _, _ := unstructured.NestedString(obj.Object, "parameters", names.MgmtStorageClassParam)
					g.Expect(param).To(Equal(tc.class))
					replicated, found, _ := unstructured.NestedString(obj.Object, "parameters", names.ReplicatedParam)
					if tc.replicated {
						g.Expect(replicated).To(Equal("true"))
					} else {
						g.Expect(found).To(BeFalse(), "only a replicated class says so: the others stay as they were installed")
					}
				}
			}
			g.Expect(classes).To(Equal(tc.classes))
			for _, obj := range base {
				g.Expect(obj.GetLabels()).NotTo(HaveKey(ManagedByLabel), "the parsed install is not changed")
			}
		})
	}
}

// TestParseInstallRefusals: an install without what the controller fills in is refused at
// start, with what is missing.
func TestParseInstallRefusals(t *testing.T) {
	const identity = `
apiVersion: v1
kind: ConfigMap
metadata: {name: pvbridge-cluster, namespace: pvbridge-system}
data: {cluster-name: alpha, cluster-uid: "0000"}
`
	const class = `
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: {name: pvbridge}
provisioner: guest.csi.pvbridge.io
parameters: {mgmtStorageClass: pmem}
`
	for _, tc := range []struct{ name, yaml, err string }{
		{"valid", identity + "---" + class, ""},
		{"no identity", class, "no ConfigMap pvbridge-cluster with the cluster's identity"},
		{"identity without the UID", `
apiVersion: v1
kind: ConfigMap
metadata: {name: pvbridge-cluster, namespace: pvbridge-system}
data: {cluster-name: alpha}
---` + class, `ConfigMap pvbridge-cluster has no "cluster-uid"`},
		{"no class", identity, "no StorageClass of guest.csi.pvbridge.io"},
		{"class without the parameter", identity + `---
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: {name: pvbridge}
provisioner: guest.csi.pvbridge.io
`, "StorageClass pvbridge has no mgmtStorageClass parameter"},
		{"object without a name", identity + "---" + class + "---\napiVersion: v1\nkind: ConfigMap\n", "an object without kind or name"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			objs, err := parseInstall([]byte(tc.yaml))
			if tc.err == "" {
				g.Expect(err).NotTo(HaveOccurred())
				g.Expect(objs).To(HaveLen(2))
			} else {
				g.Expect(err).To(MatchError(ContainSubstring(tc.err)))
			}
		})
	}
}

// TestAllowedClasses: the Cluster's annotation, else the Namespace's, in the written order; an
// annotation present but empty on the Cluster allows none, whatever the Namespace says.
func TestAllowedClasses(t *testing.T) {
	for _, tc := range []struct {
		name              string
		cluster, ns, want []string // cluster, ns: nil for no annotation, else {value}
	}{
		{"cluster's", []string{"gold, pmem"}, []string{"iron"}, []string{"gold", "pmem"}},
		{"namespace's", nil, []string{" pmem ,,gold"}, []string{"pmem", "gold"}},
		{"empty on the cluster", []string{""}, []string{"iron"}, nil},
		{"none", nil, nil, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := &clusterv1.Cluster{}
			if tc.cluster != nil {
				c.Annotations = map[string]string{tenancy.StorageClassesAnnotation: tc.cluster[0]}
			}
			ns := &corev1.Namespace{}
			if tc.ns != nil {
				ns.Annotations = map[string]string{tenancy.StorageClassesAnnotation: tc.ns[0]}
			}
			NewWithT(t).Expect(allowedClasses(c, ns)).To(Equal(tc.want))
		})
	}
}

// TestGuestInstall, against the two apiservers: an opted-in Cluster's guest gets the install with
// the cluster's name, UID and first allowed class (here the Namespace's), written by
// server-side apply as pvbridge-tenants; a changed Deployment and a deleted CSIDriver are put
// back; a new allow-list (of a replicated class) replaces the StorageClasses; an empty one leaves them out with an
// Event; the opt-out annotation leaves the guest alone; and deleting the Cluster removes
// nothing from the guest.
func TestGuestInstall(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	e := newTenantEnv(t, map[string]string{tenancy.StorageClassesAnnotation: "fast, pmem"})
	cfg := e.config()
	cfg.InstallResync = 300 * time.Millisecond
	e.startManager(t, cfg)
	c := e.createCluster(t, "alpha", true, map[string]string{tenancy.GuestInstallAnnotation: "true"})
	e.createKubeconfigSecret(t, c)
	reasons := func(ctx context.Context) ([]string, error) { return eventReasons(ctx, c) }

	// Installed, with the cluster's values.
	expected, skipped, err := renderInstall(must(guestInstall()), c, "fast", false, "")
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(skipped).To(BeEmpty())
	eventually(g, func(g Gomega, ctx context.Context) {
		cm := &corev1.ConfigMap{}
		g.Expect(guestAdmin.Get(ctx, clusterConfigKey, cm)).To(Succeed())
		g.Expect(cm.Data).To(Equal(map[string]string{"cluster-name": "alpha", "cluster-uid": string(c.UID)}))
	}).WithContext(ctx).Should(Succeed())
	for _, want := range expected {
		obj := &unstructured.Unstructured{}
		obj.SetGroupVersionKind(want.GroupVersionKind())
		eventually(g, func(ctx context.Context) error {
			return guestAdmin.Get(ctx, client.ObjectKeyFromObject(want), obj)
		}).WithContext(ctx).Should(Succeed(), objectName(want))
		g.Expect(obj.GetLabels()).To(HaveKeyWithValue(ManagedByLabel, fieldManager), objectName(want))
		g.Expect(obj.GetManagedFields()).To(ContainElement(And(
			HaveField("Manager", fieldManager), HaveField("Operation", metav1.ManagedFieldsOperationApply))), objectName(want))
	}
	deployment := &appsv1.Deployment{}
	g.Expect(guestAdmin.Get(ctx, controllerKey, deployment)).To(Succeed())
	g.Expect(deployment.Spec.Template.Annotations).To(HaveKeyWithValue(tenancy.ClusterUIDLabel, string(c.UID)))
	g.Expect(deployment.Spec.Template.Spec.Containers[0].Args).To(ContainElements("--cluster-name=$(CLUSTER_NAME)", "--cluster-uid=$(CLUSTER_UID)"))
	g.Expect(deployment.Spec.Template.Spec.Containers[0].Env).To(ContainElement(HaveField("ValueFrom.ConfigMapKeyRef.Name", tenancy.GuestIdentityConfigMap)),
		"guest-csi's --cluster-uid reads the ConfigMap")
	for _, key := range []client.ObjectKey{defaultClassKey, xfsClassKey} {
		sc := &storagev1.StorageClass{}
		g.Expect(guestAdmin.Get(ctx, key, sc)).To(Succeed())
		g.Expect(sc.Parameters).To(HaveKeyWithValue(names.MgmtStorageClassParam, "fast"), "the Namespace's first allowed class")
	}
	g.Expect(guestAdmin.Get(ctx, snapshotClassKey, &snapshotv1.VolumeSnapshotClass{})).To(Succeed())
	eventually(g, reasons).WithContext(ctx).Should(ContainElement(eventGuestInstalled))

	// Drift is put back: a Deployment changed by someone else, a deleted CSIDriver.
	patch := client.MergeFrom(deployment.DeepCopy())
	deployment.Spec.Replicas = ptr.To[int32](3)
	deployment.Spec.Template.Spec.Containers[0].Image = "example.com/not-guest-csi:latest"
	g.Expect(guestAdmin.Patch(ctx, deployment, patch, client.FieldOwner("kubectl-edit"))).To(Succeed())
	driver := &storagev1.CSIDriver{}
	g.Expect(guestAdmin.Get(ctx, client.ObjectKey{Name: names.GuestDriver}, driver)).To(Succeed())
	g.Expect(guestAdmin.Delete(ctx, driver)).To(Succeed())
	eventually(g, func(g Gomega, ctx context.Context) {
		g.Expect(guestAdmin.Get(ctx, controllerKey, deployment)).To(Succeed())
		g.Expect(deployment.Spec.Replicas).To(HaveValue(BeEquivalentTo(1)))
		g.Expect(deployment.Spec.Template.Spec.Containers[0].Image).To(Equal("ghcr.io/pvbridge/guest-csi:v0.1.0"))
		g.Expect(guestAdmin.Get(ctx, client.ObjectKey{Name: names.GuestDriver}, &storagev1.CSIDriver{})).To(Succeed())
	}).WithContext(ctx).Should(Succeed())

	// A new allow-list on the Cluster that names a replicated management class first: the
	// StorageClasses, whose parameters cannot change, are replaced, and say that it is replicated.
	replicatedClass := &storagev1.StorageClass{ObjectMeta: metav1.ObjectMeta{Name: "pmem"}, Provisioner: names.PmemDriver,
		Parameters: map[string]string{names.ReplicasParam: "2"}}
	g.Expect(mgmtClient.Create(ctx, replicatedClass)).To(Succeed())
	t.Cleanup(func() { _ = mgmtClient.Delete(context.Background(), replicatedClass) })
	old := &storagev1.StorageClass{}
	g.Expect(guestAdmin.Get(ctx, defaultClassKey, old)).To(Succeed())
	annotateCluster(t, c, tenancy.StorageClassesAnnotation, "pmem,fast")
	eventually(g, func(g Gomega, ctx context.Context) {
		for _, key := range []client.ObjectKey{defaultClassKey, xfsClassKey} {
			sc := &storagev1.StorageClass{}
			g.Expect(guestAdmin.Get(ctx, key, sc)).To(Succeed())
			g.Expect(sc.Parameters).To(HaveKeyWithValue(names.MgmtStorageClassParam, "pmem"))
			g.Expect(sc.Parameters).To(HaveKeyWithValue(names.ReplicatedParam, "true"))
		}
	}).WithContext(ctx).Should(Succeed())
	replaced := &storagev1.StorageClass{}
	g.Expect(guestAdmin.Get(ctx, defaultClassKey, replaced)).To(Succeed())
	g.Expect(replaced.UID).NotTo(Equal(old.UID))
	g.Expect(replaced.Annotations).To(HaveKeyWithValue("storageclass.kubernetes.io/is-default-class", "true"))

	// An empty allow-list: the StorageClasses are left out, with an Event; the rest is still
	// applied.
	annotateCluster(t, c, tenancy.StorageClassesAnnotation, "")
	eventually(g, func(ctx context.Context) ([]string, error) { return eventNotes(ctx, c, eventGuestClassSkipped) }).
		WithContext(ctx).Should(ContainElement(HavePrefix(installSkipReason)))
	for _, key := range []client.ObjectKey{defaultClassKey, xfsClassKey} {
		g.Expect(guestAdmin.Delete(ctx, &storagev1.StorageClass{ObjectMeta: metav1.ObjectMeta{Name: key.Name}})).To(Succeed())
	}
	g.Expect(guestAdmin.Get(ctx, controllerKey, deployment)).To(Succeed())
	patch = client.MergeFrom(deployment.DeepCopy())
	deployment.Spec.Replicas = ptr.To[int32](4)
	g.Expect(guestAdmin.Patch(ctx, deployment, patch, client.FieldOwner("kubectl-edit"))).To(Succeed())
	eventually(g, func(g Gomega, ctx context.Context) {
		g.Expect(guestAdmin.Get(ctx, controllerKey, deployment)).To(Succeed())
		g.Expect(deployment.Spec.Replicas).To(HaveValue(BeEquivalentTo(1)))
	}).WithContext(ctx).Should(Succeed())
	g.Consistently(func(ctx context.Context) bool {
		err := guestAdmin.Get(ctx, defaultClassKey, &storagev1.StorageClass{})
		return apierrors.IsNotFound(err)
	}).WithContext(ctx).WithTimeout(2*time.Second).WithPolling(100*time.Millisecond).Should(BeTrue(),
		"no StorageClass without an allowed management class")

	// Opt-out: the guest is left as it is.
	annotateCluster(t, c, tenancy.GuestInstallAnnotation, "false")
	eventually(g, reasons).WithContext(ctx).Should(ContainElement(eventGuestInstallOff))
	patch = client.MergeFrom(deployment.DeepCopy())
	deployment.Spec.Replicas = ptr.To[int32](5)
	g.Expect(guestAdmin.Patch(ctx, deployment, patch, client.FieldOwner("kubectl-edit"))).To(Succeed())
	g.Expect(guestAdmin.Delete(ctx, &storagev1.CSIDriver{ObjectMeta: metav1.ObjectMeta{Name: names.GuestDriver}})).To(Succeed())
	annotateCluster(t, c, "touched", "1") // a reconcile, which must not apply
	g.Consistently(func(g Gomega, ctx context.Context) {
		g.Expect(guestAdmin.Get(ctx, controllerKey, deployment)).To(Succeed())
		g.Expect(deployment.Spec.Replicas).To(HaveValue(BeEquivalentTo(5)))
		err := guestAdmin.Get(ctx, client.ObjectKey{Name: names.GuestDriver}, &storagev1.CSIDriver{})
		g.Expect(apierrors.IsNotFound(err)).To(BeTrue(), "the deleted CSIDriver stays deleted: %v", err)
	}).WithContext(ctx).WithTimeout(2 * time.Second).WithPolling(100 * time.Millisecond).Should(Succeed())

	// Back on, then the Cluster is deleted: the guest keeps everything.
	annotateCluster(t, c, tenancy.GuestInstallAnnotation, "true")
	annotateCluster(t, c, tenancy.StorageClassesAnnotation, "pmem")
	eventually(g, func(ctx context.Context) error {
		return guestAdmin.Get(ctx, client.ObjectKey{Name: names.GuestDriver}, &storagev1.CSIDriver{})
	}).WithContext(ctx).Should(Succeed())
	g.Expect(mgmtClient.Delete(ctx, c)).To(Succeed())
	eventually(g, func(ctx context.Context) bool {
		return apierrors.IsNotFound(mgmtClient.Get(ctx, client.ObjectKeyFromObject(c), &clusterv1.Cluster{}))
	}).WithContext(ctx).Should(BeTrue(), "the cleanup lets the Cluster go")
	for _, want := range expected {
		obj := &unstructured.Unstructured{}
		obj.SetGroupVersionKind(want.GroupVersionKind())
		g.Expect(guestAdmin.Get(ctx, client.ObjectKeyFromObject(want), obj)).To(Succeed(), "%s stays in the guest", objectName(want))
	}
}

// annotateCluster sets an annotation of c in the management cluster.
func annotateCluster(t *testing.T, c *clusterv1.Cluster, key, value string) {
	t.Helper()
	patch := client.MergeFrom(c.DeepCopy())
	if c.Annotations == nil {
		c.Annotations = map[string]string{}
	}
	c.Annotations[key] = value
	if err := mgmtClient.Patch(t.Context(), c, patch); err != nil {
		t.Fatal(err)
	}
}

// eventNotes are the notes of the Events about obj with reason.
func eventNotes(ctx context.Context, obj client.Object, reason string) ([]string, error) {
	var list eventsv1.EventList
	if err := mgmtClient.List(ctx, &list, client.InNamespace(obj.GetNamespace())); err != nil {
		return nil, err
	}
	var notes []string
	for _, ev := range list.Items {
		if ev.Regarding.UID == obj.GetUID() && ev.Reason == reason {
			notes = append(notes, ev.Note)
		}
	}
	return notes, nil
}

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}

// TestMirrorImage: a mirror replaces the registry of each image, Docker Hub's implied one too.
func TestMirrorImage(t *testing.T) {
	for image, want := range map[string]string{
		"ghcr.io/pvbridge/guest-csi:v0.1.0":                  "mirror.test:5000/k8s/pvbridge/guest-csi:v0.1.0",
		"registry.k8s.io/sig-storage/csi-provisioner:v6.4.0": "mirror.test:5000/k8s/sig-storage/csi-provisioner:v6.4.0",
		"localhost/tools/probe@sha256:0123":                  "mirror.test:5000/k8s/tools/probe@sha256:0123",
		"registry.example.com:5000/team/app:1":               "mirror.test:5000/k8s/team/app:1",
		"team/app:1":                                         "mirror.test:5000/k8s/team/app:1",
		"busybox:1.36":                                       "mirror.test:5000/k8s/library/busybox:1.36",
	} {
		t.Run(image, func(t *testing.T) {
			NewWithT(t).Expect(mirrorImage(image, "mirror.test:5000/k8s")).To(Equal(want))
		})
	}
}

// TestRenderInstallMirrorsEveryImage: with a registry, no container of the install names
// another one.
func TestRenderInstallMirrorsEveryImage(t *testing.T) {
	g := NewWithT(t)
	cluster := &clusterv1.Cluster{ObjectMeta: metav1.ObjectMeta{Namespace: "tenant-a", Name: "alpha", UID: "1234-uid"}}
	objs, _, err := renderInstall(must(guestInstall()), cluster, "fast", false, "mirror.test")
	g.Expect(err).NotTo(HaveOccurred())
	var images []string
	for _, u := range objs {
		for _, field := range []string{"containers", "initContainers"} {
			containers, _, _ := unstructured.NestedSlice(u.Object, "spec", "template", "spec", field)
			for _, c := range containers {
				images = append(images, c.(map[string]any)["image"].(string))
			}
		}
	}
	g.Expect(images).To(ContainElement("mirror.test/pvbridge/guest-csi:v0.1.0"))
	g.Expect(images).To(HaveEach(HavePrefix("mirror.test/")))
}
