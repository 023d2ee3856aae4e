package csiserver

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"k8s.io/klog/v2"
)

// probeTimeout bounds one health check's CSI Probe (the livenessprobe sidecar's default).
const probeTimeout = 3 * time.Second

// HealthHandler answers /healthz and /readyz by calling the driver's CSI Probe through its own
// socket, as the kubernetes-csi livenessprobe sidecar does from beside it. /healthz (liveness) is
// 200 whenever the driver answers, ready or not, and 500 when it does not: a driver whose gRPC
// server hangs is restarted by its pod's liveness probe, with no sidecar image to ship, and one
// whose API server is away is not (a restart would not bring it back). /readyz is 503 while
// the driver answers not ready.
func (s *Server) HealthHandler() http.Handler {
	var (
		once sync.Once
		conn *grpc.ClientConn
		err  error
	)
	probe := func(w http.ResponseWriter, r *http.Request, needReady bool) {
		once.Do(func() {
			conn, err = grpc.NewClient("unix://"+s.path, grpc.WithTransportCredentials(insecure.NewCredentials()))
		})
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		ctx, cancel := context.WithTimeout(r.Context(), probeTimeout)
		defer cancel()
		resp, perr := csi.NewIdentityClient(conn).Probe(ctx, &csi.ProbeRequest{})
		switch {
		case perr != nil:
			http.Error(w, fmt.Sprintf("CSI Probe on %s: %v", s.path, perr), http.StatusInternalServerError)
		case needReady && resp.GetReady() != nil && !resp.GetReady().GetValue():
			http.Error(w, "the driver is not ready", http.StatusServiceUnavailable)
		default:
			_, _ = w.Write([]byte("ok"))
		}
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) { probe(w, r, false) })
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, r *http.Request) { probe(w, r, true) })
	return mux
}

// ServeHealth serves HealthHandler on addr (host:port) until ctx ends.
func (s *Server) ServeHealth(ctx context.Context, addr string) error {
	return serveHTTP(ctx, addr, s.HealthHandler(), "/healthz")
}

// MetricsHandler answers /metrics with the metrics of g (OperationsMetric among them) in
// Prometheus' text format.
func MetricsHandler(g prometheus.Gatherer) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(g, promhttp.HandlerOpts{}))
	return mux
}

// ServeMetrics serves MetricsHandler on addr (host:port) until ctx ends.
func ServeMetrics(ctx context.Context, addr string, g prometheus.Gatherer) error {
	return serveHTTP(ctx, addr, MetricsHandler(g), "/metrics")
}

// serveHTTP serves handler, whose one path is path, on addr until ctx ends.
func serveHTTP(ctx context.Context, addr string, handler http.Handler, path string) error {
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("%s endpoint: %w", path, err)
	}
	hs := &http.Server{Handler: handler, ReadHeaderTimeout: 5 * time.Second}
	go func() {
		<-ctx.Done()
		// Health checks and scrapes are quick: close at once rather than wait for them.
		_ = hs.Close()
	}()
	klog.FromContext(ctx).Info("Serving HTTP", "address", l.Addr().String(), "path", path)
	if err := hs.Serve(l); !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("%s endpoint: %w", path, err)
	}
	return nil
}
