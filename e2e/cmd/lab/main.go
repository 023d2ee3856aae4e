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
	"k8s.io/klog/v2"
	logf "sigs.k8s.io/controller-runtime/pkg/log"

	"pvbridge.io/e2e/cluster"
	"pvbridge.io/e2e/deploy"
)

func main() {
	dir := flag.String("dir", envOr("PVBRIDGE_LAB_DIR", "/tmp/pvbridge-lab"), "directory of the lab's state, logs and kubeconfigs (emptied on start; keep it short: unix socket paths are limited to 108 bytes)")
	flag.Parse()
	// The lab's own clients (controller-runtime's) log through klog, as the components do.
	logf.SetLogger(klog.Background())
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

// The lab: a management cluster whose hosts run mgmt-csi over emulated PMEM and vm-operator,
// and a guest cluster "alpha" whose nodes are VirtualMachines of namespace tenant-a.
var (
	mgmtHosts = []string{"host-a", "host-b"}
	guest     = deploy.GuestOptions{
		Name: "alpha", Namespace: "tenant-a",
		VMs: map[string]string{"vm-1": "host-a", "vm-2": "host-b", "vm-3": "host-a"},
	}
)

// pmemPerHost is the size of each host's emulated PMEM region (a sparse file: it takes disk
// space only as volumes are written).
const pmemPerHost = 8 << 30

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
	fmt.Println("starting the management cluster: control plane, hosts host-a and host-b with mgmt-csi and vm-operator ...")
	mcp, err := lab.StartControlPlane(ctx, "mgmt")
	if err != nil {
		return err
	}
	mgmt, err := deploy.StartManagement(ctx, lab, mcp, deploy.MgmtOptions{Hosts: mgmtHosts, PmemSize: pmemPerHost, HostLabels: deploy.VMHostLabels})
	if err != nil {
		return err
	}
	op, err := deploy.StartVMOperator(lab, mgmt)
	if err != nil {
		return err
	}
	if _, err := deploy.StartTenants(ctx, lab, mgmt, deploy.TenantsOptions{}); err != nil {
		return err
	}
	fmt.Println("starting the guest cluster alpha: control plane, VirtualMachines vm-1, vm-2 (host-b), vm-3 as its nodes, guest-csi ...")
	gcp, err := lab.StartControlPlane(ctx, "guest")
	if err != nil {
		return err
	}
	g, err := deploy.StartGuest(ctx, lab, mgmt, op, gcp, guest)
	if err != nil {
		return err
	}
	fmt.Printf("\nthe lab is up (%.1fs). Logs and state: %s\n", time.Since(start).Seconds(), dir)

	kubectl, err := bin.Tool("kubectl")
	if err != nil {
		return err
	}
	if err := demo(ctx, g, mgmt, kubectl); err != nil {
		return fmt.Errorf("demo: %w", err)
	}
	fmt.Printf("\nmanagement cluster:\n  export KUBECONFIG=%s\n  %s get nodes,virtualmachines,pvc,pv,volumeattachments,pmemvolumes,pmemnodes -A\n", mcp.Kubeconfig, kubectl)
	fmt.Printf("\nguest cluster %s:\n  export KUBECONFIG=%s\n  %s get nodes,pvc,pv,volumeattachments -A\n", guest.Name, gcp.Kubeconfig, kubectl)
	fmt.Println("\nPress Ctrl-C to stop.")
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
