package driver

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	. "github.com/onsi/gomega"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"pvbridge.io/guest-csi/internal/mgmt"
	"pvbridge.io/pkg/csinode/csinodetest"
)

func TestOptionsValidate(t *testing.T) {
	valid := func(mode Mode, change func(*Options)) Options {
		o := Options{Endpoint: "unix:///csi/csi.sock", Mode: mode, Version: "v0.1.0"}
		if mode == ModeNode {
			o.NodeID = "tenant-a-md-0-x7k2p"
		} else {
			o.ClusterName, o.ClusterUID = "tenant-a", "4b0f3a4e-6d0c-4a43-9a39-6f1f3c1c0a11"
			o.Mgmt = mgmt.Credentials{Kubeconfig: "/etc/pvbridge/mgmt/kubeconfig"}
			o.CredentialPoll, o.CapacityNamespace = 10*time.Second, "pvbridge-system"
		}
		if change != nil {
			change(&o)
		}
		return o
	}
	tests := []struct {
		name    string
		opts    Options
		wantErr []string
	}{
		{name: "controller", opts: valid(ModeController, nil)},
		{name: "node", opts: valid(ModeNode, nil)},
		{name: "node registering with kubelet", opts: valid(ModeNode, func(o *Options) { o.KubeletRegistrationDir = "/var/lib/kubelet/plugins_registry" })},
		{name: "endpoint as a path", opts: valid(ModeController, func(o *Options) { o.Endpoint = "/csi/csi.sock" })},
		{name: "tcp endpoint", opts: valid(ModeController, func(o *Options) { o.Endpoint = "tcp://127.0.0.1:9000" }), wantErr: []string{"endpoint"}},
		{name: "no mode", opts: valid("", nil), wantErr: []string{`mode ""`}},
		{name: "unknown mode", opts: valid("all", nil), wantErr: []string{`mode "all"`}},
		{name: "node without node ID", opts: valid(ModeNode, func(o *Options) { o.NodeID = "" }), wantErr: []string{"node ID is required"}},
		{name: "node ID that is not a node name", opts: valid(ModeNode, func(o *Options) { o.NodeID = "Node_1" }), wantErr: []string{"not a node name"}},
		{name: "node with a device root", opts: valid(ModeNode, func(o *Options) { o.DeviceRoot = "/var/lib/vms/vm-1" })},
		{name: "relative device root", opts: valid(ModeNode, func(o *Options) { o.DeviceRoot = "vm-1" }), wantErr: []string{"device root \"vm-1\" is not absolute"}},
		{name: "controller with device root", opts: valid(ModeController, func(o *Options) { o.DeviceRoot = "/" }), wantErr: []string{"device root is only used in node mode"}},
		{name: "relative registration directory", opts: valid(ModeNode, func(o *Options) { o.KubeletRegistrationDir = "plugins_registry" }), wantErr: []string{"not absolute"}},
		{name: "controller with node ID", opts: valid(ModeController, func(o *Options) { o.NodeID = "n" }), wantErr: []string{"only used in node mode"}},
		{name: "controller registering with kubelet", opts: valid(ModeController, func(o *Options) { o.KubeletRegistrationDir = "/r" }), wantErr: []string{"only done in node mode"}},
		{name: "no version", opts: valid(ModeController, func(o *Options) { o.Version = "" }), wantErr: []string{"version"}},
		{name: "controller without cluster", opts: valid(ModeController, func(o *Options) { o.ClusterUID = "" }), wantErr: []string{"name and UID are required"}},
		{name: "controller without credential", opts: valid(ModeController, func(o *Options) { o.Mgmt = mgmt.Credentials{} }), wantErr: []string{"kubeconfig or credential directory is required"}},
		{name: "controller with a token directory", opts: valid(ModeController, func(o *Options) {
			o.Mgmt = mgmt.Credentials{Dir: "/var/run/secrets/pvbridge", Server: "https://mgmt:6443"}
		})},
		{name: "token directory without server", opts: valid(ModeController, func(o *Options) { o.Mgmt = mgmt.Credentials{Dir: "/var/run/secrets/pvbridge"} }), wantErr: []string{"needs the management apiserver's URL"}},
		{name: "relative management kubeconfig", opts: valid(ModeController, func(o *Options) { o.Mgmt.Kubeconfig = "kubeconfig" }), wantErr: []string{"not an absolute path"}},
		{name: "controller without poll interval", opts: valid(ModeController, func(o *Options) { o.CredentialPoll = 0 }), wantErr: []string{"poll interval"}},
		{name: "bad default class", opts: valid(ModeController, func(o *Options) { o.StorageClass = "Fast SSD" }), wantErr: []string{`"Fast SSD" is no object name`}},
		{name: "node with management credential", opts: valid(ModeNode, func(o *Options) { o.Mgmt.Kubeconfig = "/k" }), wantErr: []string{"holds no management credential"}},
		{
			name:    "every problem is reported",
			opts:    Options{Endpoint: "csi.sock", Mode: ModeNode},
			wantErr: []string{"endpoint", "node ID is required", "version"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			err := tt.opts.Validate()
			if len(tt.wantErr) == 0 {
				g.Expect(err).NotTo(HaveOccurred())
				return
			}
			g.Expect(err).To(HaveOccurred())
			g.Expect(strings.Split(err.Error(), "\n")).To(HaveLen(len(tt.wantErr)))
			for _, want := range tt.wantErr {
				g.Expect(err.Error()).To(ContainSubstring(want))
			}
		})
	}
}

