package csiserver

import (
	"context"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	. "github.com/onsi/gomega"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"
	"k8s.io/klog/v2"
	"k8s.io/klog/v2/ktesting"
)

// fakeIdentity answers Probe with probeErr. When started is set, Probe signals on it and waits
// for release or for its context to end.
type fakeIdentity struct {
	csi.UnimplementedIdentityServer
	probeErr error
	notReady bool
	started  chan struct{}
	release  chan struct{}
}

func (f *fakeIdentity) Probe(ctx context.Context, _ *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	if f.started != nil {
		f.started <- struct{}{}
		select {
		case <-f.release:
		case <-ctx.Done():
			return nil, status.FromContextError(ctx.Err()).Err()
		}
	}
	if f.probeErr != nil {
		return nil, f.probeErr
	}
	return &csi.ProbeResponse{Ready: wrapperspb.Bool(!f.notReady)}, nil
}

type fakeNode struct {
	csi.UnimplementedNodeServer
}

func (fakeNode) NodeStageVolume(ctx context.Context, _ *csi.NodeStageVolumeRequest) (*csi.NodeStageVolumeResponse, error) {
	klog.FromContext(ctx).Info("Staging")
	return nil, status.Error(codes.NotFound, "no such disk")
}

// start serves on a socket in a temporary directory and returns a connected client and a
// function that stops the server and returns Serve's result; the server stops when the test
// ends at the latest.
func start(ctx context.Context, t *testing.T, opts Options, register func(*Server)) (*grpc.ClientConn, func() error) {
	t.Helper()
	g := NewWithT(t)
	if opts.Endpoint == "" {
		opts.Endpoint = filepath.Join(t.TempDir(), "csi.sock")
	}
	s, err := New(opts)
	g.Expect(err).NotTo(HaveOccurred())
	register(s)

	ctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- s.Serve(ctx) }()
	stop := sync.OnceValue(func() error {
		cancel()
		return <-done
	})
	t.Cleanup(func() { _ = stop() })

	conn, err := grpc.NewClient("unix://"+s.Path(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	g.Expect(err).NotTo(HaveOccurred())
	t.Cleanup(func() { _ = conn.Close() })
	return conn, stop
}

func TestParseEndpoint(t *testing.T) {
	tests := []struct {
		name     string
		endpoint string
		want     string
		wantErr  string
	}{
		{name: "unix URL", endpoint: "unix:///run/csi/csi.sock", want: "/run/csi/csi.sock"},
		{name: "absolute path", endpoint: "/run/csi/csi.sock", want: "/run/csi/csi.sock"},
		{name: "path is cleaned", endpoint: "unix:///run//csi/./csi.sock", want: "/run/csi/csi.sock"},
		{name: "empty", endpoint: "", wantErr: "empty"},
		{name: "tcp is refused", endpoint: "tcp://127.0.0.1:10000", wantErr: "only unix sockets"},
		{name: "unix URL with a host", endpoint: "unix://run/csi.sock", wantErr: "unix:///absolute/path"},
		{name: "relative path", endpoint: "csi.sock", wantErr: "absolute"},
		{name: "longest path", endpoint: "/" + strings.Repeat("a", 106), want: "/" + strings.Repeat("a", 106)},
		{name: "path too long for a socket", endpoint: "/" + strings.Repeat("a", 107), wantErr: "unix sockets allow 107"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			got, err := ParseEndpoint(tt.endpoint)
			if tt.wantErr != "" {
				g.Expect(err).To(MatchError(ContainSubstring(tt.wantErr)))
				return
			}
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(got).To(Equal(tt.want))
		})
	}
}

func TestServerServesOnUnixSocket(t *testing.T) {
	tests := []struct {
		name     string
		endpoint func(dir string) string
	}{
		{name: "unix URL", endpoint: func(dir string) string { return "unix://" + filepath.Join(dir, "csi.sock") }},
		{name: "plain path", endpoint: func(dir string) string { return filepath.Join(dir, "csi.sock") }},
		{name: "missing directory is created", endpoint: func(dir string) string { return filepath.Join(dir, "plugin", "csi.sock") }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			conn, _ := start(t.Context(), t, Options{Endpoint: tt.endpoint(t.TempDir())}, func(s *Server) {
				csi.RegisterIdentityServer(s, &fakeIdentity{})
			})
			resp, err := csi.NewIdentityClient(conn).Probe(t.Context(), &csi.ProbeRequest{})
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(resp.GetReady().GetValue()).To(BeTrue())
		})
	}
}

