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
		name     string
		identity *fakeIdentity
		stopped  bool
		code     int
		body     string
	}{
		{name: "ready", identity: &fakeIdentity{}, code: http.StatusOK, body: "ok"},
		{name: "not ready", identity: &fakeIdentity{notReady: true}, code: http.StatusServiceUnavailable, body: "not ready"},
		{name: "Probe fails", identity: &fakeIdentity{probeErr: status.Error(codes.FailedPrecondition, "no PMEM")}, code: http.StatusInternalServerError, body: "no PMEM"},
		{name: "the gRPC server stopped", identity: &fakeIdentity{}, stopped: true, code: http.StatusInternalServerError, body: "CSI Probe on"},
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
			resp, err := http.Get(hs.URL + "/healthz")
			g.Expect(err).NotTo(HaveOccurred())
			defer resp.Body.Close()
			body, err := io.ReadAll(resp.Body)
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(resp.StatusCode).To(Equal(tc.code), string(body))
			g.Expect(string(body)).To(ContainSubstring(tc.body))
		})
	}
}
