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
	"slices"
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
	runtime := flag.String("runtime", envOr("PVBRIDGE_LAB_RUNTIME", "process"), "process: pvbridge runs as processes beside kubelets whose container runtime is a fake (the quicker lab); "+
		"containerd: every node runs containerd, and pvbridge is installed in real containers with kubectl apply -k of the overlays and the images make images builds; "+
		"capi: as containerd, with the guest made by Cluster API's controllers from the shipped cluster template (one control plane and two worker machines, VMs that boot kubeadm); "+
		"qemu: as capi, with a third host, host-q, whose host agent runs the shipped qemu hypervisor, and a worker there that is a QEMU VM booting the node image (make node-image; minutes under TCG)")
	flag.Parse()
	// The lab's own clients (controller-runtime's) log through klog, as the components do.
	logf.SetLogger(klog.Background())
	if *runtime != "process" && *runtime != "containerd" && *runtime != "capi" && *runtime != "qemu" {
		fmt.Fprintf(os.Stderr, "lab: --runtime=%s: want process, containerd, capi or qemu\n", *runtime)
		os.Exit(2)
	}
	if err := run(*dir, *runtime); err != nil {
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

func run(dir, runtime string) error {
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
	var d demoLab
	switch runtime {
	case "containerd":
		d, err = startInstalled(ctx, lab)
	case "capi", "qemu":
		d, err = startClusterAPI(ctx, lab, runtime == "qemu")
	default:
		d, err = startProcesses(ctx, lab)
	}
	if err != nil {
		return err
	}
	var prom *deploy.Prometheus
	if d.containers {
		fmt.Println("starting Prometheus: the metrics Services of both clusters, the alerts of manifests/components/monitoring ...")
		if prom, err = deploy.StartPrometheus(ctx, lab, map[string]*cluster.ControlPlane{"management": d.mgmt, "guest": d.guest}); err != nil {
			return err
		}
	}
	fmt.Printf("\nthe lab is up (%.1fs). Logs and state: %s\n", time.Since(start).Seconds(), dir)

	kubectl, err := bin.Tool("kubectl")
	if err != nil {
		return err
	}
	if err := demo(ctx, d, kubectl); err != nil {
		return fmt.Errorf("demo: %w", err)
	}
	fmt.Printf("\nmanagement cluster:\n  export KUBECONFIG=%s\n  %s get nodes,virtualmachines,pvc,pv,volumeattachments,pmemvolumes,pmemnodes -A\n", d.mgmt.Kubeconfig, kubectl)
	fmt.Printf("\nguest cluster %s:\n  export KUBECONFIG=%s\n  %s get nodes,pvc,pv,volumeattachments -A\n", guest.Name, d.guest.Kubeconfig, kubectl)
	if d.registry != "" {
		fmt.Printf("\nthe guest's image registry (plain HTTP): push an image to %[1]s/<name>:<tag>, run it as image: %[1]s/<name>:<tag>\n", d.registry)
	}
	if prom != nil {
		promtool, err := bin.Tool("promtool")
		if err != nil {
			return err
		}
		// Built from the module proxy, Prometheus has no web UI (its assets are built with npm).
		fmt.Printf("\nPrometheus at http://%[1]s (its HTTP API; every pvbridge component of both clusters, label cluster):\n  %[2]s query instant http://%[1]s 'pvbridge_pmem_free_bytes'\n  curl -s http://%[1]s/api/v1/alerts\n", prom.Address, promtool)
	}
	fmt.Println("\nPress Ctrl-C to stop.")
	<-ctx.Done()
	return nil
}

// startProcesses starts both clusters with pvbridge's components as processes.
func startProcesses(ctx context.Context, lab *cluster.Lab) (demoLab, error) {
	fmt.Println("starting the management cluster: control plane, hosts host-a and host-b with mgmt-csi and vm-operator ...")
	mcp, err := lab.StartControlPlane(ctx, "mgmt")
	if err != nil {
		return demoLab{}, err
	}
	mgmt, err := deploy.StartManagement(ctx, lab, mcp, deploy.MgmtOptions{Hosts: mgmtHosts, PmemSize: pmemPerHost, HostLabels: deploy.VMHostLabels})
	if err != nil {
		return demoLab{}, err
	}
	op, err := deploy.StartVMOperator(lab, mgmt, nil)
	if err != nil {
		return demoLab{}, err
	}
	if _, err := deploy.StartTenants(ctx, lab, mgmt, deploy.TenantsOptions{}); err != nil {
		return demoLab{}, err
	}
	fmt.Println("starting the guest cluster alpha: control plane, VirtualMachines vm-1, vm-2 (host-b), vm-3 as its nodes, guest-csi ...")
	gcp, err := lab.StartControlPlane(ctx, "guest")
	if err != nil {
		return demoLab{}, err
	}
	g, err := deploy.StartGuest(ctx, lab, mgmt, op, gcp, guest)
	if err != nil {
		return demoLab{}, err
	}
	return demoLab{mgmt: mcp, guest: gcp, guestNodes: g.Nodes, vm: "vm-2"}, nil
}

// startInstalled starts both clusters on containerd nodes and installs pvbridge from the
// overlays.
func startInstalled(ctx context.Context, lab *cluster.Lab) (demoLab, error) {
	fmt.Println("building the images, starting both clusters on containerd nodes (management: host-a, host-b; guest alpha: VirtualMachines vm-1, vm-2 (host-b), vm-3), installing pvbridge with kubectl apply -k of the overlays ...")
	in, err := deploy.Install(ctx, lab, deploy.InstalledOptions{Hosts: mgmtHosts, PmemSize: pmemPerHost, Guest: guest})
	if err != nil {
		return demoLab{}, err
	}
	return demoLab{mgmt: in.Mgmt, guest: in.Guest, guestNodes: in.GuestNodes, containers: true, vm: "vm-2"}, nil
}

// startClusterAPI starts the management cluster on containerd nodes with pvbridge and Cluster
// API, and the guest through Cluster API from the shipped cluster template; with qemu, a third
// host whose VMs are QEMU VMs, and a pool of one worker there, the demo's node.
func startClusterAPI(ctx context.Context, lab *cluster.Lab, qemu bool) (demoLab, error) {
	fmt.Println("building the images, starting the management cluster on containerd nodes (host-a, host-b) with pvbridge and Cluster API; guest alpha from the cluster template: one control plane and two worker machines as VirtualMachines that boot kubeadm ...")
	opts := deploy.InstalledOptions{
		Hosts: mgmtHosts, PmemSize: pmemPerHost, ClusterAPI: true, Workers: 2,
		Guest: deploy.GuestOptions{Name: guest.Name, Namespace: guest.Namespace},
	}
	if qemu {
		opts.Hosts, opts.QEMUHost = append(slices.Clone(mgmtHosts), qemuHost), qemuHost
	}
	in, err := deploy.Install(ctx, lab, opts)
	if err != nil {
		return demoLab{}, err
	}
	d := demoLab{mgmt: in.Mgmt, guest: in.Guest, guestNodes: in.GuestNodes, containers: true, vm: in.Workers()[0], capi: true, registry: in.Registry.Address}
	if qemu {
		fmt.Printf("host %s joined, its host agent the shipped qemu hypervisor on bridge %s; a MachineDeployment of one worker there, a QEMU VM booting the node image (TCG: minutes) ...\n", qemuHost, in.QEMUNetwork.Bridge)
		start := time.Now()
		workers, err := in.StartQEMUPool(ctx, guest.Name+"-pool-q", 1)
		if err != nil {
			return demoLab{}, err
		}
		fmt.Printf("QEMU worker %s: Node Ready with guest-csi after %.0fs (its console: %s)\n", workers[0], time.Since(start).Seconds(),
			in.Hosts[qemuHost].HostPath(filepath.Join("/var/lib/pvbridge/qemu", guest.Namespace+"_"+workers[0], "serial.log")))
		d.vm = workers[0]
	}
	return d, nil
}

// qemuHost is the host of RUNTIME=qemu whose VMs are QEMU VMs.
const qemuHost = "host-q"

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
