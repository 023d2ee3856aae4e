package csiserver

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	. "github.com/onsi/gomega"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
)

func TestIdentity(t *testing.T) {
	id := &Identity{Name: "pmem.csi.pvbridge.io", Version: "v1.2.3"}
	tests := []struct {
		name  string
		call  func() (any, error)
		check func(g Gomega, resp any)
	}{
		{
			name: "GetPluginInfo names the driver and its version",
			call: func() (any, error) { return id.GetPluginInfo(t.Context(), &csi.GetPluginInfoRequest{}) },
			check: func(g Gomega, resp any) {
				info := resp.(*csi.GetPluginInfoResponse)
				g.Expect(info.GetName()).To(Equal("pmem.csi.pvbridge.io"))
				g.Expect(info.GetVendorVersion()).To(Equal("v1.2.3"))
			},
		},
		{
			name: "GetPluginCapabilities advertises the controller and group controller services and topology",
			call: func() (any, error) {
				return id.GetPluginCapabilities(t.Context(), &csi.GetPluginCapabilitiesRequest{})
			},
			check: func(g Gomega, resp any) {
				var services []csi.PluginCapability_Service_Type
				for _, c := range resp.(*csi.GetPluginCapabilitiesResponse).GetCapabilities() {
					services = append(services, c.GetService().GetType())
				}
				g.Expect(services).To(ConsistOf(
					csi.PluginCapability_Service_CONTROLLER_SERVICE,
					csi.PluginCapability_Service_GROUP_CONTROLLER_SERVICE,
					csi.PluginCapability_Service_VOLUME_ACCESSIBILITY_CONSTRAINTS,
				))
			},
		},
		{
			name: "Probe reports ready",
			call: func() (any, error) { return id.Probe(t.Context(), &csi.ProbeRequest{}) },
			check: func(g Gomega, resp any) {
				ready := resp.(*csi.ProbeResponse).GetReady()
				g.Expect(ready).NotTo(BeNil(), "an unset ready field means ready, but say it explicitly")
				g.Expect(ready.GetValue()).To(BeTrue())
			},
		},
		{
			name: "Probe reports ready while the Ready check passes",
			call: func() (any, error) {
				withCheck := &Identity{Ready: func(context.Context) error { return nil }}
				return withCheck.Probe(t.Context(), &csi.ProbeRequest{})
			},
			check: func(g Gomega, resp any) {
				g.Expect(resp.(*csi.ProbeResponse).GetReady().GetValue()).To(BeTrue())
			},
		},
		{
			name: "Probe reports not ready, with no error, while the Ready check fails",
			call: func() (any, error) {
				withCheck := &Identity{Ready: func(context.Context) error { return errors.New("connection refused") }}
				return withCheck.Probe(t.Context(), &csi.ProbeRequest{})
			},
			check: func(g Gomega, resp any) {
				ready := resp.(*csi.ProbeResponse).GetReady()
				g.Expect(ready).NotTo(BeNil())
				g.Expect(ready.GetValue()).To(BeFalse())
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			resp, err := tt.call()
			g.Expect(err).NotTo(HaveOccurred())
			tt.check(g, resp)
		})
	}
}

func TestAPIServerReadyAsksReadyz(t *testing.T) {
	for _, tc := range []struct {
		name    string
		code    int // 0: nothing listens
		wantErr bool
	}{
		{name: "the API server is ready", code: http.StatusOK},
		{name: "the API server is not ready", code: http.StatusInternalServerError, wantErr: true},
		{name: "the API server does not answer", wantErr: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			var asked string
			hs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				asked = r.URL.Path
				w.WriteHeader(tc.code)
			}))
			t.Cleanup(hs.Close)
			if tc.code == 0 {
				hs.Close()
			}
			c, err := rest.RESTClientFor(&rest.Config{Host: hs.URL, ContentConfig: rest.ContentConfig{NegotiatedSerializer: scheme.Codecs.WithoutConversion(), GroupVersion: &schema.GroupVersion{}}})
			g.Expect(err).NotTo(HaveOccurred())
			err = APIServerReady(c)(t.Context())
			g.Expect(err != nil).To(Equal(tc.wantErr), "%v", err)
			if tc.code != 0 {
				g.Expect(asked).To(Equal("/readyz"))
			}
		})
	}
}
