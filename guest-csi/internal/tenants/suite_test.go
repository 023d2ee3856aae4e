package tenants

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/rest"
	"k8s.io/klog/v2"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
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
	assets := os.Getenv("PVBRIDGE_BIN")
	if assets == "" {
		cache, err := os.UserCacheDir()
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		assets = filepath.Join(cache, "pvbridge", "bin")
	}
	crds := filepath.Join("..", "..", "..", "manifests", "crd")
	mgmt := &envtest.Environment{
		CRDDirectoryPaths: []string{
			filepath.Join(crds, "bases"), filepath.Join(crds, "capi"), filepath.Join(crds, "snapshot"),
		},
		ErrorIfCRDPathMissing: true,
		BinaryAssetsDirectory: assets,
	}
	// The guest serves VolumeSnapshotClasses, which the guest install includes.
	guest := &envtest.Environment{
		CRDDirectoryPaths:     []string{filepath.Join(crds, "snapshot")},
		ErrorIfCRDPathMissing: true,
		BinaryAssetsDirectory: assets,
	}
	for name, env := range map[string]*envtest.Environment{"management": mgmt, "guest": guest} {
		if _, err := env.Start(); err != nil {
			fmt.Fprintf(os.Stderr, "start the %s test apiserver (binaries from %s; run `make tools`): %v\n", name, assets, err)
			return 1
		}
		defer func() { _ = env.Stop() }()
	}
	mgmtConfig = mgmt.Config
	if mgmtClient, err = client.New(mgmtConfig, client.Options{Scheme: scheme}); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	admin, err := guest.AddUser(envtest.User{Name: "capi-admin", Groups: []string{"system:masters"}}, nil)
	if err == nil {
		guestKubeconfig, err = admin.KubeConfig()
	}
	if err == nil {
		guestAdmin, err = client.New(admin.Config(), client.Options{Scheme: scheme})
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "guest admin:", err)
		return 1
	}
	return m.Run()
}
