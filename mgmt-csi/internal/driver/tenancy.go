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

// The parameters csi-provisioner adds to CreateVolume, csi-snapshotter to
// CreateVolumeGroupSnapshot (with --extra-create-metadata) and csi-resizer to
// ControllerModifyVolume (with --extra-modify-metadata).
const (
	sidecarParameterPrefix      = "csi.storage.k8s.io/"
	pvcNameParameter            = sidecarParameterPrefix + "pvc/name"
	pvcNamespaceParameter       = sidecarParameterPrefix + "pvc/namespace"
	groupSnapshotNamespaceParam = sidecarParameterPrefix + "volumegroupsnapshot/namespace"
)

// Each guest cluster's budget of VolumeAttributesClass changes. A change costs the management
// cluster csi-resizer's writes of the claim and its PersistentVolume, and the host agent's live
// change of the disk's limits with its VirtualMachine status writes: work that every tenant's
// volumes share, which a guest toggling its claims' classes in a loop would otherwise take
// from all. modifiesBurst changes at once, then one every six seconds.
const (
	modifiesBurst     = 20
	modifiesPerSecond = 1.0 / 6
)

// modifyBudget takes one VolumeAttributesClass change from the budget of the guest cluster
// that owns the claim (params: csi-resizer's --extra-modify-metadata), and refuses the change,
// ResourceExhausted, when it is spent: csi-resizer keeps the claim's modification InProgress,
// with the refusal in its ModifyVolumeError condition, and calls again after its backoff. A
// claim no guest cluster owns (the admin's) has no budget.
func (s *controllerServer) modifyBudget(ctx context.Context, params map[string]string) error {
	cluster, _, ok, err := s.owner(ctx, params)
	if err != nil || !ok {
		return err
	}
	ns, name := params[pvcNamespaceParameter], params[pvcNameParameter]
	if !s.modifies.Allow(ns + "/" + cluster) {
		return status.Errorf(codes.ResourceExhausted,
			"guest cluster %s/%s has spent its budget of VolumeAttributesClass changes (%d at once, then one every %.0f s): PVC %s/%s changes class when the budget allows",
			ns, cluster, modifiesBurst, 1/modifiesPerSecond, ns, name)
	}
	return nil
}

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
// otherwise go to the host with the most room, anywhere. nil means no restriction: no
// parameters there, or a claim no guest cluster owns.
func (s *controllerServer) guestHosts(ctx context.Context, params map[string]string) ([]string, error) {
	cluster, hosts, ok, err := s.owner(ctx, params)
	switch {
	case err != nil || !ok:
		return nil, err
	case len(hosts) == 0:
		return nil, status.Errorf(codes.ResourceExhausted,
			"PVC %s/%s belongs to guest cluster %s, which runs no VirtualMachine on any host yet: its volumes go only to the hosts of its VirtualMachines",
			params[pvcNamespaceParameter], params[pvcNameParameter], cluster)
	}
	slices.Sort(hosts)
	return hosts, nil
}

// owner finds the guest cluster that owns the claim the sidecar's metadata parameters name,
// and its hosts, in the tenancy parameters of the claim's namespace (tenancy.HostsOfOwner). ok
// is false for a claim no guest cluster owns, or no claim named. The parameters are read live,
// by name (one read per call; no cache of ConfigMaps).
func (s *controllerServer) owner(ctx context.Context, params map[string]string) (cluster string, hosts []string, ok bool, err error) {
	name, ns := params[pvcNameParameter], params[pvcNamespaceParameter]
	if name == "" || ns == "" {
		return "", nil, false, nil
	}
	cm := &corev1.ConfigMap{}
	switch err := s.apiReader.Get(ctx, client.ObjectKey{Namespace: ns, Name: tenancy.ParamsConfigMap}, cm); {
	case apierrors.IsNotFound(err):
		return "", nil, false, nil
	case err != nil:
		return "", nil, false, csiserver.APIError(err, "read the tenancy parameters %s/%s", ns, tenancy.ParamsConfigMap)
	}
	cluster, hosts, ok = tenancy.HostsOfOwner(cm.Data, name)
	return cluster, hosts, ok, nil
}
