package tenants

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	. "github.com/onsi/gomega"
)

// A guest apiserver's response is read up to the bound and no further: a longer one fails with
// errGuestResponseTooLarge, whatever reads it.
func TestLimitResponses(t *testing.T) {
	const limit = 16
	for _, tt := range []struct {
		name    string
		size    int
		wantErr error
	}{
		{"shorter than the bound", limit - 1, nil},
		{"exactly the bound", limit, nil},
		{"one byte more", limit + 1, errGuestResponseTooLarge},
		{"endless, as far as the client cares", 1 << 20, errGuestResponseTooLarge},
	} {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
				_, _ = io.WriteString(w, strings.Repeat("x", tt.size))
			}))
			defer srv.Close()
			c := &http.Client{Transport: limitResponses(http.DefaultTransport, limit)}
			resp, err := c.Get(srv.URL)
			g.Expect(err).NotTo(HaveOccurred())
			defer resp.Body.Close()
			body, err := io.ReadAll(resp.Body)
			if tt.wantErr != nil {
				g.Expect(err).To(MatchError(tt.wantErr))
				g.Expect(len(body)).To(BeNumerically("<=", limit))
				return
			}
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(body).To(HaveLen(tt.size))
		})
	}
}
