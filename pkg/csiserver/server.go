// Package csiserver serves gRPC services, CSI or kubelet plugin registration, on a unix socket:
// the serving both pvbridge drivers share. Every unary RPC gets a contextual logger that names
// the method, logs its request and response with secrets stripped, and, when a Prometheus
// registerer is given, is measured.
package csiserver

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"time"

	"github.com/go-logr/logr"
	"github.com/kubernetes-csi/csi-lib-utils/protosanitizer"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"
)

// maxSocketPath is the longest path a unix socket address can hold on Linux (sun_path is 108
// bytes, including the terminating NUL).
const maxSocketPath = 107

// OperationsMetric is the histogram of the CSI calls a driver served, by driver, method and gRPC
// status code: the name, labels and buckets of the kubernetes-csi plugins' metric
// (csi-lib-utils' NewCSIMetricsManagerForPlugin), so that the dashboards and alerts made for
// the sidecars' csi_sidecar_operations_seconds work on the drivers too.
const OperationsMetric = "csi_plugin_operations_seconds"

// DefaultGracePeriod is how long Serve lets in-flight RPCs finish after its context ends.
const DefaultGracePeriod = 10 * time.Second

// Options configure a Server.
type Options struct {
	// Endpoint is the socket to listen on: `unix:///abs/path` or an absolute path.
	Endpoint string
	// Registerer receives the RPC latency histogram (OperationsMetric). Nil disables metrics.
	Registerer prometheus.Registerer
	// DriverName labels the histogram's samples (driver_name).
	DriverName string
	// GracePeriod bounds the graceful stop; zero means DefaultGracePeriod.
	GracePeriod time.Duration
}

// Server is a gRPC server listening on a unix socket. Register services on it (it is a
// grpc.ServiceRegistrar) before calling Serve.
type Server struct {
	path        string
	listener    net.Listener
	grpc        *grpc.Server
	duration    *prometheus.HistogramVec
	driver      string
	gracePeriod time.Duration
	// logger is the base of every RPC's logger. Serve sets it before it accepts connections.
	logger logr.Logger
}

var _ grpc.ServiceRegistrar = &Server{}

// New listens on the endpoint, replacing a stale socket left by a previous run.
func New(opts Options) (*Server, error) {
	path, err := ParseEndpoint(opts.Endpoint)
	if err != nil {
		return nil, err
	}
	s := &Server{path: path, driver: opts.DriverName, gracePeriod: opts.GracePeriod, logger: klog.Background()}
	if s.gracePeriod == 0 {
		s.gracePeriod = DefaultGracePeriod
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o750); err != nil {
		return nil, fmt.Errorf("create socket directory: %w", err)
	}
	if err := removeStaleSocket(path); err != nil {
		return nil, err
	}
	s.listener, err = net.Listen("unix", path)
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", path, err)
	}
	if opts.Registerer != nil {
		s.duration = prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    OperationsMetric,
			Help:    "Container Storage Interface operation duration with gRPC error code status total",
			Buckets: []float64{.1, .25, .5, 1, 2.5, 5, 10, 15, 25, 50, 120, 300, 600},
		}, []string{"driver_name", "method_name", "grpc_status_code"})
		if err := opts.Registerer.Register(s.duration); err != nil {
			// A server started again in the same process (a restart in a test) keeps counting
			// in the histogram the first one registered.
			var already prometheus.AlreadyRegisteredError
			if !errors.As(err, &already) {
				_ = s.listener.Close()
				return nil, fmt.Errorf("register RPC metrics: %w", err)
			}
			s.duration = already.ExistingCollector.(*prometheus.HistogramVec)
		}
	}
	s.grpc = grpc.NewServer(grpc.UnaryInterceptor(s.intercept))
	return s, nil
}

// ParseEndpoint returns the socket path of an endpoint given as `unix:///abs/path` or as an
// absolute path.
func ParseEndpoint(endpoint string) (string, error) {
	if endpoint == "" {
		return "", errors.New("endpoint is empty")
	}
	path := endpoint
	if u, err := url.Parse(endpoint); err == nil && u.Scheme != "" {
		if u.Scheme != "unix" {
			return "", fmt.Errorf("endpoint %q: only unix sockets are supported", endpoint)
		}
		if u.Host != "" {
			return "", fmt.Errorf("endpoint %q: want unix:///absolute/path", endpoint)
		}
		path = u.Path
	}
	if !filepath.IsAbs(path) {
		return "", fmt.Errorf("endpoint %q: socket path must be absolute", endpoint)
	}
	path = filepath.Clean(path)
	if len(path) > maxSocketPath {
		return "", fmt.Errorf("endpoint %q: socket path is %d bytes, unix sockets allow %d", endpoint, len(path), maxSocketPath)
	}
	return path, nil
}

// removeStaleSocket removes a socket file left behind by a process that did not stop cleanly.
// Anything else at that path is an error: it is not ours to delete.
func removeStaleSocket(path string) error {
	fi, err := os.Lstat(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("check socket %s: %w", path, err)
	}
	if fi.Mode().Type() != fs.ModeSocket {
		return fmt.Errorf("%s exists and is not a socket", path)
	}
	if err := os.Remove(path); err != nil {
		return fmt.Errorf("remove stale socket %s: %w", path, err)
	}
	return nil
}

// Path is the socket path the server listens on.
func (s *Server) Path() string { return s.path }

// RegisterService registers a gRPC service; generated Register*Server functions call it.
func (s *Server) RegisterService(desc *grpc.ServiceDesc, impl any) {
	s.grpc.RegisterService(desc, impl)
}

// Serve serves until ctx ends, then stops gracefully: in-flight RPCs get the grace period to
// finish, then their contexts are cancelled and Serve waits for them to return, so handlers must
// honour their context. The socket file is removed when Serve returns. RPC loggers derive from
// ctx's logger.
func (s *Server) Serve(ctx context.Context) error {
	s.logger = klog.FromContext(ctx)
	s.logger.Info("Serving gRPC", "endpoint", s.path)

	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		<-ctx.Done()
		timer := time.AfterFunc(s.gracePeriod, s.grpc.Stop)
		defer timer.Stop()
		s.grpc.GracefulStop()
	}()

	err := s.grpc.Serve(s.listener)
	if ctx.Err() == nil {
		// Serve failed on its own; stop the goroutine above.
		s.grpc.Stop()
		return fmt.Errorf("serve on %s: %w", s.path, err)
	}
	<-stopped
	s.logger.Info("Stopped serving gRPC", "endpoint", s.path)
	return nil
}

func (s *Server) intercept(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	logger := klog.LoggerWithValues(s.logger, "method", info.FullMethod)
	ctx = klog.NewContext(ctx, logger)
	logger.V(5).Info("Request", "request", protosanitizer.StripSecrets(req))

	start := time.Now()
	resp, err := handler(ctx, req)
	code := status.Code(err)
	if s.duration != nil {
		s.duration.WithLabelValues(s.driver, info.FullMethod, code.String()).Observe(time.Since(start).Seconds())
	}
	if err != nil {
		logger.V(2).Info("Request failed", "code", code.String(), "err", err)
		return resp, err
	}
	logger.V(5).Info("Response", "response", protosanitizer.StripSecrets(resp))
	return resp, nil
}
