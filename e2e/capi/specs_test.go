package capi_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	. "github.com/onsi/gomega"

	"pvbridge.io/e2e/deploy"
)

// clusterAPISpecs runs Cluster API's own provider specs (e2e/capispecs: QuickStartSpec and the
// others the suite of every provider runs) against the lab, on host-a and host-b: the specs
// labelled ci, or those of the label filter PVBRIDGE_CAPI_SPECS ("all": every one; make
// capi-e2e). The specs' log, JUnit report and dumps are in the lab's capispecs directory, or
// PVBRIDGE_CAPI_SPECS_DIR.
func clusterAPISpecs(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	labels := "ci"
	if v, ok := os.LookupEnv("PVBRIDGE_CAPI_SPECS"); ok {
		labels = v
		if v == "all" {
			labels = ""
		}
	}
	dir := filepath.Join(lab.Root, "capispecs")
	if v := os.Getenv("PVBRIDGE_CAPI_SPECS_DIR"); v != "" {
		dir = v
	}
	version, etcdTag := guestVersion(ctx, g, mgmtClient(g))
	start := time.Now()
	log, err := in.RunClusterAPISpecs(ctx, lab, deploy.ClusterAPISpecsOptions{
		Labels: labels, Version: version, EtcdTag: etcdTag, Hosts: []string{"host-a", "host-b"},
		Dir: dir,
	})
	if log != "" {
		out, _ := os.ReadFile(log)
		lines := strings.Split(strings.TrimSpace(string(out)), "\n")
		t.Logf("Cluster API's specs (label filter %q), the end of their log %s:\n%s", labels, log, strings.Join(lines[max(0, len(lines)-40):], "\n"))
	}
	g.Expect(err).NotTo(HaveOccurred())
	t.Logf("Cluster API's specs (label filter %q) passed in %.0f s", labels, time.Since(start).Seconds())
}
