package driver

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	. "github.com/onsi/gomega"
	"google.golang.org/grpc/codes"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	"pvbridge.io/guest-csi/internal/mgmt"
	"pvbridge.io/guest-csi/internal/request"
	"pvbridge.io/pkg/tenancy"
)

// guestIdentity makes user, bound to rules in the env's namespace, and writes its management kubeconfig to path. It returns
// the RoleBinding, whose deletion revokes the identity.
func (e *guestEnv) guestIdentity(t *testing.T, user, path string, rules []rbacv1.PolicyRule) *rbacv1.RoleBinding {
	t.Helper()
	g := NewWithT(t)
	ctx := t.Context()
	role := &rbacv1.Role{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: user}, Rules: rules}
	g.Expect(e.admin.Create(ctx, role)).To(Succeed())
	binding := &rbacv1.RoleBinding{
		ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: user},
		Subjects:   []rbacv1.Subject{{Kind: rbacv1.UserKind, Name: user}},
		RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: role.Name},
	}
	g.Expect(e.admin.Create(ctx, binding)).To(Succeed())
	u, err := testEnv.AddUser(envtest.User{Name: user}, nil)
	g.Expect(err).NotTo(HaveOccurred())
	data, err := u.KubeConfig()
	g.Expect(err).NotTo(HaveOccurred())
	cfg, err := clientcmd.Load(data)
	g.Expect(err).NotTo(HaveOccurred())
	for _, c := range cfg.Contexts {
		c.Namespace = e.ns
	}
	// Written aside and renamed, as kubelet updates a mounted Secret: a reader never sees half.
	g.Expect(clientcmd.WriteToFile(*cfg, path+".new")).To(Succeed())
	g.Expect(os.Rename(path+".new", path)).To(Succeed())
	return binding
}

// The management credential is reread while the controller runs: a rotated identity is picked
// up without a restart, calls in flight fail at most with retryable codes, and once the old
// identity is revoked every call still succeeds.
func TestCredentialRotation(t *testing.T) {
	g := NewWithT(t)
	kubeconfig := filepath.Join(t.TempDir(), "kubeconfig")
	// Until the credential exists the controller answers Unavailable.
	e := newGuestEnv(t, envOptions{mgmt: &mgmt.Credentials{Kubeconfig: kubeconfig}})
	g.Eventually(func(g Gomega) {
		_, err := call(t, e.ctrl.ListSnapshots, &csi.ListSnapshotsRequest{})
		expectCodeIn(g, err, codes.Unavailable, "not connected to the management cluster yet")
	}).WithTimeout(eventually).Should(Succeed())

	// The first identity may do everything but take snapshots.
	noSnapshots := slices.Clone(tenancy.GuestRules)
	noSnapshots[1].Verbs = []string{"get", "list", "watch"}
	first := e.guestIdentity(t, "guest-"+e.ns+"-1", kubeconfig, noSnapshots)
	e.waitConnected(t)
	ids := make([]string, 10)
	for i := range ids {
		ids[i] = e.createVolume(t, fmt.Sprintf("rot-%d", i))
	}

	// Publish every volume while the credential rotates, then revoke the first identity.
	var wg sync.WaitGroup
	errs := make(chan error, len(ids))
	for _, id := range ids {
		wg.Go(func() {
			if _, err := retried(t, e.ctrl.ControllerPublishVolume, e.publishReq(id, "vm-1")); err != nil {
				errs <- err
			}
		})
	}
	e.guestIdentity(t, "guest-"+e.ns+"-2", kubeconfig, tenancy.GuestRules)
	wg.Wait()
	close(errs)
	for err := range errs {
		g.Expect(err).NotTo(HaveOccurred())
	}
	// Snapshots work once the controller uses the second identity.
	g.Eventually(func() error {
		_, err := call(t, e.ctrl.CreateSnapshot, &csi.CreateSnapshotRequest{Name: "snapshot-rotation", SourceVolumeId: ids[0]})
		return err
	}).WithTimeout(eventually).Should(Succeed())
	_, err := call(t, e.ctrl.DeleteSnapshot, &csi.DeleteSnapshotRequest{SnapshotId: request.MgmtName(e.cluster.UID, "snapshot-", "snapshot-rotation")})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(e.admin.Delete(t.Context(), first)).To(Succeed())

	for _, id := range ids {
		_, err := retried(t, e.ctrl.ControllerUnpublishVolume, e.unpublishReq(id, "vm-1"))
		g.Expect(err).NotTo(HaveOccurred(), "the controller works with the new identity")
		_, err = retried(t, e.ctrl.DeleteVolume, &csi.DeleteVolumeRequest{VolumeId: id})
		g.Expect(err).NotTo(HaveOccurred())
	}
	g.Expect(e.vmVolumes(t, "vm-1")).To(BeEmpty())
}
