// Package capi_test proves pvbridge in the setting it was made for: a guest cluster that
// Cluster API's own controllers make (core, kubeadm bootstrap and control plane providers, and
// pvbridge's infrastructure provider) from the shipped cluster template, whose Machines are
// VirtualMachines that boot kubeadm in the lab, with pvbridge installed in real containers from
// the overlays in both clusters: the Machine lifecycle with volumes attached, and the storage
// features e2e/suite proves on the process lab. One test runs its steps in order on one such
// lab (deploy.Install with ClusterAPI): two management hosts and a QEMU host, guest cluster
// alpha of one control plane machine and two workers, made by the previous release's provider,
// which a step upgrades with clusterctl, to which the Machine lifecycle steps add a pool of
// workers on host-b, and the QEMU steps a worker on host-q that boots the node image in a QEMU
// VM beside the steps between them.
package capi_test

import (
	"context"
	"flag"
	"os"
	"testing"

	"k8s.io/klog/v2"
	logf "sigs.k8s.io/controller-runtime/pkg/log"

	"pvbridge.io/e2e/cluster"
	"pvbridge.io/e2e/deploy"
	"pvbridge.io/e2e/polling"
)

var (
	// lab and in are the shared lab and what is installed in it.
	lab *cluster.Lab
	in  *deploy.Installed
)

func TestMain(m *testing.M) {
	polling.Set()
	flag.Parse()
	logf.SetLogger(klog.Background()) // deploy's controller-runtime clients log through klog
	os.Exit(cluster.RunTests(m, func(ctx context.Context, l *cluster.Lab) error {
		lab = l
		previous, err := deploy.PreviousRelease(ctx, lab)
		if err != nil {
			return err
		}
		in, err = deploy.Install(ctx, lab, deploy.InstalledOptions{
			Hosts: []string{"host-a", "host-b", qemuHost}, PmemSize: 16 << 30,
			ClusterAPI: true, Workers: 2, QEMUHost: qemuHost, Previous: previous,
			Guest: deploy.GuestOptions{Name: "alpha", Namespace: "tenant-a"},
		})
		return err
	}))
}
