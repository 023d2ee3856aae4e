// Command guest-csi is the CSI driver guest.csi.pvbridge.io. Its controller mirrors the volumes
// of a guest cluster into PersistentVolumeClaims of the management cluster and attaches them to
// the guest's VirtualMachines; its node plugin, on every guest node, finds an attached disk by
// its serial and mounts it.
package main

import (
	"context"
	"fmt"
	"os"

	"github.com/spf13/pflag"

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
	fs.StringVar(&opts.KubeletRegistrationDir, "kubelet-registration-dir", "",
		"Kubelet's plugin registration directory, usually /var/lib/kubelet/plugins_registry. When set, the node plugin registers itself with kubelet there, in place of node-driver-registrar. Only with --mode=node.")
	command.Main(fs, "guest-csi", fmt.Sprintf("CSI driver %s, version %s.", driver.Name, version), func(ctx context.Context) error {
		d, err := driver.New(opts)
		if err != nil {
			return err
		}
		return d.Run(ctx)
	})
}
