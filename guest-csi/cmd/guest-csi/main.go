// Command guest-csi is the CSI driver guest.csi.pvbridge.io. Its controller mirrors the volumes
// of a guest cluster into PersistentVolumeClaims of the management cluster and attaches them to
// the guest's VirtualMachines; its node plugin, on every guest node, finds an attached disk by
// its serial and mounts it.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/spf13/pflag"
	"k8s.io/component-base/featuregate"
	"k8s.io/component-base/logs"
	logsapi "k8s.io/component-base/logs/api/v1"
	"k8s.io/klog/v2"

	"pvbridge.io/guest-csi/internal/driver"
)

// version is set at build time with -ldflags "-X main.version=<version>".
var version = "devel"

func main() {
	opts := driver.Options{Version: version}
	logging := logsapi.NewLoggingConfiguration()
	features := featuregate.NewFeatureGate()
	if err := logsapi.AddFeatureGates(features); err != nil {
		panic(err) // only fails when a gate is added twice
	}

	fs := pflag.NewFlagSet(os.Args[0], pflag.ExitOnError)
	fs.StringVar(&opts.Endpoint, "endpoint", "unix:///csi/csi.sock",
		"CSI socket to serve, as unix:///absolute/path or an absolute path. A stale socket left by a previous run is replaced.")
	fs.StringVar((*string)(&opts.Mode), "mode", "",
		`Services to serve: "controller" (beside the CSI sidecars, one per guest cluster) or "node" (on every guest node). Required.`)
	fs.StringVar(&opts.NodeID, "node-id", "",
		"Name of this guest node, which is also the name of its VirtualMachine in the management cluster; usually the pod's spec.nodeName. Required with --mode=node.")
	fs.StringVar(&opts.KubeletRegistrationDir, "kubelet-registration-dir", "",
		"Kubelet's plugin registration directory, usually /var/lib/kubelet/plugins_registry. When set, the node plugin registers itself with kubelet there, in place of node-driver-registrar. Only with --mode=node.")
	logsapi.AddFlags(logging, fs)
	features.AddFlag(fs)
	fs.Usage = func() {
		fmt.Fprintf(os.Stderr, "Usage: %s [flags]\n\nCSI driver %s, version %s.\n\nFlags:\n", os.Args[0], driver.Name, version)
		fs.PrintDefaults()
	}
	_ = fs.Parse(os.Args[1:]) // ExitOnError: Parse exits on a bad flag.
	if fs.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "unexpected arguments: %v\n", fs.Args())
		fs.Usage()
		os.Exit(2)
	}

	logs.InitLogs()
	if err := logsapi.ValidateAndApply(logging, features); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, opts)
	stop()
	if err != nil {
		klog.Background().Error(err, "guest-csi failed")
		klog.FlushAndExit(klog.ExitFlushTimeout, 1)
	}
	logs.FlushLogs()
}

func run(ctx context.Context, opts driver.Options) error {
	d, err := driver.New(opts)
	if err != nil {
		return err
	}
	return d.Run(ctx)
}
