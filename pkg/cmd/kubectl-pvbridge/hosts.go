package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"text/tabwriter"

	"github.com/spf13/cobra"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/cli-runtime/pkg/genericclioptions"
	"k8s.io/cli-runtime/pkg/genericiooptions"
	"sigs.k8s.io/controller-runtime/pkg/client"

	pmemv1 "pvbridge.io/pkg/apis/pmem/v1alpha1"
	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
)

// hostRow is a management host as `hosts` shows it.
type hostRow struct {
	Name string `json:"name"`
	// State is Ready or NotReady, and drained or lost when it is.
	State string `json:"state"`
	// PmemMode, PmemFree and PmemTotal are what its mgmt-csi node agent reports (PmemNode).
	PmemMode  string `json:"pmemMode,omitempty"`
	PmemFree  string `json:"pmemFree,omitempty"`
	PmemTotal string `json:"pmemTotal,omitempty"`
	// Volumes are the PMEM volumes of one replica on it; Replicas the live replicas of
	// replicated volumes.
	Volumes  int `json:"volumes"`
	Replicas int `json:"replicas"`
	// VMs run on it, with Disks hot-plugged among them (attached volumes) of Slots (the VMs'
	// hot-plug slots, where their status says).
	VMs   int `json:"vms"`
	Disks int `json:"disks"`
	Slots int `json:"slots"`
}

func newHostsCommand(flags *genericclioptions.ConfigFlags, streams genericiooptions.IOStreams) *cobra.Command {
	var out output
	cmd := &cobra.Command{
		Use:   "hosts",
		Short: "List the management hosts: state, PMEM, volumes, replicas, VMs and their disks",
		Long: `Lists the management hosts (Nodes labelled ` + vmv1.HostLabel + `=true, and every node with a
PmemNode): whether they are Ready, drained or lost, the PMEM their mgmt-csi node agent reports,
the PMEM volumes and replicas on them, and the VirtualMachines that run there with their
hot-plugged disks and slots.`,
		Args: exactArgs(0),
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, _, err := newClient(flags)
			if err != nil {
				return fmt.Errorf("management cluster: %w", err)
			}
			rows, err := listHosts(cmd.Context(), c)
			if err != nil {
				return err
			}
			return out.print(streams.Out, rows, func(w io.Writer) { printHosts(w, rows) })
		},
	}
	out.add(cmd)
	return cmd
}

// listHosts reads the hosts, one List per kind.
func listHosts(ctx context.Context, c client.Reader) ([]hostRow, error) {
	nodes, pmemNodes := &corev1.NodeList{}, &pmemv1.PmemNodeList{}
	volumes, replicas, vms := &pmemv1.PmemVolumeList{}, &pmemv1.PmemReplicaList{}, &vmv1.VirtualMachineList{}
	if err := errors.Join(c.List(ctx, nodes), c.List(ctx, pmemNodes), c.List(ctx, volumes), c.List(ctx, replicas), c.List(ctx, vms)); err != nil {
		return nil, err
	}
	rows := map[string]*hostRow{}
	states := map[string]string{} // of every Node, for the hosts that have a PmemNode only
	row := func(name string) *hostRow {
		if rows[name] == nil {
			rows[name] = &hostRow{Name: name, State: cmp.Or(states[name], "NotFound")}
		}
		return rows[name]
	}
	for i := range nodes.Items {
		n := &nodes.Items[i]
		states[n.Name] = hostState(n)
		if n.Labels[vmv1.HostLabel] == "true" {
			row(n.Name)
		}
	}
	for _, p := range pmemNodes.Items {
		r := row(p.Name)
		r.PmemMode = string(p.Status.Mode)
		if p.Status.Free != nil {
			r.PmemFree = p.Status.Free.String()
		}
		if p.Status.Total != nil {
			r.PmemTotal = p.Status.Total.String()
		}
	}
	for _, v := range volumes.Items {
		if r := rows[v.Labels[pmemv1.NodeLabel]]; r != nil { // a volume of one replica
			r.Volumes++
		}
	}
	for _, rep := range replicas.Items {
		if r := rows[rep.Spec.Node]; r != nil && rep.Live() {
			r.Replicas++
		}
	}
	for _, vm := range vms.Items {
		r := rows[vm.Status.Host]
		if r == nil {
			continue
		}
		r.VMs++
		for _, v := range vm.Status.Volumes {
			if v.Attached {
				r.Disks++
			}
		}
		if vm.Status.MaxVolumes != nil {
			r.Slots += int(*vm.Status.MaxVolumes)
		}
	}
	out := make([]hostRow, 0, len(rows))
	for _, r := range rows {
		out = append(out, *r)
	}
	slices.SortFunc(out, func(a, b hostRow) int { return strings.Compare(a.Name, b.Name) })
	return out, nil
}

// hostState is Ready or NotReady, with the host's drain or loss.
func hostState(n *corev1.Node) string {
	state := "NotReady"
	for _, c := range n.Status.Conditions {
		if c.Type == corev1.NodeReady && c.Status == corev1.ConditionTrue {
			state = "Ready"
		}
	}
	switch {
	case vmv1.HostLost(n):
		state += ",Lost"
	case vmv1.HostDraining(n):
		state += ",Drained"
	}
	return state
}

// printHosts writes rows as a table.
func printHosts(w io.Writer, rows []hostRow) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "HOST\tSTATE\tPMEM\tFREE\tTOTAL\tVOLUMES\tREPLICAS\tVMS\tDISKS/SLOTS")
	for _, r := range rows {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%d\t%d\t%d\t%d/%d\n", r.Name, r.State, dash(r.PmemMode), dash(r.PmemFree), dash(r.PmemTotal),
			r.Volumes, r.Replicas, r.VMs, r.Disks, r.Slots)
	}
	_ = tw.Flush()
}

// dash is s, or "-" when empty.
func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
