package hostagent

import (
	"github.com/prometheus/client_golang/prometheus"
	"sigs.k8s.io/controller-runtime/pkg/metrics"
)

// forcedOff counts the VMs forced off because their guest did not release its disks within the
// unplug timeout (the alert PvbridgeVMForcedOff, manifests/components/monitoring): a guest that
// ignores hot-unplug, which its cluster's admin must look at.
var forcedOff = prometheus.NewCounterVec(prometheus.CounterOpts{
	Name: "pvbridge_vm_forced_off_total",
	Help: "VirtualMachines forced off because their guest did not release its disks within the unplug timeout.",
}, []string{"namespace", "vm"})

func init() {
	metrics.Registry.MustRegister(forcedOff)
}
