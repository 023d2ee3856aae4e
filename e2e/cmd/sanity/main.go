// Command sanity runs the csi-sanity binary against mgmt-csi as the lab runs it: a management
// control plane with one host (a real kubelet, an emulated PMEM region and the mgmt-csi node
// agent) and the mgmt-csi controller with its sidecars. csi-sanity talks to the host's node
// socket and the controller socket, once with mount and once with block volumes; its output is
// streamed, and the last line sums up the runs as `mgmt-csi: N passed, M failed, K skipped`.
// The lab is stopped at the end, on Ctrl-C too. The exit status is non-zero if a run failed.
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
	total, err := sanity(ctx, verbose)
	if err != nil {
		fmt.Fprintln(os.Stderr, "sanity:", err)
	}
	fmt.Printf("mgmt-csi: %d passed, %d failed, %d skipped\n", total.Passed, total.Failed, total.Skipped)
	if err != nil || total.Failed > 0 {
		return 1
	}
	return 0
}

// sanity starts the lab, runs csi-sanity once per access type and stops the lab again. It
// returns the sum of the runs' results and an error if a run failed or could not run.
func sanity(ctx context.Context, verbose bool) (summary, error) {
	var total summary
	bin, err := cluster.DefaultBinaries()
	if err != nil {
		return total, err
	}
	csiSanity, err := bin.Tool("csi-sanity")
	if err != nil {
		return total, err
	}
	root, err := os.MkdirTemp("/tmp", "pvb-sanity-")
	if err != nil {
		return total, err
	}
	lab, err := cluster.NewLab(root, bin)
	if err != nil {
		return total, err
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

	fmt.Printf("starting a management control plane with mgmt-csi on %s (logs: %s) ...\n", host, root)
	cp, err := lab.StartControlPlane(ctx, "mgmt")
	if err != nil {
		return total, err
	}
	mgmt, err := deploy.StartManagement(ctx, lab, cp, deploy.MgmtOptions{Hosts: []string{host}, PmemSize: pmemSize})
	if err != nil {
		return total, err
	}
	node := mgmt.Hosts[0].Node
	dirs := filepath.Join(root, "sanity")
	if err := os.Mkdir(dirs, 0o755); err != nil {
		return total, err
	}

	var errs []error
	for _, accessType := range []string{"mount", "block"} {
		args := []string{
			"--csi.endpoint=" + filepath.Join(node.PluginDir(deploy.PmemDriver), "csi.sock"),
			"--csi.controllerendpoint=" + filepath.Join(cp.Dir, "mgmt-csi", "csi.sock"),
			"--csi.mountdir=" + filepath.Join(dirs, accessType+"-target"),
			"--csi.stagingdir=" + filepath.Join(dirs, accessType+"-staging"),
			"--csi.testvolumeaccesstype=" + accessType,
			"--csi.testvolumesize=" + strconv.Itoa(volumeSize),
			"--csi.testvolumeexpandsize=" + strconv.Itoa(expandSize),
			"--ginkgo.timeout=" + runTimeout.String(),
		}
		if verbose {
			args = append(args, "--ginkgo.v")
		}
		fmt.Printf("\n== csi-sanity, %s volumes\n", accessType)
		s, err := runSanity(ctx, csiSanity, args)
		fmt.Printf("== %s volumes: %d passed, %d failed, %d skipped\n", accessType, s.Passed, s.Failed, s.Skipped)
		total = total.add(s)
		if err != nil {
			errs = append(errs, fmt.Errorf("%s volumes: %w", accessType, err))
		}
		if ctx.Err() != nil {
			break
		}
	}
	failed = len(errs) > 0 || total.Failed > 0
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
