// Package tenants is the management-cluster side of pvbridge's tenancy: a controller over Cluster
// API Clusters that opt in with the label pvbridge.io/enabled=true, with one reconciler per
// concern:
//
//   - credentials (CredentialsReconciler): the guest's identity — ServiceAccount <c>-pvbridge,
//     its Role (tenancy.GuestRules) and RoleBinding in the Cluster's namespace, a Role and
//     RoleBinding (tenancy.CapacityRules) in the capacity namespace — and a token of it, made
//     into a kubeconfig and delivered into the guest cluster as the Secret
//     pvbridge-mgmt-credentials, renewed when two thirds of its life have passed;
//   - guest install (InstallReconciler): the guest side of pvbridge (guest/install.yaml, rendered
//     from manifests/overlays/guest) applied into the guest cluster with the Cluster's name, UID
//     and first allowed management StorageClass, and applied again every resync; a Cluster
//     annotated pvbridge.io/guest-install=false is left alone;
//   - parameters (ParamsReconciler): the ConfigMap pvbridge-tenancy of each namespace, which the
//     admission policy reads (the contract in docs/tenants.md);
//   - cleanup (CleanupReconciler): the finalizer pvbridge.io/cleanup; when a Cluster is deleted,
//     once its VirtualMachines are gone, the management PVCs, VolumeSnapshots and
//     VolumeGroupSnapshots it owns are deleted, those shared with it released, and its
//     capacity-namespace RBAC removed;
//   - quota (QuotaReconciler): a count quota of VolumeSnapshots in every enforced namespace that
//     has none;
//   - quota usage (QuotaUsageReconciler): how much of each quota of an enforced namespace is
//     used, as a metric (metrics.go).
//
// Nothing is removed from a guest cluster when its Cluster goes: the guest goes with it. The
// Cluster itself is never written but for that finalizer: its status belongs to Cluster API.
// Progress is told by Events on the Cluster and in the log.
package tenants

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"strings"
	"time"

	groupsnapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumegroupsnapshot/v1"
	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/selection"
	"k8s.io/apimachinery/pkg/util/validation"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/utils/clock"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/healthz"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"
	"sigs.k8s.io/controller-runtime/pkg/predicate"

	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/pkg/tenancy"
)

const (
	// CleanupFinalizer holds a deleted Cluster until its management volumes are cleaned up.
	CleanupFinalizer = "pvbridge.io/cleanup"
	// GuestSecretKey is the key of the kubeconfig in tenancy.GuestCredentialsSecret.
	GuestSecretKey = "kubeconfig"
	// IdentitySuffix makes the name of a guest's ServiceAccount, Role and RoleBinding:
	// <cluster>-pvbridge.
	IdentitySuffix = "-pvbridge"
	// ClusterNamespaceLabel marks the capacity-namespace RBAC of a guest with its Cluster's
	// namespace (beside tenancy.ClusterNameLabel and ClusterUIDLabel).
	ClusterNamespaceLabel = "pvbridge.io/cluster-namespace"
	// ManagedByLabel marks every object this controller writes.
	ManagedByLabel = "app.kubernetes.io/managed-by"
	// fieldManager names the controller in managedFields, Events and ManagedByLabel.
	fieldManager = "pvbridge-tenants"
	// MinTokenTTL is the shortest token the apiserver issues through the TokenRequest API.
	MinTokenTTL = 10 * time.Minute
)

// Options configure the tenants controller.
type Options struct {
	// Kubeconfig is the path of the management cluster's kubeconfig. Empty: $KUBECONFIG, the
	// in-cluster configuration, then ~/.kube/config.
	Kubeconfig string
	// MgmtServer is the URL of the management apiserver as guests reach it, written into their
	// kubeconfigs. Required: the controller's own (often in-cluster) address is rarely it.
	MgmtServer string
	// MgmtCAFile is the CA bundle guests verify MgmtServer with; empty: the controller's own
	// rest.Config CA.
	MgmtCAFile string
	// CapacityNamespace is where mgmt-csi publishes CSIStorageCapacity objects.
	CapacityNamespace string
	// GuestNamespace is the namespace of the guest cluster that receives tenancy.GuestCredentialsSecret.
	GuestNamespace string
	// TokenTTL is the requested lifetime of a guest's token; it is renewed after two thirds.
	TokenTTL time.Duration
	// LeaderElect runs one active replica; LeaderElectionNamespace holds its Lease (empty: the
	// in-cluster namespace).
	LeaderElect             bool
	LeaderElectionNamespace string
	// MetricsAddress and HealthAddress are host:port, or "0" for none.
	MetricsAddress string
	HealthAddress  string
	// KubeAPIQPS and KubeAPIBurst limit the requests to the management apiserver.
	KubeAPIQPS   float32
	KubeAPIBurst int
	// SnapshotQuota and GroupSnapshotQuota are the counts of VolumeSnapshots and
	// VolumeGroupSnapshots each enforced namespace's quota allows (QuotaReconciler); 0: that
	// count is not in the quota, and with both 0 the controller makes no quota.
	SnapshotQuota, GroupSnapshotQuota int64
	// ImageRegistry, when set, replaces the registry of every image the guest install names
	// (a platform's mirror): see mirrorImage.
	ImageRegistry string
}

