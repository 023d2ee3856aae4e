// Command kubectl-pvbridge is a kubectl plugin for pvbridge's operators: `kubectl pvbridge trace
// pvc <name>` (or `trace pv <name>`) prints the chain of objects a guest volume is made of in
// both clusters and, for the step that holds it, which object and why.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"text/tabwriter"
	"time"

	"github.com/spf13/pflag"
	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/controller-runtime/pkg/client"

	pmemv1 "pvbridge.io/pkg/apis/pmem/v1alpha1"
	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/pkg/chain"
)

// Exit codes: a chain whose every step is done, a chain that is not, a failure to read it, a
// bad command line.
const (
	exitDone     = 0
	exitError    = 1
	exitUsage    = 2
	exitNotReady = 3
)

const usage = `Usage: kubectl pvbridge trace (pvc NAME [-n NAMESPACE] | pv NAME) --mgmt-kubeconfig FILE [flags]

Prints the objects a guest volume is made of, in the guest cluster (--kubeconfig, or kubectl's
default) and in the management cluster (--mgmt-kubeconfig, an admin's: it reads PVs,
PmemVolumes and VolumeAttachments): guest PVC, guest PV, management PVC and PV, PmemVolume and
its host, and for each guest VolumeAttachment the VirtualMachine's volume entries and the
management VolumeAttachment. It names the step that holds the volume (the first that failed,
else the first that waits) and the latest warning Event about its object. Exits 0 when every step is done, 3 when one is not, 1 when the
chain cannot be read, 2 on a bad command line.

Flags:
`

func main() {
	os.Exit(run(context.Background(), os.Args[1:], os.Stdout, os.Stderr))
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := pflag.NewFlagSet("kubectl-pvbridge", pflag.ContinueOnError)
	fs.SetOutput(stderr)
	kubeconfig := fs.String("kubeconfig", "", "Kubeconfig of the guest cluster; empty for kubectl's default ($KUBECONFIG, ~/.kube/config).")
	namespace := fs.StringP("namespace", "n", "", "Namespace of the guest PVC; empty for the kubeconfig context's, else default.")
	mgmtKubeconfig := fs.String("mgmt-kubeconfig", "", "Kubeconfig of the management cluster. Required.")
	mgmtNamespace := fs.String("mgmt-namespace", "", "The guest cluster's namespace in the management cluster; empty to find it from the guest's Cluster UID (ConfigMap pvbridge-system/pvbridge-cluster), else the management kubeconfig context's.")
	timeout := fs.Duration("timeout", 30*time.Second, "How long the reads may take.")
	fs.Usage = func() {
		fmt.Fprint(stderr, usage)
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return exitUsage
	}
	if fs.NArg() != 3 || fs.Arg(0) != "trace" || (fs.Arg(1) != "pvc" && fs.Arg(1) != "pv") || *mgmtKubeconfig == "" {
		fs.Usage()
		return exitUsage
	}

	scheme := runtime.NewScheme()
	if err := errors.Join(clientgoscheme.AddToScheme(scheme), vmv1.AddToScheme(scheme), pmemv1.AddToScheme(scheme)); err != nil {
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
	if fs.Arg(1) == "pvc" {
		steps, err = t.PVC(ctx, *namespace, fs.Arg(2))
	} else {
		steps, err = t.PV(ctx, fs.Arg(2))
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

// reader returns a client of the cluster of kubeconfig (kubectl's loading rules when empty) and
// the namespace of its context ("default" when it names none).
func reader(kubeconfig string, scheme *runtime.Scheme) (client.Reader, string, error) {
	rules := clientcmd.NewDefaultClientConfigLoadingRules()
	rules.ExplicitPath = kubeconfig
	loader := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules, &clientcmd.ConfigOverrides{})
	cfg, err := loader.ClientConfig()
	if err != nil {
		return nil, "", err
	}
	namespace, _, err := loader.Namespace()
	if err != nil {
		return nil, "", err
	}
	c, err := client.New(cfg, client.Options{Scheme: scheme})
	return c, namespace, err
}
