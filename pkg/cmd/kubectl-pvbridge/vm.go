package main

import (
	"context"
	"fmt"
	"io"
	"text/tabwriter"

	"github.com/spf13/cobra"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/cli-runtime/pkg/genericclioptions"
	"k8s.io/cli-runtime/pkg/genericiooptions"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
)

// vmReport is a VirtualMachine as `vm` shows it.
type vmReport struct {
	Namespace  string     `json:"namespace"`
	Name       string     `json:"name"`
	Host       string     `json:"host,omitempty"`
	Phase      string     `json:"phase,omitempty"`
	Addresses  []string   `json:"addresses,omitempty"`
	MaxVolumes int32      `json:"maxVolumes,omitempty"`
	Volumes    []vmVolume `json:"volumes"`
}

// vmVolume is one of a VM's volumes: its claim and PV, whether the management VolumeAttachment
// to the VM's host is attached, and whether the disk is hot-plugged into the VM (and as which
// serial), or why not.
type vmVolume struct {
	Name               string `json:"name"`
	Claim              string `json:"claim"`
	PersistentVolume   string `json:"persistentVolume,omitempty"`
	VolumeAttachment   string `json:"volumeAttachment,omitempty"`
	AttachmentAttached bool   `json:"attachmentAttached"`
	HotPlugged         bool   `json:"hotPlugged"`
	DiskSerial         string `json:"diskSerial,omitempty"`
	Class              string `json:"volumeAttributesClass,omitempty"`
	Error              string `json:"error,omitempty"`
}

func newVMCommand(flags *genericclioptions.ConfigFlags, streams genericiooptions.IOStreams) *cobra.Command {
	var out output
	cmd := &cobra.Command{
		Use:   "vm NAME",
		Short: "Show a VirtualMachine's host and volumes: claims, attachments, hot-plugged disks",
		Long: `Shows a VirtualMachine of the management cluster (-n, its namespace): its host, phase and
addresses, and for each volume of its spec the claim and PV, the management VolumeAttachment to
the host and whether it is attached, and whether the disk is hot-plugged into the VM (its
serial, as the guest sees /dev/disk/by-id/virtio-<serial>) or the host agent's error.`,
		Args: exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, namespace, err := newClient(flags)
			if err != nil {
				return fmt.Errorf("management cluster: %w", err)
			}
			report, err := readVM(cmd.Context(), c, namespace, args[0])
			if err != nil {
				return err
			}
			return out.print(streams.Out, report, report.print)
		},
	}
	out.add(cmd)
	return cmd
}

// readVM reads VirtualMachine namespace/name and what its volumes are made of.
func readVM(ctx context.Context, c client.Reader, namespace, name string) (*vmReport, error) {
	vm := &vmv1.VirtualMachine{}
	if err := c.Get(ctx, client.ObjectKey{Namespace: namespace, Name: name}, vm); err != nil {
		return nil, fmt.Errorf("VirtualMachine %s/%s: %w", namespace, name, err)
	}
	vas := &storagev1.VolumeAttachmentList{}
	if err := c.List(ctx, vas); err != nil {
		return nil, err
	}
	r := &vmReport{
		Namespace: vm.Namespace, Name: vm.Name, Host: vm.Status.Host, Phase: string(vm.Status.Phase),
		Addresses: vm.Status.Addresses, MaxVolumes: ptr.Deref(vm.Status.MaxVolumes, 0), Volumes: []vmVolume{},
	}
	for _, v := range vm.Spec.Volumes {
		row := vmVolume{Name: v.Name, Claim: v.PersistentVolumeClaim.ClaimName}
		pvc := &corev1.PersistentVolumeClaim{}
		switch err := c.Get(ctx, client.ObjectKey{Namespace: vm.Namespace, Name: row.Claim}, pvc); {
		case apierrors.IsNotFound(err):
			row.Error = "claim not found"
		case err != nil:
			return nil, err
		}
		row.PersistentVolume = pvc.Spec.VolumeName
		for _, va := range vas.Items {
			if row.PersistentVolume != "" && ptr.Deref(va.Spec.Source.PersistentVolumeName, "") == row.PersistentVolume && va.Spec.NodeName == vm.Status.Host {
				row.VolumeAttachment, row.AttachmentAttached = va.Name, va.Status.Attached
			}
		}
		for _, s := range vm.Status.Volumes {
			if s.Name == v.Name {
				row.HotPlugged, row.DiskSerial, row.Class = s.Attached, s.DiskSerial, s.VolumeAttributesClassName
				if s.Error != "" {
					row.Error = s.Error
				}
			}
		}
		r.Volumes = append(r.Volumes, row)
	}
	return r, nil
}

// print writes the report as a header and a table of the volumes.
func (r *vmReport) print(w io.Writer) {
	fmt.Fprintf(w, "VirtualMachine %s/%s on %s: %s", r.Namespace, r.Name, dash(r.Host), dash(r.Phase))
	if len(r.Addresses) > 0 {
		fmt.Fprintf(w, ", addresses %v", r.Addresses)
	}
	if r.MaxVolumes > 0 {
		fmt.Fprintf(w, ", %d slots", r.MaxVolumes)
	}
	fmt.Fprintln(w)
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "VOLUME\tCLAIM\tPV\tATTACHMENT\tATTACHED\tHOT-PLUGGED\tSERIAL\tERROR")
	for _, v := range r.Volumes {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%t\t%t\t%s\t%s\n", v.Name, v.Claim, dash(v.PersistentVolume), dash(v.VolumeAttachment),
			v.AttachmentAttached, v.HotPlugged, dash(v.DiskSerial), v.Error)
	}
	_ = tw.Flush()
}
