package driver

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/klog/v2"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
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
	if fuzzing() {
		return m.Run() // fuzz targets need no apiserver, and every fuzz worker runs TestMain
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
	testEnv = &envtest.Environment{
		CRDDirectoryPaths:     []string{filepath.Join(crds, "bases"), filepath.Join(crds, "snapshot")},
		ErrorIfCRDPathMissing: true,
		BinaryAssetsDirectory: assets,
	}
	env := testEnv
	if _, err := env.Start(); err != nil {
		fmt.Fprintf(os.Stderr, "start the test apiserver (binaries from %s; run `make tools`): %v\n", assets, err)
		return 1
	}
	defer func() { _ = env.Stop() }()
	dir, err := os.MkdirTemp("", "guest-csi-test-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(dir)
	admin, err := env.AddUser(envtest.User{Name: "admin", Groups: []string{"system:masters"}}, nil)
	if err == nil {
		var data []byte
		if data, err = admin.KubeConfig(); err == nil {
			adminKubeconfig = filepath.Join(dir, "kubeconfig")
			err = os.WriteFile(adminKubeconfig, data, 0o600)
		}
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "admin kubeconfig:", err)
		return 1
	}
	return m.Run()
}

// fuzzing reports whether the test binary runs a fuzz target (or is one of its workers).
func fuzzing() bool {
	for _, name := range []string{"test.fuzz", "test.fuzzworker"} {
		if f := flag.Lookup(name); f != nil && f.Value.String() != "" && f.Value.String() != "false" {
			return true
		}
	}
	return false
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
