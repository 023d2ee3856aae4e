// Command mgmt-csi is the CSI driver pmem.csi.pvbridge.io of the management cluster. Its central
// controller records volumes and snapshots as PmemVolume and PmemSnapshot objects; its node agent,
// one per host, carves them from the host's persistent memory and stages and publishes them.
package main

import (
	"context"
	"fmt"
	"os"
	"time"

	"github.com/spf13/pflag"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/klog/v2"
	ctrl "sigs.k8s.io/controller-runtime"

	"pvbridge.io/mgmt-csi/internal/driver"
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
		`Services to serve: "controller" (the central controller, beside the CSI sidecars) or "node" (the node agent, one per host). Required.`)
	fs.StringVar(&opts.NodeID, "node-id", "",
		"Name of this host's Kubernetes Node; usually the pod's spec.nodeName. Required with --mode=node.")
	fs.StringVar(&opts.HealthAddress, "health-address", "",
		`host:port to serve /healthz on, e.g. ":9808": it calls the driver's CSI Probe through its socket, in place of the livenessprobe sidecar; empty for none.`)
	fs.StringVar(&opts.KubeletRegistrationDir, "kubelet-registration-dir", "",
		"Kubelet's plugin registration directory, usually /var/lib/kubelet/plugins_registry. When set, the node plugin registers itself with kubelet there, in place of node-driver-registrar. Only with --mode=node.")
	fs.Int64Var(&opts.MaxVolumesPerNode, "max-volumes-per-node", 0,
		"How many volumes the scheduler may place on this host, as NodeGetInfo reports it; 0 means no limit. Only with --mode=node.")
	fs.StringVar(&opts.Kubeconfig, "kubeconfig", "",
		"Kubeconfig of the management cluster; empty means the in-cluster configuration of the pod's service account.")
	fs.Float32Var(&opts.KubeAPIQPS, "kube-api-qps", 50, "Queries per second to the Kubernetes API.")
	fs.IntVar(&opts.KubeAPIBurst, "kube-api-burst", 100, "Burst of queries to the Kubernetes API.")
	fs.BoolVar(&opts.LeaderElection, "leader-election", false,
		"Controller: run the reconciler of replicated volumes in one controller of several, chosen by the Lease pvbridge-mgmt-csi-controller (every one serves its sidecars). Only with --mode=controller.")
	fs.StringVar(&opts.LeaderElectionNamespace, "leader-election-namespace", "",
		"Namespace of the leader election Lease; empty for the pod's namespace (required outside a cluster).")
	fs.StringVar(&opts.MetricsAddress, "metrics-address", "0",
		`Address to serve Prometheus metrics on (CSI RPC latency and errors by method and code), e.g. ":8080"; "0" turns them off.`)
	fs.StringVar((*string)(&opts.PmemMode), "pmem-mode", "",
		`PMEM back end of the node agent: "file" (sparse files on a DAX filesystem, exposed as loop devices), "lvm" (a volume group per PMEM region) or "ndctl" (a namespace per volume). Required with --mode=node.`)
	fs.StringVar(&opts.Pmem.File.Dir, "pmem-dir", "",
		"File mode: directory on the PMEM filesystem (in production a DAX-mounted fsdax namespace) that holds the volumes.")
	fs.Var(quantity{&opts.Pmem.File.Capacity}, "pmem-capacity",
		`File mode: PMEM to hand out, as a quantity ("64Gi"); empty means the size of the filesystem of --pmem-dir.`)
	fs.StringSliceVar(&opts.Pmem.LVM.VolumeGroups, "lvm-volume-groups", nil,
		"LVM mode: the volume groups to carve volumes from, one per PMEM region.")
	fs.StringSliceVar(&opts.Pmem.Ndctl.Regions, "ndctl-regions", nil,
		"ndctl mode: the PMEM regions to use (e.g. region0); empty means every PMEM region.")
	fs.StringVar(&opts.Replication.Address, "replica-address", "",
		"host:port on which this host's replica server serves its replicas of replicated volumes to the other hosts' agents; reachable from them, never from guests. Empty: the host holds no replica. Only with --mode=node.")
	fs.StringVar(&opts.Replication.KeysDir, "replica-keys-dir", "",
		`Directory holding keys.psk ("pvbridge:<hex key>"), the pre-shared key with which the hosts' agents reach each other's replica servers; mount it from a Secret that only the node agents read. Empty: the host takes no part in replicated volumes. Only with --mode=node.`)
	fs.StringVar(&opts.Replication.RunDir, "run-dir", "/run/pvbridge/mgmt-csi",
		"Directory of the host's qemu-storage-daemons (the replica server and the targets of replicated volumes attached here); short, for their sockets. Only with --mode=node.")
	fs.StringVar(&opts.Replication.Daemons.NetNS, "daemon-netns", "",
		"Network namespace file in which the qemu-storage-daemons run, e.g. /proc/1/ns/net (the host's, with hostPID), so that the replica server and the targets' connections outlive the pod's network; empty for the agent's. Only with --mode=node.")
	fs.StringVar(&opts.Replication.Daemons.CgroupParent, "daemon-cgroup-parent", "",
		"Cgroup, relative to --cgroup-root, below which each qemu-storage-daemon gets a cgroup of its own, out of the agent container's, which the container runtime kills when it stops the container; empty leaves them in the agent's. Only with --mode=node.")
	fs.StringVar(&opts.Replication.Daemons.CgroupRoot, "cgroup-root", "/sys/fs/cgroup",
		"The host's cgroup filesystem, for --daemon-cgroup-parent. Only with --mode=node.")
	fs.DurationVar(&opts.Replication.RebuildInterval, "rebuild-interval", 10*time.Second,
		"How often the node agent looks for replicas to copy a volume into (a replaced or moved one) and for replicas of drained hosts to take out of the volumes it serves. Only with --mode=node.")
	command.Main(fs, "mgmt-csi", version, fmt.Sprintf("CSI driver %s.", driver.Name), func(ctx context.Context) error {
		ctrl.SetLogger(klog.NewKlogr())
		d, err := driver.New(opts)
		if err != nil {
			return err
		}
		return d.Run(ctx)
	})
}

// quantity is a flag holding a Kubernetes quantity ("64Gi") as bytes.
type quantity struct{ bytes *int64 }

func (q quantity) String() string {
	if q.bytes == nil || *q.bytes == 0 {
		return ""
	}
	return resource.NewQuantity(*q.bytes, resource.BinarySI).String()
}

func (q quantity) Set(s string) error {
	v, err := resource.ParseQuantity(s)
	if err != nil {
		return err
	}
	*q.bytes = v.Value()
	return nil
}

func (quantity) Type() string { return "quantity" }
