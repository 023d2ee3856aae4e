package agent

import (
	"github.com/prometheus/client_golang/prometheus"
	"sigs.k8s.io/controller-runtime/pkg/metrics"
)

// The node's PMEM as NodeReporter last read it from the back end, served with controller-runtime's
// metrics: what an operator watches to add capacity before CreateVolume answers ResourceExhausted
// (the alert PvbridgePmemNearlyFull, manifests/components/monitoring).
var (
	pmemTotalBytes = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "pvbridge_pmem_total_bytes",
		Help: "PMEM the node's back end manages, in bytes.",
	}, []string{"node"})
	pmemFreeBytes = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "pvbridge_pmem_free_bytes",
		Help: "PMEM of the node not allocated to volumes or snapshots, in bytes.",
	}, []string{"node"})
)

func init() {
	metrics.Registry.MustRegister(pmemTotalBytes, pmemFreeBytes)
}
