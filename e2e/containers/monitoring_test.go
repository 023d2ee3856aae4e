package containers_test

import (
	"context"
	"math"
	"slices"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	promv1 "github.com/prometheus/client_golang/api/prometheus/v1"
	"github.com/prometheus/common/model"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"

	"pvbridge.io/e2e/cluster"
	"pvbridge.io/e2e/deploy"
	"pvbridge.io/e2e/monitoring"
	"pvbridge.io/pkg/names"
)

// TestPrometheusScrapesAlertsAndDashboard runs the lab's Prometheus as the monitoring component
// configures one (every metrics Service of both clusters, the PrometheusRule) and checks it
// against the installed lab: every component is scraped; each alert whose condition a lab can
// make real within minutes becomes active when it is (a refused attach, a host's PMEM filled, a
// tenant's quota used up, and the provisioning it makes fail); and every query of the dashboard returns data.
// An alert is active from its first evaluation that holds (pending) and fires after its `for`;
// the `for` durations, and the alerts no lab makes real in minutes (slow calls, a VM forced
// off, an overdue credential), are what rules_test.yaml proves with promtool.
func TestPrometheusScrapesAlertsAndDashboard(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	gc, mc := in.Guest.Client(), in.Mgmt.Client()
	prom, err := deploy.StartPrometheus(ctx, lab, map[string]*cluster.ControlPlane{"management": in.Mgmt, "guest": in.Guest})
	g.Expect(err).NotTo(HaveOccurred())

	t.Log("every metrics Service of both clusters is scraped, and up")
	want := map[string]bool{}
	for _, c := range []kubernetes.Interface{mc, gc} {
		services, err := c.CoreV1().Services("").List(ctx, metav1.ListOptions{LabelSelector: "pvbridge.io/metrics=true"})
		g.Expect(err).NotTo(HaveOccurred())
		for _, s := range services.Items {
			want[s.Name] = true
		}
	}
	g.Expect(want).To(HaveKey("mgmt-csi-node-metrics"))
	g.Expect(want).To(HaveKey("guest-csi-controller-metrics"))
	g.Eventually(func(g Gomega) {
		targets, err := prom.API.Targets(ctx)
		g.Expect(err).NotTo(HaveOccurred())
		scraped := map[string]bool{}
		for _, target := range targets.Active {
			g.Expect(target.Health).To(Equal(promv1.HealthGood), "%s: %s", target.ScrapeURL, target.LastError)
			scraped[string(target.Labels["job"])] = true
		}
		g.Expect(scraped).To(Equal(want))
	}).WithContext(ctx).WithTimeout(2 * time.Minute).Should(Succeed())

	t.Log("volumes provisioned and attached in both layers, in two rounds a scrape apart, so that rates have two samples")
	ns, err := deploy.CreateNamespace(ctx, gc, "monitoring")
	g.Expect(err).NotTo(HaveOccurred())
	// What the test makes is removed whether it passes or not (the tests after it share the
	// lab), last made first.
	cleanup := func(f func(ctx context.Context) error) { cleanupAfter(t, f) }
	loops, err := cluster.LoopsBelow(lab.Root)
	g.Expect(err).NotTo(HaveOccurred())
	cleanup(func(ctx context.Context) error {
		if err := gc.CoreV1().Namespaces().Delete(ctx, ns, metav1.DeleteOptions{}); err != nil {
			return err
		}
		// Until the management volumes are gone too: their loop devices detached.
		return wait.PollUntilContextCancel(ctx, time.Second, true, func(ctx context.Context) (bool, error) {
			pvcs, err := gc.CoreV1().PersistentVolumeClaims(ns).List(ctx, metav1.ListOptions{})
			if err != nil || len(pvcs.Items) > 0 {
				return false, nil
			}
			now, err := cluster.LoopsBelow(lab.Root)
			return err == nil && len(now) == len(loops), nil
		})
	})
	for i, name := range []string{"first", "second"} {
		_, err = gc.CoreV1().PersistentVolumeClaims(ns).Create(ctx, deploy.PVC(ns, name, "", "64Mi", false), metav1.CreateOptions{})
		g.Expect(err).NotTo(HaveOccurred())
		_, err = gc.CoreV1().Pods(ns).Create(ctx, deploy.Pod(ns, name, name, "", false), metav1.CreateOptions{})
		g.Expect(err).NotTo(HaveOccurred())
		waitRunning(ctx, g, gc, ns, name)
		if i == 0 {
			g.Eventually(func(g Gomega) {
				g.Expect(query(ctx, g, prom, `csi_sidecar_operations_seconds_count{cluster="guest", method_name="/csi.v1.Controller/ControllerPublishVolume", grpc_status_code="OK"}`)).NotTo(BeEmpty())
			}).WithContext(ctx).WithTimeout(time.Minute).Should(Succeed())
		}
	}

	t.Log("a refused attach: a static volume whose management claim does not exist")
	claim := deploy.PVC(ns, "missing", "", "64Mi", false)
	claim.Spec.StorageClassName, claim.Spec.VolumeName = ptr.To(""), ns+"-missing"
	missing := deploy.ImportedPV(claim.Spec.VolumeName, "no-such-volume", "", claim)
	missing.Spec.PersistentVolumeReclaimPolicy = corev1.PersistentVolumeReclaimRetain
	_, err = gc.CoreV1().PersistentVolumes().Create(ctx, missing, metav1.CreateOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	cleanup(func(ctx context.Context) error {
		return gc.CoreV1().PersistentVolumes().Delete(ctx, missing.Name, metav1.DeleteOptions{})
	})
	_, err = gc.CoreV1().PersistentVolumeClaims(ns).Create(ctx, claim, metav1.CreateOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	_, err = gc.CoreV1().Pods(ns).Create(ctx, deploy.Pod(ns, "missing", "missing", "", false), metav1.CreateOptions{})
	g.Expect(err).NotTo(HaveOccurred())

	t.Log("a host filled: a management claim of most of a host's PMEM")
	full := deploy.PVC(metav1.NamespaceDefault, ns+"-fill", "pmem-immediate", fillSize(), false)
	_, err = mc.CoreV1().PersistentVolumeClaims(full.Namespace).Create(ctx, full, metav1.CreateOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	cleanup(func(ctx context.Context) error {
		return mc.CoreV1().PersistentVolumeClaims(full.Namespace).Delete(ctx, full.Name, metav1.DeleteOptions{})
	})

	t.Log("a tenant's quota used up (an admin's quota of as many claims as the tenant has), and so a failing provision: one more guest claim")
	tenant := in.Options.Guest.Namespace
	claims, err := mc.CoreV1().PersistentVolumeClaims(tenant).List(ctx, metav1.ListOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	quota := &corev1.ResourceQuota{
		ObjectMeta: metav1.ObjectMeta{Namespace: tenant, Name: ns},
		Spec: corev1.ResourceQuotaSpec{Hard: corev1.ResourceList{
			corev1.ResourcePersistentVolumeClaims: *resource.NewQuantity(int64(len(claims.Items)), resource.DecimalSI),
		}},
	}
	_, err = mc.CoreV1().ResourceQuotas(tenant).Create(ctx, quota, metav1.CreateOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	cleanup(func(ctx context.Context) error {
		return mc.CoreV1().ResourceQuotas(tenant).Delete(ctx, quota.Name, metav1.DeleteOptions{})
	})
	_, err = gc.CoreV1().PersistentVolumeClaims(ns).Create(ctx, deploy.PVC(ns, "over-quota", "", "64Mi", false), metav1.CreateOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	_, err = gc.CoreV1().Pods(ns).Create(ctx, deploy.Pod(ns, "over-quota", "over-quota", "", false), metav1.CreateOptions{})
	g.Expect(err).NotTo(HaveOccurred())

	t.Log("each alert is active, for the component and the object it names")
	active := map[string]model.LabelSet{
		"PvbridgeAttachFailing":        {"driver_name": names.GuestDriver, "grpc_status_code": "NotFound"},
		"PvbridgeProvisionFailing":     {"driver_name": names.GuestDriver, "grpc_status_code": "ResourceExhausted"},
		"PvbridgePmemNearlyFull":       {"cluster": "management"},
		"PvbridgeTenantQuotaExhausted": {"cluster": "management", "namespace": model.LabelValue(tenant), "resourcequota": model.LabelValue(ns), "resource": "persistentvolumeclaims"},
	}
	g.Eventually(func(g Gomega) {
		alerts, err := prom.API.Alerts(ctx)
		g.Expect(err).NotTo(HaveOccurred())
		var labels []model.LabelSet
		for _, a := range alerts.Alerts {
			if a.State == promv1.AlertStatePending || a.State == promv1.AlertStateFiring {
				labels = append(labels, a.Labels)
			}
		}
		for name, want := range active {
			want = want.Merge(model.LabelSet{model.AlertNameLabel: model.LabelValue(name)})
			g.Expect(slices.ContainsFunc(labels, func(got model.LabelSet) bool {
				return got.Merge(want).Equal(got)
			})).To(BeTrue(), "alert %v is not active; active: %v", want, labels)
		}
	}).WithContext(ctx).WithTimeout(3 * time.Minute).WithPolling(deploy.ScrapeInterval).Should(Succeed())

	t.Log("every query of the dashboard returns data")
	for _, panel := range monitoring.Panels {
		for _, q := range panel.Queries {
			expr := q.PromQL("5m")
			g.Eventually(func(g Gomega) {
				g.Expect(query(ctx, g, prom, expr)).To(ContainElement(HaveField("Value", Not(BeNaN()))), "panel %q: %s", panel.Title, expr)
			}).WithContext(ctx).WithTimeout(time.Minute).Should(Succeed())
		}
	}
}

// fillSize is a claim of 90 % of a lab host's PMEM: past the alert's 85 % on the host it lands on.
// cleanupAfter runs f when the test ends, whether it passed or not (the tests after it share the
// lab), with a context of its own.
func cleanupAfter(t *testing.T, f func(ctx context.Context) error) {
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		defer cancel()
		if err := f(ctx); err != nil {
			t.Error(err)
		}
	})
}

func fillSize() string {
	return resource.NewQuantity(in.Options.PmemSize/10*9, resource.BinarySI).String()
}

// query returns the instant vector of expr.
func query(ctx context.Context, g Gomega, prom *deploy.Prometheus, expr string) model.Vector {
	v, _, _, err := prom.API.Query(ctx, expr, time.Now())
	g.Expect(err).NotTo(HaveOccurred(), expr)
	g.Expect(v.Type()).To(Equal(model.ValVector), expr)
	return v.(model.Vector)
}

// BeNaN matches a NaN sample value.
func BeNaN() OmegaMatcher {
	return WithTransform(func(v model.SampleValue) bool { return math.IsNaN(float64(v)) }, BeTrue())
}

// waitRunning waits until pod ns/name runs: its volumes are attached and mounted.
func waitRunning(ctx context.Context, g Gomega, c kubernetes.Interface, ns, name string) {
	g.Eventually(func(g Gomega) {
		p, err := c.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(p.Status.Phase).To(Equal(corev1.PodRunning))
	}).WithContext(ctx).WithTimeout(3 * time.Minute).Should(Succeed())
}
