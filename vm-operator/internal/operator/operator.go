// Package operator runs the vm-operator: in the controller role it places VirtualMachines and
// manages their volumes' VolumeAttachments; in the host-agent role, one per host, it drives the
// power state of the VirtualMachines on that host and hot-plugs their volumes; in the
// infrastructure-provider role it is pvbridge's Cluster API infrastructure provider, whose
// Machines are VirtualMachines. Every role is a controller-runtime manager over the same scheme.
package operator

import (
	"context"
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"time"

	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/validation"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/klog/v2"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/healthz"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	infrav1 "pvbridge.io/pkg/apis/infrastructure/v1alpha1"
	pmemv1alpha1 "pvbridge.io/pkg/apis/pmem/v1alpha1"
	vmv1alpha1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/pkg/csiserver"
	"pvbridge.io/pkg/hold"
	"pvbridge.io/vm-operator/internal/capi"
	"pvbridge.io/vm-operator/internal/controller"
	"pvbridge.io/vm-operator/internal/hostagent"
	"pvbridge.io/vm-operator/internal/hypervisor"
	"pvbridge.io/vm-operator/internal/hypervisor/local"
	"pvbridge.io/vm-operator/internal/hypervisor/qemu"
)

// Role selects what the process does.
type Role string

const (
	// RoleController places VirtualMachines and manages their volumes' attachments.
	RoleController Role = "controller"
	// RoleHostAgent runs on one host and hot-plugs volumes into the VirtualMachines there.
	RoleHostAgent Role = "host-agent"
	// RoleInfrastructureProvider is the Cluster API infrastructure provider: PVBridgeClusters
	// and PVBridgeMachines, whose machines are VirtualMachines.
	RoleInfrastructureProvider Role = "infrastructure-provider"
)

// Options configure the operator.
type Options struct {
	// Kubeconfig is the path of the management cluster's kubeconfig. Empty means the usual
	// lookup: $KUBECONFIG, the in-cluster configuration, then ~/.kube/config.
	Kubeconfig string
	// MetricsAddress is the host:port of the Prometheus endpoint; "0" disables it.
	MetricsAddress string
	// HealthAddress is the host:port of /healthz and /readyz; "0" disables them.
	HealthAddress string
	// Role selects what the process does.
	Role Role
	// NodeName is the name of the host's Kubernetes Node. Host-agent role only.
	NodeName string
	// Hypervisor is the host agent's hypervisor driver: "local" (a VM is a directory, the lab)
	// or "qemu"; VMRoot is the local driver's root, QEMU the qemu driver's options (its
	// HotplugPorts are Slots).
	Hypervisor string
	VMRoot     string
	QEMU       qemu.Options
	// Slots is how many disks a VirtualMachine holds hot-plugged at once when its
	// spec.maxVolumes does not say; 0 means the driver's default (qemu 16, local 64).
	Slots int
	// CSIEndpoint is the unix socket of the host's mgmt-csi node plugin.
	CSIEndpoint string
	// StateDir is where the host agent stages and publishes VM volumes.
	StateDir string
	// UnplugTimeout is how long the host agent waits for the guest of a VM that must stop to
	// release its disks before it forces the VM off; zero waits for ever.
	UnplugTimeout time.Duration
	// HoldMax bounds how long the host agent holds the writes of VMs for a group snapshot
	// (the hold socket beside the mgmt-csi node socket); zero means hold.DefaultMaxHold.
	HoldMax time.Duration
	// VolumeDetachTimeout is how long the infrastructure provider waits for the volumes of a
	// deleted machine's VirtualMachine to detach before it powers the VM off anyway; zero
	// waits for ever.
	VolumeDetachTimeout time.Duration
	// KubeAPIQPS and KubeAPIBurst limit the operator's API requests.
	KubeAPIQPS   float32
	KubeAPIBurst int
	// LeaderElect makes the controller and the infrastructure provider run one active replica
	// of several, chosen by a Lease (leaseName) in LeaderElectionNamespace (empty: the pod's).
	LeaderElect             bool
	LeaderElectionNamespace string
	// WatchNamespace and WatchFilter restrict the infrastructure provider to the Cluster API
	// objects of one namespace, and to those labelled cluster.x-k8s.io/watch-filter=WatchFilter
	// (clusterctl's conventions); empty: all of them.
	WatchNamespace string
	WatchFilter    string
}

// leaseName is the Lease of each role's leader election.
var leaseName = map[Role]string{
	RoleController:             "pvbridge-vm-operator-controller",
	RoleInfrastructureProvider: "pvbridge-infrastructure-provider",
}

