// Command sanity runs the csi-sanity binary against both drivers as the lab runs them: a
// management control plane with one host (a real kubelet, an emulated PMEM region, the mgmt-csi
// node agent and the vm-operator host agent), the mgmt-csi controller with its sidecars and
// vm-operator; and a guest cluster with one node, VirtualMachine vm-1 on that host, with the
// guest-csi node plugin and the guest-csi controller with its sidecars. csi-sanity talks to each
// driver's node and controller sockets, once with mount and once with block volumes; guest-csi's
// calls go through the real management side (PVCs, VolumeSnapshots, VM spec.volumes, hot-plug).
// Its output is streamed, and the last lines sum up the runs per driver as
// `<driver>: N passed, M failed, K skipped`. The lab is stopped at the end, on Ctrl-C too. The
// exit status is non-zero if a run failed.
//
// The lab has one host: csi-sanity creates the volumes of its node tests without topology and
// stages them on the node it tests, so with a second host the controller would place some of
// them where that node cannot reach them.
package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"regexp"
	"strconv"
	"syscall"
	"time"

	"pvbridge.io/e2e/cluster"
	"pvbridge.io/e2e/deploy"
	"pvbridge.io/pkg/names"
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

func main() {
	verbose := flag.Bool("v", false, "print every spec, not only failures (ginkgo.v)")
	flag.Parse()
	os.Exit(run(*verbose))
}

func run(verbose bool) int {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	totals, err := sanity(ctx, verbose)
	if err != nil {
		fmt.Fprintln(os.Stderr, "sanity:", err)
	}
	failed := err != nil
	for _, t := range totals {
		fmt.Printf("%s: %d passed, %d failed, %d skipped\n", t.driver, t.Passed, t.Failed, t.Skipped)
		failed = failed || t.Failed > 0
	}
	if failed {
		return 1
	}
	return 0
}

// driverTotal is the sum of a driver's runs.
type driverTotal struct {
	driver string
	summary
}

// sanity starts the lab, runs csi-sanity once per driver and access type and stops the lab
// again. It returns the sums of each driver's runs and an error if a run failed or could not run.
func sanity(ctx context.Context, verbose bool) ([]driverTotal, error) {
	var totals []driverTotal
	bin, err := cluster.DefaultBinaries()
	if err != nil {
		return totals, err
	}
	csiSanity, err := bin.Tool("csi-sanity")
	if err != nil {
		return totals, err
	}
	root, err := os.MkdirTemp("/tmp", "pvb-sanity-")
	if err != nil {
		return totals, err
	}
	lab, err := cluster.NewLab(root, bin)
	if err != nil {
		return totals, err
	}
	failed := true
	defer func() {
		fmt.Println("stopping the lab ...")
		err := lab.Stop()
		switch {
		case err != nil:
			fmt.Fprintln(os.Stderr, "sanity: stop the lab:", err)
		case failed:
			fmt.Printf("the lab's logs stay in %s\n", root)
		default:
			_ = os.RemoveAll(root)
		}
	}()

	fmt.Printf("starting a management control plane with mgmt-csi and vm-operator on %s (logs: %s) ...\n", host, root)
	cp, err := lab.StartControlPlane(ctx, "mgmt")
	if err != nil {
		return totals, err
	}
	mgmt, err := deploy.StartManagement(ctx, lab, cp, deploy.MgmtOptions{Hosts: []string{host}, PmemSize: pmemSize, HostLabels: deploy.VMHostLabels})
	if err != nil {
		return totals, err
	}
	dirs := filepath.Join(root, "sanity")
	if err := os.Mkdir(dirs, 0o755); err != nil {
		return totals, err
	}
	var errs []error
	total, err := runDriver(ctx, csiSanity, filepath.Join(dirs, "mgmt-csi"), verbose,
		filepath.Join(mgmt.Hosts[0].Node.PluginDir(names.PmemDriver), "csi.sock"),
		filepath.Join(cp.Dir, "mgmt-csi", "csi.sock"), "")
	totals = append(totals, driverTotal{"mgmt-csi", total})
	errs = append(errs, err)

	if ctx.Err() == nil {
		fmt.Printf("\nstarting vm-operator and a guest cluster with VirtualMachine vm-1 on %s and guest-csi ...\n", host)
		op, err := deploy.StartVMOperator(lab, mgmt)
		if err != nil {
			return totals, err
		}
		if _, err := deploy.StartTenants(ctx, lab, mgmt, deploy.TenantsOptions{}); err != nil {
			return totals, err
		}
		gcp, err := lab.StartControlPlane(ctx, "guest")
		if err != nil {
			return totals, err
		}
		g, err := deploy.StartGuest(ctx, lab, mgmt, op, gcp, deploy.GuestOptions{Name: "sanity", Namespace: "sanity", VMs: map[string]string{"vm-1": host}})
		if err != nil {
			return totals, err
		}
		// Volumes without topology bind at once, on the one host.
		params := filepath.Join(dirs, "guest-parameters.yaml")
		if err := os.WriteFile(params, []byte(names.MgmtStorageClassParam+": "+deploy.StorageClassPmemImmediate+"\n"), 0o644); err != nil {
			return totals, err
		}
		total, err = runDriver(ctx, csiSanity, filepath.Join(dirs, "guest-csi"), verbose,
			filepath.Join(g.Nodes["vm-1"].PluginDir(names.GuestDriver), "csi.sock"),
			g.ControllerSocket(), params)
		totals = append(totals, driverTotal{"guest-csi", total})
		errs = append(errs, err)
	}
	err = errors.Join(errs...)
	failed = err != nil
	for _, t := range totals {
		failed = failed || t.Failed > 0
	}
	return totals, err
}

