package driver

import (
	"flag"
	"os"
	"testing"

	"pvbridge.io/pkg/testenv"
)

// kubeconfig is an admin kubeconfig of the package's test apiserver: a real kube-apiserver and
// etcd (the lab's pinned binaries) with pvbridge's CRDs, started once by TestMain.
var kubeconfig string

func TestMain(m *testing.M) {
	os.Exit(runSuite(m))
}

func runSuite(m *testing.M) int {
	flag.Parse()
	if testenv.Fuzzing() {
		return m.Run()
	}
	return testenv.RunTests(m, func(srv *testenv.Server) { kubeconfig = srv.AdminKubeconfig }, "bases")
}
