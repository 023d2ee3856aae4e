package manifests

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"testing"

	. "github.com/onsi/gomega"
	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"sigs.k8s.io/yaml"

	"pvbridge.io/e2e/monitoring"
	"pvbridge.io/pkg/testenv"
)

// metricsLabel marks the Services that manifests/components/monitoring's ServiceMonitor scrapes.
const metricsLabel = "pvbridge.io/metrics"

// monitoringDir is the optional monitoring component.
var monitoringDir = filepath.Join(manifestsDir, "components", "monitoring")

// TestMetricsServicesReachEveryComponent: in every overlay, each container port that serves
// metrics (the components' `metrics`, the sidecars' and snapshot-controller's HTTP endpoints) is
// a port of a metrics Service that selects its pods, and each metrics Service's port names a
// container port of the pods it selects; the ServiceMonitor scrapes every port those Services
// name.
func TestMetricsServicesReachEveryComponent(t *testing.T) {
	g := NewWithT(t)
	monitor := &monitoringv1.ServiceMonitor{}
	strictDecode(g, filepath.Join(monitoringDir, "servicemonitor.yaml"), monitor)
	scraped := map[string]bool{}
	for _, e := range monitor.Spec.Endpoints {
		scraped[e.Port] = true
	}
	g.Expect(monitor.Spec.Selector.MatchLabels).To(Equal(map[string]string{metricsLabel: "true"}))

	servesMetrics := func(p corev1.ContainerPort) bool {
		return slices.Contains([]string{"metrics", "provisioner", "attacher", "resizer", "snapshotter", "http"}, p.Name)
	}
	for _, overlay := range []string{"management", "guest", "capi-provider"} {
		t.Run(overlay, func(t *testing.T) {
			g := NewWithT(t)
			_, objs := build(t.Context(), g, filepath.Join(manifestsDir, "overlays", overlay))
			type pods struct {
				name   string
				labels labels.Set
				ports  []corev1.ContainerPort
			}
			var workloads []pods
			var services []*corev1.Service
			for _, obj := range objs {
				switch obj.GetKind() {
				case "Deployment":
					d := &appsv1.Deployment{}
					fromUnstructured(g, obj, d)
					workloads = append(workloads, pods{objectKey(obj), d.Spec.Template.Labels, containerPorts(d.Spec.Template.Spec)})
				case "DaemonSet":
					d := &appsv1.DaemonSet{}
					fromUnstructured(g, obj, d)
					workloads = append(workloads, pods{objectKey(obj), d.Spec.Template.Labels, containerPorts(d.Spec.Template.Spec)})
				case "Service":
					if obj.GetLabels()[metricsLabel] == "true" {
						s := &corev1.Service{}
						fromUnstructured(g, obj, s)
						services = append(services, s)
					}
				}
			}
			g.Expect(services).NotTo(BeEmpty())
			for _, s := range services {
				var selected []pods
				for _, w := range workloads {
					if labels.SelectorFromSet(s.Spec.Selector).Matches(w.labels) {
						selected = append(selected, w)
					}
				}
				g.Expect(selected).To(HaveLen(1), "Service %s/%s selects the pods of one workload", s.Namespace, s.Name)
				g.Expect(s.Spec.ClusterIP).To(Equal(corev1.ClusterIPNone), "Service %s: headless, every pod scraped", s.Name)
				for _, p := range s.Spec.Ports {
					g.Expect(scraped).To(HaveKey(p.Name), "Service %s port %s is scraped by the ServiceMonitor", s.Name, p.Name)
					g.Expect(selected[0].ports).To(ContainElement(HaveField("Name", p.TargetPort.StrVal)),
						"Service %s port %s targets a named port of %s", s.Name, p.Name, selected[0].name)
				}
			}
			for _, w := range workloads {
				for _, p := range w.ports {
					if !servesMetrics(p) {
						continue
					}
					g.Expect(services).To(ContainElement(SatisfyAll(
						WithTransform(func(s *corev1.Service) bool { return labels.SelectorFromSet(s.Spec.Selector).Matches(w.labels) }, BeTrue()),
						HaveField("Spec.Ports", ContainElement(HaveField("TargetPort.StrVal", p.Name))),
					)), "port %s of %s is in a metrics Service", p.Name, w.name)
				}
			}
		})
	}
}

// TestAlertRules runs `promtool check rules` and `promtool test rules` on the PrometheusRule's
// groups with rules_test.yaml: each alert fires on its condition, after its `for`, with its
// labels and annotations, and not on what is normal.
func TestAlertRules(t *testing.T) {
	g := NewWithT(t)
	promtool := promtool(g)
	rule := &monitoringv1.PrometheusRule{}
	strictDecode(g, filepath.Join(monitoringDir, "rules.yaml"), rule)
	groups, err := yaml.Marshal(rule.Spec)
	g.Expect(err).NotTo(HaveOccurred())
	dir := t.TempDir()
	g.Expect(os.WriteFile(filepath.Join(dir, "rules.yaml"), groups, 0o600)).To(Succeed())
	tests, err := os.ReadFile(filepath.Join(monitoringDir, "rules_test.yaml"))
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(os.WriteFile(filepath.Join(dir, "rules_test.yaml"), tests, 0o600)).To(Succeed())

	// Every alert has a test that expects it to fire.
	var cases struct {
		Tests []struct {
			AlertRuleTest []struct {
				Alertname string            `json:"alertname"`
				ExpAlerts []json.RawMessage `json:"exp_alerts"`
			} `json:"alert_rule_test"`
		} `json:"tests"`
	}
	g.Expect(yaml.Unmarshal(tests, &cases)).To(Succeed())
	fired := map[string]bool{}
	for _, c := range cases.Tests {
		for _, a := range c.AlertRuleTest {
			fired[a.Alertname] = fired[a.Alertname] || len(a.ExpAlerts) > 0
		}
	}
	for _, group := range rule.Spec.Groups {
		for _, r := range group.Rules {
			g.Expect(fired).To(HaveKeyWithValue(r.Alert, true), "rules_test.yaml makes %s fire", r.Alert)
		}
	}

	for _, args := range [][]string{{"check", "rules", "rules.yaml"}, {"test", "rules", "rules_test.yaml"}} {
		cmd := exec.CommandContext(t.Context(), promtool, args...)
		cmd.Dir = dir
		out, err := cmd.CombinedOutput()
		g.Expect(err).NotTo(HaveOccurred(), "promtool %v:\n%s", args, out)
		t.Logf("promtool %v:\n%s", args, out)
	}
}