// validateRegistry accepts an image registry as ImageRegistry takes it: host[:port][/path],
// without a scheme, a trailing slash, a tag or a digest.
func validateRegistry(registry string) error {
	if registry == "" {
		return nil
	}
	host, _, _ := strings.Cut(registry, "/")
	if strings.Contains(registry, "://") || strings.HasSuffix(registry, "/") || strings.ContainsAny(registry, " @") ||
		host == "" || strings.Contains(strings.TrimPrefix(registry, host), ":") {
		return fmt.Errorf("guest image registry %q is not host[:port][/path] (e.g. mirror.example.com:5000/k8s)", registry)
	}
	return nil
}

// Validate reports every problem with the options.
func (o *Options) Validate() error {
	var errs []error
	if u, err := url.Parse(o.MgmtServer); o.MgmtServer == "" {
		errs = append(errs, errors.New("the management server URL (as guests reach it) is required"))
	} else if err != nil || u.Scheme != "https" || u.Host == "" {
		errs = append(errs, fmt.Errorf("management server %q is not an https:// URL", o.MgmtServer))
	}
	for what, ns := range map[string]string{"capacity": o.CapacityNamespace, "guest": o.GuestNamespace} {
		if msgs := validation.IsDNS1123Label(ns); len(msgs) > 0 {
			errs = append(errs, fmt.Errorf("%s namespace %q is not a namespace name: %v", what, ns, msgs))
		}
	}
	if o.SnapshotQuota < 0 {
		errs = append(errs, fmt.Errorf("snapshot quota %d is negative", o.SnapshotQuota))
	}
	if o.GroupSnapshotQuota < 0 {
		errs = append(errs, fmt.Errorf("group snapshot quota %d is negative", o.GroupSnapshotQuota))
	}
	if err := validateRegistry(o.ImageRegistry); err != nil {
		errs = append(errs, err)
	}
	if o.TokenTTL < MinTokenTTL {
		errs = append(errs, fmt.Errorf("token TTL %s is below the apiserver's minimum of %s", o.TokenTTL, MinTokenTTL))
	}
	for what, addr := range map[string]string{"metrics": o.MetricsAddress, "health": o.HealthAddress} {
		if addr == "0" {
			continue
		}
		if _, _, err := net.SplitHostPort(addr); err != nil {
			errs = append(errs, fmt.Errorf("%s address: %w", what, err))
		}
	}
	return errors.Join(errs...)
}

// NewScheme returns the types the controller reads and writes: the built-in kinds, Cluster
// API's Cluster, VolumeSnapshots, VolumeGroupSnapshots and pvbridge's VirtualMachines.
func NewScheme() (*runtime.Scheme, error) {
	scheme := runtime.NewScheme()
	for _, add := range []func(*runtime.Scheme) error{
		clientgoscheme.AddToScheme,
		clusterv1.AddToScheme,
		snapshotv1.AddToScheme,
		groupsnapshotv1.AddToScheme,
		vmv1.AddToScheme,
	} {
		if err := add(scheme); err != nil {
			return nil, err
		}
	}
	return scheme, nil
}

// Config is what the reconcilers share, resolved from Options.
type Config struct {
	// MgmtServer and MgmtCA (PEM) go into every guest kubeconfig.
	MgmtServer string
	MgmtCA     []byte
	// CapacityNamespace, GuestNamespace and TokenTTL: see Options.
	CapacityNamespace string
	GuestNamespace    string
	TokenTTL          time.Duration
	// InstallResync is how often the guest install is applied again; zero:
	// DefaultInstallResync.
	InstallResync time.Duration
	// Clock tells when a token is due for renewal; nil: the real clock.
	Clock clock.PassiveClock
	// SnapshotQuota, GroupSnapshotQuota and ImageRegistry: see Options.
	SnapshotQuota, GroupSnapshotQuota int64
	ImageRegistry                     string
}

