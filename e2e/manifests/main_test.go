// Package manifests proves the kustomize overlays of manifests/ against a real kube-apiserver:
// every overlay builds and each of its objects passes a server-side dry run, and the tenancy
// admission policy, applied for real, refuses every cross-tenant write of a guest identity with
// its reason while the same writes within the guest's own rights pass.
package manifests

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

// The package's test apiserver, started once by TestMain: a real kube-apiserver and etcd (the
// lab's pinned binaries) with pvbridge's and the snapshot CRDs, RBAC authorization and the
// default admission plugins.
var (
	// adminConfig is an admin (system:masters) of the apiserver; adminKubeconfig its file.
	adminConfig     *rest.Config
	adminKubeconfig string
	// kubectl is the pinned kubectl, with kustomize built in.
	kubectl string
)

// manifestsDir is the repository's manifests/ directory.
var manifestsDir = filepath.Join("..", "..", "manifests")

func TestMain(m *testing.M) {
	os.Exit(runSuite(m))
}

func runSuite(m *testing.M) int {
	ctrl.SetLogger(klog.Background())
	bin := os.Getenv("PVBRIDGE_BIN")
	if bin == "" {
		cache, err := os.UserCacheDir()
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		bin = filepath.Join(cache, "pvbridge", "bin")
	}
	kubectl = filepath.Join(bin, "kubectl")
	if _, err := os.Stat(kubectl); err != nil {
		fmt.Fprintf(os.Stderr, "kubectl is not built (run `make tools`): %v\n", err)
		return 1
	}
	crds := filepath.Join(manifestsDir, "crd")
	env := &envtest.Environment{
		CRDDirectoryPaths:     []string{filepath.Join(crds, "bases"), filepath.Join(crds, "snapshot")},
		ErrorIfCRDPathMissing: true,
		BinaryAssetsDirectory: bin,
	}
	if _, err := env.Start(); err != nil {
		fmt.Fprintf(os.Stderr, "start the test apiserver (binaries from %s; run `make tools`): %v\n", bin, err)
		return 1
	}
	defer func() { _ = env.Stop() }()
	dir, err := os.MkdirTemp("", "pvbridge-manifests-test-")
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
	adminConfig = admin.Config()
	return m.Run()
}
