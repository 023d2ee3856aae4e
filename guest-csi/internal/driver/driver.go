// Package driver is the CSI driver guest.csi.pvbridge.io, which gives the pods of a guest
// cluster volumes that live in its management cluster.
package driver

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sync/errgroup"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/klog/v2"

	"pvbridge.io/pkg/csiserver"
	"pvbridge.io/pkg/mounter"
	"pvbridge.io/pkg/registration"
)

// Name is the CSI driver name.
const Name = "guest.csi.pvbridge.io"

// Mode selects the CSI services a process serves.
type Mode string

const (
	// ModeController serves the controller side: it mirrors guest volumes into the management
	// cluster and attaches them to VirtualMachines.
	ModeController Mode = "controller"
	// ModeNode serves a guest node: it finds the attached disk by its serial and mounts it.
	ModeNode Mode = "node"
)

// Options configure the driver.
type Options struct {
	// Endpoint is the CSI socket: unix:///abs/path or an absolute path.
	Endpoint string
	// Mode selects the services to serve.
	Mode Mode
	// NodeID is the guest node's name, which is also its VirtualMachine's name. Node mode only.
	NodeID string
	// KubeletRegistrationDir is kubelet's plugin registration directory. When set (node mode
	// only), the driver registers itself with kubelet.
	KubeletRegistrationDir string
	// DeviceRoot is the root under which the node plugin looks up disks: <root>/sys/block and
	// <root>/dev. Node mode only; "" means "/". The lab's VMs have their device tree in a
	// directory.
	DeviceRoot string
	// Host tells the node plugin the management host of its VM, which NodeGetInfo reports as
	// the node's topology. Node mode only. While it is nil, or does not know the host,
	// NodeGetInfo answers Unavailable.
	Host Host
	// Version is the driver version GetPluginInfo reports.
	Version string
}

// Validate reports every problem with the options.
func (o *Options) Validate() error {
	var errs []error
	if _, err := csiserver.ParseEndpoint(o.Endpoint); err != nil {
		errs = append(errs, err)
	}
	switch o.Mode {
	case ModeController:
		if o.NodeID != "" {
			errs = append(errs, errors.New("node ID is only used in node mode"))
		}
		if o.KubeletRegistrationDir != "" {
			errs = append(errs, errors.New("kubelet registration is only done in node mode"))
		}
		if o.DeviceRoot != "" {
			errs = append(errs, errors.New("device root is only used in node mode"))
		}
	case ModeNode:
		if o.NodeID == "" {
			errs = append(errs, errors.New("node ID is required in node mode"))
		} else if msgs := validation.IsDNS1123Subdomain(o.NodeID); len(msgs) > 0 {
			errs = append(errs, fmt.Errorf("node ID %q is not a node name: %v", o.NodeID, msgs))
		}
		if o.KubeletRegistrationDir != "" && !filepath.IsAbs(o.KubeletRegistrationDir) {
			errs = append(errs, fmt.Errorf("kubelet registration directory %q is not absolute", o.KubeletRegistrationDir))
		}
		if o.DeviceRoot != "" && !filepath.IsAbs(o.DeviceRoot) {
			errs = append(errs, fmt.Errorf("device root %q is not absolute", o.DeviceRoot))
		}
	default:
		errs = append(errs, fmt.Errorf("mode %q is neither %q nor %q", o.Mode, ModeController, ModeNode))
	}
	if o.Version == "" {
		errs = append(errs, errors.New("version is empty"))
	}
	return errors.Join(errs...)
}

// Driver serves the CSI services of guest.csi.pvbridge.io: Identity, and in node mode Node.
// The Controller service does not exist yet.
type Driver struct {
	opts Options
}

// New returns a driver for valid options.
func New(opts Options) (*Driver, error) {
	if err := opts.Validate(); err != nil {
		return nil, err
	}
	if opts.Mode == ModeNode && opts.DeviceRoot == "" {
		opts.DeviceRoot = "/"
	}
	return &Driver{opts: opts}, nil
}

// Run serves the CSI socket, and in node mode the kubelet registration socket, until ctx ends.
func (d *Driver) Run(ctx context.Context) error {
	logger := klog.FromContext(ctx)
	logger.Info("Starting CSI driver", "driver", Name, "version", d.opts.Version, "mode", d.opts.Mode, "nodeID", d.opts.NodeID)

	server, err := csiserver.New(csiserver.Options{Endpoint: d.opts.Endpoint})
	if err != nil {
		return err
	}
	csi.RegisterIdentityServer(server, &csiserver.Identity{Name: Name, Version: d.opts.Version})
	if d.opts.Mode == ModeNode {
		csi.RegisterNodeServer(server, newNodeServer(d.opts.NodeID, d.opts.Host, d.opts.DeviceRoot, mounter.New()))
	}

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	g, ctx := errgroup.WithContext(ctx)
	g.Go(func() error { return server.Serve(ctx) })
	if d.opts.Mode == ModeNode && d.opts.KubeletRegistrationDir != "" {
		// The CSI socket listens already, so kubelet can call it as soon as it sees this one.
		registrar, err := registration.New(registration.Options{
			DriverName: Name,
			Endpoint:   server.Path(),
			Dir:        d.opts.KubeletRegistrationDir,
		})
		if err != nil {
			cancel()
			_ = g.Wait()
			return err
		}
		g.Go(func() error { return registrar.Serve(ctx) })
	}
	return g.Wait()
}