// SetupWithManager registers the reconcilers with mgr.
func SetupWithManager(mgr ctrl.Manager, cfg Config) error {
	if cfg.Clock == nil {
		cfg.Clock = clock.RealClock{}
	}
	guests := NewGuestClients(mgr.GetScheme())
	creds := &CredentialsReconciler{
		Client:    mgr.GetClient(),
		APIReader: mgr.GetAPIReader(),
		Config:    cfg,
		Guests:    guests,
		Recorder:  mgr.GetEventRecorder(fieldManager),
	}
	if err := creds.SetupWithManager(mgr); err != nil {
		return fmt.Errorf("set up the credentials controller: %w", err)
	}
	install := &InstallReconciler{
		Client:   mgr.GetClient(),
		Guests:   guests,
		Recorder: mgr.GetEventRecorder(fieldManager),
		Resync:   cfg.InstallResync,
		Registry: cfg.ImageRegistry,
	}
	if err := install.SetupWithManager(mgr); err != nil {
		return fmt.Errorf("set up the guest install controller: %w", err)
	}
	params := &ParamsReconciler{Client: mgr.GetClient()}
	if err := params.SetupWithManager(mgr); err != nil {
		return fmt.Errorf("set up the parameters controller: %w", err)
	}
	cleanup := &CleanupReconciler{
		Client:            mgr.GetClient(),
		APIReader:         mgr.GetAPIReader(),
		CapacityNamespace: cfg.CapacityNamespace,
		Recorder:          mgr.GetEventRecorder(fieldManager),
	}
	if err := cleanup.SetupWithManager(mgr); err != nil {
		return fmt.Errorf("set up the cleanup controller: %w", err)
	}
	usage := &QuotaUsageReconciler{Client: mgr.GetClient()}
	if err := usage.SetupWithManager(mgr); err != nil {
		return fmt.Errorf("set up the quota usage controller: %w", err)
	}
	if cfg.SnapshotQuota > 0 || cfg.GroupSnapshotQuota > 0 {
		quota := &QuotaReconciler{Client: mgr.GetClient(), Snapshots: cfg.SnapshotQuota, GroupSnapshots: cfg.GroupSnapshotQuota}
		if err := quota.SetupWithManager(mgr); err != nil {
			return fmt.Errorf("set up the quota controller: %w", err)
		}
	}
	return nil
}

// Leader election, in the Lease's namespace (--leader-election-namespace; pvbridge-system in
// manifests/base/tenants): the Lease, and the core Events controller-runtime records on it.
// +kubebuilder:rbac:groups=coordination.k8s.io,resources=leases,verbs=get;create;update,namespace=pvbridge-system
// +kubebuilder:rbac:groups="",resources=events,verbs=create;patch,namespace=pvbridge-system

// Controller is the tenants controller's manager.
type Controller struct {
	mgr ctrl.Manager
}

// New builds the manager for valid options; it does not contact the apiserver.
func New(opts Options) (*Controller, error) {
	if err := opts.Validate(); err != nil {
		return nil, err
	}
	rc, err := restConfig(opts.Kubeconfig)
	if err != nil {
		return nil, err
	}
	if opts.KubeAPIQPS > 0 {
		rc.QPS = opts.KubeAPIQPS
	}
	if opts.KubeAPIBurst > 0 {
		rc.Burst = opts.KubeAPIBurst
	}
	ca, err := mgmtCA(opts.MgmtCAFile, rc)
	if err != nil {
		return nil, err
	}
	scheme, err := NewScheme()
	if err != nil {
		return nil, err
	}
	mgr, err := ctrl.NewManager(rc, ctrl.Options{
		Scheme:                  scheme,
		Cache:                   CacheOptions(),
		Metrics:                 metricsserver.Options{BindAddress: opts.MetricsAddress},
		HealthProbeBindAddress:  opts.HealthAddress,
		LeaderElection:          opts.LeaderElect,
		LeaderElectionID:        "pvbridge-tenants",
		LeaderElectionNamespace: opts.LeaderElectionNamespace,
		// A replica that stops gives the Lease up, for the other to take over at once.
		LeaderElectionReleaseOnCancel: true,
	})
	if err != nil {
		return nil, fmt.Errorf("create manager: %w", err)
	}
	err = SetupWithManager(mgr, Config{
		MgmtServer: opts.MgmtServer, MgmtCA: ca,
		CapacityNamespace: opts.CapacityNamespace, GuestNamespace: opts.GuestNamespace, TokenTTL: opts.TokenTTL,
		SnapshotQuota: opts.SnapshotQuota, GroupSnapshotQuota: opts.GroupSnapshotQuota, ImageRegistry: opts.ImageRegistry,
	})
	if err != nil {
		return nil, err
	}
	if err := mgr.AddHealthzCheck("ping", healthz.Ping); err != nil {
		return nil, err
	}
	if err := mgr.AddReadyzCheck("ping", healthz.Ping); err != nil {
		return nil, err
	}
	return &Controller{mgr: mgr}, nil
}

