package tenants

import (
	"fmt"
	"os"
	"testing"

	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/rest"
	"k8s.io/klog/v2"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pvbridge.io/pkg/testenv"
)

// The package's two test apiservers, real kube-apiservers and etcds (the lab's pinned
// binaries) started once by TestMain: mgmt plays the management cluster (pvbridge's, Cluster
// API's and the snapshot CRDs; a namespace per test), guest a guest cluster (the snapshot CRDs;
// a namespace per test receives the credential; the guest install's objects are shared). Neither runs kube-controller-manager: no garbage collector,
// no PVC protection controller.
var (
	scheme *runtime.Scheme
	// mgmtConfig and mgmtClient are the management cluster's admin.
	mgmtConfig *rest.Config
	mgmtClient client.Client
	// guestKubeconfig is an admin kubeconfig of the guest cluster, as Cluster API writes it
	// into <cluster>-kubeconfig; guestAdmin is that admin's client.
	guestKubeconfig []byte
	guestAdmin      client.Client
)

func TestMain(m *testing.M) {
	os.Exit(runSuite(m))
}

func runSuite(m *testing.M) int {
	ctrl.SetLogger(klog.Background())
	var err error
	if scheme, err = NewScheme(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	mgmt, err := testenv.Start("bases", "capi", "snapshot")
	if err != nil {
		fmt.Fprintln(os.Stderr, "management:", err)
		return 1
	}
	defer mgmt.Stop()
	// The guest serves VolumeSnapshotClasses, which the guest install includes.
	guest, err := testenv.Start("snapshot")
	if err != nil {
		fmt.Fprintln(os.Stderr, "guest:", err)
		return 1
	}
	defer guest.Stop()
	mgmtConfig = mgmt.Config
	if mgmtClient, err = client.New(mgmtConfig, client.Options{Scheme: scheme}); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	// The guest's admin, as Cluster API writes its kubeconfig.
	if guestKubeconfig, err = guest.Admin.KubeConfig(); err == nil {
		guestAdmin, err = client.New(guest.Admin.Config(), client.Options{Scheme: scheme})
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "guest admin:", err)
		return 1
	}
	return m.Run()
}
