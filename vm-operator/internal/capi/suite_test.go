package capi

import (
	"os"
	"testing"

	"k8s.io/client-go/rest"
	"k8s.io/klog/v2"
	ctrl "sigs.k8s.io/controller-runtime"

	"pvbridge.io/pkg/testenv"
)

// testEnv is the package's test apiserver: a real kube-apiserver and etcd with pvbridge's CRDs,
// the provider's and Cluster API's Cluster and Machine, started once by TestMain. It runs no
// other controller: the tests play Cluster API and vm-operator by writing objects themselves.
var testEnv *rest.Config

func TestMain(m *testing.M) {
	os.Exit(runSuite(m))
}

func runSuite(m *testing.M) int {
	ctrl.SetLogger(klog.Background())
	return testenv.RunTests(m, func(srv *testenv.Server) { testEnv = srv.Config }, "bases", "capi", "infrastructure")
}
