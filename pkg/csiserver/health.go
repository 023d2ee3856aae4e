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
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"k8s.io/klog/v2"
)

// probeTimeout bounds one health check's CSI Probe (the livenessprobe sidecar's default).
const probeTimeout = 3 * time.Second

// HealthHandler answers /healthz by calling the driver's CSI Probe through its own socket, as
// the kubernetes-csi livenessprobe sidecar does from beside it: 200 when the driver answers
// ready, 503 when it answers not ready, 500 when it does not answer. A driver whose gRPC server
// hangs is then restarted by its pod's liveness probe, with no sidecar image to ship.
func (s *Server) HealthHandler() http.Handler {
	var (
		once sync.Once
		conn *grpc.ClientConn
		err  error
	)
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) {
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
		case resp.GetReady() != nil && !resp.GetReady().GetValue():
			http.Error(w, "the driver is not ready", http.StatusServiceUnavailable)
		default:
			_, _ = w.Write([]byte("ok"))
		}
	})
	return mux
}

// ServeHealth serves HealthHandler on addr (host:port) until ctx ends.
func (s *Server) ServeHealth(ctx context.Context, addr string) error {
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("health endpoint: %w", err)
	}
	hs := &http.Server{Handler: s.HealthHandler(), ReadHeaderTimeout: 5 * time.Second}
	go func() {
		<-ctx.Done()
		// The health checks are quick: close at once rather than wait for them.
		_ = hs.Close()
	}()
	klog.FromContext(ctx).Info("Serving health checks", "address", l.Addr().String(), "path", "/healthz")
	if err := hs.Serve(l); !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("health endpoint: %w", err)
	}
	return nil
}
