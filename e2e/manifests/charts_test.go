package manifests

import (
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	. "github.com/onsi/gomega"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"

	"pvbridge.io/e2e/charts"
	"pvbridge.io/pkg/testenv"
)

// TestHelmChartValues renders each chart (charts/, generated from the overlays; make verify
// proves that its defaults make the overlay's objects) with the pinned helm and every value an
// admin sets: each image from a mirror, a workload's extra arguments after the shipped ones,
// the chart's settings in its ConfigMap (the management one's name, a hash of the value,
// changes with it and the controller reads the new one), per-workload replicas, node selector,
// resources, tolerations and priority class, pull secrets, and the snapshot-controller left out;
// a workload it does not have is refused; and a release into another namespace than
// pvbridge-system fails with the command to use.
func TestHelmChartValues(t *testing.T) {
	bin, err := testenv.BinDir()
	NewWithT(t).Expect(err).NotTo(HaveOccurred())
	helm := filepath.Join(bin, "helm")
	render := func(g Gomega, chart string, args ...string) (map[string]*appsv1.DaemonSet, map[string]*appsv1.Deployment, map[string]*corev1.ConfigMap) {
		out, err := exec.Command(helm, append([]string{"template", "pvbridge", filepath.Join("..", "..", "charts", chart), "--namespace", charts.Namespace}, args...)...).CombinedOutput()
		g.Expect(err).NotTo(HaveOccurred(), "helm template:\n%s", out)
		daemonSets, deployments, configMaps := map[string]*appsv1.DaemonSet{}, map[string]*appsv1.Deployment{}, map[string]*corev1.ConfigMap{}
		for _, doc := range strings.Split(string(out), "\n---\n") {
			var meta struct{ Kind string }
			g.Expect(yaml.Unmarshal([]byte(doc), &meta)).To(Succeed())
			switch meta.Kind {
			case "DaemonSet":
				ds := &appsv1.DaemonSet{}
				g.Expect(yaml.UnmarshalStrict([]byte(doc), ds)).To(Succeed())
				daemonSets[ds.Name] = ds
			case "Deployment":
				d := &appsv1.Deployment{}
				g.Expect(yaml.UnmarshalStrict([]byte(doc), d)).To(Succeed())
				deployments[d.Name] = d
			case "ConfigMap":
				cm := &corev1.ConfigMap{}
				g.Expect(yaml.UnmarshalStrict([]byte(doc), cm)).To(Succeed())
				configMaps[cm.Name] = cm
			}
		}
		return daemonSets, deployments, configMaps
	}
	tests := []struct {
		chart, workload string
		// deployment and its container get workload values.
		deployment, container string
		set                   []string
		// configMap is the ConfigMap of the settings (its name's prefix), want its data.
		configMap string
		want      map[string]string
	}{
		{
			chart: "pvbridge-management", workload: "mgmt-csi-node", deployment: "vm-operator-controller", container: "vm-operator",
			set:       []string{"mgmtServer=https://mgmt.example.com:6443"},
			configMap: "pvbridge-tenants-", want: map[string]string{"mgmt-server": "https://mgmt.example.com:6443"},
		},
		{
			chart: "pvbridge-guest", workload: "guest-csi-node", deployment: "guest-csi-controller", container: "guest-csi",
			set:       []string{"clusterName=alpha", "clusterUID=6b1bd1b7-4a4c-4bb0-a3a5-4b1f5f0fd6a1"},
			configMap: "pvbridge-cluster", want: map[string]string{"cluster-name": "alpha", "cluster-uid": "6b1bd1b7-4a4c-4bb0-a3a5-4b1f5f0fd6a1"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.chart, func(t *testing.T) {
			g := NewWithT(t)
			// The defaults are the overlay's placeholders, which the chart's schema refuses.
			defaultDaemonSets, _, defaultConfigMaps := render(g, tt.chart, "--skip-schema-validation")
			var settingArgs []string
			for _, s := range tt.set {
				settingArgs = append(settingArgs, "--set", s)
			}
			args := append([]string{"--set", "imageRegistry=mirror.example.com:5000", "--set-json", `extraArgs={"` + tt.workload + `":["--v=5"]}`}, settingArgs...)
			daemonSets, deployments, configMaps := render(g, tt.chart, args...)

			var pods []corev1.PodSpec
			for _, ds := range daemonSets {
				pods = append(pods, ds.Spec.Template.Spec)
			}
			for _, d := range deployments {
				pods = append(pods, d.Spec.Template.Spec)
			}
			g.Expect(pods).NotTo(BeEmpty())
			for _, pod := range pods {
				for _, c := range append(pod.InitContainers, pod.Containers...) {
					g.Expect(c.Image).To(HavePrefix("mirror.example.com:5000/"), c.Name)
				}
			}

			g.Expect(daemonSets).To(HaveKey(tt.workload))
			shipped := defaultDaemonSets[tt.workload].Spec.Template.Spec.Containers[0].Args
			g.Expect(daemonSets[tt.workload].Spec.Template.Spec.Containers[0].Args).To(Equal(append(shipped, "--v=5")))

			cm := settings(g, configMaps, tt.configMap)
			for k, v := range tt.want {
				g.Expect(cm.Data).To(HaveKeyWithValue(k, v))
			}
			if strings.HasSuffix(tt.configMap, "-") { // named after a hash of its data
				g.Expect(cm.Name).NotTo(Equal(settings(g, defaultConfigMaps, tt.configMap).Name))
				for _, d := range deployments {
					for _, c := range d.Spec.Template.Spec.Containers {
						for _, env := range c.Env {
							if ref := env.ValueFrom; ref != nil && ref.ConfigMapKeyRef != nil && strings.HasPrefix(ref.ConfigMapKeyRef.Name, tt.configMap) {
								g.Expect(ref.ConfigMapKeyRef.Name).To(Equal(cm.Name), "%s reads the new ConfigMap", d.Name)
							}
						}
					}
				}
			}

			// Per workload: replicas, a node selector and one container's resources on a
			// Deployment, tolerations and a priority class on a DaemonSet; pull secrets on every
			// pod; no snapshot-controller.
			daemonSets, deployments, _ = render(g, tt.chart, append([]string{
				"--set-json", `workloads={"` + tt.deployment + `":{"replicas":3,"nodeSelector":{"example.com/pool":"infra"},"resources":{"` + tt.container + `":{"limits":{"memory":"1Gi"}}}},` +
					`"` + tt.workload + `":{"tolerations":[{"key":"example.com/pmem","operator":"Exists"}],"priorityClassName":"pmem-critical"}}`,
				"--set-json", `imagePullSecrets=[{"name":"mirror-credentials"}]`, "--set", "snapshotController=false",
			}, settingArgs...)...)
			d := deployments[tt.deployment]
			g.Expect(d.Spec.Replicas).To(HaveValue(BeEquivalentTo(3)))
			g.Expect(d.Spec.Template.Spec.NodeSelector).To(Equal(map[string]string{"example.com/pool": "infra"}))
			for _, c := range d.Spec.Template.Spec.Containers {
				if c.Name == tt.container {
					g.Expect(c.Resources.Limits.Memory().String()).To(Equal("1Gi"))
					g.Expect(c.Resources.Requests).To(BeEmpty(), "the value replaces the shipped resources")
				} else {
					g.Expect(c.Resources.Limits).NotTo(BeEmpty(), "%s keeps its shipped resources", c.Name)
				}
			}
			ds := daemonSets[tt.workload].Spec.Template.Spec
			g.Expect(ds.Tolerations).To(Equal([]corev1.Toleration{{Key: "example.com/pmem", Operator: corev1.TolerationOpExists}}))
			g.Expect(ds.PriorityClassName).To(Equal("pmem-critical"))
			for _, w := range deployments {
				g.Expect(w.Spec.Template.Spec.ImagePullSecrets).To(Equal([]corev1.LocalObjectReference{{Name: "mirror-credentials"}}), w.Name)
			}
			g.Expect(deployments).NotTo(HaveKey("snapshot-controller"))
			_, withController, _ := render(g, tt.chart, settingArgs...)
			g.Expect(withController).To(HaveKey("snapshot-controller"), "installed by default")

			// A workload the chart does not have is refused, by name.
			out, err := exec.Command(helm, append([]string{"template", "pvbridge", filepath.Join("..", "..", "charts", tt.chart), "--namespace", charts.Namespace,
				"--set-json", `workloads={"mgmt-csi-nodes":{"replicas":2}}`}, settingArgs...)...).CombinedOutput()
			g.Expect(err).To(HaveOccurred())
			g.Expect(string(out)).To(ContainSubstring("mgmt-csi-nodes"))

			out, err = exec.Command(helm, append([]string{"template", "pvbridge", filepath.Join("..", "..", "charts", tt.chart), "--namespace", "default"}, settingArgs...)...).CombinedOutput()
			g.Expect(err).To(HaveOccurred())
			g.Expect(string(out)).To(ContainSubstring("helm install --namespace pvbridge-system --create-namespace"))
		})
	}
}

// settings is the one ConfigMap whose name starts with prefix.
func settings(g Gomega, configMaps map[string]*corev1.ConfigMap, prefix string) *corev1.ConfigMap {
	var found []*corev1.ConfigMap
	for name, cm := range configMaps {
		if strings.HasPrefix(name, prefix) {
			found = append(found, cm)
		}
	}
	g.Expect(found).To(HaveLen(1), "ConfigMaps named %s*", prefix)
	return found[0]
}
