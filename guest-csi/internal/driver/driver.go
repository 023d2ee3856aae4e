// Package driver is the CSI driver guest.csi.pvbridge.io, which gives the pods of a guest
// cluster volumes that live in its management cluster.
package driver

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	groupsnapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumegroupsnapshot/v1"
	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"golang.org/x/sync/errgroup"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/kubernetes"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pvbridge.io/guest-csi/internal/mgmt"
	"pvbridge.io/guest-csi/internal/topology"
	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/pkg/await"
	"pvbridge.io/pkg/command"
	"pvbridge.io/pkg/csiserver"
	"pvbridge.io/pkg/mounter"
	"pvbridge.io/pkg/names"
	"pvbridge.io/pkg/registration"
	"pvbridge.io/pkg/tenancy"
)

// Name is the CSI driver name.
const Name = names.GuestDriver

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
	// Version is the driver version GetPluginInfo reports.
	Version string
	// GuestKubeconfig is a kubeconfig of the guest cluster; "" means the in-cluster config.
	// The controller labels guest Nodes and reads guest PVCs' labels; the node plugin reads
	// its own Node.
	GuestKubeconfig string
	// KubeAPIQPS and KubeAPIBurst limit the requests to each apiserver.
	KubeAPIQPS   float32
	KubeAPIBurst int

	// Controller mode.

	// ClusterName and ClusterUID identify the guest cluster: its Cluster API Cluster in the
	// management namespace.
	ClusterName, ClusterUID string
	// Mgmt is the management credential, reread every CredentialPoll.
	Mgmt           mgmt.Credentials
	CredentialPoll time.Duration
	// StorageClass and SnapshotClass are the management classes used when the guest class
	// names none ("": the management cluster's default class).
	StorageClass, SnapshotClass string
	// CapacityNamespace is where mgmt-csi's csi-provisioner publishes CSIStorageCapacity.
	CapacityNamespace string
	// WarningsPeriod bounds how old the management Warning Event a DeadlineExceeded names may
	// be: one List of the namespace's warnings serves the calls of a period. 0 means 10 s,
	// well within a sidecar's timeout, so that a retried call names a warning written during
	// the one before.
	WarningsPeriod time.Duration

	// Node mode.

	// NodeID is the guest node's name, which is also its VirtualMachine's name.
	NodeID string
	// HealthAddress (host:port) serves /healthz, which calls Probe through the CSI socket;
	// empty for none.
	HealthAddress string
	// MetricsAddress (host:port) serves Prometheus metrics: the CSI calls' latency and codes
	// (csiserver.OperationsMetric) and the Go runtime's; "" or "0" for none.
	MetricsAddress string
	// KubeletRegistrationDir is kubelet's plugin registration directory. When set, the driver
	// registers itself with kubelet there, once the node's host is known.
	KubeletRegistrationDir string
	// DeviceRoot is the root under which the node plugin looks up disks: <root>/sys/block and
	// <root>/dev. "" means "/". The lab's VMs have their device tree in a directory.
	DeviceRoot string
	// Host tells the node plugin the management host of its VM, which NodeGetInfo reports as
	// the node's topology. nil: the label of the node's guest Node (topology.NodeHost).
	Host Host
}

// Validate reports every problem with the options.
func (o *Options) Validate() error {
	var errs []error
	if _, err := csiserver.ParseEndpoint(o.Endpoint); err != nil {
		errs = append(errs, err)
	}
	if o.GuestKubeconfig != "" && !filepath.IsAbs(o.GuestKubeconfig) {
		errs = append(errs, fmt.Errorf("guest kubeconfig %q is not an absolute path", o.GuestKubeconfig))
	}
	switch o.Mode {
	case ModeController:
		errs = append(errs, o.validateController()...)
	case ModeNode:
		errs = append(errs, o.validateNode()...)
	default:
		errs = append(errs, fmt.Errorf("mode %q is neither %q nor %q", o.Mode, ModeController, ModeNode))
	}
	if o.Version == "" {
		errs = append(errs, errors.New("version is empty"))
	}
	return errors.Join(errs...)
}

