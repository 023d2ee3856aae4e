package csiserver

import (
	"context"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/types/known/wrapperspb"
	"k8s.io/client-go/rest"
	"k8s.io/klog/v2"
)

// Identity is the CSI Identity service of a pvbridge driver. Both drivers have a controller
// service, a group controller service (group snapshots) and topology, so their capabilities
// are the same.
type Identity struct {
	csi.UnimplementedIdentityServer
	Name    string
	Version string
	// Ready, when set, says whether the process can do its work now; Probe answers not ready
	// while it fails. The sidecars wait for ready before they read the API server once for
	// good (csi-snapshotter turns group snapshots off for its whole run when its first look
	// at their CRDs fails), so a controller is ready only while its API server answers.
	Ready func(context.Context) error
}

// GetPluginInfo names the driver and its version.
func (i *Identity) GetPluginInfo(context.Context, *csi.GetPluginInfoRequest) (*csi.GetPluginInfoResponse, error) {
	return &csi.GetPluginInfoResponse{Name: i.Name, VendorVersion: i.Version}, nil
}

// GetPluginCapabilities describes the whole driver, whatever the mode of this process: sidecars
// of either side ask it.
func (i *Identity) GetPluginCapabilities(context.Context, *csi.GetPluginCapabilitiesRequest) (*csi.GetPluginCapabilitiesResponse, error) {
	return &csi.GetPluginCapabilitiesResponse{
		Capabilities: []*csi.PluginCapability{
			serviceCapability(csi.PluginCapability_Service_CONTROLLER_SERVICE),
			serviceCapability(csi.PluginCapability_Service_GROUP_CONTROLLER_SERVICE),
			serviceCapability(csi.PluginCapability_Service_VOLUME_ACCESSIBILITY_CONSTRAINTS),
		},
	}, nil
}

func serviceCapability(t csi.PluginCapability_Service_Type) *csi.PluginCapability {
	return &csi.PluginCapability{
		Type: &csi.PluginCapability_Service_{Service: &csi.PluginCapability_Service{Type: t}},
	}
}

// Probe reports ready unless Ready fails. Not ready is a healthy answer (the CSI spec's "still
// initializing"): the process is not restarted for it.
func (i *Identity) Probe(ctx context.Context, _ *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	if i.Ready != nil {
		if err := i.Ready(ctx); err != nil {
			klog.FromContext(ctx).V(2).Info("Not ready", "err", err)
			return &csi.ProbeResponse{Ready: wrapperspb.Bool(false)}, nil
		}
	}
	return &csi.ProbeResponse{Ready: wrapperspb.Bool(true)}, nil
}

// APIServerReady is a Ready check: the API server c talks to answers its /readyz.
func APIServerReady(c rest.Interface) func(context.Context) error {
	return func(ctx context.Context) error {
		return c.Get().AbsPath("/readyz").Do(ctx).Error()
	}
}

// ControllerCapabilities is a ControllerGetCapabilities answer listing types.
func ControllerCapabilities(types ...csi.ControllerServiceCapability_RPC_Type) *csi.ControllerGetCapabilitiesResponse {
	resp := &csi.ControllerGetCapabilitiesResponse{}
	for _, t := range types {
		resp.Capabilities = append(resp.Capabilities, &csi.ControllerServiceCapability{
			Type: &csi.ControllerServiceCapability_Rpc{Rpc: &csi.ControllerServiceCapability_RPC{Type: t}},
		})
	}
	return resp
}

// GroupControllerCapabilities is a GroupControllerGetCapabilities answer listing types.
func GroupControllerCapabilities(types ...csi.GroupControllerServiceCapability_RPC_Type) *csi.GroupControllerGetCapabilitiesResponse {
	resp := &csi.GroupControllerGetCapabilitiesResponse{}
	for _, t := range types {
		resp.Capabilities = append(resp.Capabilities, &csi.GroupControllerServiceCapability{
			Type: &csi.GroupControllerServiceCapability_Rpc{Rpc: &csi.GroupControllerServiceCapability_RPC{Type: t}},
		})
	}
	return resp
}
