package controller

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"k8s.io/client-go/rest"
	"k8s.io/klog/v2"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
)

// testEnv is the package's test apiserver: a real kube-apiserver and etcd (the lab's pinned
// binaries) with pvbridge's CRDs, started once by TestMain. It runs no controllers: the tests
// play the PV binder, csi-attacher and the host agent by writing status themselves.
var testEnv *rest.Config

func TestMain(m *testing.M) {
	os.Exit(runSuite(m))
}

func runSuite(m *testing.M) int {
	ctrl.SetLogger(klog.Background())
	assets := os.Getenv("PVBRIDGE_BIN")
	if assets == "" {
		cache, err := os.UserCacheDir()
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		assets = filepath.Join(cache, "pvbridge", "bin")
	}
	env := &envtest.Environment{
		CRDDirectoryPaths:     []string{filepath.Join("..", "..", "..", "manifests", "crd", "bases")},
		ErrorIfCRDPathMissing: true,
		BinaryAssetsDirectory: assets,
	}
	cfg, err := env.Start()
	if err != nil {
		fmt.Fprintf(os.Stderr, "start the test apiserver (binaries from %s; run `make tools`): %v\n", assets, err)
		return 1
	}
	defer func() { _ = env.Stop() }()
	testEnv = cfg
	return m.Run()
}
