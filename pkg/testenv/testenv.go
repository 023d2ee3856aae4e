// Package testenv starts the test apiservers of pvbridge's integration tests: a real
// kube-apiserver and etcd (the lab's pinned binaries, through controller-runtime's envtest) with
// CRDs of the repository's manifests/crd and a system:masters user. Only tests import it.
package testenv

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"

	"github.com/onsi/ginkgo/v2"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
	"sigs.k8s.io/controller-runtime/pkg/manager"
)

// BinDir is the directory of the pinned third-party binaries: $PVBRIDGE_BIN, else
// <user cache directory>/pvbridge/bin, where `make tools` builds them.
func BinDir() (string, error) {
	if dir := os.Getenv("PVBRIDGE_BIN"); dir != "" {
		return dir, nil
	}
	cache, err := os.UserCacheDir()
	if err != nil {
		return "", err
	}
	return filepath.Join(cache, "pvbridge", "bin"), nil
}

// repoRoot is the pvbridge repository: $PVBRIDGE_ROOT (the Makefile sets it; the end-to-end
// tests are built with -trimpath, which leaves no absolute source path), else found from this
// file's path.
func repoRoot() (string, error) {
	if dir := os.Getenv("PVBRIDGE_ROOT"); dir != "" {
		return dir, nil
	}
	_, self, _, ok := runtime.Caller(0)
	if !ok || !filepath.IsAbs(self) {
		return "", errors.New("cannot find the repository's manifests/crd: set PVBRIDGE_ROOT")
	}
	return filepath.Join(filepath.Dir(self), "..", ".."), nil
}

// Server is a running test apiserver.
type Server struct {
	*envtest.Environment
	// Admin is a system:masters user; AdminKubeconfig is its kubeconfig file.
	Admin           *envtest.AuthenticatedUser
	AdminKubeconfig string

	dir string
}

// Start starts a test apiserver serving the CRDs of the named directories of manifests/crd
// (bases, snapshot, capi). Stop it with Stop.
func Start(crds ...string) (*Server, error) {
	bin, err := BinDir()
	if err != nil {
		return nil, err
	}
	repo, err := repoRoot()
	if err != nil {
		return nil, err
	}
	root := filepath.Join(repo, "manifests", "crd")
	env := &envtest.Environment{ErrorIfCRDPathMissing: true, BinaryAssetsDirectory: bin}
	for _, name := range crds {
		env.CRDDirectoryPaths = append(env.CRDDirectoryPaths, filepath.Join(root, name))
	}
	if _, err := env.Start(); err != nil {
		return nil, fmt.Errorf("start the test apiserver (binaries from %s; run `make tools`): %w", bin, err)
	}
	s := &Server{Environment: env}
	if err := s.addAdmin(); err != nil {
		s.Stop()
		return nil, fmt.Errorf("admin of the test apiserver: %w", err)
	}
	return s, nil
}

func (s *Server) addAdmin() error {
	var err error
	if s.Admin, err = s.AddUser(envtest.User{Name: "admin", Groups: []string{"system:masters"}}, nil); err != nil {
		return err
	}
	data, err := s.Admin.KubeConfig()
	if err != nil {
		return err
	}
	if s.dir, err = os.MkdirTemp("", "pvbridge-testenv-"); err != nil {
		return err
	}
	s.AdminKubeconfig = filepath.Join(s.dir, "kubeconfig")
	return os.WriteFile(s.AdminKubeconfig, data, 0o600)
}

// Stop stops the apiserver and etcd and removes the admin's kubeconfig.
func (s *Server) Stop() {
	_ = s.Environment.Stop()
	if s.dir != "" {
		_ = os.RemoveAll(s.dir)
	}
}

// Unthrottle lifts client-go's client-side rate limit from cfg, which a config loaded from a
// kubeconfig gets by default (5 requests/s after a burst of 10): it paced a test's fixtures, a
// fifth of a second for each of their writes, rather than the code under test. The admin's
// Environment.Config needs none: envtest gives it 1000 requests/s.
func Unthrottle(cfg *rest.Config) {
	cfg.QPS, cfg.Burst = -1, 0
}

// Fuzzing reports whether the test binary runs a fuzz target (or is one of its workers): every
// fuzz worker runs TestMain again, and fuzz targets need no apiserver. Call it after flag.Parse.
func Fuzzing() bool {
	for _, name := range []string{"test.fuzz", "test.fuzzworker"} {
		if f := flag.Lookup(name); f != nil && f.Value.String() != "" && f.Value.String() != "false" {
			return true
		}
	}
	return false
}

// ReportFailures makes each failed spec of the Ginkgo suite t runs a failure of t, with its
// name, place and message: go test prints those below "--- FAIL", after the suite's output and
// whatever the test's cleanups log, where the tail of a CI log shows them.
func ReportFailures(t *testing.T) {
	ginkgo.ReportAfterSuite("failures of "+t.Name(), func(r ginkgo.Report) {
		for _, s := range r.SpecReports {
			if s.Failed() {
				t.Errorf("%s\n%s\n%s", s.FullText(), s.Failure.Location, s.Failure.Message)
			}
		}
	})
}

// HasCapability reports whether capability c (unix.CAP_*) is in set of this process: "CapEff"
// (what it may do now) or "CapBnd" (what any process it starts, containers included, may ever
// have), as /proc/self/status shows them.
func HasCapability(t *testing.T, set string, c int) bool {
	t.Helper()
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.Lines(string(b)) {
		if hex, ok := strings.CutPrefix(line, set+":"); ok {
			caps, err := strconv.ParseUint(strings.TrimSpace(hex), 16, 64)
			if err != nil {
				t.Fatal(err)
			}
			return caps&(1<<c) != 0
		}
	}
	t.Fatalf("no %s in /proc/self/status", set)
	return false
}

// RunManager starts mgr for the rest of the test: it is stopped when the test ends, and an
// error it stopped with fails the test.
func RunManager(t *testing.T, mgr manager.Manager) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- mgr.Start(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("manager: %v", err)
		}
	})
}

// RunTests runs a package's tests against one test apiserver with crds (Start): use takes what
// the tests need of it before they run, and it is stopped after them. It returns the tests'
// exit code, 1 if the apiserver did not start.
func RunTests(m *testing.M, use func(*Server), crds ...string) int {
	srv, err := Start(crds...)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer srv.Stop()
	use(srv)
	return m.Run()
}
