// Package driver is the CSI driver pmem.csi.pvbridge.io, which provisions node-local
// persistent-memory volumes on the hosts of the management cluster.
package driver

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sync/errgroup"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/klog/v2"
	"sigs.k8s.io/controller-runtime/pkg/metrics"

	"pvbridge.io/mgmt-csi/internal/pmem"
	"pvbridge.io/mgmt-csi/internal/replication"
	pmemv1 "pvbridge.io/pkg/apis/pmem/v1alpha1"
	"pvbridge.io/pkg/csiserver"
	"pvbridge.io/pkg/hold"
	"pvbridge.io/pkg/mounter"
	"pvbridge.io/pkg/names"
	"pvbridge.io/pkg/qsd"
	"pvbridge.io/pkg/registration"
)

// Name is the CSI driver name.
const Name = names.PmemDriver

// Mode selects the CSI services a process serves.
type Mode string

const (
	// ModeController serves the central controller: it records volumes as PmemVolume objects
	// and answers for capacity and attachment.
	ModeController Mode = "controller"
	// ModeNode serves the node agent of one host: it owns the host's PMEM and stages volumes.
	ModeNode Mode = "node"
)

// Options configure the driver.
type Options struct {
	// Endpoint is the CSI socket: unix:///abs/path or an absolute path.
	Endpoint string
	// Mode selects the services to serve.
	Mode Mode
	// NodeID is the name of the host's Kubernetes Node. Node mode only.
	NodeID string
	// HealthAddress (host:port) serves /healthz, which calls Probe through the CSI socket;
	// empty for none.
	HealthAddress string
	// KubeletRegistrationDir is kubelet's plugin registration directory. When set (node mode
	// only), the driver registers itself with kubelet.
	KubeletRegistrationDir string
	// Version is the driver version GetPluginInfo reports.
	Version string
	// MaxVolumesPerNode is how many volumes the scheduler may place on this node; 0 means no
	// limit. Node mode only.
	MaxVolumesPerNode int64
	// Kubeconfig is the path of a kubeconfig; empty means the in-cluster configuration.
	Kubeconfig string
	// KubeAPIQPS and KubeAPIBurst limit the driver's API requests.
	KubeAPIQPS   float32
	KubeAPIBurst int
	// MetricsAddress serves Prometheus metrics (CSI RPC latency and errors, controller-runtime);
	// "0" turns them off.
	MetricsAddress string
	// PmemMode is the back end of the node agent (node mode only); Pmem configures it.
	PmemMode pmemv1.Mode
	Pmem     pmem.Options
	// Replication configures the node's part in replicated volumes (node mode only).
	Replication ReplicationOptions
	// LeaderElection makes one controller of several run the reconciler of replicated volumes,
	// chosen by the Lease leaseName in LeaderElectionNamespace (empty: the pod's); every one
	// serves its CSI socket, which only its sidecars (themselves elected) call. Controller mode
	// only.
	LeaderElection          bool
	LeaderElectionNamespace string
}

// leaseName is the Lease of the controllers' leader election.
const leaseName = "pvbridge-mgmt-csi-controller"

// ReplicationOptions configure a node agent's replica server and targets. A node without
// KeysDir takes no part in replicated volumes; one with KeysDir and no Address attaches them
// (its targets reach the other nodes' replica servers) but holds no replica.
type ReplicationOptions struct {
	// Address is the host:port of the node's replica server, reachable from the other nodes'
	// agents and not from guests.
	Address string
	// KeysDir holds keys.psk, the pre-shared key of the replica servers (a Secret that only the
	// node agents mount).
	KeysDir string
	// RunDir holds the directories of the node's qemu-storage-daemons, short enough for their
	// sockets.
	RunDir string
	// RebuildInterval is how often the node looks for replicas to rebuild and to retire
	// (Rebuilder); zero: rebuildInterval.
	RebuildInterval time.Duration
	// Daemons places the qemu-storage-daemons out of the agent's container, so that its
	// restart stops no volume (docs/design.md).
	Daemons qsd.Placement
}

// maxRunDirLen bounds ReplicationOptions.RunDir: a target's directory adds a "/t/" and a
// volume ID to it.
const maxRunDirLen = qsd.MaxDirLen - len("/t/") - 63

