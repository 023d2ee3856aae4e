package tenants

import (
	"context"
	"fmt"
	"maps"
	"math/rand/v2"
	"sort"
	"strings"
	"testing"
	"time"

	groupsnapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumegroupsnapshot/v1"
	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	eventsv1 "k8s.io/api/events/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/utils/ptr"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/config"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/pkg/tenancy"
	"pvbridge.io/pkg/testenv"
)

// tenantEnv is one test's share of the two apiservers: a tenant namespace and a capacity
// namespace in the management cluster, a namespace for the credential in the guest cluster.
type tenantEnv struct {
	ns, capacityNS, guestNS string
}

func newTenantEnv(t *testing.T, nsAnnotations map[string]string) *tenantEnv {
	t.Helper()
	suffix := fmt.Sprintf("%06d", rand.IntN(1_000_000))
	e := &tenantEnv{ns: "tenant-" + suffix, capacityNS: "capacity-" + suffix, guestNS: "guest-" + suffix}
	for _, ns := range []*corev1.Namespace{
		{ObjectMeta: metav1.ObjectMeta{Name: e.ns, Annotations: nsAnnotations}},
		{ObjectMeta: metav1.ObjectMeta{Name: e.capacityNS}},
	} {
		if err := mgmtClient.Create(t.Context(), ns); err != nil {
			t.Fatal(err)
		}
	}
	if err := guestAdmin.Create(t.Context(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: e.guestNS}}); err != nil {
		t.Fatal(err)
	}
	return e
}

// config is the reconcilers' configuration for this test: the management apiserver as seen
// by the guest, its CA, the test's namespaces, 10-minute tokens.
func (e *tenantEnv) config() Config {
	server := mgmtConfig.Host
	if !strings.HasPrefix(server, "https://") {
		server = "https://" + server
	}
	return Config{
		MgmtServer: server, MgmtCA: mgmtConfig.CAData,
		CapacityNamespace: e.capacityNS, GuestNamespace: e.guestNS, TokenTTL: MinTokenTTL,
	}
}

// startManager runs the three reconcilers as the controller runs them, on a cache of the test's
// namespaces, until the test ends.
func (e *tenantEnv) startManager(t *testing.T, cfg Config) {
	t.Helper()
	opts := CacheOptions()
	opts.DefaultNamespaces = map[string]cache.Config{e.ns: {}, e.capacityNS: {}}
	opts.ByObject[&corev1.Namespace{}] = cache.ByObject{Field: fields.OneTermEqualSelector("metadata.name", e.ns)}
	mgr, err := ctrl.NewManager(mgmtConfig, ctrl.Options{
		Scheme:                 scheme,
		Cache:                  opts,
		Metrics:                metricsserver.Options{BindAddress: "0"},
		HealthProbeBindAddress: "0",
		Controller:             config.Controller{SkipNameValidation: ptr.To(true)},
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := SetupWithManager(mgr, cfg); err != nil {
		t.Fatal(err)
	}
	testenv.RunManager(t, mgr)
}

// accountUID waits for the ServiceAccount of cluster's guest identity and returns its UID.
func (e *tenantEnv) accountUID(t *testing.T, cluster string) string {
	t.Helper()
	sa := &corev1.ServiceAccount{}
	key := client.ObjectKey{Namespace: e.ns, Name: identityName(cluster)}
	eventually(NewWithT(t), func(ctx context.Context) error { return mgmtClient.Get(ctx, key, sa) }).
		WithContext(t.Context()).Should(Succeed())
	return string(sa.UID)
}

// createCluster creates an opted-in Cluster (or not, with optIn false) in the test namespace.
// Its guest install is off unless annotations set tenancy.GuestInstallAnnotation: the guest apiserver
// is shared, and only the install tests install into it.
func (e *tenantEnv) createCluster(t *testing.T, name string, optIn bool, annotations map[string]string) *clusterv1.Cluster {
	t.Helper()
	annotations = maps.Clone(annotations)
	if _, ok := annotations[tenancy.GuestInstallAnnotation]; !ok {
		if annotations == nil {
			annotations = map[string]string{}
		}
		annotations[tenancy.GuestInstallAnnotation] = "false"
	}
	c := &clusterv1.Cluster{
		ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: name, Annotations: annotations},
		Spec:       clusterv1.ClusterSpec{ControlPlaneEndpoint: clusterv1.APIEndpoint{Host: "127.0.0.1", Port: 6443}},
	}
	if optIn {
		c.Labels = map[string]string{tenancy.EnabledLabel: "true"}
	}
	if err := mgmtClient.Create(t.Context(), c); err != nil {
		t.Fatal(err)
	}
	return c
}

// createKubeconfigSecret writes the guest's admin kubeconfig into <cluster>-kubeconfig as
// Cluster API does.
// writeParams runs the parameters reconciler once for the namespace, as the manager would
// after a Cluster opted in: the credentials reconciler waits for it.
func (e *tenantEnv) writeParams(t *testing.T) {
	t.Helper()
	if _, err := (&ParamsReconciler{Client: mgmtClient}).Reconcile(t.Context(), ctrl.Request{NamespacedName: client.ObjectKey{Namespace: e.ns, Name: tenancy.ParamsConfigMap}}); err != nil {
		t.Fatal(err)
	}
}

// grantIdentity runs the credentials reconciler once, which makes the Cluster's identity and
// then waits for the parameters to name its account, and writes the parameters.
func (e *tenantEnv) grantIdentity(t *testing.T, r *CredentialsReconciler, c *clusterv1.Cluster) {
	t.Helper()
	res, err := r.Reconcile(t.Context(), ctrl.Request{NamespacedName: client.ObjectKeyFromObject(c)})
	if err != nil || res.RequeueAfter != time.Second {
		t.Fatalf("the first reconcile waits for the parameters: %v, %v", res, err)
	}
	e.writeParams(t)
}

func (e *tenantEnv) createKubeconfigSecret(t *testing.T, c *clusterv1.Cluster) {
	t.Helper()
	secret := &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{
			Namespace: e.ns, Name: c.Name + "-kubeconfig",
			Labels: map[string]string{clusterv1.ClusterNameLabel: c.Name},
			OwnerReferences: []metav1.OwnerReference{{
				APIVersion: clusterv1.GroupVersion.String(), Kind: "Cluster", Name: c.Name, UID: c.UID, Controller: ptr.To(true),
			}},
		},
		Type: "cluster.x-k8s.io/secret",
		Data: map[string][]byte{"value": guestKubeconfig},
	}
	if err := mgmtClient.Create(t.Context(), secret); err != nil {
		t.Fatal(err)
	}
}

