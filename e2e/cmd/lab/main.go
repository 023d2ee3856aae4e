// Command lab runs pvbridge's lab until interrupted: a management and a guest Kubernetes control
// plane on 127.0.0.1 with their nodes (real kubelets), then prints how to reach them. Ctrl-C
// stops everything and leaves no process or mount behind. Only one lab runs at a time.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"pvbridge.io/e2e/cluster"
)

func main() {
	dir := flag.String("dir", envOr("PVBRIDGE_LAB_DIR", "/tmp/pvbridge-lab"), "directory of the lab's state, logs and kubeconfigs (emptied on start; keep it short: unix socket paths are limited to 108 bytes)")
	flag.Parse()
	if err := run(*dir); err != nil {
		fmt.Fprintln(os.Stderr, "lab:", err)
		os.Exit(1)
	}
}

func envOr(key, def string) string {
	if v := os.Getenv(key); v != "" {
		return v
	}
	return def
}

// topology is the lab: which control planes run and which nodes each has.
var topology = []struct {
	cluster string
	nodes   []string
}{
	{"mgmt", []string{"host-a", "host-b"}},
	{"guest", []string{"vm-1", "vm-2", "vm-3"}},
}

func run(dir string) error {
	dir, err := filepath.Abs(dir)
	if err != nil {
		return err
	}
	unlock, err := lock(dir + ".lock")
	if err != nil {
		return err
	}
	defer unlock()
	if err := os.RemoveAll(dir); err != nil {
		return fmt.Errorf("empty %s: %w", dir, err)
	}
	bin, err := cluster.DefaultBinaries()
	if err != nil {
		return err
	}
	lab, err := cluster.NewLab(dir, bin)
	if err != nil {
		return err
	}
	defer func() {
		fmt.Println("stopping the lab ...")
		if err := lab.Stop(); err != nil {
			fmt.Fprintln(os.Stderr, "lab: stop:", err)
		}
		fmt.Println("stopped: no lab process or mount is left")
	}()

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	start := time.Now()
	var cps []*cluster.ControlPlane
	for _, c := range topology {
		fmt.Printf("starting the %s control plane ...\n", c.cluster)
		cp, err := lab.StartControlPlane(ctx, c.cluster)
		if err != nil {
			return err
		}
		for _, n := range c.nodes {
			fmt.Printf("  node %s ...\n", n)
			if _, err := cp.AddNode(ctx, n, cluster.NodeOptions{}); err != nil {
				return err
			}
		}
		cps = append(cps, cp)
	}
	fmt.Printf("\nthe lab is up (%.1fs). Logs and state: %s\n\n", time.Since(start).Seconds(), dir)
	kubectl, _ := bin.Tool("kubectl")
	for _, cp := range cps {
		fmt.Printf("%s cluster:\n  kubeconfig: %s\n  %s --kubeconfig %s get nodes\n\n", cp.Name, cp.Kubeconfig, kubectl, cp.Kubeconfig)
	}
	fmt.Println("Press Ctrl-C to stop.")
	<-ctx.Done()
	return nil
}

// lock takes an exclusive lock on path, or says which lab holds it.
func lock(path string) (func(), error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, err
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			holder, _ := os.ReadFile(path)
			return nil, fmt.Errorf("a lab is already running (pid %s); stop it with Ctrl-C in its terminal, or use another --dir", string(holder))
		}
		return nil, err
	}
	_ = f.Truncate(0)
	_, _ = fmt.Fprintf(f, "%d", os.Getpid())
	return func() { f.Close() }, nil
}
