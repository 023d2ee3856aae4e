package csiserver

import (
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	. "github.com/onsi/gomega"
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
