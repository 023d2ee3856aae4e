package hostagent

import (
	"context"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/metrics"

	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
)

// forcedOff counts the VMs forced off because their guest did not release its disks within the
// unplug timeout (the alert PvbridgeVMForcedOff, manifests/components/monitoring): a guest that
// ignores hot-unplug, which its cluster's admin must look at.
var forcedOff = prometheus.NewCounterVec(prometheus.CounterOpts{
	Name: "pvbridge_vm_forced_off_total",
	Help: "VirtualMachines forced off because their guest did not release its disks within the unplug timeout.",
}, []string{"namespace", "vm"})

// writesHeld is how long the host agent held the writes of VMs while a group snapshot cut
// their volumes (hold.go): the guests' I/O stalls that long.
var writesHeld = prometheus.NewHistogram(prometheus.HistogramOpts{
	Name:    "pvbridge_vm_writes_held_seconds",
	Help:    "How long the host agent held the writes of VirtualMachines while a group snapshot cut their volumes.",
	Buckets: prometheus.ExponentialBuckets(0.001, 4, 8), // 1 ms to 16 s
})

func init() {
	metrics.Registry.MustRegister(forcedOff, writesHeld)
}

var volumesDesc = prometheus.NewDesc("pvbridge_vm_volumes",
	"Volumes attached to the VirtualMachines of the host, per namespace (a tenant's guest clusters).",
	[]string{"node", "namespace"}, nil)

// volumesCollector counts, at each scrape, the attached volumes in the status of the VMs on
// node, from the agent's cache (which holds this host's VMs): a count kept in the reconciler
// would have to follow every VM's deletion and move, this one is always what the cache says.
type volumesCollector struct {
	reader client.Reader
	node   string
}

func (c *volumesCollector) Describe(ch chan<- *prometheus.Desc) { ch <- volumesDesc }

func (c *volumesCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	vms := &vmv1.VirtualMachineList{}
	if err := c.reader.List(ctx, vms); err != nil {
		ch <- prometheus.NewInvalidMetric(volumesDesc, err)
		return
	}
	perNamespace := map[string]int{}
	for _, vm := range vms.Items {
		if vm.Status.Host != c.node {
			continue
		}
		for _, v := range vm.Status.Volumes {
			if v.Attached {
				perNamespace[vm.Namespace]++
			}
		}
	}
	for ns, n := range perNamespace {
		ch <- prometheus.MustNewConstMetric(volumesDesc, prometheus.GaugeValue, float64(n), c.node, ns)
	}
}
