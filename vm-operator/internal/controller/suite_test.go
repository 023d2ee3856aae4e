package controller

import (
	"os"
	"testing"

	"k8s.io/client-go/rest"
	"k8s.io/klog/v2"
	ctrl "sigs.k8s.io/controller-runtime"

	"pvbridge.io/pkg/testenv"
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
	return testenv.RunTests(m, func(srv *testenv.Server) { testEnv = srv.Config }, "bases")
}
