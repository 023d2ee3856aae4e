// Package operator runs the vm-operator: in the controller role it places VirtualMachines and
// drives their power state and volumes; in the host-agent role, one per host, it hot-plugs
// volumes into the VirtualMachines on that host. Both roles are controller-runtime managers over
// the same scheme. The reconcilers come in later.
package operator

import (
	"context"
	"errors"
	"fmt"
	"net"

	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/validation"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/klog/v2"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/healthz"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	pmemv1alpha1 "pvbridge.io/pkg/apis/pmem/v1alpha1"
	vmv1alpha1 "pvbridge.io/pkg/apis/vm/v1alpha1"
)

// Role selects what the process does.
type Role string

const (
	// RoleController places VirtualMachines and manages their volumes' attachments.
	RoleController Role = "controller"
	// RoleHostAgent runs on one host and hot-plugs volumes into the VirtualMachines there.
	RoleHostAgent Role = "host-agent"
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
		if o.NodeName == "" {
			errs = append(errs, errors.New("node name is required in the host-agent role"))
		} else if msgs := validation.IsDNS1123Subdomain(o.NodeName); len(msgs) > 0 {
			errs = append(errs, fmt.Errorf("node name %q is not a node name: %v", o.NodeName, msgs))
		}
	default:
		errs = append(errs, fmt.Errorf("role %q is neither %q nor %q", o.Role, RoleController, RoleHostAgent))
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
// PersistentVolumeClaims, VolumeAttachments, ...) and pvbridge's VirtualMachine and PMEM kinds.
func NewScheme() (*runtime.Scheme, error) {
	scheme := runtime.NewScheme()
	for _, add := range []func(*runtime.Scheme) error{
		clientgoscheme.AddToScheme,
		vmv1alpha1.AddToScheme,
		pmemv1alpha1.AddToScheme,
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

// New builds the manager for valid options. It does not contact the API server.
func New(opts Options) (*Operator, error) {
	if err := opts.Validate(); err != nil {
		return nil, err
	}
	cfg, err := restConfig(opts.Kubeconfig)
	if err != nil {
		return nil, err
	}
	scheme, err := NewScheme()
	if err != nil {
		return nil, err
	}
	mgr, err := ctrl.NewManager(cfg, ctrl.Options{
		Scheme:                 scheme,
		Metrics:                metricsserver.Options{BindAddress: opts.MetricsAddress},
		HealthProbeBindAddress: opts.HealthAddress,
	})
	if err != nil {
		return nil, fmt.Errorf("create manager: %w", err)
	}
	if err := mgr.AddHealthzCheck("ping", healthz.Ping); err != nil {
		return nil, err
	}
	if err := mgr.AddReadyzCheck("ping", healthz.Ping); err != nil {
		return nil, err
	}
	return &Operator{opts: opts, mgr: mgr}, nil
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
	klog.FromContext(ctx).Info("Starting vm-operator", "role", o.opts.Role, "node", o.opts.NodeName)
	return o.mgr.Start(ctx)
}