// validate reports every problem with the replication options.
func (o ReplicationOptions) validate() []error {
	var errs []error
	if o.Address != "" {
		if o.KeysDir == "" {
			errs = append(errs, errors.New("a replica server needs the directory of its keys"))
		}
		if _, _, err := net.SplitHostPort(o.Address); err != nil {
			errs = append(errs, fmt.Errorf("replica server address %q: %w", o.Address, err))
		}
	}
	if o.KeysDir != "" && (!filepath.IsAbs(o.RunDir) || len(filepath.Clean(o.RunDir)) > maxRunDirLen) {
		errs = append(errs, fmt.Errorf("run directory %q must be an absolute path of at most %d bytes", o.RunDir, maxRunDirLen))
	}
	if err := o.Daemons.Validate(); err != nil {
		errs = append(errs, err)
	}
	return errs
}

// KeysFile is the pre-shared key's file in ReplicationOptions.KeysDir.
const KeysFile = "keys.psk"

// withKeys returns o, or, when KeysDir has no keys file (the shipped DaemonSet's optional
// Secret was not created), options with which the node takes no part in replicated volumes.
func (o ReplicationOptions) withKeys(logger klog.Logger) ReplicationOptions {
	if o.KeysDir == "" {
		return o
	}
	file := filepath.Join(o.KeysDir, KeysFile)
	if _, err := os.Stat(file); err == nil {
		return o
	}
	logger.Info("No pre-shared key of the replica servers: this host takes no part in replicated volumes", "file", file)
	o.Address, o.KeysDir = "", ""
	return o
}

// targets returns the node's targets of replicated volumes, nil without keys.
func (o ReplicationOptions) targets() *replication.Targets {
	if o.KeysDir == "" {
		return nil
	}
	return &replication.Targets{RunDir: filepath.Join(o.RunDir, "t"), KeysDir: o.KeysDir, Placement: o.Daemons}
}

// server returns the node's replica server, nil without an address.
func (o ReplicationOptions) server() *replication.Server {
	if o.Address == "" {
		return nil
	}
	return &replication.Server{Dir: qsd.Dir(filepath.Join(o.RunDir, "server")), Address: o.Address, KeysDir: o.KeysDir, Placement: o.Daemons}
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
		if o.MaxVolumesPerNode != 0 {
			errs = append(errs, errors.New("max volumes per node is only used in node mode"))
		}
		if o.PmemMode != "" {
			errs = append(errs, errors.New("the PMEM back end is only used in node mode"))
		}
		if o.Replication.Address != "" || o.Replication.KeysDir != "" {
			errs = append(errs, errors.New("replication is configured in node mode only"))
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
		if o.MaxVolumesPerNode < 0 {
			errs = append(errs, fmt.Errorf("max volumes per node %d is negative", o.MaxVolumesPerNode))
		}
		switch o.PmemMode {
		case pmemv1.ModeFile:
			if o.Pmem.File.Dir == "" {
				errs = append(errs, errors.New("the file back end needs a directory"))
			}
		case pmemv1.ModeLVM:
			if len(o.Pmem.LVM.VolumeGroups) == 0 {
				errs = append(errs, errors.New("the lvm back end needs volume groups"))
			}
		case pmemv1.ModeNdctl:
		default:
			errs = append(errs, fmt.Errorf("PMEM mode %q is none of file, lvm, ndctl", o.PmemMode))
		}
		errs = append(errs, o.Replication.validate()...)
		if o.LeaderElection {
			errs = append(errs, errors.New("leader election is for the controller: every node runs its own agent"))
		}
	default:
		errs = append(errs, fmt.Errorf("mode %q is neither %q nor %q", o.Mode, ModeController, ModeNode))
	}
	if o.Version == "" {
		errs = append(errs, errors.New("version is empty"))
	}
	if o.KubeAPIQPS < 0 || o.KubeAPIBurst < 0 {
		errs = append(errs, errors.New("API QPS and burst must not be negative"))
	}
	return errors.Join(errs...)
}