// Run runs the reconcilers until ctx is cancelled.
func (c *Controller) Run(ctx context.Context) error {
	return c.mgr.Start(ctx)
}

// CacheOptions keep the manager's cache to the Secrets and ConfigMaps the controller reads:
// Cluster API's (labelled with the cluster name) and its own.
func CacheOptions() cache.Options {
	capi, err := labels.NewRequirement(clusterv1.ClusterNameLabel, selection.Exists, nil)
	if err != nil {
		panic(err) // a constant, valid label key
	}
	return cache.Options{DefaultTransform: cache.TransformStripManagedFields(), ByObject: map[client.Object]cache.ByObject{
		&corev1.Secret{}:         {Label: labels.NewSelector().Add(*capi)},
		&corev1.ConfigMap{}:      {Label: labels.SelectorFromSet(labels.Set{ManagedByLabel: fieldManager})},
		&corev1.ServiceAccount{}: {Label: labels.SelectorFromSet(labels.Set{ManagedByLabel: fieldManager})},
	}}
}

func restConfig(kubeconfig string) (*rest.Config, error) {
	if kubeconfig == "" {
		return ctrl.GetConfig()
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return nil, fmt.Errorf("load kubeconfig %s: %w", kubeconfig, err)
	}
	return cfg, nil
}

// mgmtCA is the CA bundle guests get: the file's, else the controller's own.
func mgmtCA(file string, rc *rest.Config) ([]byte, error) {
	if file == "" {
		file = rc.CAFile
	}
	if file != "" {
		ca, err := os.ReadFile(file)
		if err != nil {
			return nil, fmt.Errorf("read the management CA: %w", err)
		}
		return ca, nil
	}
	if len(rc.CAData) == 0 {
		return nil, errors.New("the controller's own connection has no CA to hand to guests; set the management CA file")
	}
	return rc.CAData, nil
}

// optedIn is true for Clusters labelled tenancy.EnabledLabel=true.
func optedIn(obj client.Object) bool {
	return obj.GetLabels()[tenancy.EnabledLabel] == "true"
}

// optedInClusters filters the Cluster watch of the guest install controller.
var optedInClusters = builder.WithPredicates(predicate.NewPredicateFuncs(optedIn))

// deletions passes the deletions of objects, and nothing else.
var deletions = predicate.Funcs{
	CreateFunc:  func(event.CreateEvent) bool { return false },
	UpdateFunc:  func(event.UpdateEvent) bool { return false },
	GenericFunc: func(event.GenericEvent) bool { return false },
}

// enforced passes namespaces labelled tenancy.TenancyNamespaceLabel=tenancy.TenancyEnforced.
func enforced(obj client.Object) bool {
	return obj.GetLabels()[tenancy.TenancyNamespaceLabel] == tenancy.TenancyEnforced
}

// optedInBefore passes Clusters that opt in, or did before an update.
var optedInBefore = predicate.Funcs{
	CreateFunc:  func(e event.CreateEvent) bool { return optedIn(e.Object) },
	UpdateFunc:  func(e event.UpdateEvent) bool { return optedIn(e.ObjectOld) || optedIn(e.ObjectNew) },
	DeleteFunc:  func(e event.DeleteEvent) bool { return optedIn(e.Object) },
	GenericFunc: func(e event.GenericEvent) bool { return optedIn(e.Object) },
}

// identityName is the name of a guest's ServiceAccount, Role and RoleBinding.
func identityName(cluster string) string { return cluster + IdentitySuffix }

// managedLabels are the labels of every object written for cluster.
func managedLabels(c *clusterv1.Cluster) map[string]string {
	return map[string]string{
		ManagedByLabel:           fieldManager,
		ClusterNamespaceLabel:    c.Namespace,
		tenancy.ClusterNameLabel: c.Name,
		tenancy.ClusterUIDLabel:  string(c.UID),
	}
}

// tenant is the tenancy view of a Cluster.
func tenant(c *clusterv1.Cluster) tenancy.Cluster {
	return tenancy.Cluster{Namespace: c.Namespace, Name: c.Name, UID: string(c.UID)}
}
