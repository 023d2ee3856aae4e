package driver

import (
	"context"
	"slices"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pvbridge.io/pkg/csiserver"
	"pvbridge.io/pkg/tenancy"
)

// The parameters csi-provisioner adds to CreateVolume, and csi-snapshotter to
// CreateVolumeGroupSnapshot, with --extra-create-metadata.
const (
	pvcNameParameter            = "csi.storage.k8s.io/pvc/name"
	pvcNamespaceParameter       = "csi.storage.k8s.io/pvc/namespace"
	groupSnapshotNamespaceParam = "csi.storage.k8s.io/volumegroupsnapshot/namespace"
)

// snapshotRoom refuses a group snapshot of n new members that the ResourceQuotas of its
// namespace leave no room for. Its members are cut (on lvm and ndctl, full copies on the
// shared host) before snapshot-controller makes their VolumeSnapshots, which the quota counts:
// a quota that refused those afterwards would leave the copies in place while the group
// exists. So the members are counted first, against what each quota has left (status.hard
// minus status.used). Groups of one namespace taken at once may each pass: the namespace's
// count quota of VolumeGroupSnapshots bounds how many. Read live: one list per new group.
func (s *controllerServer) snapshotRoom(ctx context.Context, params map[string]string, n int) error {
	ns := params[groupSnapshotNamespaceParam]
	if ns == "" {
		return nil
	}
	quotas := &corev1.ResourceQuotaList{}
	if err := s.apiReader.List(ctx, quotas, client.InNamespace(ns)); err != nil {
		return csiserver.APIError(err, "list the ResourceQuotas of namespace %s", ns)
	}
	for _, q := range quotas.Items {
		hard, ok := q.Status.Hard[tenancy.SnapshotCountResource]
		if !ok {
			continue
		}
		used := q.Status.Used[tenancy.SnapshotCountResource]
		if room := hard.Value() - used.Value(); int64(n) > room {
			return status.Errorf(codes.ResourceExhausted,
				"a group snapshot of %d members does not fit ResourceQuota %s/%s: %s of %s VolumeSnapshots used, room for %d; no member is cut",
				n, ns, q.Name, used.String(), hard.String(), max(room, 0))
		}
	}
	return nil
}

// guestHosts returns the hosts a new volume without accessibility requirements may go to when
// a guest cluster asks for it: those of the cluster's VirtualMachines, from the tenancy
// parameters of the claim's namespace. The admission policy already refuses a guest claim that
// selects a host outside them; this covers the claims that select none (a class of Immediate
// binding, or a selection csi-provisioner dropped after a host had no room), which would
// otherwise go to the host with the most room, anywhere. nil means no restriction: no parameters there, or a claim no guest cluster owns.
// The parameters are read live, by name (one read per new volume; no cache of ConfigMaps).
func (s *controllerServer) guestHosts(ctx context.Context, params map[string]string) ([]string, error) {
	name, ns := params[pvcNameParameter], params[pvcNamespaceParameter]
	if name == "" || ns == "" {
		return nil, nil
	}
	cm := &corev1.ConfigMap{}
	switch err := s.apiReader.Get(ctx, client.ObjectKey{Namespace: ns, Name: tenancy.ParamsConfigMap}, cm); {
	case apierrors.IsNotFound(err):
		return nil, nil
	case err != nil:
		return nil, csiserver.APIError(err, "read the tenancy parameters %s/%s", ns, tenancy.ParamsConfigMap)
	}
	cluster, hosts, ok := tenancy.HostsOfOwner(cm.Data, name)
	switch {
	case !ok:
		return nil, nil
	case len(hosts) == 0:
		return nil, status.Errorf(codes.ResourceExhausted,
			"PVC %s/%s belongs to guest cluster %s, which runs no VirtualMachine on any host yet: its volumes go only to the hosts of its VirtualMachines",
			ns, name, cluster)
	}
	slices.Sort(hosts)
	return hosts, nil
}