func TestNewReplacesStaleSocket(t *testing.T) {
	g := NewWithT(t)
	path := filepath.Join(t.TempDir(), "csi.sock")
	// A socket left behind by a process that died without closing its listener.
	l, err := net.Listen("unix", path)
	g.Expect(err).NotTo(HaveOccurred())
	l.(*net.UnixListener).SetUnlinkOnClose(false)
	g.Expect(l.Close()).To(Succeed())
	g.Expect(path).To(BeAnExistingFile())

	conn, _ := start(t.Context(), t, Options{Endpoint: path}, func(s *Server) {
		csi.RegisterIdentityServer(s, &fakeIdentity{})
	})
	_, err = csi.NewIdentityClient(conn).Probe(t.Context(), &csi.ProbeRequest{})
	g.Expect(err).NotTo(HaveOccurred())
}

func TestNewRefusesToRemoveAFileThatIsNotASocket(t *testing.T) {
	g := NewWithT(t)
	path := filepath.Join(t.TempDir(), "csi.sock")
	g.Expect(os.WriteFile(path, []byte("data"), 0o600)).To(Succeed())

	_, err := New(Options{Endpoint: path})
	g.Expect(err).To(MatchError(ContainSubstring("not a socket")))
	g.Expect(os.ReadFile(path)).To(Equal([]byte("data")))
}

func TestServeStopsGracefullyAndRemovesSocket(t *testing.T) {
	g := NewWithT(t)
	path := filepath.Join(t.TempDir(), "csi.sock")
	s, err := New(Options{Endpoint: path})
	g.Expect(err).NotTo(HaveOccurred())
	identity := &fakeIdentity{started: make(chan struct{}), release: make(chan struct{})}
	csi.RegisterIdentityServer(s, identity)

	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- s.Serve(ctx) }()

	conn, err := grpc.NewClient("unix://"+path, grpc.WithTransportCredentials(insecure.NewCredentials()))
	g.Expect(err).NotTo(HaveOccurred())
	defer conn.Close()
	probed := make(chan error, 1)
	go func() {
		_, err := csi.NewIdentityClient(conn).Probe(t.Context(), &csi.ProbeRequest{}, grpc.WaitForReady(true))
		probed <- err
	}()
	// Cancel while the RPC is in flight: it must still complete.
	g.Eventually(identity.started).Should(Receive())
	cancel()
	g.Consistently(done, 100*time.Millisecond).ShouldNot(Receive())
	close(identity.release)

	g.Eventually(probed).Should(Receive(Not(HaveOccurred())))
	g.Eventually(done).Should(Receive(BeNil()))
	g.Expect(path).NotTo(BeAnExistingFile())
}

func TestServeCancelsRPCsStillRunningAfterGracePeriod(t *testing.T) {
	g := NewWithT(t)
	identity := &fakeIdentity{started: make(chan struct{}), release: make(chan struct{})}
	conn, stop := start(t.Context(), t, Options{GracePeriod: 100 * time.Millisecond}, func(s *Server) {
		csi.RegisterIdentityServer(s, identity)
	})
	probed := make(chan error, 1)
	go func() {
		_, err := csi.NewIdentityClient(conn).Probe(t.Context(), &csi.ProbeRequest{}, grpc.WaitForReady(true))
		probed <- err
	}()
	g.Eventually(identity.started).Should(Receive())

	stopped := make(chan error, 1)
	go func() { stopped <- stop() }()
	g.Eventually(stopped).Should(Receive(BeNil()))
	g.Eventually(probed).Should(Receive(HaveOccurred()))
}

func TestInterceptorLogsThroughContextualLoggerWithoutSecrets(t *testing.T) {
	g := NewWithT(t)
	logger := ktesting.NewLogger(t, ktesting.NewConfig(ktesting.BufferLogs(true), ktesting.Verbosity(5)))
	ctx := klog.NewContext(t.Context(), logger)
	conn, _ := start(ctx, t, Options{}, func(s *Server) {
		csi.RegisterNodeServer(s, fakeNode{})
	})

	_, err := csi.NewNodeClient(conn).NodeStageVolume(t.Context(), &csi.NodeStageVolumeRequest{
		VolumeId: "vol-1",
		Secrets:  map[string]string{"password": "hunter2"},
	})
	g.Expect(status.Code(err)).To(Equal(codes.NotFound))

	logs := logger.GetSink().(ktesting.Underlier).GetBuffer().String()
	const method = `method="/csi.v1.Node/NodeStageVolume"`
	g.Expect(logs).NotTo(ContainSubstring("hunter2"))
	g.Expect(lineWith(logs, "Request")).To(SatisfyAll(ContainSubstring(method), ContainSubstring("vol-1"), ContainSubstring("***stripped***")))
	g.Expect(lineWith(logs, "Staging")).To(ContainSubstring(method), "the handler's context logger names the method")
	g.Expect(lineWith(logs, "Request failed")).To(SatisfyAll(ContainSubstring(method), ContainSubstring(`code="NotFound"`)))
}

