package registration

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	. "github.com/onsi/gomega"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)

// serve starts a Registrar in a temporary directory and returns a client of its socket, dialed
// the way kubelet's plugin watcher dials it.
func serve(t *testing.T, opts Options) (*Registrar, registerapi.RegistrationClient) {
	t.Helper()
	g := NewWithT(t)
	r, err := New(opts)
	g.Expect(err).NotTo(HaveOccurred())

	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- r.Serve(ctx) }()
	t.Cleanup(func() {
		cancel()
		err := <-done
		if _, refused := r.Registered(); refused != nil {
			g.Expect(err).To(MatchError(refused.Error()), "a refused plugin's Serve returns the reason")
		} else {
			g.Expect(err).To(Succeed())
		}
		g.Expect(r.Path()).NotTo(BeAnExistingFile(), "kubelet deregisters a plugin when its socket goes away")
	})

	conn, err := grpc.NewClient("unix://"+r.Path(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	g.Expect(err).NotTo(HaveOccurred())
	t.Cleanup(func() { _ = conn.Close() })
	return r, registerapi.NewRegistrationClient(conn)
}

// socketDir returns a temporary directory with a path short enough for a unix socket, which
// t.TempDir's paths, named after the test, are not always.
func socketDir(t *testing.T) string {
	dir, err := os.MkdirTemp("", "reg")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	return dir
}

func TestGetInfoDescribesTheCSIPlugin(t *testing.T) {
	tests := []struct {
		name         string
		endpoint     string
		wantEndpoint string
	}{
		{name: "endpoint given as a path", endpoint: "/var/lib/kubelet/plugins/pmem.csi.pvbridge.io/csi.sock", wantEndpoint: "/var/lib/kubelet/plugins/pmem.csi.pvbridge.io/csi.sock"},
		{name: "endpoint given as a unix URL", endpoint: "unix:///run/csi/csi.sock", wantEndpoint: "/run/csi/csi.sock"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			dir := socketDir(t)
			r, client := serve(t, Options{DriverName: "pmem.csi.pvbridge.io", Endpoint: tt.endpoint, Dir: dir})
			g.Expect(r.Path()).To(Equal(filepath.Join(dir, "pmem.csi.pvbridge.io-reg.sock")))

			info, err := client.GetInfo(t.Context(), &registerapi.InfoRequest{}, grpc.WaitForReady(true))
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(info.Type).To(Equal("CSIPlugin"))
			g.Expect(info.Name).To(Equal("pmem.csi.pvbridge.io"))
			g.Expect(info.Endpoint).To(Equal(tt.wantEndpoint))
			g.Expect(info.SupportedVersions).To(Equal([]string{"1.0.0"}))
		})
	}
}

func TestNotifyRegistrationStatusRecordsKubeletsAnswer(t *testing.T) {
	tests := []struct {
		name           string
		notifications  []*registerapi.RegistrationStatus
		wantRegistered bool
		wantErr        string
	}{
		{name: "no answer yet"},
		{
			name:           "registered",
			notifications:  []*registerapi.RegistrationStatus{{PluginRegistered: true}},
			wantRegistered: true,
		},
		{
			name:          "refused",
			notifications: []*registerapi.RegistrationStatus{{PluginRegistered: false, Error: "unsupported version"}},
			wantErr:       "kubelet refused the plugin: unsupported version",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			r, client := serve(t, Options{DriverName: "guest.csi.pvbridge.io", Endpoint: "/csi/csi.sock", Dir: socketDir(t)})
			for _, n := range tt.notifications {
				_, err := client.NotifyRegistrationStatus(t.Context(), n, grpc.WaitForReady(true))
				g.Expect(err).NotTo(HaveOccurred())
			}

			registered, err := r.Registered()
			g.Expect(registered).To(Equal(tt.wantRegistered))
			if tt.wantErr != "" {
				g.Expect(err).To(MatchError(tt.wantErr))
			} else {
				g.Expect(err).NotTo(HaveOccurred())
			}
		})
	}
}

// Kubelet never asks a socket again once it has refused the plugin: Serve removes the socket
// and ends with the reason, so that the plugin exits and registers anew when restarted.
func TestServeEndsWhenKubeletRefuses(t *testing.T) {
	g := NewWithT(t)
	r, client := serve(t, Options{DriverName: "guest.csi.pvbridge.io", Endpoint: "/csi/csi.sock", Dir: socketDir(t)})
	_, err := client.NotifyRegistrationStatus(t.Context(), &registerapi.RegistrationStatus{PluginRegistered: false, Error: "node not found"}, grpc.WaitForReady(true))
	g.Expect(err).NotTo(HaveOccurred())
	g.Eventually(r.Path).ShouldNot(BeAnExistingFile())
}

func TestNewValidatesOptions(t *testing.T) {
	tests := []struct {
		name    string
		opts    Options
		wantErr string
	}{
		{name: "no driver name", opts: Options{Endpoint: "/csi.sock", Dir: "/reg"}, wantErr: "driver name is empty"},
		{name: "relative endpoint", opts: Options{DriverName: "d", Endpoint: "csi.sock", Dir: "/reg"}, wantErr: "CSI endpoint"},
		{name: "relative directory", opts: Options{DriverName: "d", Endpoint: "/csi.sock", Dir: "reg"}, wantErr: "registration directory"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			_, err := New(tt.opts)
			g.Expect(err).To(MatchError(ContainSubstring(tt.wantErr)))
		})
	}
}
