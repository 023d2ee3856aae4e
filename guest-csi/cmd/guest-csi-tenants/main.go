// Command guest-csi-tenants runs in the management cluster and gives every Cluster API Cluster
// labelled pvbridge.io/enabled=true what its guest-csi needs there: a least-privilege identity
// whose token it delivers into the guest cluster and renews, guest-csi itself installed into the
// guest cluster, the tenancy parameters the admission policy reads, and the cleanup of the
// cluster's volumes when it is deleted.
package main

import (
	"context"
	"os"
	"time"

	"github.com/spf13/pflag"
	"k8s.io/klog/v2"
	ctrl "sigs.k8s.io/controller-runtime"

	"pvbridge.io/guest-csi/internal/tenants"
	"pvbridge.io/pkg/command"
	"pvbridge.io/pkg/tenancy"
)

// version is set at build time with -ldflags "-X main.version=<version>".
var version = "devel"

func main() {
	var opts tenants.Options
	fs := pflag.NewFlagSet(os.Args[0], pflag.ExitOnError)
	fs.StringVar(&opts.Kubeconfig, "kubeconfig", "",
		"Path of the management cluster's kubeconfig. When empty: $KUBECONFIG, the in-cluster configuration, then ~/.kube/config.")
	fs.StringVar(&opts.MgmtServer, "mgmt-server", "",
		"https:// URL of the management apiserver as guest clusters reach it; written into their kubeconfigs. Required.")
	fs.StringVar(&opts.MgmtCAFile, "mgmt-ca-file", "",
		"CA bundle with which guests verify --mgmt-server; empty for the CA of the controller's own connection.")
	fs.StringVar(&opts.CapacityNamespace, "capacity-namespace", "pvbridge-system",
		"Namespace where mgmt-csi publishes CSIStorageCapacity objects; each guest identity may list them there.")
	fs.StringVar(&opts.GuestNamespace, "guest-namespace", "pvbridge-system",
		"Namespace of the guest cluster that receives the Secret "+tenancy.GuestCredentialsSecret+" (key "+tenants.GuestSecretKey+
			"); the guest install's guest-csi controller runs in pvbridge-system and mounts it from there.")
	fs.DurationVar(&opts.TokenTTL, "token-ttl", 24*time.Hour,
		"Lifetime of a guest's token (at least 10m); it is renewed when two thirds of it have passed.")
	fs.BoolVar(&opts.LeaderElect, "leader-elect", true, "Run one active replica, chosen by a Lease named pvbridge-tenants.")
	fs.StringVar(&opts.LeaderElectionNamespace, "leader-election-namespace", "",
		"Namespace of the leader election Lease; empty for the pod's namespace (required outside a cluster).")
	fs.StringVar(&opts.MetricsAddress, "metrics-bind-address", "0",
		`host:port to serve Prometheus metrics on (/metrics), or "0" for none.`)
	fs.StringVar(&opts.HealthAddress, "health-probe-bind-address", ":8081",
		`host:port to serve the /healthz and /readyz probes on, or "0" for none.`)
	fs.Int64Var(&opts.SnapshotQuota, "snapshot-quota", 100,
		"VolumeSnapshots each namespace labelled "+tenancy.TenancyNamespaceLabel+"="+tenancy.TenancyEnforced+
			" may hold: the controller creates the ResourceQuota "+tenants.SnapshotQuota+" where there is none (an admin may change it). 0: none.")
	fs.Int64Var(&opts.GroupSnapshotQuota, "group-snapshot-quota", 20,
		"VolumeGroupSnapshots each such namespace may hold, in the same ResourceQuota (a group's members count as VolumeSnapshots too). 0: none.")
	fs.StringVar(&opts.ImageRegistry, "guest-image-registry", "",
		"A registry (host[:port][/path]) that replaces the registry of every image installed into guests, for a platform's mirror: "+
			"ghcr.io/pvbridge/guest-csi:v0.1.0 becomes <registry>/pvbridge/guest-csi:v0.1.0, registry.k8s.io/sig-storage/csi-provisioner:v6.4.0 <registry>/sig-storage/csi-provisioner:v6.4.0. Empty: the images as shipped.")
	fs.Float32Var(&opts.KubeAPIQPS, "kube-api-qps", 20, "Queries per second to the management apiserver.")
	fs.IntVar(&opts.KubeAPIBurst, "kube-api-burst", 40, "Burst of queries to the management apiserver.")
	command.Main(fs, "guest-csi-tenants", version, "pvbridge tenants controller.", func(ctx context.Context) error {
		ctrl.SetLogger(klog.Background())
		c, err := tenants.New(opts)
		if err != nil {
			return err
		}
		return c.Run(ctx)
	})
}
