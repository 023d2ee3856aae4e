package driver

import (
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	. "github.com/onsi/gomega"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

func TestValidateCSIName(t *testing.T) {
	for _, tc := range []struct {
		name, csiName string
		want          codes.Code
	}{
		{"csi-provisioner's name", "pvc-4b0f3a4e-6d0c-4a43-9a39-6f1f3c1c0a11", codes.OK},
		{"at the bound", strings.Repeat("a", 512), codes.OK},
		{"at the bound in characters, not bytes", strings.Repeat("é", 512), codes.OK},
		{"empty", "", codes.InvalidArgument},
		{"over the bound the admission policy sets on pvbridge.io/csi-name", strings.Repeat("a", 513), codes.InvalidArgument},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			g.Expect(status.Code(validateCSIName(tc.csiName))).To(Equal(tc.want))
		})
	}
}

func TestTopologyHost(t *testing.T) {
	topo := func(host string) *csi.Topology { return &csi.Topology{Segments: map[string]string{TopologyKey: host}} }
	g := NewWithT(t)
	g.Expect(topologyHost(nil)).To(BeEmpty())
	g.Expect(topologyHost(&csi.TopologyRequirement{Requisite: []*csi.Topology{topo("a"), topo("b")}, Preferred: []*csi.Topology{topo("b")}})).To(Equal("b"))
	g.Expect(topologyHost(&csi.TopologyRequirement{Requisite: []*csi.Topology{{Segments: map[string]string{"zone": "z"}}, topo("a")}})).To(Equal("a"))
}