// Validate reports every problem with the options.
func (o *Options) Validate() error {
	var errs []error
	switch o.Role {
	case RoleController:
		if o.NodeName != "" {
			errs = append(errs, errors.New("node name is only used in the host-agent role"))
		}
	case RoleHostAgent:
		switch {
		case o.Hypervisor == "local" && !filepath.IsAbs(o.VMRoot):
			errs = append(errs, fmt.Errorf("the local hypervisor needs an absolute VM root, not %q", o.VMRoot))
		case o.Hypervisor == "qemu" && !filepath.IsAbs(o.QEMU.RunDir):
			errs = append(errs, fmt.Errorf("the qemu hypervisor needs an absolute run directory, not %q", o.QEMU.RunDir))
		case o.Hypervisor != "local" && o.Hypervisor != "qemu":
			errs = append(errs, fmt.Errorf("hypervisor %q is neither local nor qemu", o.Hypervisor))
		}
		if _, err := csiserver.ParseEndpoint(o.CSIEndpoint); err != nil {
			errs = append(errs, fmt.Errorf("CSI endpoint: %w", err))
		}
		if o.Slots < 0 || o.Slots > hypervisor.MaxSlots {
			errs = append(errs, fmt.Errorf("slots %d: want 0 (the driver's default) to %d", o.Slots, hypervisor.MaxSlots))
		}
		if o.UnplugTimeout < 0 {
			errs = append(errs, fmt.Errorf("unplug timeout %s is negative", o.UnplugTimeout))
		}
		if o.HoldMax < 0 {
			errs = append(errs, fmt.Errorf("longest hold %s is negative", o.HoldMax))
		}
		if !filepath.IsAbs(o.StateDir) {
			errs = append(errs, fmt.Errorf("state directory %q is not absolute", o.StateDir))
		}
		if o.NodeName == "" {
			errs = append(errs, errors.New("node name is required in the host-agent role"))
		} else if msgs := validation.IsDNS1123Subdomain(o.NodeName); len(msgs) > 0 {
			errs = append(errs, fmt.Errorf("node name %q is not a node name: %v", o.NodeName, msgs))
		}
	case RoleInfrastructureProvider:
		if o.NodeName != "" {
			errs = append(errs, errors.New("node name is only used in the host-agent role"))
		}
		if o.VolumeDetachTimeout < 0 {
			errs = append(errs, fmt.Errorf("volume detach timeout %s is negative", o.VolumeDetachTimeout))
		}
		if msgs := validation.IsDNS1123Label(o.WatchNamespace); o.WatchNamespace != "" && len(msgs) > 0 {
			errs = append(errs, fmt.Errorf("namespace %q is not a namespace: %v", o.WatchNamespace, msgs))
		}
		if msgs := validation.IsValidLabelValue(o.WatchFilter); len(msgs) > 0 {
			errs = append(errs, fmt.Errorf("watch filter %q is not a label value: %v", o.WatchFilter, msgs))
		}
	default:
		errs = append(errs, fmt.Errorf("role %q is not %q, %q or %q", o.Role, RoleController, RoleHostAgent, RoleInfrastructureProvider))
	}
	if o.Role == RoleHostAgent && o.LeaderElect {
		errs = append(errs, errors.New("leader election is for the controller and infrastructure-provider roles: each host runs its own agent"))
	}
	if o.Role != RoleInfrastructureProvider && (o.WatchNamespace != "" || o.WatchFilter != "") {
		errs = append(errs, errors.New("the namespace and the watch filter are only used in the infrastructure-provider role"))
	}
	if err := validateAddress(o.MetricsAddress); err != nil {
		errs = append(errs, fmt.Errorf("metrics address: %w", err))
	}
	if err := validateAddress(o.HealthAddress); err != nil {
		errs = append(errs, fmt.Errorf("health address: %w", err))
	}
	return errors.Join(errs...)
}

// validateAddress accepts "0", which controller-runtime reads as "disabled", and host:port.
func validateAddress(addr string) error {
	if addr == "0" {
		return nil
	}
	_, _, err := net.SplitHostPort(addr)
	return err
}

// NewScheme returns the types the operator reads and writes: the built-in kinds (Pods,
// PersistentVolumeClaims, VolumeAttachments, ...), pvbridge's VirtualMachine and PMEM kinds,
// and the Cluster API kinds the infrastructure provider reads and implements.
func NewScheme() (*runtime.Scheme, error) {
	scheme := runtime.NewScheme()
	for _, add := range []func(*runtime.Scheme) error{
		clientgoscheme.AddToScheme,
		vmv1alpha1.AddToScheme,
		pmemv1alpha1.AddToScheme,
		clusterv1.AddToScheme,
		infrav1.AddToScheme,
	} {
		if err := add(scheme); err != nil {
			return nil, err
		}
	}
	return scheme, nil
}

// Operator is a controller-runtime manager configured for one role.
type Operator struct {
	opts Options
	mgr  ctrl.Manager
}

