package deploy

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/prometheus/client_golang/api"
	promv1 "github.com/prometheus/client_golang/api/prometheus/v1"
	"sigs.k8s.io/yaml"

	"pvbridge.io/e2e/cluster"
)

// Prometheus is the lab's Prometheus server (hack/build-tools.sh prometheus), a process of the
// lab on 127.0.0.1. It scrapes what the monitoring component's ServiceMonitor selects in every
// cluster it is given (the Services labelled pvbridge.io/metrics, their metrics and sidecar
// ports, with the labels the Prometheus Operator gives such targets, honouring the metrics' own,
// and the cluster's name as label cluster) through Kubernetes service discovery with the cluster's kubeconfig, and
// evaluates the component's PrometheusRule. Pods are reached at their addresses on the lab's
// bridges, as a Prometheus in the cluster reaches them.
type Prometheus struct {
	// Address is the server's host:port: its HTTP API (built from the module proxy, it has no
	// web UI, whose assets are built with npm).
	Address string
	// API queries it.
	API promv1.API
}

// ScrapeInterval is how often the lab's Prometheus scrapes and evaluates its rules: short, so
// that a test sees a condition within seconds; rates over a 5m window need two samples.
const ScrapeInterval = 5 * time.Second

// StartPrometheus starts the lab's Prometheus scraping clusters (by the name given as label
// cluster) and returns once it serves.
func StartPrometheus(ctx context.Context, lab *cluster.Lab, clusters map[string]*cluster.ControlPlane) (*Prometheus, error) {
	bin, err := lab.Binaries().Tool("prometheus")
	if err != nil {
		return nil, err
	}
	dir := filepath.Join(lab.Root, "prometheus")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	rules, err := ruleGroups(filepath.Join(lab.Binaries().Repo, "manifests", "components", "monitoring", "rules.yaml"))
	if err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(dir, "rules.yaml"), rules, 0o644); err != nil {
		return nil, err
	}
	config, err := prometheusConfig(clusters)
	if err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(dir, "prometheus.yaml"), config, 0o644); err != nil {
		return nil, err
	}
	ports, err := cluster.FreePorts(1)
	if err != nil {
		return nil, err
	}
	address := fmt.Sprintf("127.0.0.1:%d", ports[0])
	p, err := lab.Start(cluster.Command{
		Name: "prometheus", Bin: bin, Dir: dir, LogPath: filepath.Join(dir, "prometheus.log"), Restart: true,
		Args: []string{
			"--config.file=" + filepath.Join(dir, "prometheus.yaml"),
			"--storage.tsdb.path=" + filepath.Join(dir, "data"),
			"--web.listen-address=" + address,
		},
	})
	if err != nil {
		return nil, err
	}
	if err := cluster.WaitHTTPReady(ctx, time.Minute, "http://"+address+"/-/ready"); err != nil {
		return nil, fmt.Errorf("prometheus: %w (log: %s)", err, p.LogPath)
	}
	c, err := api.NewClient(api.Config{Address: "http://" + address})
	if err != nil {
		return nil, err
	}
	return &Prometheus{Address: address, API: promv1.NewAPI(c)}, nil
}

// ruleGroups is the groups of the PrometheusRule in file as a Prometheus rule file.
func ruleGroups(file string) ([]byte, error) {
	data, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	var rule struct {
		Spec struct {
			Groups []any `json:"groups"`
		} `json:"spec"`
	}
	if err := yaml.Unmarshal(data, &rule); err != nil {
		return nil, fmt.Errorf("%s: %w", file, err)
	}
	if len(rule.Spec.Groups) == 0 {
		return nil, fmt.Errorf("%s: no rule groups", file)
	}
	return yaml.Marshal(map[string]any{"groups": rule.Spec.Groups})
}

// prometheusConfig is the configuration of the lab's Prometheus: one job per cluster, doing what
// the ServiceMonitor asks of the Prometheus Operator.
func prometheusConfig(clusters map[string]*cluster.ControlPlane) ([]byte, error) {
	interval := ScrapeInterval.String()
	var jobs []any
	for name, cp := range clusters {
		jobs = append(jobs, map[string]any{
			"job_name": name, "honor_labels": true,
			"kubernetes_sd_configs": []any{map[string]any{
				"role": "endpointslice", "kubeconfig_file": cp.Kubeconfig,
				"namespaces": map[string]any{"names": []string{InstallNamespace, capiProviderNamespace}},
			}},
			"relabel_configs": []any{
				// The ServiceMonitor's selector and endpoints.
				keep("__meta_kubernetes_service_label_pvbridge_io_metrics", "true"),
				keep("__meta_kubernetes_endpointslice_port_name", "metrics|provisioner|attacher|resizer|snapshotter"),
				// The Prometheus Operator's target labels.
				copyLabel("__meta_kubernetes_namespace", "namespace"),
				copyLabel("__meta_kubernetes_service_name", "service"),
				copyLabel("__meta_kubernetes_service_name", "job"),
				copyLabel("__meta_kubernetes_pod_name", "pod"),
				copyLabel("__meta_kubernetes_pod_container_name", "container"),
				copyLabel("__meta_kubernetes_endpointslice_port_name", "endpoint"),
				map[string]any{"target_label": "cluster", "replacement": name},
			},
		})
	}
	return yaml.Marshal(map[string]any{
		"global":         map[string]any{"scrape_interval": interval, "evaluation_interval": interval},
		"rule_files":     []string{"rules.yaml"},
		"scrape_configs": jobs,
	})
}

func keep(label, regex string) map[string]any {
	return map[string]any{"source_labels": []string{label}, "regex": regex, "action": "keep"}
}

func copyLabel(from, to string) map[string]any {
	return map[string]any{"source_labels": []string{from}, "target_label": to}
}