func (o *Options) validateController() []error {
	var errs []error
	if o.NodeID != "" {
		errs = append(errs, errors.New("node ID is only used in node mode"))
	}
	if o.KubeletRegistrationDir != "" {
		errs = append(errs, errors.New("kubelet registration is only done in node mode"))
	}
	if o.DeviceRoot != "" {
		errs = append(errs, errors.New("device root is only used in node mode"))
	}
	if o.ClusterName == "" || o.ClusterUID == "" {
		errs = append(errs, errors.New("the guest cluster's name and UID are required in controller mode"))
	}
	if msgs := validation.IsValidLabelValue(o.ClusterName); len(msgs) > 0 {
		errs = append(errs, fmt.Errorf("cluster name %q is no label value: %v", o.ClusterName, msgs))
	}
	if msgs := validation.IsValidLabelValue(o.ClusterUID); len(msgs) > 0 || len(o.ClusterUID) > 36 {
		errs = append(errs, fmt.Errorf("cluster UID %q is no Kubernetes UID", o.ClusterUID))
	}
	if err := o.Mgmt.Validate(); err != nil {
		errs = append(errs, err)
	}
	if o.CredentialPoll <= 0 {
		errs = append(errs, errors.New("the credential poll interval must be positive"))
	}
	for _, class := range []string{o.StorageClass, o.SnapshotClass, o.CapacityNamespace} {
		if class != "" && len(validation.IsDNS1123Subdomain(class)) > 0 {
			errs = append(errs, fmt.Errorf("%q is no object name", class))
		}
	}
	if o.CapacityNamespace == "" {
		errs = append(errs, errors.New("the namespace of the management CSIStorageCapacity objects is required"))
	}
	return errs
}

func (o *Options) validateNode() []error {
	var errs []error
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
	if o.ClusterName != "" || o.ClusterUID != "" || o.Mgmt != (mgmt.Credentials{}) {
		errs = append(errs, errors.New("the node plugin holds no management credential and no cluster identity"))
	}
	return errs
}

// Driver serves the CSI services of guest.csi.pvbridge.io: Identity, and Controller or Node.
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

// Run serves the CSI socket until ctx ends; the controller also keeps the management
// connection and labels guest Nodes, the node plugin registers with kubelet.
func (d *Driver) Run(ctx context.Context) error {
	logger := klog.FromContext(ctx)
	logger.Info("Starting CSI driver", "driver", Name, "version", d.opts.Version, "mode", d.opts.Mode, "nodeID", d.opts.NodeID)

	guest, err := d.guestClient()
	if err != nil {
		return err
	}
	registry := prometheus.NewRegistry()
	registry.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}), command.BuildInfo("guest-csi", d.opts.Version))
	server, err := csiserver.New(csiserver.Options{Endpoint: d.opts.Endpoint, Registerer: registry, DriverName: Name})
	if err != nil {
		return err
	}
	identity := &csiserver.Identity{Name: Name, Version: d.opts.Version}
	if d.opts.Mode == ModeController {
		// The sidecars beside the controller read the guest's API server.
		identity.Ready = csiserver.APIServerReady(guest.Discovery().RESTClient())
	}
	csi.RegisterIdentityServer(server, identity)

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	g, ctx := errgroup.WithContext(ctx)
	if d.opts.HealthAddress != "" {
		g.Go(func() error { return server.ServeHealth(ctx, d.opts.HealthAddress) })
	}
	if d.opts.MetricsAddress != "" && d.opts.MetricsAddress != "0" {
		g.Go(func() error { return csiserver.ServeMetrics(ctx, d.opts.MetricsAddress, registry) })
	}
	if d.opts.Mode == ModeController {
		conn, labeller, err := d.setupController(server, guest)
		if err != nil {
			return err
		}
		g.Go(func() error { return conn.Run(ctx) })
		g.Go(func() error { return labeller.Run(ctx) })
		g.Go(func() error { return server.Serve(ctx) })
		return g.Wait()
	}

	host := d.opts.Host
	if host == nil {
		host = topology.NodeHost{Client: guest, Node: d.opts.NodeID}
	}
	csi.RegisterNodeServer(server, newNodeServer(d.opts.NodeID, host, d.opts.DeviceRoot, mounter.New()))
	g.Go(func() error { return server.Serve(ctx) })
	if d.opts.KubeletRegistrationDir != "" {
		g.Go(func() error { return d.register(ctx, server.Path(), host) })
	}
	return g.Wait()
}

// register registers the node plugin with kubelet once the node's host is known: kubelet asks
// NodeGetInfo once, and never again after a failed registration.
func (d *Driver) register(ctx context.Context, endpoint string, host Host) error {
	if _, err := host.VMOf(ctx); err != nil {
		klog.FromContext(ctx).Info("Waiting for the node's host before registering with kubelet", "reason", err.Error())
		if err := host.WaitForHost(ctx); err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
	}
	registrar, err := registration.New(registration.Options{DriverName: Name, Endpoint: endpoint, Dir: d.opts.KubeletRegistrationDir})
	if err != nil {
		return err
	}
	return registrar.Serve(ctx)
}