// guestSecret reads the credential delivered into the guest cluster.
func (e *tenantEnv) guestSecret(ctx context.Context) (*corev1.Secret, error) {
	s := &corev1.Secret{}
	return s, guestAdmin.Get(ctx, client.ObjectKey{Namespace: e.guestNS, Name: tenancy.GuestCredentialsSecret}, s)
}

// identityClient is a management client with the credential of a guest Secret.
func identityClient(t *testing.T, kubeconfig []byte) client.Client {
	t.Helper()
	rc, err := clientcmd.RESTConfigFromKubeConfig(kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	testenv.Unthrottle(rc)
	c, err := client.New(rc, client.Options{Scheme: scheme})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// eventReasons are the reasons of the Events about obj, sorted.
func eventReasons(ctx context.Context, obj client.Object) ([]string, error) {
	var list eventsv1.EventList
	if err := mgmtClient.List(ctx, &list, client.InNamespace(obj.GetNamespace())); err != nil {
		return nil, err
	}
	var reasons []string
	for _, ev := range list.Items {
		if ev.Regarding.UID == obj.GetUID() {
			reasons = append(reasons, ev.Reason)
		}
	}
	sort.Strings(reasons)
	return reasons, nil
}

// pvc is a management PVC of the test namespace with labels and the shared-with annotation
// (none when shared is "").
func (e *tenantEnv) pvc(name string, labels map[string]string, shared string) *corev1.PersistentVolumeClaim {
	c := &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: name, Labels: labels},
		Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			Resources:   corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")}},
		},
	}
	if shared != "" {
		c.Annotations = map[string]string{tenancy.SharedWithAnnotation: shared}
	}
	return c
}

// snapshot is a management VolumeSnapshot of the test namespace, like pvc.
func (e *tenantEnv) snapshot(name string, labels map[string]string, shared string) *snapshotv1.VolumeSnapshot {
	s := &snapshotv1.VolumeSnapshot{
		ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: name, Labels: labels},
		Spec:       snapshotv1.VolumeSnapshotSpec{Source: snapshotv1.VolumeSnapshotSource{PersistentVolumeClaimName: ptr.To("source")}},
	}
	if shared != "" {
		s.Annotations = map[string]string{tenancy.SharedWithAnnotation: shared}
	}
	return s
}

// groupSnapshot is a management VolumeGroupSnapshot of the test namespace with labels.
func (e *tenantEnv) groupSnapshot(name string, labels map[string]string) *groupsnapshotv1.VolumeGroupSnapshot {
	return &groupsnapshotv1.VolumeGroupSnapshot{
		ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: name, Labels: labels},
		Spec: groupsnapshotv1.VolumeGroupSnapshotSpec{Source: groupsnapshotv1.VolumeGroupSnapshotSource{
			Selector: &metav1.LabelSelector{MatchLabels: labels},
		}},
	}
}

// vm is a VirtualMachine of a guest cluster's, labelled by Cluster API.
func (e *tenantEnv) vm(name, cluster string) *vmv1.VirtualMachine {
	return &vmv1.VirtualMachine{
		ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: name, Labels: map[string]string{tenancy.CAPIClusterNameLabel: cluster}},
		Spec:       vmv1.VirtualMachineSpec{PowerState: vmv1.PowerStateOn},
	}
}

// create creates objs in the management cluster.
func create(t *testing.T, objs ...client.Object) {
	t.Helper()
	for _, obj := range objs {
		if err := mgmtClient.Create(t.Context(), obj); err != nil {
			t.Fatal(err)
		}
	}
}

// eventually is Gomega's Eventually with the suite's patience.
func eventually(g Gomega, f any) AsyncAssertion {
	return g.Eventually(f).WithTimeout(20 * time.Second).WithPolling(50 * time.Millisecond)
}
