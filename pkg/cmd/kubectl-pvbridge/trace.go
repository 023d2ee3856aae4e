package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"k8s.io/cli-runtime/pkg/genericclioptions"
	"k8s.io/cli-runtime/pkg/genericiooptions"

	"pvbridge.io/pkg/chain"
)

const traceLong = `Prints the objects a guest volume is made of, in the guest cluster (the connection flags,
or kubectl's default) and in the management cluster (--mgmt-kubeconfig, an admin's: it reads
PVs, PmemVolumes and VolumeAttachments): guest PVC, guest PV, management PVC and PV, PmemVolume
and its host, and for each guest VolumeAttachment the VirtualMachine's volume entries and the
management VolumeAttachment. It names the step that holds the volume (the first that failed,
else the first that waits) and the latest warning Event about its object. Exits 0 when every
step is done, 3 when one is not, 1 when the chain cannot be read, 2 on a bad command line.`

// traceReport is what trace prints with -o json|yaml.
type traceReport struct {
	MgmtNamespace string       `json:"mgmtNamespace"`
	Steps         []chain.Step `json:"steps"`
	// HeldBy is the step that holds the volume, if one does.
	HeldBy *chain.Step `json:"heldBy,omitempty"`
}

func newTraceCommand(guestFlags *genericclioptions.ConfigFlags, streams genericiooptions.IOStreams) *cobra.Command {
	mgmtFlags := genericclioptions.NewConfigFlags(false)
	var mgmtNamespace string
	var timeout time.Duration
	var out output
	cmd := &cobra.Command{
		Use:     "trace (pvc NAME | pv NAME) --mgmt-kubeconfig FILE",
		Short:   "Print the chain of objects of a guest volume in both clusters, and what holds it",
		Long:    traceLong,
		Example: "  kubectl pvbridge trace pvc data -n shop --mgmt-kubeconfig admin.kubeconfig",
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) != 2 || (args[0] != "pvc" && args[0] != "pv") {
				return usageError{cmd.CommandPath(), fmt.Errorf("want pvc NAME or pv NAME, not %q", args)}
			}
			if *mgmtFlags.KubeConfig == "" {
				return usageError{cmd.CommandPath(), errors.New("--mgmt-kubeconfig is required")}
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			guest, namespace, err := newClient(guestFlags)
			if err != nil {
				return fmt.Errorf("guest cluster: %w", err)
			}
			mgmt, contextNamespace, err := newClient(mgmtFlags)
			if err != nil {
				return fmt.Errorf("management cluster: %w", err)
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), timeout)
			defer cancel()
			t := &chain.Tracer{Guest: guest, Mgmt: mgmt, MgmtNamespace: mgmtNamespace}
			how := "--mgmt-namespace"
			if t.MgmtNamespace == "" {
				if t.MgmtNamespace, how, err = chain.FindMgmtNamespace(ctx, guest, mgmt); err != nil {
					t.MgmtNamespace, how = contextNamespace, "the management kubeconfig's context, as "+err.Error()
				}
			}
			report := traceReport{MgmtNamespace: t.MgmtNamespace}
			if args[0] == "pvc" {
				report.Steps, err = t.PVC(ctx, namespace, args[1])
			} else {
				report.Steps, err = t.PV(ctx, args[1])
			}
			report.HeldBy = chain.Stuck(report.Steps)
			if perr := out.print(streams.Out, report, func(w io.Writer) {
				fmt.Fprintf(w, "management namespace %s (from %s)\n\n", t.MgmtNamespace, how)
				printSteps(w, report.Steps)
				if report.HeldBy != nil && err == nil {
					fmt.Fprintf(w, "\nheld by %s: %s\n", report.HeldBy.Object, report.HeldBy.Why)
				}
			}); perr != nil {
				return perr
			}
			switch {
			case err != nil:
				return err
			case report.HeldBy != nil:
				return errNotDone
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(mgmtFlags.KubeConfig, "mgmt-kubeconfig", "", "Kubeconfig of the management cluster. Required.")
	f.StringVar(mgmtFlags.Context, "mgmt-context", "", "Context of --mgmt-kubeconfig; empty for its current context.")
	f.StringVar(&mgmtNamespace, "mgmt-namespace", "", "The guest cluster's namespace in the management cluster; empty to find it from the guest's Cluster UID (ConfigMap pvbridge-system/pvbridge-cluster), else the management context's.")
	f.DurationVar(&timeout, "timeout", 30*time.Second, "How long the reads may take.")
	out.add(cmd)
	return cmd
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