// lineWith returns the first buffered log line with message msg; the interceptor puts the
// method first.
func lineWith(logs, msg string) string {
	for _, line := range strings.Split(logs, "\n") {
		if strings.HasPrefix(line, "INFO "+msg+" method=") {
			return line
		}
	}
	return ""
}

func TestMetricsRecordLatencyByMethodAndCode(t *testing.T) {
	tests := []struct {
		name     string
		probeErr error
		wantCode string
	}{
		{name: "success", wantCode: "OK"},
		{name: "gRPC error", probeErr: status.Error(codes.FailedPrecondition, "not ready"), wantCode: "FailedPrecondition"},
		{name: "plain error", probeErr: errors.New("boom"), wantCode: "Unknown"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			reg := prometheus.NewPedanticRegistry()
			conn, _ := start(t.Context(), t, Options{Registerer: reg, DriverName: "test.csi.pvbridge.io"}, func(s *Server) {
				csi.RegisterIdentityServer(s, &fakeIdentity{probeErr: tt.probeErr})
			})
			_, _ = csi.NewIdentityClient(conn).Probe(t.Context(), &csi.ProbeRequest{})

			g.Expect(testutil.CollectAndCount(reg, OperationsMetric)).To(Equal(1))
			families, err := reg.Gather()
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(families).To(HaveLen(1))
			m := families[0].GetMetric()[0]
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			g.Expect(labels).To(Equal(map[string]string{"driver_name": "test.csi.pvbridge.io", "method_name": "/csi.v1.Identity/Probe", "grpc_status_code": tt.wantCode}))
			g.Expect(m.GetHistogram().GetSampleCount()).To(Equal(uint64(1)))
		})
	}
}

func TestMetricsHandlerServesTheHistogram(t *testing.T) {
	g := NewWithT(t)
	reg := prometheus.NewRegistry()
	conn, _ := start(t.Context(), t, Options{Registerer: reg, DriverName: "test.csi.pvbridge.io"}, func(s *Server) {
		csi.RegisterIdentityServer(s, &fakeIdentity{})
	})
	_, err := csi.NewIdentityClient(conn).Probe(t.Context(), &csi.ProbeRequest{})
	g.Expect(err).NotTo(HaveOccurred())

	rec := httptest.NewRecorder()
	MetricsHandler(reg).ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	g.Expect(rec.Code).To(Equal(http.StatusOK))
	g.Expect(rec.Body.String()).To(ContainSubstring(
		`csi_plugin_operations_seconds_count{driver_name="test.csi.pvbridge.io",grpc_status_code="OK",method_name="/csi.v1.Identity/Probe"} 1`))
}

func TestASecondServerSharesTheRegisteredHistogram(t *testing.T) {
	g := NewWithT(t)
	reg := prometheus.NewRegistry()
	var first *Server
	_, stop := start(t.Context(), t, Options{Registerer: reg}, func(s *Server) { first = s })
	defer stop()

	second, err := New(Options{Endpoint: filepath.Join(t.TempDir(), "b.sock"), Registerer: reg})
	g.Expect(err).NotTo(HaveOccurred())
	defer second.listener.Close()
	g.Expect(second.duration).To(BeIdenticalTo(first.duration))

	clash := prometheus.NewCounter(prometheus.CounterOpts{Name: OperationsMetric, Help: "x"})
	other := prometheus.NewRegistry()
	g.Expect(other.Register(clash)).To(Succeed())
	path := filepath.Join(t.TempDir(), "c.sock")
	_, err = New(Options{Endpoint: path, Registerer: other})
	g.Expect(err).To(MatchError(ContainSubstring("register RPC metrics")), "a different collector of that name is an error")
	g.Expect(path).NotTo(BeAnExistingFile(), "the listener is closed again")
}