// Driver serves the CSI services of pmem.csi.pvbridge.io: in controller mode Identity and
// Controller, in node mode Identity and Node plus the node agent that realizes the node's
// volumes.
type Driver struct {
	opts Options
	// backend is the node's PMEM (node mode); Run makes it from the options unless a test set it.
	backend pmem.Backend
}

// New returns a driver for valid options.
func New(opts Options) (*Driver, error) {
	if err := opts.Validate(); err != nil {
		return nil, err
	}
	return &Driver{opts: opts}, nil
}

// Run serves the CSI socket, and in node mode the node agent and the kubelet registration
// socket, until ctx ends. The CSI socket opens once the API cache is in sync, so that no call
// is answered from an empty cache.
func (d *Driver) Run(ctx context.Context) error {
	logger := klog.FromContext(ctx)
	logger.Info("Starting CSI driver", "driver", Name, "version", d.opts.Version, "mode", d.opts.Mode, "nodeID", d.opts.NodeID)

	cfg, err := restConfig(d.opts)
	if err != nil {
		return err
	}
	mgr, err := newManager(cfg, d.opts)
	if err != nil {
		return err
	}
	server, err := csiserver.New(csiserver.Options{Endpoint: d.opts.Endpoint, Registerer: metrics.Registry, DriverName: Name})
	if err != nil {
		return err
	}
	identity := &csiserver.Identity{Name: Name, Version: d.opts.Version}
	csi.RegisterIdentityServer(server, identity)
	switch d.opts.Mode {
	case ModeController:
		dc, err := discovery.NewDiscoveryClientForConfig(cfg)
		if err != nil {
			return err
		}
		identity.Ready = csiserver.APIServerReady(dc.RESTClient())
		cs, err := setupController(ctx, mgr)
		if err != nil {
			return err
		}
		csi.RegisterControllerServer(server, cs)
		csi.RegisterGroupControllerServer(server, &groupControllerServer{controllerServer: cs})
	case ModeNode:
		if d.backend == nil {
			if d.backend, err = pmem.New(ctx, d.opts.PmemMode, d.opts.Pmem); err != nil {
				return err
			}
		}
		d.opts.Replication = d.opts.Replication.withKeys(logger)
		if err := setupAgent(mgr, d.backend, d.opts.NodeID, hold.SocketBeside(d.opts.Endpoint), d.opts.Replication); err != nil {
			return err
		}
		devices := VolumeDevices{Backend: d.backend, Node: d.opts.NodeID, Reader: mgr.GetAPIReader(), Writer: mgr.GetClient(), Targets: d.opts.Replication.targets()}
		ns := newNodeServer(d.opts.NodeID, d.opts.MaxVolumesPerNode, devices, mounter.New())
		if devices.Targets != nil {
			devices.Targets.Faulted = devices.faultReplica
			if err := errors.Join(mgr.Add(devices.Targets), mgr.Add(Rebuilder{Devices: devices, Locks: &ns.Locks, Interval: d.opts.Replication.RebuildInterval})); err != nil {
				return err
			}
		}
		csi.RegisterNodeServer(server, ns)
	}

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	g, ctx := errgroup.WithContext(ctx)
	g.Go(func() error { return mgr.Start(ctx) })
	if !mgr.GetCache().WaitForCacheSync(ctx) {
		cancel()
		return errors.Join(errors.New("the API cache did not sync"), g.Wait())
	}
	g.Go(func() error { return server.Serve(ctx) })
	if d.opts.HealthAddress != "" {
		g.Go(func() error { return server.ServeHealth(ctx, d.opts.HealthAddress) })
	}
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

// restConfig is the configuration of the kubeconfig option, or the in-cluster one.
func restConfig(o Options) (*rest.Config, error) {
	cfg, err := clientcmd.BuildConfigFromFlags("", o.Kubeconfig)
	if err != nil {
		return nil, fmt.Errorf("kubeconfig: %w", err)
	}
	if o.KubeAPIQPS > 0 {
		cfg.QPS = o.KubeAPIQPS
	}
	if o.KubeAPIBurst > 0 {
		cfg.Burst = o.KubeAPIBurst
	}
	cfg.UserAgent = "mgmt-csi/" + string(o.Mode)
	return cfg, nil
}
