package driver

import (
	"flag"
	"os"
	"path/filepath"
	"testing"

	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/klog/v2"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	"pvbridge.io/pkg/testenv"
)

// adminKubeconfig is an admin kubeconfig of the package's test apiserver: a real kube-apiserver
// and etcd (the lab's pinned binaries) with pvbridge's and the snapshot CRDs, started once by
// TestMain. It plays both clusters: the management one (a namespace per test) and the guest.
var adminKubeconfig string

// testEnv is the test apiserver, which adds users for the credential tests.
var testEnv *envtest.Environment

func TestMain(m *testing.M) {
	os.Exit(runSuite(m))
}

func runSuite(m *testing.M) int {
	ctrl.SetLogger(klog.Background())
	flag.Parse()
	if testenv.Fuzzing() {
		return m.Run()
	}
	return testenv.RunTests(m, func(srv *testenv.Server) {
		testEnv, adminKubeconfig = srv.Environment, srv.AdminKubeconfig
	}, "bases", "snapshot")
}

// kubeconfigIn writes a copy of the admin kubeconfig whose context names namespace, as the
// management kubeconfig of a guest cluster does, and returns its path.
func kubeconfigIn(t *testing.T, namespace string) string {
	t.Helper()
	cfg, err := clientcmd.LoadFromFile(adminKubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range cfg.Contexts {
		c.Namespace = namespace
	}
	path := filepath.Join(t.TempDir(), "mgmt-kubeconfig")
	if err := clientcmd.WriteToFile(*cfg, path); err != nil {
		t.Fatal(err)
	}
	return path
}
