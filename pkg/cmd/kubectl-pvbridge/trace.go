package main

import (
	"context"
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"github.com/spf13/pflag"

	"pvbridge.io/pkg/chain"
)

const traceUsage = `Usage: kubectl pvbridge trace (pvc NAME [-n NAMESPACE] | pv NAME) --mgmt-kubeconfig FILE [flags]

Prints the objects a guest volume is made of, in the guest cluster (--kubeconfig, or kubectl's
default) and in the management cluster (--mgmt-kubeconfig, an admin's: it reads PVs,
PmemVolumes and VolumeAttachments): guest PVC, guest PV, management PVC and PV, PmemVolume and
its host, and for each guest VolumeAttachment the VirtualMachine's volume entries and the
management VolumeAttachment. It names the step that holds the volume (the first that failed,
else the first that waits) and the latest warning Event about its object. Exits 0 when every step is done, 3 when one is not, 1 when the
chain cannot be read, 2 on a bad command line.

Flags:
`

// runTrace runs `kubectl pvbridge trace` with args, those after "trace".
func runTrace(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := pflag.NewFlagSet("kubectl-pvbridge trace", pflag.ContinueOnError)
	fs.SetOutput(stderr)
	kubeconfig := fs.String("kubeconfig", "", "Kubeconfig of the guest cluster; empty for kubectl's default ($KUBECONFIG, ~/.kube/config).")
	namespace := fs.StringP("namespace", "n", "", "Namespace of the guest PVC; empty for the kubeconfig context's, else default.")
	mgmtKubeconfig := fs.String("mgmt-kubeconfig", "", "Kubeconfig of the management cluster. Required.")
	mgmtNamespace := fs.String("mgmt-namespace", "", "The guest cluster's namespace in the management cluster; empty to find it from the guest's Cluster UID (ConfigMap pvbridge-system/pvbridge-cluster), else the management kubeconfig context's.")
	timeout := fs.Duration("timeout", 30*time.Second, "How long the reads may take.")
	fs.Usage = func() {
		fmt.Fprint(stderr, traceUsage)
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return exitUsage
	}
	if fs.NArg() != 2 || (fs.Arg(0) != "pvc" && fs.Arg(0) != "pv") || *mgmtKubeconfig == "" {
		fs.Usage()
		return exitUsage
	}

	scheme, err := newScheme()
	if err != nil {
		fmt.Fprintln(stderr, err)
		return exitError
	}
	guest, guestNamespace, err := reader(*kubeconfig, scheme)
	if err != nil {
		fmt.Fprintln(stderr, "guest cluster:", err)
		return exitError
	}
	mgmt, contextNamespace, err := reader(*mgmtKubeconfig, scheme)
	if err != nil {
		fmt.Fprintln(stderr, "management cluster:", err)
		return exitError
	}
	if *namespace == "" {
		*namespace = guestNamespace
	}

	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	t := &chain.Tracer{Guest: guest, Mgmt: mgmt, MgmtNamespace: *mgmtNamespace}
	how := "--mgmt-namespace"
	if t.MgmtNamespace == "" {
		if t.MgmtNamespace, how, err = chain.FindMgmtNamespace(ctx, guest, mgmt); err != nil {
			t.MgmtNamespace, how = contextNamespace, "the management kubeconfig's context, as "+err.Error()
		}
	}
	fmt.Fprintf(stdout, "management namespace %s (from %s)\n\n", t.MgmtNamespace, how)
	var steps []chain.Step
	if fs.Arg(0) == "pvc" {
		steps, err = t.PVC(ctx, *namespace, fs.Arg(1))
	} else {
		steps, err = t.PV(ctx, fs.Arg(1))
	}
	printSteps(stdout, steps)
	if err != nil {
		fmt.Fprintln(stderr, err)
		return exitError
	}
	if stuck := chain.Stuck(steps); stuck != nil {
		fmt.Fprintf(stdout, "\nheld by %s: %s\n", stuck.Object, stuck.Why)
		return exitNotReady
	}
	return exitDone
}

// printSteps writes steps as a table.
func printSteps(w io.Writer, steps []chain.Step) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "OBJECT\tSTATE\tDETAIL")
	for _, s := range steps {
		detail := s.Detail
		if s.State != chain.Done {
			detail = s.Why
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\n", s.Object, s.State, detail)
	}
	_ = tw.Flush()
}