// promtool is the path of the pinned promtool.
func promtool(g Gomega) string {
	bin, err := testenv.BinDir()
	g.Expect(err).NotTo(HaveOccurred())
	p := filepath.Join(bin, "promtool")
	_, err = os.Stat(p)
	g.Expect(err).NotTo(HaveOccurred(), "promtool is not built: run `make tools`")
	return p
}

// strictDecode reads a YAML file into obj, failing on any field obj's type does not have.
func strictDecode(g Gomega, file string, obj any) {
	data, err := os.ReadFile(file)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(yaml.UnmarshalStrict(data, obj)).To(Succeed(), file)
}

func fromUnstructured(g Gomega, u *unstructured.Unstructured, obj any) {
	g.Expect(runtime.DefaultUnstructuredConverter.FromUnstructuredWithValidation(u.Object, obj, true)).To(Succeed(), objectKey(u))
}

func containerPorts(spec corev1.PodSpec) []corev1.ContainerPort {
	var ports []corev1.ContainerPort
	for _, c := range spec.Containers {
		ports = append(ports, c.Ports...)
	}
	return ports
}

// TestDashboardQueriesParse: every query of the Grafana dashboard (e2e/monitoring) is valid
// PromQL, checked by promtool as the expression of a recording rule (Grafana's $__rate_interval
// read as 5m).
func TestDashboardQueriesParse(t *testing.T) {
	g := NewWithT(t)
	type rule struct {
		Record string `json:"record"`
		Expr   string `json:"expr"`
	}
	var rules []rule
	for i, p := range monitoring.Panels {
		for j, q := range p.Queries {
			rules = append(rules, rule{Record: fmt.Sprintf("pvbridge:panel_%d_%d", i, j), Expr: q.PromQL("5m")})
		}
	}
	file := filepath.Join(t.TempDir(), "dashboard-rules.yaml")
	data, err := yaml.Marshal(map[string]any{"groups": []any{map[string]any{"name": "dashboard", "rules": rules}}})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(os.WriteFile(file, data, 0o600)).To(Succeed())
	out, err := exec.CommandContext(t.Context(), promtool(g), "check", "rules", file).CombinedOutput()
	g.Expect(err).NotTo(HaveOccurred(), "promtool check rules:\n%s", out)
	g.Expect(string(out)).To(ContainSubstring(fmt.Sprintf("SUCCESS: %d rules found", len(rules))))
}

// TestMonitoringComponentBuilds: the monitoring component added to the management and guest
// overlays, as an admin's overlay adds it, brings its ServiceMonitor, its PrometheusRule and the
// dashboard's ConfigMap.
func TestMonitoringComponentBuilds(t *testing.T) {
	component, err := filepath.Abs(monitoringDir)
	NewWithT(t).Expect(err).NotTo(HaveOccurred())
	for _, overlay := range []string{"management", "guest"} {
		t.Run(overlay, func(t *testing.T) {
			g := NewWithT(t)
			dir := t.TempDir()
			base, err := filepath.Abs(filepath.Join(manifestsDir, "overlays", overlay))
			g.Expect(err).NotTo(HaveOccurred())
			rel := func(to string) string {
				p, err := filepath.Rel(dir, to)
				g.Expect(err).NotTo(HaveOccurred())
				return p
			}
			kustomization := fmt.Sprintf("resources: [%s]\ncomponents: [%s]\n", rel(base), rel(component))
			g.Expect(os.WriteFile(filepath.Join(dir, "kustomization.yaml"), []byte(kustomization), 0o600)).To(Succeed())
			_, objs := build(t.Context(), g, dir)
			keys := map[string]*unstructured.Unstructured{}
			for _, obj := range objs {
				keys[objectKey(obj)] = obj
			}
			g.Expect(keys).To(HaveKey("ServiceMonitor/pvbridge-system/pvbridge"))
			g.Expect(keys).To(HaveKey("PrometheusRule/pvbridge-system/pvbridge"))
			g.Expect(keys).To(HaveKey("ConfigMap/pvbridge-system/pvbridge-dashboard"))
			dashboard, err := os.ReadFile(filepath.Join(monitoringDir, "dashboard.json"))
			g.Expect(err).NotTo(HaveOccurred())
			cm := keys["ConfigMap/pvbridge-system/pvbridge-dashboard"]
			g.Expect(cm.GetLabels()).To(HaveKeyWithValue("grafana_dashboard", "1"))
			data, _, err := unstructured.NestedString(cm.Object, "data", "dashboard.json")
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(data).To(Equal(string(dashboard)))
		})
	}
}
