// Package sanity_test runs the csi-sanity binary against both drivers as the lab runs them: a
// management control plane with one host (a real kubelet, an emulated PMEM region, the mgmt-csi
// node agent and the vm-operator host agent), the mgmt-csi controller with its sidecars and
// vm-operator; and a guest cluster with one node, VirtualMachine vm-1 on that host, with the
// guest-csi node plugin and the guest-csi controller with its sidecars. csi-sanity talks to each
// driver's node and controller sockets, once with mount and once with block volumes; guest-csi's
// calls go through the real management side (PVCs, VolumeSnapshots, VM spec.volumes, hot-plug).
// Each run's output (every spec, with its duration) goes to a file of the lab, whose tail a
// failed run prints (the lab's directory is kept then); each run logs `<driver>, <access type>
// volumes: N passed, M failed, K skipped`.
//
// The lab has one host: csi-sanity creates the volumes of its node tests without topology and
// stages them on the node it tests, so with a second host the controller would place some of
// them where that node cannot reach them.
package sanity_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"testing"
	"time"

	"pvbridge.io/e2e/cluster"
	"pvbridge.io/e2e/deploy"
	"pvbridge.io/e2e/polling"
	"pvbridge.io/pkg/names"
	"pvbridge.io/pkg/qos"
)

const (
	host = "host-a"
	// pmemSize is the host's emulated PMEM (a sparse file). The largest csi-sanity spec holds
	// five volumes and five snapshots at once.
	pmemSize = 4 << 30
	// volumeSize and expandSize are csi-sanity's volume sizes: its mount volumes are ext4
	// (csi-sanity leaves fs_type empty), which mkfs makes at any size. Multiples of the file
	// back end's 1 MiB alignment, so that volumes are exactly as large as asked.
	volumeSize = 64 << 20
	expandSize = 128 << 20
	// runTimeout bounds one csi-sanity run: csi-sanity calls without a deadline, and the
	// controller waits for the node agent as long as a call lasts.
	runTimeout = 15 * time.Minute
)

// driver is what csi-sanity needs of a driver: its sockets and the file of its volumes'
// parameters ("" for none).
type driver struct {
	name, node, controller, params string
	// mutableParams is a YAML file of a VolumeAttributesClass's parameters.
	mutableParams string
}

var (
	lab     *cluster.Lab
	drivers []driver
)

func TestMain(m *testing.M) {
	polling.Set()
	os.Exit(cluster.RunTests(m, func(ctx context.Context, l *cluster.Lab) error {
		lab = l
		cp, err := lab.StartControlPlane(ctx, "mgmt")
		if err != nil {
			return err
		}
		mgmt, err := deploy.StartManagement(ctx, lab, cp, deploy.MgmtOptions{Hosts: []string{host}, PmemSize: pmemSize, HostLabels: deploy.VMHostLabels})
		if err != nil {
			return err
		}
		op, err := deploy.StartVMOperator(lab, mgmt, nil)
		if err != nil {
			return err
		}
		if _, err := deploy.StartTenants(ctx, lab, mgmt, deploy.TenantsOptions{}); err != nil {
			return err
		}
		gcp, err := lab.StartControlPlane(ctx, "guest")
		if err != nil {
			return err
		}
		g, err := deploy.StartGuest(ctx, lab, mgmt, op, gcp, deploy.GuestOptions{Name: "sanity", Namespace: "sanity", VMs: map[string]string{"vm-1": host}})
		if err != nil {
			return err
		}
		// Volumes without topology bind at once, on the one host.
		// Volumes without topology bind at once, on the one host. The mutable parameters are a
		// VolumeAttributesClass's, for the ModifyVolume specs.
		files := map[string]string{
			"guest-parameters.yaml":         names.MgmtStorageClassParam + ": " + deploy.StorageClassPmemImmediate,
			"guest-mutable-parameters.yaml": names.MgmtVolumeAttributesClassParam + ": " + deploy.AttributesClassPmem,
			"mgmt-mutable-parameters.yaml":  qos.MaxIOPSParam + ": \"100000\"",
		}
		for name, content := range files {
			if err := os.WriteFile(filepath.Join(lab.Root, name), []byte(content+"\n"), 0o644); err != nil {
				return err
			}
		}
		drivers = []driver{
			{"mgmt-csi", filepath.Join(mgmt.Hosts[0].Node.PluginDir(names.PmemDriver), "csi.sock"), filepath.Join(cp.Dir, "mgmt-csi", "csi.sock"), "",
				filepath.Join(lab.Root, "mgmt-mutable-parameters.yaml")},
			{"guest-csi", filepath.Join(g.Nodes["vm-1"].PluginDir(names.GuestDriver), "csi.sock"), g.ControllerSocket(), filepath.Join(lab.Root, "guest-parameters.yaml"),
				filepath.Join(lab.Root, "guest-mutable-parameters.yaml")},
		}
		return nil
	}))
}