// runDriver runs csi-sanity against a driver's node and controller sockets, once per access
// type, with its paths below dir and the volume parameters in the file params ("" for none).
func runDriver(ctx context.Context, csiSanity, dir string, verbose bool, node, controller, params string) (summary, error) {
	var total summary
	if err := os.Mkdir(dir, 0o755); err != nil {
		return total, err
	}
	var errs []error
	for _, accessType := range []string{"mount", "block"} {
		args := []string{
			"--csi.endpoint=" + node,
			"--csi.controllerendpoint=" + controller,
			"--csi.mountdir=" + filepath.Join(dir, accessType+"-target"),
			"--csi.stagingdir=" + filepath.Join(dir, accessType+"-staging"),
			"--csi.testvolumeaccesstype=" + accessType,
			"--csi.testvolumesize=" + strconv.Itoa(volumeSize),
			"--csi.testvolumeexpandsize=" + strconv.Itoa(expandSize),
			"--ginkgo.timeout=" + runTimeout.String(),
		}
		if params != "" {
			args = append(args, "--csi.testvolumeparameters="+params)
		}
		if verbose {
			args = append(args, "--ginkgo.v")
		}
		fmt.Printf("\n== csi-sanity %s, %s volumes\n", filepath.Base(dir), accessType)
		s, err := runSanity(ctx, csiSanity, args)
		fmt.Printf("== %s, %s volumes: %d passed, %d failed, %d skipped\n", filepath.Base(dir), accessType, s.Passed, s.Failed, s.Skipped)
		total = total.add(s)
		if err != nil {
			errs = append(errs, fmt.Errorf("%s, %s volumes: %w", filepath.Base(dir), accessType, err))
		}
		if ctx.Err() != nil {
			break
		}
	}
	return total, errors.Join(errs...)
}

// runSanity runs csi-sanity with args, streams its output, and returns the summary it ends with.
func runSanity(ctx context.Context, path string, args []string) (summary, error) {
	var out bytes.Buffer
	cmd := exec.CommandContext(ctx, path, args...)
	cmd.Stdout = io.MultiWriter(os.Stdout, &out)
	cmd.Stderr = os.Stderr
	runErr := cmd.Run()
	s, err := parseSummary(out.Bytes())
	if runErr != nil {
		return s, fmt.Errorf("csi-sanity: %w", runErr)
	}
	return s, err
}

// summary is the outcome of a Ginkgo suite.
type summary struct {
	Passed, Failed, Pending, Skipped int
}

func (s summary) add(o summary) summary {
	return summary{s.Passed + o.Passed, s.Failed + o.Failed, s.Pending + o.Pending, s.Skipped + o.Skipped}
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
