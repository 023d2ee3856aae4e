package driver

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"sigs.k8s.io/controller-runtime/pkg/envtest"
)

// kubeconfig is an admin kubeconfig of the package's test apiserver: a real kube-apiserver and
// etcd (the lab's pinned binaries) with pvbridge's CRDs, started once by TestMain.
var kubeconfig string

func TestMain(m *testing.M) {
	os.Exit(runSuite(m))
}

func runSuite(m *testing.M) int {
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
	env := &envtest.Environment{
		CRDDirectoryPaths:     []string{filepath.Join("..", "..", "..", "manifests", "crd", "bases")},
		ErrorIfCRDPathMissing: true,
		BinaryAssetsDirectory: assets,
	}
	if _, err := env.Start(); err != nil {
		fmt.Fprintf(os.Stderr, "start the test apiserver (binaries from %s; run `make tools`): %v\n", assets, err)
		return 1
	}
	defer func() { _ = env.Stop() }()
	admin, err := env.AddUser(envtest.User{Name: "admin", Groups: []string{"system:masters"}}, nil)
	if err == nil {
		var data []byte
		if data, err = admin.KubeConfig(); err == nil {
			dir, derr := os.MkdirTemp("", "mgmt-csi-test-")
			if derr != nil {
				err = derr
			} else {
				defer os.RemoveAll(dir)
				kubeconfig = filepath.Join(dir, "kubeconfig")
				err = os.WriteFile(kubeconfig, data, 0o600)
			}
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