// New builds the manager for valid options. In the controller role it does not contact the API
// server; a host agent does, to set up its cache of the VMs on its host (a field selector).
func New(opts Options) (*Operator, error) {
	if err := opts.Validate(); err != nil {
		return nil, err
	}
	cfg, err := restConfig(opts.Kubeconfig)
	if err != nil {
		return nil, err
	}
	if opts.KubeAPIQPS > 0 {
		cfg.QPS = opts.KubeAPIQPS
	}
	if opts.KubeAPIBurst > 0 {
		cfg.Burst = opts.KubeAPIBurst
	}
	scheme, err := NewScheme()
	if err != nil {
		return nil, err
	}
	mopts := ctrl.Options{
		Scheme:                 scheme,
		Metrics:                metricsserver.Options{BindAddress: opts.MetricsAddress},
		HealthProbeBindAddress: opts.HealthAddress,
		Cache:                  cacheOptions(opts),
		// A replica that stops (a rolling update, a drained node) gives the Lease up, so that
		// another takes over at once rather than after the Lease's 15 s run out: the process
		// exits when the manager returns.
		LeaderElection:                opts.LeaderElect,
		LeaderElectionID:              leaseName[opts.Role],
		LeaderElectionNamespace:       opts.LeaderElectionNamespace,
		LeaderElectionReleaseOnCancel: true,
	}
	mgr, err := ctrl.NewManager(cfg, mopts)
	if err != nil {
		return nil, fmt.Errorf("create manager: %w", err)
	}
	switch opts.Role {
	case RoleController:
		if err := controller.SetupWithManager(mgr); err != nil {
			return nil, err
		}
	case RoleHostAgent:
		if err := setupHostAgent(mgr, opts); err != nil {
			return nil, err
		}
	case RoleInfrastructureProvider:
		if err := capi.SetupWithManager(mgr, capi.Options{VolumeDetachTimeout: opts.VolumeDetachTimeout, WatchFilter: capi.WatchFilter(opts.WatchFilter)}); err != nil {
			return nil, err
		}
	}
	if err := mgr.AddHealthzCheck("ping", healthz.Ping); err != nil {
		return nil, err
	}
	if err := mgr.AddReadyzCheck("ping", healthz.Ping); err != nil {
		return nil, err
	}
	return &Operator{opts: opts, mgr: mgr}, nil
}

// setupHostAgent makes the hypervisor driver and the mgmt-csi client of the host agent.
func setupHostAgent(mgr ctrl.Manager, opts Options) error {
	var hv hypervisor.Driver
	var err error
	if opts.Hypervisor == "qemu" {
		q := opts.QEMU
		q.HotplugPorts = opts.Slots
		hv, err = qemu.New(q)
	} else {
		hv, err = local.New(local.Options{Root: opts.VMRoot, Slots: opts.Slots})
	}
	if err != nil {
		return fmt.Errorf("%s hypervisor: %w", opts.Hypervisor, err)
	}
	socket, err := csiserver.ParseEndpoint(opts.CSIEndpoint)
	if err != nil {
		return err
	}
	// grpc.NewClient connects lazily: the node plugin may start after the agent.
	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return fmt.Errorf("mgmt-csi node plugin at %s: %w", socket, err)
	}
	agent := &hostagent.Reconciler{
		Client:        mgr.GetClient(),
		APIReader:     mgr.GetAPIReader(),
		Node:          opts.NodeName,
		Hypervisor:    hv,
		CSI:           csi.NewNodeClient(conn),
		StateDir:      opts.StateDir,
		UnplugTimeout: opts.UnplugTimeout,
		Recorder:      mgr.GetEventRecorder("vm-operator-host-agent"),
	}
	if err := agent.SetupWithManager(mgr); err != nil {
		return err
	}
	// mgmt-csi's node agent asks for the writers of a group snapshot's volumes to be held on a
	// socket beside its own, in the directory the host agent mounts already.
	return mgr.Add(&hostagent.HoldServer{Agent: agent, Path: hold.SocketBeside(socket), MaxHold: opts.HoldMax})
}

func restConfig(kubeconfig string) (*rest.Config, error) {
	if kubeconfig == "" {
		cfg, err := ctrl.GetConfig()
		if err != nil {
			return nil, fmt.Errorf("find a kubeconfig: %w", err)
		}
		return cfg, nil
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return nil, fmt.Errorf("load kubeconfig %s: %w", kubeconfig, err)
	}
	return cfg, nil
}

// Run runs the manager until ctx ends.
func (o *Operator) Run(ctx context.Context) error {
	klog.FromContext(ctx).Info("Starting vm-operator", "role", o.opts.Role, "node", o.opts.NodeName, "leaderElection", o.opts.LeaderElect)
	return o.mgr.Start(ctx)
}