// guestClient returns a client of the guest cluster.
func (d *Driver) guestClient() (kubernetes.Interface, error) {
	var cfg *rest.Config
	var err error
	if d.opts.GuestKubeconfig != "" {
		cfg, err = clientcmd.BuildConfigFromFlags("", d.opts.GuestKubeconfig)
	} else {
		cfg, err = rest.InClusterConfig()
	}
	if err != nil {
		return nil, fmt.Errorf("guest cluster client: %w", err)
	}
	cfg.QPS, cfg.Burst, cfg.UserAgent = d.opts.KubeAPIQPS, d.opts.KubeAPIBurst, "guest-csi"
	return kubernetes.NewForConfig(cfg)
}

// newScheme holds the management objects the controller reads and writes.
func newScheme() (*runtime.Scheme, error) {
	s := runtime.NewScheme()
	for _, add := range []func(*runtime.Scheme) error{clientgoscheme.AddToScheme, vmv1.AddToScheme, snapshotv1.AddToScheme, groupsnapshotv1.AddToScheme} {
		if err := add(s); err != nil {
			return nil, err
		}
	}
	return s, nil
}

// setupController makes the management connection, whose cache holds only the guest's own
// objects in its namespace (PVCs, VolumeSnapshots and VolumeGroupSnapshots labelled with the
// cluster's UID, the cluster's VirtualMachines), the controller and group controller services
// waiting on it, and the node labeller.
func (d *Driver) setupController(server *csiserver.Server, guest kubernetes.Interface) (*mgmt.Conn, *topology.Labeller, error) {
	scheme, err := newScheme()
	if err != nil {
		return nil, nil, err
	}
	cluster := tenancy.Cluster{Name: d.opts.ClusterName, UID: d.opts.ClusterUID}
	own := labels.SelectorFromSet(labels.Set{tenancy.ClusterUIDLabel: cluster.UID})
	vms := labels.SelectorFromSet(labels.Set{tenancy.CAPIClusterNameLabel: cluster.Name})
	watched := map[string]client.Object{
		kindPVC:           &corev1.PersistentVolumeClaim{},
		kindSnapshot:      &snapshotv1.VolumeSnapshot{},
		kindGroupSnapshot: &groupsnapshotv1.VolumeGroupSnapshot{},
		kindVM:            &vmv1.VirtualMachine{},
	}
	hub := await.NewHub()
	var labeller *topology.Labeller
	conn, err := mgmt.New(mgmt.Options{
		Credentials: d.opts.Mgmt,
		Scheme:      scheme,
		CacheOptions: func(namespace string) cache.Options {
			return cache.Options{
				DefaultNamespaces: map[string]cache.Config{namespace: {}},
				DefaultTransform:  cache.TransformStripManagedFields(),
				ByObject: map[client.Object]cache.ByObject{
					watched[kindPVC]:           {Label: own},
					watched[kindSnapshot]:      {Label: own},
					watched[kindGroupSnapshot]: {Label: own},
					watched[kindVM]:            {Label: vms},
				},
			}
		},
		OnSession: func(ctx context.Context, c cache.Cache) error {
			for kind, obj := range watched {
				inf, err := c.GetInformer(ctx, obj)
				if err != nil {
					return fmt.Errorf("informer for %s: %w", kind, err)
				}
				if _, err := inf.AddEventHandler(hub.Handler(kind)); err != nil {
					return err
				}
				if kind == kindVM {
					if _, err := inf.AddEventHandler(labeller.VMHandler()); err != nil {
						return err
					}
				}
			}
			return nil
		},
		Poll:  d.opts.CredentialPoll,
		QPS:   d.opts.KubeAPIQPS,
		Burst: d.opts.KubeAPIBurst,
	})
	if err != nil {
		return nil, nil, err
	}
	labeller = topology.NewLabeller(guest, func(ctx context.Context, name string) (topology.VM, error) {
		vm := &vmv1.VirtualMachine{}
		err := conn.Get(ctx, client.ObjectKey{Namespace: conn.Namespace(), Name: name}, vm)
		if err != nil {
			return topology.VM{}, client.IgnoreNotFound(err)
		}
		ready := meta.FindStatusCondition(vm.Status.Conditions, vmv1.ReadyCondition)
		return topology.VM{
			Host: vm.Status.Host, MaxVolumes: int64(ptr.Deref(vm.Status.MaxVolumes, 0)),
			HostLost: ready != nil && ready.Reason == vmv1.HostLostReason,
		}, nil
	})
	cfg := controllerConfig{
		cluster:           cluster,
		storageClass:      d.opts.StorageClass,
		snapshotClass:     d.opts.SnapshotClass,
		capacityNamespace: d.opts.CapacityNamespace,
		warningsPeriod:    d.opts.WarningsPeriod,
	}
	controller := newControllerServer(cfg, conn, guest, hub)
	csi.RegisterControllerServer(server, controller)
	csi.RegisterGroupControllerServer(server, &groupControllerServer{controllerServer: controller})
	return conn, labeller, nil
}
