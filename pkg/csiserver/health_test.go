package csiserver

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	. "github.com/onsi/gomega"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

func TestHealthProbesTheDriverThroughItsSocket(t *testing.T) {
	for _, tc := range []struct {
		name        string
		identity    *fakeIdentity
		stopped     bool
		live, ready int
		body        string
	}{
		{name: "ready", identity: &fakeIdentity{}, live: http.StatusOK, ready: http.StatusOK, body: "ok"},
		{name: "not ready: alive, not restarted", identity: &fakeIdentity{notReady: true}, live: http.StatusOK, ready: http.StatusServiceUnavailable, body: "not ready"},
		{name: "Probe fails", identity: &fakeIdentity{probeErr: status.Error(codes.FailedPrecondition, "no PMEM")}, live: http.StatusInternalServerError, ready: http.StatusInternalServerError, body: "no PMEM"},
		{name: "the gRPC server stopped", identity: &fakeIdentity{}, stopped: true, live: http.StatusInternalServerError, ready: http.StatusInternalServerError, body: "CSI Probe on"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			s, err := New(Options{Endpoint: filepath.Join(t.TempDir(), "csi.sock")})
			g.Expect(err).NotTo(HaveOccurred())
			csi.RegisterIdentityServer(s, tc.identity)
			ctx, cancel := context.WithCancel(t.Context())
			done := make(chan error, 1)
			go func() { done <- s.Serve(ctx) }()
			if tc.stopped {
				cancel()
				g.Expect(<-done).To(Succeed())
			}
			t.Cleanup(cancel)

			hs := httptest.NewServer(s.HealthHandler())
			t.Cleanup(hs.Close)
			for path, code := range map[string]int{"/healthz": tc.live, "/readyz": tc.ready} {
				resp, err := http.Get(hs.URL + path)
				g.Expect(err).NotTo(HaveOccurred())
				body, err := io.ReadAll(resp.Body)
				g.Expect(resp.Body.Close()).To(Succeed())
				g.Expect(err).NotTo(HaveOccurred())
				g.Expect(resp.StatusCode).To(Equal(code), "%s: %s", path, body)
				if code != http.StatusOK {
					g.Expect(string(body)).To(ContainSubstring(tc.body), path)
				}
			}
		})
	}
}
