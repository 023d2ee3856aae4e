package driver

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	. "github.com/onsi/gomega"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/rand"
	"k8s.io/apimachinery/pkg/util/uuid"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/util/retry"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pvbridge.io/guest-csi/internal/mgmt"
	"pvbridge.io/guest-csi/internal/request"
	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/pkg/csinode/csinodetest"
	"pvbridge.io/pkg/tenancy"
)

const (
	envHost      = "host-a"
	envFullHost  = "host-full"
	envClass     = "pmem"
	capacityNS   = "pvbridge-system"
	callTimeout  = 20 * time.Second
	envMountSize = 64 * mib
)

// guestEnv is a guest cluster's controller service against the test apiserver: a namespace
// with the cluster's VMs (each with a device tree in a directory), the responder playing the
// management side, and the driver in controller mode, reached through its socket.
type guestEnv struct {
	ns      string
	cluster tenancy.Cluster
	admin   client.Client
	ctrl    csi.ControllerClient
	groups  csi.GroupControllerClient
	resp    *responder
	roots   map[string]string // VM → device root
	socket  string
}

type envOptions struct {
	vms       []string
	fullHosts []string
	// mgmt overrides the controller's management credential (default: an admin kubeconfig
	// whose context names the namespace).
	mgmt *mgmt.Credentials
}

func newGuestEnv(t *testing.T, opts envOptions) *guestEnv {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Fatal("the controller tests attach real loop devices and must run as root")
	}
	if opts.vms == nil {
		opts.vms = []string{"vm-1", "vm-2"}
	}
	e := &guestEnv{
		ns:    "tenant-" + rand.String(6),
		admin: adminClient(t),
		roots: map[string]string{},
	}
	e.cluster = tenancy.Cluster{Namespace: e.ns, Name: "alpha", UID: string(uuid.NewUUID())}
	ctx := t.Context()
	g := NewWithT(t)
	g.Expect(e.admin.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: e.ns}})).To(Succeed())
	// The management class: the apiserver lets only PVCs of an expandable class grow.
	class := &storagev1.StorageClass{
		ObjectMeta: metav1.ObjectMeta{Name: envClass}, Provisioner: responderDriver, AllowVolumeExpansion: ptrTo(true),
	}
	if err := e.admin.Create(ctx, class); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	for _, name := range opts.vms {
		e.roots[name] = filepath.Join(t.TempDir(), "vm")
		e.createVM(t, name, envHost, e.cluster.Name)
	}
	e.resp = startResponder(t, e.ns, e.roots, opts.fullHosts...)

	dir := csinodetest.SocketDir(t)
	e.socket = filepath.Join(dir, "controller.sock")
	cred := mgmt.Credentials{Kubeconfig: kubeconfigIn(t, e.ns)}
	if opts.mgmt != nil {
		cred = *opts.mgmt
	}
	runDriver(t, Options{
		Endpoint: e.socket, Mode: ModeController, Version: "test", GuestKubeconfig: adminKubeconfig,
		KubeAPIQPS: 100, KubeAPIBurst: 200,
		ClusterName: e.cluster.Name, ClusterUID: e.cluster.UID, Mgmt: cred, CredentialPoll: 100 * time.Millisecond,
		StorageClass: envClass, CapacityNamespace: capacityNS,
		// A second, not the default 10 s: a test waits for the List that shows a new warning.
		WarningsPeriod: time.Second,
	})
	conn := csinodetest.Dial(t, e.socket)
	e.ctrl, e.groups = csi.NewControllerClient(conn), csi.NewGroupControllerClient(conn)
	if opts.mgmt == nil {
		e.waitConnected(t)
	}
	return e
}

// waitConnected waits until the driver has its management session.
func (e *guestEnv) waitConnected(t *testing.T) {
	t.Helper()
	NewWithT(t).Eventually(func() error {
		_, err := e.ctrl.ListSnapshots(t.Context(), &csi.ListSnapshotsRequest{})
		return err
	}).WithTimeout(eventually).Should(Succeed())
}

// createVM creates VM name of cluster on host.
func (e *guestEnv) createVM(t *testing.T, name, host, cluster string) {
	t.Helper()
	g := NewWithT(t)
	vm := &vmv1.VirtualMachine{ObjectMeta: metav1.ObjectMeta{
		Namespace: e.ns, Name: name, Labels: map[string]string{tenancy.CAPIClusterNameLabel: cluster},
	}}
	g.Expect(e.admin.Create(t.Context(), vm)).To(Succeed())
	// The responder writes the status too: a conflict rereads.
	g.Expect(retry.RetryOnConflict(retry.DefaultBackoff, func() error {
		if err := e.admin.Get(t.Context(), client.ObjectKeyFromObject(vm), vm); err != nil {
			return err
		}
		vm.Status.Host = host
		return e.admin.Status().Update(t.Context(), vm)
	})).To(Succeed())
}

// runDriver runs a driver with opts until the test ends, and fails the test if it stops with an
// error.
func runDriver(t *testing.T, opts Options) {
	t.Helper()
	d, err := New(opts)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.WithoutCancel(t.Context()))
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("%s driver: %v", opts.Mode, err)
		}
	})
}

