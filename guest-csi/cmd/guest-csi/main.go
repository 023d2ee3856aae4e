// Command guest-csi is the CSI driver guest.csi.pvbridge.io. Its controller mirrors the volumes
// of a guest cluster into PersistentVolumeClaims of the management cluster and attaches them to
// the guest's VirtualMachines; its node plugin, on every guest node, finds an attached disk by
// its serial and mounts it.
package main

import (
	"context"
	"fmt"
	"os"
	"time"

	"github.com/spf13/pflag"
	"k8s.io/klog/v2"
	ctrl "sigs.k8s.io/controller-runtime"

	"pvbridge.io/guest-csi/internal/driver"
	"pvbridge.io/pkg/command"
)

// version is set at build time with -ldflags "-X main.version=<version>".
var version = "devel"

func main() {
	opts := driver.Options{Version: version}
	fs := pflag.NewFlagSet(os.Args[0], pflag.ExitOnError)
	fs.StringVar(&opts.Endpoint, "endpoint", "unix:///csi/csi.sock",
		"CSI socket to serve, as unix:///absolute/path or an absolute path. A stale socket left by a previous run is replaced.")
	fs.StringVar((*string)(&opts.Mode), "mode", "",
		`Services to serve: "controller" (beside the CSI sidecars, one per guest cluster) or "node" (on every guest node). Required.`)
	fs.StringVar(&opts.NodeID, "node-id", "",
		"Name of this guest node, which is also the name of its VirtualMachine in the management cluster; usually the pod's spec.nodeName. Required with --mode=node.")
	fs.StringVar(&opts.HealthAddress, "health-address", "",
		`host:port to serve /healthz on, e.g. ":9808": it calls the driver's CSI Probe through its socket, in place of the livenessprobe sidecar; empty for none.`)
	fs.StringVar(&opts.MetricsAddress, "metrics-address", "0",
		`Address to serve Prometheus metrics on (CSI RPC latency and errors by method and code), e.g. ":8080"; "0" turns them off.`)
	fs.StringVar(&opts.KubeletRegistrationDir, "kubelet-registration-dir", "",
		"Kubelet's plugin registration directory, usually /var/lib/kubelet/plugins_registry. When set, the node plugin registers itself with kubelet there, in place of node-driver-registrar, once the controller has labelled the node with its host. Only with --mode=node.")
	fs.StringVar(&opts.DeviceRoot, "device-root", "",
		"Root of the device tree in which the node plugin finds attached disks by serial (<root>/sys/block, <root>/dev); empty for /. Only with --mode=node.")
	fs.StringVar(&opts.GuestKubeconfig, "kubeconfig", "",
		"Kubeconfig of the guest cluster; empty for the in-cluster configuration.")
	fs.Float32Var(&opts.KubeAPIQPS, "kube-api-qps", 20, "Queries per second to each apiserver.")
	fs.IntVar(&opts.KubeAPIBurst, "kube-api-burst", 40, "Burst of queries to each apiserver.")
	fs.StringVar(&opts.ClusterName, "cluster-name", "",
		"Name of the guest cluster's Cluster API Cluster in the management namespace. Required with --mode=controller.")
	fs.StringVar(&opts.ClusterUID, "cluster-uid", "",
		"UID of that Cluster: management objects are named and labelled with it. Required with --mode=controller.")
	fs.StringVar(&opts.Mgmt.Kubeconfig, "mgmt-kubeconfig", "",
		"Kubeconfig of the management cluster, whose context names the guest's namespace; reread when it changes. Controller mode; or --mgmt-credentials-dir.")
	fs.StringVar(&opts.Mgmt.Dir, "mgmt-credentials-dir", "",
		"Directory with a management token, ca.crt and namespace (a projected ServiceAccount token), reread when they change. Controller mode; needs --mgmt-server.")
	fs.StringVar(&opts.Mgmt.Server, "mgmt-server", "", "URL of the management apiserver, with --mgmt-credentials-dir.")
	fs.StringVar(&opts.Mgmt.Namespace, "mgmt-namespace", "", "Namespace of the guest in the management cluster, if not the credential's.")
	fs.DurationVar(&opts.CredentialPoll, "mgmt-credentials-poll", 10*time.Second, "How often the management credential is reread to pick up a rotation.")
	fs.StringVar(&opts.StorageClass, "default-mgmt-storage-class", "",
		"Management StorageClass of volumes whose guest StorageClass has no mgmtStorageClass parameter; empty for the management cluster's default class.")
	fs.StringVar(&opts.SnapshotClass, "default-mgmt-snapshot-class", "",
		"Management VolumeSnapshotClass of snapshots whose guest class has no mgmtSnapshotClass parameter; empty for the management cluster's default.")
	fs.StringVar(&opts.CapacityNamespace, "mgmt-capacity-namespace", "pvbridge-system",
		"Namespace of the management cluster where mgmt-csi publishes CSIStorageCapacity objects. Controller mode.")
	command.Main(fs, "guest-csi", version, fmt.Sprintf("CSI driver %s.", driver.Name), func(ctx context.Context) error {
		ctrl.SetLogger(klog.Background())
		d, err := driver.New(opts)
		if err != nil {
			return err
		}
		return d.Run(ctx)
	})
}
