package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/cli-runtime/pkg/genericclioptions"
	"k8s.io/cli-runtime/pkg/genericiooptions"
	"sigs.k8s.io/controller-runtime/pkg/client"

	pmemv1 "pvbridge.io/pkg/apis/pmem/v1alpha1"
	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
)

const drainLong = `Drains management host HOST before its maintenance: taints its Node ` + vmv1.DrainTaint + `:NoSchedule,
so that it takes no new pod, VirtualMachine or replica, and each replica of a replicated volume
on it moves to another host (a new replica there is rebuilt from the volume, then HOST's is
taken out of the volume and deleted). It waits until no replica is left on HOST, or --wait
passes, and prints what stays: replicas no other host can take (why), the PMEM volumes that
live only on HOST, and the VirtualMachines that run there (move their guest nodes with Cluster
API, e.g. delete their Machines, before the host goes down). With --undo it removes the taint:
the host takes new VMs and replicas again. Reads and writes the management cluster as an
admin. Exits 0 once HOST holds no replica, 3 when some stay, 1 when the cluster cannot be
read, 2 on a bad command line.`

func newDrainHostCommand(flags *genericclioptions.ConfigFlags, streams genericiooptions.IOStreams) *cobra.Command {
	var undo bool
	var waitFor time.Duration
	var out output
	cmd := &cobra.Command{
		Use:   "drain-host HOST",
		Short: "Move a management host's replicas away before its maintenance (--undo brings it back)",
		Long:  drainLong,
		Args:  exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			host, ctx := args[0], cmd.Context()
			c, _, err := newClient(flags)
			if err != nil {
				return fmt.Errorf("management cluster: %w", err)
			}
			if err := setDrainTaint(ctx, c, host, !undo); err != nil {
				return err
			}
			if undo {
				fmt.Fprintf(streams.Out, "host %s: drain taint removed; it takes new VMs and replicas again\n", host)
				return nil
			}
			if out == "" {
				fmt.Fprintf(streams.Out, "host %s: tainted %s:NoSchedule\n", host, vmv1.DrainTaint)
			}
			var left *hostContents
			err = wait.PollUntilContextTimeout(ctx, 2*time.Second, waitFor, true, func(ctx context.Context) (bool, error) {
				left, err = contentsOf(ctx, c, host)
				return err == nil && len(left.Replicas) == 0, err
			})
			if left == nil {
				return err
			}
			if err := out.print(streams.Out, left, func(w io.Writer) { left.print(w, host) }); err != nil {
				return err
			}
			if len(left.Replicas) > 0 {
				return errNotDone
			}
			return nil
		},
	}
	cmd.Flags().BoolVar(&undo, "undo", false, "Bring the host back: remove the drain taint.")
	cmd.Flags().DurationVar(&waitFor, "wait", 10*time.Minute, "How long to wait for the host's replicas to move; 0 to only say what stays.")
	out.add(cmd)
	return cmd
}

// setDrainTaint adds the drain taint to the Node of host, or removes it.
func setDrainTaint(ctx context.Context, c client.Client, host string, on bool) error {
	node := &corev1.Node{}
	if err := c.Get(ctx, client.ObjectKey{Name: host}, node); err != nil {
		return fmt.Errorf("host %s: %w", host, err)
	}
	patch := client.MergeFromWithOptions(node.DeepCopy(), client.MergeFromWithOptimisticLock{})
	node.Spec.Taints = slices.DeleteFunc(node.Spec.Taints, func(t corev1.Taint) bool { return t.Key == vmv1.DrainTaint })
	if on {
		node.Spec.Taints = append(node.Spec.Taints, corev1.Taint{Key: vmv1.DrainTaint, Effect: corev1.TaintEffectNoSchedule})
	}
	if err := c.Patch(ctx, node, patch); err != nil {
		return fmt.Errorf("taint host %s: %w", host, err)
	}
	return nil
}

// hostContents is what a host holds of pvbridge's.
type hostContents struct {
	// Replicas are the live replicas, each with what holds it.
	Replicas []string `json:"replicas"`
	// Volumes are the PMEM volumes of one replica: they live only here.
	Volumes []string `json:"volumes"`
	// VMs are the VirtualMachines that run here, namespace/name.
	VMs []string `json:"vms"`
}

// contentsOf reads what host holds.
func contentsOf(ctx context.Context, c client.Reader, host string) (*hostContents, error) {
	on := client.MatchingLabels{pmemv1.NodeLabel: host}
	replicas, volumes, vms := &pmemv1.PmemReplicaList{}, &pmemv1.PmemVolumeList{}, &vmv1.VirtualMachineList{}
	if err := errors.Join(c.List(ctx, replicas, on), c.List(ctx, volumes, on), c.List(ctx, vms)); err != nil {
		return nil, err
	}
	h := &hostContents{}
	for _, r := range replicas.Items {
		if !r.Live() {
			continue // faulted or retired: deleted soon, with nothing the volume needs
		}
		h.Replicas = append(h.Replicas, fmt.Sprintf("%s (volume %s): %s", r.Name, r.Spec.VolumeID, whyStays(ctx, c, &r)))
	}
	for _, v := range volumes.Items {
		h.Volumes = append(h.Volumes, v.Name)
	}
	for _, vm := range vms.Items {
		if vm.Status.Host == host {
			h.VMs = append(h.VMs, vm.Namespace+"/"+vm.Name)
		}
	}
	return h, nil
}

// whyStays says what replica r, live on a drained host, waits for: its replacement (and that
// one's state), or a host to take one (the repair's error, which the controller logs).
func whyStays(ctx context.Context, c client.Reader, r *pmemv1.PmemReplica) string {
	list := &pmemv1.PmemReplicaList{}
	if err := c.List(ctx, list, client.MatchingLabels{pmemv1.VolumeLabel: r.Spec.VolumeID}); err != nil {
		return err.Error()
	}
	for _, o := range list.Items {
		if o.Annotations[pmemv1.ReplacesAnnotation] != r.Name || !o.Live() {
			continue
		}
		if !o.HasData() {
			state := "being made"
			if c := meta.FindStatusCondition(o.Status.Conditions, pmemv1.ReadyCondition); c != nil && c.Status == "True" {
				state = "being rebuilt"
			}
			return fmt.Sprintf("its replacement %s on %s is %s", o.Name, o.Spec.Node, state)
		}
		return fmt.Sprintf("its replacement %s on %s has the data; it is being taken out of the volume", o.Name, o.Spec.Node)
	}
	return "no replacement yet: no other host without a replica of the volume has room (or is undrained); the mgmt-csi controller's log says which"
}

// print writes what stays on host.
func (h *hostContents) print(w io.Writer, host string) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintf(tw, "replicas on %s\t%d\n", host, len(h.Replicas))
	for _, r := range h.Replicas {
		fmt.Fprintf(tw, "  %s\t\n", r)
	}
	fmt.Fprintf(tw, "PMEM volumes of one replica (they live only on %s)\t%d\n", host, len(h.Volumes))
	for _, v := range h.Volumes {
		fmt.Fprintf(tw, "  %s\t\n", v)
	}
	fmt.Fprintf(tw, "VirtualMachines on %s (move their guest nodes before the host goes down)\t%d\n", host, len(h.VMs))
	for _, vm := range h.VMs {
		fmt.Fprintf(tw, "  %s\t\n", vm)
	}
	_ = tw.Flush()
}