// TestCSISanity runs csi-sanity against each driver, once per access type. The management
// driver goes first: csi-sanity's ListSnapshots specs count every snapshot of the driver, and
// guest-csi's snapshots are management snapshots too.
func TestCSISanity(t *testing.T) {
	csiSanity, err := lab.Binaries().Tool("csi-sanity")
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(lab.Root, "sanity")
	for _, d := range drivers {
		for _, accessType := range []string{"mount", "block"} {
			t.Run(d.name+"/"+accessType, func(t *testing.T) {
				base := filepath.Join(dir, d.name+"-"+accessType)
				if err := os.MkdirAll(base, 0o755); err != nil {
					t.Fatal(err)
				}
				args := []string{
					"--csi.endpoint=" + d.node,
					"--csi.controllerendpoint=" + d.controller,
					"--csi.mountdir=" + filepath.Join(base, "target"),
					"--csi.stagingdir=" + filepath.Join(base, "staging"),
					"--csi.testvolumeaccesstype=" + accessType,
					"--csi.testvolumesize=" + strconv.Itoa(volumeSize),
					"--csi.testvolumeexpandsize=" + strconv.Itoa(expandSize),
					"--ginkgo.timeout=" + runTimeout.String(),
					"--ginkgo.v", "--ginkgo.no-color",
				}
				if d.params != "" {
					args = append(args, "--csi.testvolumeparameters="+d.params)
				}
				args = append(args, "--csi.testvolumemutableparameters="+d.mutableParams)
				out, runErr := exec.CommandContext(t.Context(), csiSanity, args...).CombinedOutput()
				logFile := base + ".log"
				if err := os.WriteFile(logFile, out, 0o644); err != nil {
					t.Error(err)
				}
				s, err := parseSummary(out)
				t.Logf("%s, %s volumes: %d passed, %d failed, %d skipped", d.name, accessType, s.Passed, s.Failed, s.Skipped)
				switch {
				case runErr != nil || err != nil || s.Failed > 0:
					t.Errorf("csi-sanity against %s, %s volumes: %v; the end of its output (all of it in %s):\n%s",
						d.name, accessType, errors.Join(runErr, err), logFile, cluster.Tail(logFile, 200))
				case s.Passed == 0:
					t.Errorf("csi-sanity against %s, %s volumes: no spec passed", d.name, accessType)
				}
			})
		}
	}
}

// summary is the outcome of a Ginkgo suite.
type summary struct {
	Passed, Failed, Pending, Skipped int
}

var (
	// ansi matches the colour escapes Ginkgo writes.
	ansi = regexp.MustCompile("\x1b\\[[0-9;]*m")
	// counts matches the last line of Ginkgo's report, e.g.
	// "SUCCESS! -- 75 Passed | 0 Failed | 1 Pending | 27 Skipped".
	counts = regexp.MustCompile(`(?m)(\d+) Passed \| (\d+) Failed \| (\d+) Pending \| (\d+) Skipped`)
)

// parseSummary reads the counts of the last Ginkgo report in out.
func parseSummary(out []byte) (summary, error) {
	all := counts.FindAllSubmatch(ansi.ReplaceAll(out, nil), -1)
	if len(all) == 0 {
		return summary{}, errors.New("no Ginkgo summary in the output of csi-sanity")
	}
	var n [4]int
	for i, b := range all[len(all)-1][1:] {
		v, err := strconv.Atoi(string(b))
		if err != nil {
			return summary{}, fmt.Errorf("the Ginkgo summary: %w", err)
		}
		n[i] = v
	}
	return summary{Passed: n[0], Failed: n[1], Pending: n[2], Skipped: n[3]}, nil
}
