// Package registration registers a CSI node plugin with kubelet's plugin watcher, which is the
// job node-driver-registrar does in ordinary deployments (it is not available here, and doing it
// in-process is a few lines). Kubelet finds the registration socket in its plugins_registry
// directory, calls GetInfo, connects to the CSI endpoint, and reports the outcome through
// NotifyRegistrationStatus.
package registration

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"sync"

	"k8s.io/klog/v2"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"pvbridge.io/pkg/csiserver"
)

// DefaultDir is kubelet's plugin registration directory with the default --root-dir.
const DefaultDir = "/var/lib/kubelet/plugins_registry"

// supportedVersions are the CSI versions the plugin speaks, in kubelet's terms.
var supportedVersions = []string{"1.0.0"}

// Options configure a Registrar.
type Options struct {
	// DriverName is the CSI driver name kubelet registers.
	DriverName string
	// Endpoint is the driver's CSI socket, which kubelet dials: `unix:///abs/path` or an
	// absolute path.
	Endpoint string
	// Dir is kubelet's plugin registration directory.
	Dir string
}

// Registrar serves the kubelet plugin registration service on <Dir>/<DriverName>-reg.sock.
type Registrar struct {
	registerapi.UnimplementedRegistrationServer

	driverName string
	endpoint   string
	server     *csiserver.Server

	mu         sync.Mutex // guards registered and err
	registered bool
	err        error
	// refused is closed when kubelet refuses the plugin.
	refused    chan struct{}
	refuseOnce sync.Once
}

// New listens on the registration socket. Start serving the CSI endpoint first: kubelet calls
// the driver as soon as it sees this socket.
func New(opts Options) (*Registrar, error) {
	if opts.DriverName == "" {
		return nil, errors.New("driver name is empty")
	}
	endpoint, err := csiserver.ParseEndpoint(opts.Endpoint)
	if err != nil {
		return nil, fmt.Errorf("CSI endpoint: %w", err)
	}
	if !filepath.IsAbs(opts.Dir) {
		return nil, fmt.Errorf("registration directory %q must be an absolute path", opts.Dir)
	}
	server, err := csiserver.New(csiserver.Options{
		Endpoint: filepath.Join(opts.Dir, opts.DriverName+"-reg.sock"),
	})
	if err != nil {
		return nil, err
	}
	r := &Registrar{driverName: opts.DriverName, endpoint: endpoint, server: server, refused: make(chan struct{})}
	registerapi.RegisterRegistrationServer(server, r)
	return r, nil
}

// Path is the registration socket's path.
func (r *Registrar) Path() string { return r.server.Path() }

// Serve serves until ctx ends and removes the socket, which makes kubelet deregister the plugin.
// When kubelet refuses the plugin, Serve removes the socket and returns the reason: kubelet
// never asks a socket again once it has refused it, so the plugin must exit and be restarted
// (as node-driver-registrar does) to be registered anew.
func (r *Registrar) Serve(ctx context.Context) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		select {
		case <-r.refused:
			cancel()
		case <-ctx.Done():
		}
	}()
	if err := r.server.Serve(ctx); err != nil {
		return err
	}
	if _, err := r.Registered(); err != nil {
		return err
	}
	return nil
}

// Registered reports kubelet's answer: false and no error until kubelet has answered, then
// whether it registered the plugin and, if not, why.
func (r *Registrar) Registered() (bool, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.registered, r.err
}

// GetInfo tells kubelet which plugin this is and where its CSI endpoint is.
func (r *Registrar) GetInfo(context.Context, *registerapi.InfoRequest) (*registerapi.PluginInfo, error) {
	return &registerapi.PluginInfo{
		Type:              registerapi.CSIPlugin,
		Name:              r.driverName,
		Endpoint:          r.endpoint,
		SupportedVersions: supportedVersions,
	}, nil
}

// NotifyRegistrationStatus records kubelet's answer.
func (r *Registrar) NotifyRegistrationStatus(ctx context.Context, s *registerapi.RegistrationStatus) (*registerapi.RegistrationStatusResponse, error) {
	logger := klog.FromContext(ctx)
	r.mu.Lock()
	defer r.mu.Unlock()
	r.registered = s.PluginRegistered
	r.err = nil
	if !s.PluginRegistered {
		r.refuseOnce.Do(func() { close(r.refused) })
		r.err = fmt.Errorf("kubelet refused the plugin: %s", s.Error)
		logger.Error(r.err, "Plugin registration failed", "driver", r.driverName)
		return &registerapi.RegistrationStatusResponse{}, nil
	}
	logger.Info("Plugin registered with kubelet", "driver", r.driverName)
	return &registerapi.RegistrationStatusResponse{}, nil
}