func TestRunServesIdentityAndRegistersWithKubelet(t *testing.T) {
	tests := []struct {
		name         string
		mode         Mode
		nodeID       string
		register     bool
		wantRegistry bool
	}{
		{name: "node without registration", mode: ModeNode, nodeID: "vm-1"},
		{name: "node registering with kubelet", mode: ModeNode, nodeID: "vm-1", register: true, wantRegistry: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			dir := csinodetest.SocketDir(t)
			opts := Options{
				Endpoint: "unix://" + filepath.Join(dir, "csi.sock"), Mode: tt.mode, NodeID: tt.nodeID, Version: "v1.2.3",
				GuestKubeconfig: adminKubeconfig, Host: fakeHost{host: testHost},
			}
			registry := filepath.Join(dir, "registry")
			if tt.register {
				opts.KubeletRegistrationDir = registry
			}
			d, err := New(opts)
			g.Expect(err).NotTo(HaveOccurred())

			ctx, cancel := context.WithCancel(t.Context())
			done := make(chan error, 1)
			go func() { done <- d.Run(ctx) }()

			info, err := csi.NewIdentityClient(csinodetest.Dial(t, filepath.Join(dir, "csi.sock"))).
				GetPluginInfo(t.Context(), &csi.GetPluginInfoRequest{}, grpc.WaitForReady(true))
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(info.GetName()).To(Equal("guest.csi.pvbridge.io"))
			g.Expect(info.GetVendorVersion()).To(Equal("v1.2.3"))

			_, err = csi.NewNodeClient(csinodetest.Dial(t, filepath.Join(dir, "csi.sock"))).
				NodeGetCapabilities(t.Context(), &csi.NodeGetCapabilitiesRequest{})
			if tt.mode == ModeNode {
				g.Expect(err).NotTo(HaveOccurred(), "the Node service is served in node mode")
			} else {
				g.Expect(status.Code(err)).To(Equal(codes.Unimplemented), "the Node service is served only in node mode")
			}

			regSock := filepath.Join(registry, "guest.csi.pvbridge.io-reg.sock")
			if tt.wantRegistry {
				reg, err := registerapi.NewRegistrationClient(csinodetest.Dial(t, regSock)).
					GetInfo(t.Context(), &registerapi.InfoRequest{}, grpc.WaitForReady(true))
				g.Expect(err).NotTo(HaveOccurred())
				g.Expect(reg.Endpoint).To(Equal(filepath.Join(dir, "csi.sock")))
			} else {
				g.Expect(regSock).NotTo(BeAnExistingFile())
			}

			cancel()
			g.Eventually(done).Should(Receive(BeNil()))
			g.Expect(filepath.Join(dir, "csi.sock")).NotTo(BeAnExistingFile())
			g.Expect(regSock).NotTo(BeAnExistingFile())
		})
	}
}

func TestRunFailsWhenRegistrationSocketCannotBeCreated(t *testing.T) {
	g := NewWithT(t)
	dir := csinodetest.SocketDir(t)
	notADir := filepath.Join(dir, "file")
	g.Expect(os.WriteFile(notADir, nil, 0o600)).To(Succeed())
	d, err := New(Options{
		Endpoint: filepath.Join(dir, "csi.sock"), Mode: ModeNode, NodeID: "vm-1", KubeletRegistrationDir: notADir, Version: "v1",
		GuestKubeconfig: adminKubeconfig, Host: fakeHost{host: testHost},
	})
	g.Expect(err).NotTo(HaveOccurred())

	g.Expect(d.Run(t.Context())).To(HaveOccurred())
	g.Expect(filepath.Join(dir, "csi.sock")).NotTo(BeAnExistingFile(), "the CSI socket is closed again")
}