func adminClient(t *testing.T) client.Client {
	t.Helper()
	// The test apiserver's own admin config: envtest gives it 1000 requests/s, where a config
	// loaded from a kubeconfig gets client-go's 5/s, which paced the tests' fixtures.
	cfg := rest.CopyConfig(testEnv.Config)
	scheme, err := newScheme()
	if err != nil {
		t.Fatal(err)
	}
	c, err := client.New(cfg, client.Options{Scheme: scheme})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// call runs an RPC with a deadline, as the sidecars do.
func call[Req, Resp any](t *testing.T, rpc func(context.Context, Req, ...grpc.CallOption) (Resp, error), req Req) (Resp, error) {
	ctx, cancel := context.WithTimeout(t.Context(), callTimeout)
	defer cancel()
	return rpc(ctx, req)
}

// retried runs an RPC until it succeeds or fails with a code a sidecar does not retry, as the
// sidecars do.
func retried[Req, Resp any](t *testing.T, rpc func(context.Context, Req, ...grpc.CallOption) (Resp, error), req Req) (Resp, error) {
	return retriedSeeing(t, rpc, req, func(error) {})
}

// retriedSeeing is retried that shows every answer's error to seen.
func retriedSeeing[Req, Resp any](t *testing.T, rpc func(context.Context, Req, ...grpc.CallOption) (Resp, error), req Req, seen func(error)) (Resp, error) {
	for {
		resp, err := call(t, rpc, req)
		seen(err)
		switch status.Code(err) {
		case codes.Unavailable, codes.DeadlineExceeded, codes.Aborted:
			if t.Context().Err() != nil {
				return resp, err
			}
			continue
		}
		return resp, err
	}
}

// createReq asks for a mount volume of guest PVC name on host.
func createReq(name, host string, size int64) *csi.CreateVolumeRequest {
	req := &csi.CreateVolumeRequest{
		Name:               "pvc-" + string(uuid.NewUUID()),
		CapacityRange:      &csi.CapacityRange{RequiredBytes: size},
		VolumeCapabilities: []*csi.VolumeCapability{fsCap("ext4")},
		Parameters: map[string]string{
			request.ParamPVCName: name, request.ParamPVCNamespace: "default", request.ParamPVName: "pv-" + name,
		},
	}
	if host != "" {
		req.AccessibilityRequirements = &csi.TopologyRequirement{
			Requisite: []*csi.Topology{{Segments: map[string]string{TopologyKey: host}}},
			Preferred: []*csi.Topology{{Segments: map[string]string{TopologyKey: host}}},
		}
	}
	return req
}

// restoreReq asks for a volume like createReq, restored from snapshot.
func restoreReq(name, snapshot string) *csi.CreateVolumeRequest {
	req := createReq(name, envHost, envMountSize)
	req.VolumeContentSource = &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: snapshot}}}
	return req
}

// expectRestoredFrom checks that the management PVC of volume id is restored from snapshot.
func (e *guestEnv) expectRestoredFrom(t *testing.T, id, snapshot string) {
	t.Helper()
	NewWithT(t).Expect(e.claimOf(t, id).Spec.DataSource).To(Equal(&corev1.TypedLocalObjectReference{
		APIGroup: ptrTo("snapshot.storage.k8s.io"), Kind: "VolumeSnapshot", Name: snapshot,
	}))
}

// claimOf reads the management PVC of a volume.
func (e *guestEnv) claimOf(t *testing.T, id string) *corev1.PersistentVolumeClaim {
	t.Helper()
	pvc := &corev1.PersistentVolumeClaim{}
	NewWithT(t).Expect(e.admin.Get(t.Context(), client.ObjectKey{Namespace: e.ns, Name: id}, pvc)).To(Succeed())
	return pvc
}

// createVolume creates a volume on envHost and returns its ID.
func (e *guestEnv) createVolume(t *testing.T, name string) string {
	t.Helper()
	resp, err := retried(t, e.ctrl.CreateVolume, createReq(name, envHost, envMountSize))
	NewWithT(t).Expect(err).NotTo(HaveOccurred())
	return resp.GetVolume().GetVolumeId()
}

// importClaim creates a Bound management PVC that no guest created, as a platform admin does
// before a static import, with annotations.
func (e *guestEnv) importClaim(t *testing.T, name string, annotations map[string]string) string {
	t.Helper()
	g := NewWithT(t)
	pvc := &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: name, Annotations: annotations},
		Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			VolumeMode:  ptrTo(corev1.PersistentVolumeBlock),
			Resources:   corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: volumeQuantity(envMountSize)}},
		},
	}
	g.Expect(e.admin.Create(t.Context(), pvc)).To(Succeed())
	g.Eventually(func() corev1.PersistentVolumeClaimPhase { return e.claimOf(t, name).Status.Phase }).
		WithTimeout(eventually).Should(Equal(corev1.ClaimBound))
	return name
}

func (e *guestEnv) publishReq(id, vm string) *csi.ControllerPublishVolumeRequest {
	return &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: vm, VolumeCapability: fsCap("ext4")}
}

func (e *guestEnv) unpublishReq(id, vm string) *csi.ControllerUnpublishVolumeRequest {
	return &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: vm}
}

// vmVolumes returns the names in the VM's spec.volumes.
func (e *guestEnv) vmVolumes(t *testing.T, vm string) []string {
	t.Helper()
	obj := &vmv1.VirtualMachine{}
	NewWithT(t).Expect(e.admin.Get(t.Context(), client.ObjectKey{Namespace: e.ns, Name: vm}, obj)).To(Succeed())
	var names []string
	for _, v := range obj.Spec.Volumes {
		names = append(names, v.Name)
	}
	return names
}

func ptrTo[T any](v T) *T { return &v }

func expectCodeIn(g Gomega, err error, code codes.Code, msg string) {
	g.Expect(status.Code(err)).To(Equal(code), "%v", err)
	g.Expect(err.Error()).To(ContainSubstring(msg))
}
