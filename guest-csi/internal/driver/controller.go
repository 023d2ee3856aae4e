package driver

import (
	"context"
	"encoding/json"
	"fmt"
	"time"
	"unicode/utf8"

	"github.com/container-storage-interface/spec/lib/go/csi"
	groupsnapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumegroupsnapshot/v1"
	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pvbridge.io/guest-csi/internal/request"
	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
	"pvbridge.io/pkg/await"
	"pvbridge.io/pkg/csiserver"
	"pvbridge.io/pkg/events"
	"pvbridge.io/pkg/keylock"
	"pvbridge.io/pkg/names"
	"pvbridge.io/pkg/tenancy"
)

const (
	// selectedNodeAnnotation puts a management PVC on a host: the annotation the scheduler sets,
	// which csi-provisioner follows and removes when the host has no room.
	selectedNodeAnnotation = "volume.kubernetes.io/selected-node"

	kindPVC           = "PersistentVolumeClaim"
	kindSnapshot      = "VolumeSnapshot"
	kindGroupSnapshot = "VolumeGroupSnapshot"
	kindVM            = "VirtualMachine"
)

// mgmtClient is the driver's view of the management cluster (mgmt.Conn): Get and List read
// the cache of the guest's own objects, Live reads the apiserver.
type mgmtClient interface {
	client.Reader
	Create(ctx context.Context, obj client.Object, opts ...client.CreateOption) error
	Patch(ctx context.Context, obj client.Object, patch client.Patch, opts ...client.PatchOption) error
	Delete(ctx context.Context, obj client.Object, opts ...client.DeleteOption) error
	Live() client.Reader
	Namespace() string
}

// controllerConfig is what the controller service knows of its guest cluster and of the
// management cluster's classes.
type controllerConfig struct {
	// cluster is the guest cluster; its Namespace is filled from the connection per call.
	cluster tenancy.Cluster
	// storageClass and snapshotClass apply when the guest class names none.
	storageClass, snapshotClass string
	// capacityNamespace holds mgmt-csi's CSIStorageCapacity objects.
	capacityNamespace string
	// warningsPeriod is Options.WarningsPeriod, 0 for defaultWarningsPeriod.
	warningsPeriod time.Duration
}

// controllerServer is the Controller service. It holds no state of its own: every volume is a
// management PVC named after the guest's request, every attachment an entry of a
// VirtualMachine's spec.volumes, every snapshot a management VolumeSnapshot; a retried call,
// or a restarted controller, finds them and continues.
type controllerServer struct {
	csi.UnimplementedControllerServer

	cfg   controllerConfig
	mgmt  mgmtClient
	guest kubernetes.Interface // reads the guest PVC's labels; nil: not mirrored
	hub   *await.Hub
	locks keylock.Locks
	edits volumeEdits
	// warnings answers the waits that run out from one List of the namespace's Warning Events
	// every cfg.warningsPeriod.
	warnings *events.Warnings
}

// defaultWarningsPeriod is Options.WarningsPeriod's default.
const defaultWarningsPeriod = 10 * time.Second

var _ csi.ControllerServer = (*controllerServer)(nil)

func newControllerServer(cfg controllerConfig, m mgmtClient, guest kubernetes.Interface, hub *await.Hub) *controllerServer {
	if cfg.warningsPeriod <= 0 {
		cfg.warningsPeriod = defaultWarningsPeriod
	}
	return &controllerServer{cfg: cfg, mgmt: m, guest: guest, hub: hub, warnings: events.NewWarnings(m.Live(), cfg.warningsPeriod)}
}

// cluster returns the guest cluster with the namespace of the current management session.
func (s *controllerServer) cluster() (tenancy.Cluster, error) {
	c := s.cfg.cluster
	c.Namespace = s.mgmt.Namespace()
	if c.Namespace == "" {
		return c, status.Error(codes.Unavailable, "not connected to the management cluster yet")
	}
	return c, nil
}

// lock takes the lock of a volume or snapshot, or answers Aborted while another call on it runs.
func (s *controllerServer) lock(id string) (func(), error) {
	if !s.locks.TryLock(id) {
		return nil, status.Errorf(codes.Aborted, "an operation on %s is in progress", id)
	}
	return func() { s.locks.Unlock(id) }, nil
}

func (s *controllerServer) ControllerGetCapabilities(context.Context, *csi.ControllerGetCapabilitiesRequest) (*csi.ControllerGetCapabilitiesResponse, error) {
	return csiserver.ControllerCapabilities(
		csi.ControllerServiceCapability_RPC_CREATE_DELETE_VOLUME,
		csi.ControllerServiceCapability_RPC_PUBLISH_UNPUBLISH_VOLUME,
		csi.ControllerServiceCapability_RPC_GET_CAPACITY,
		csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT,
		csi.ControllerServiceCapability_RPC_LIST_SNAPSHOTS,
		csi.ControllerServiceCapability_RPC_CLONE_VOLUME,
		csi.ControllerServiceCapability_RPC_EXPAND_VOLUME,
		csi.ControllerServiceCapability_RPC_GET_VOLUME_HEALTH,
		csi.ControllerServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER,
		csi.ControllerServiceCapability_RPC_MODIFY_VOLUME,
	), nil
}

// CreateVolume gets or creates the management PVC of the volume, on the host of the VM the
// guest scheduler chose, and waits until it is Bound.
func (s *controllerServer) CreateVolume(ctx context.Context, req *csi.CreateVolumeRequest) (*csi.CreateVolumeResponse, error) {
	if err := validateCSIName(req.GetName()); err != nil {
		return nil, err
	}
	if err := validateCapabilities(req.GetVolumeCapabilities()); err != nil {
		return nil, err
	}
	params, err := request.ParseVolumeParameters(req.GetParameters(), s.cfg.storageClass)
	if err != nil {
		return nil, err
	}
	if params.AttributesClass, err = request.ParseMutableParameters(req.GetMutableParameters()); err != nil {
		return nil, err
	}
	size, err := csiserver.RequestedSize(req.GetCapacityRange())
	if err != nil {
		return nil, err
	}
	c, err := s.cluster()
	if err != nil {
		return nil, err
	}
	name := request.MgmtName(c.UID, "pvc-", req.GetName())
	unlock, err := s.lock(name)
	if err != nil {
		return nil, err
	}
	defer unlock()
	ctx = klog.NewContext(ctx, klog.FromContext(ctx).WithValues("volumeID", name))
	host := topologyHost(req.GetAccessibilityRequirements())
	source, err := s.dataSource(ctx, c, req.GetVolumeContentSource())
	if err != nil {
		return nil, err
	}

	pvc := &corev1.PersistentVolumeClaim{}
	switch err := s.mgmt.Get(ctx, client.ObjectKey{Namespace: c.Namespace, Name: name}, pvc); {
	case apierrors.IsNotFound(err):
		pvc = s.newClaim(ctx, c, name, req.GetName(), host, size, params, source)
		if err := s.mgmt.Create(ctx, pvc); err != nil {
			return nil, csiserver.APIError(err, "create management PVC %s/%s", c.Namespace, name)
		}
		klog.FromContext(ctx).V(2).Info("Created management PVC", "host", host, "size", size, "class", params.Class)
	case err != nil:
		return nil, csiserver.APIError(err, "get management PVC %s/%s", c.Namespace, name)
	default:
		if err := compatibleClaim(pvc, c, size, req.GetCapacityRange().GetLimitBytes(), params.Class, source); err != nil {
			return nil, err
		}
		// The guest scheduler chose another VM since the last call (csi-provisioner had no
		// room on the former host and dropped its selection): follow it.
		if pvc.Status.Phase == corev1.ClaimPending && host != "" && pvc.Annotations[selectedNodeAnnotation] != host {
			if err := s.update(ctx, pvc, func() bool {
				if pvc.Status.Phase != corev1.ClaimPending {
					return false
				}
				metav1.SetMetaDataAnnotation(&pvc.ObjectMeta, selectedNodeAnnotation, host)
				return true
			}); apierrors.IsNotFound(err) {
				// Given up and deleted since the cache read it (its host had no room, see
				// waitBound): the next call, once the cache has seen that, makes it anew here.
				return nil, status.Errorf(codes.Aborted, "management PVC %s/%s was deleted since it was read (its host had no room); retrying on host %s", c.Namespace, name, host)
			} else if err != nil {
				return nil, csiserver.APIError(err, "move management PVC %s/%s to host %s", c.Namespace, name, host)
			}
		}
	}
	if pvc, err = s.waitBound(ctx, pvc, host); err != nil {
		return nil, err
	}
	if limit := req.GetCapacityRange().GetLimitBytes(); limit > 0 && capacityOf(pvc) > limit {
		return nil, status.Errorf(codes.AlreadyExists, "management PVC %s/%s is bound with %d bytes, more than limit_bytes %d", c.Namespace, name, capacityOf(pvc), limit)
	}
	vol := &csi.Volume{VolumeId: name, CapacityBytes: capacityOf(pvc), ContentSource: req.GetVolumeContentSource()}
	// A replicated volume is served by whichever host runs the VM it is attached to; the
	// selected host only places its first replica.
	if h := pvc.Annotations[selectedNodeAnnotation]; h != "" && !params.Replicated {
		vol.AccessibleTopology = []*csi.Topology{{Segments: map[string]string{TopologyKey: h}}}
	}
	return &csi.CreateVolumeResponse{Volume: vol}, nil
}

// newClaim is the management PVC of a new volume.
func (s *controllerServer) newClaim(ctx context.Context, c tenancy.Cluster, name, csiName, host string, size int64, p request.VolumeParams, source *corev1.TypedLocalObjectReference) *corev1.PersistentVolumeClaim {
	pvc := &corev1.PersistentVolumeClaim{
		ObjectMeta: mgmtObjectMeta(c, name, csiName),
		Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			VolumeMode:  ptr.To(corev1.PersistentVolumeBlock),
			Resources: corev1.VolumeResourceRequirements{
				Requests: corev1.ResourceList{corev1.ResourceStorage: *resource.NewQuantity(size, resource.BinarySI)},
			},
			DataSource: source,
		},
	}
	if p.Class != "" {
		pvc.Spec.StorageClassName = ptr.To(p.Class)
	}
	if p.AttributesClass != "" {
		pvc.Spec.VolumeAttributesClassName = ptr.To(p.AttributesClass)
	}
	if host != "" {
		pvc.Annotations[selectedNodeAnnotation] = host
	}
	if v := guestObject(p.GuestPVC); v != "" {
		pvc.Annotations[tenancy.GuestPVCAnnotation] = v
		if labels := s.guestLabels(ctx, p); labels != "" {
			pvc.Annotations[tenancy.GuestLabelsAnnotation] = labels
		}
	}
	if p.GuestPV != "" {
		pvc.Annotations[tenancy.GuestPVAnnotation] = p.GuestPV
	}
	return pvc
}

// mgmtObjectMeta is the metadata of a new management object of the cluster for a CSI name:
// the cluster's labels and the name in tenancy.CSINameAnnotation.
func mgmtObjectMeta(c tenancy.Cluster, name, csiName string) metav1.ObjectMeta {
	return metav1.ObjectMeta{
		Namespace:   c.Namespace,
		Name:        name,
		Labels:      c.Labels(),
		Annotations: map[string]string{tenancy.CSINameAnnotation: csiName},
	}
}

// guestLabels returns the guest PVC's labels as JSON, "" if there are none or they cannot be
// read (they are for people, and never worth failing a provisioning for).
func (s *controllerServer) guestLabels(ctx context.Context, p request.VolumeParams) string {
	if s.guest == nil {
		return ""
	}
	pvc, err := s.guest.CoreV1().PersistentVolumeClaims(p.GuestPVC.Namespace).Get(ctx, p.GuestPVC.Name, metav1.GetOptions{})
	if err != nil {
		klog.FromContext(ctx).V(2).Info("Cannot read the guest PVC's labels", "pvc", p.GuestPVC, "err", err)
		return ""
	}
	if len(pvc.Labels) == 0 {
		return ""
	}
	b, err := json.Marshal(pvc.Labels)
	if err != nil {
		return ""
	}
	if n := utf8.RuneCount(b); n > tenancy.MaxGuestLabelsLength {
		klog.FromContext(ctx).V(2).Info("The guest PVC's labels are too long to copy", "pvc", p.GuestPVC, "characters", n, "max", tenancy.MaxGuestLabelsLength)
		return ""
	}
	return string(b)
}

// compatibleClaim checks that an existing management PVC is the volume a repeated
// CreateVolume asks for.
func compatibleClaim(pvc *corev1.PersistentVolumeClaim, c tenancy.Cluster, size, limit int64, class string, source *corev1.TypedLocalObjectReference) error {
	what := fmt.Sprintf("management PVC %s/%s", pvc.Namespace, pvc.Name)
	requested := pvc.Spec.Resources.Requests[corev1.ResourceStorage]
	switch {
	case tenancy.AccessOf(pvc, c) != tenancy.Owned:
		return status.Errorf(codes.AlreadyExists, "%s exists and was not created for cluster %s", what, c.Name)
	case requested.Value() < size:
		return status.Errorf(codes.AlreadyExists, "%s exists with %d bytes, fewer than the %d asked for", what, requested.Value(), size)
	case limit > 0 && requested.Value() > limit:
		return status.Errorf(codes.AlreadyExists, "%s exists with %d bytes, more than limit_bytes %d", what, requested.Value(), limit)
	case class != "" && ptr.Deref(pvc.Spec.StorageClassName, "") != class:
		return status.Errorf(codes.AlreadyExists, "%s exists with StorageClass %q, not %q", what, ptr.Deref(pvc.Spec.StorageClassName, ""), class)
	case !equalSource(pvc.Spec.DataSource, source):
		return status.Errorf(codes.AlreadyExists, "%s exists with another content source", what)
	}
	return nil
}

func equalSource(a, b *corev1.TypedLocalObjectReference) bool {
	if a == nil || b == nil {
		return a == b
	}
	return ptr.Deref(a.APIGroup, "") == ptr.Deref(b.APIGroup, "") && a.Kind == b.Kind && a.Name == b.Name
}

// dataSource resolves a content source to the management PVC's dataSource: a VolumeSnapshot or
// a PVC of the namespace that the cluster owns or that is shared with it. Anything else is
// NotFound.
func (s *controllerServer) dataSource(ctx context.Context, c tenancy.Cluster, src *csi.VolumeContentSource) (*corev1.TypedLocalObjectReference, error) {
	switch {
	case src == nil:
		return nil, nil
	case src.GetSnapshot() != nil:
		id := src.GetSnapshot().GetSnapshotId()
		if _, _, err := s.accessible(ctx, c, kindSnapshot, id); err != nil {
			return nil, err
		}
		return &corev1.TypedLocalObjectReference{APIGroup: ptr.To(snapshotGroup), Kind: kindSnapshot, Name: id}, nil
	case src.GetVolume() != nil:
		id := src.GetVolume().GetVolumeId()
		if _, _, err := s.accessible(ctx, c, kindPVC, id); err != nil {
			return nil, err
		}
		return &corev1.TypedLocalObjectReference{Kind: kindPVC, Name: id}, nil
	}
	return nil, status.Error(codes.InvalidArgument, "volume_content_source has neither a snapshot nor a volume")
}

// accessible reads management object id of kind (PVC, VolumeSnapshot or VolumeGroupSnapshot)
// and tells what the cluster may do with it. A missing object or an invalid ID is NotFound
// (lookup); a foreign one FailedPrecondition, with the reason, on every call. A member snapshot of
// one of the cluster's group snapshots (tenancy.GroupMember) is Shared: restored like any of its
// snapshots, deleted only with its group.
func (s *controllerServer) accessible(ctx context.Context, c tenancy.Cluster, kind, id string) (client.Object, tenancy.Access, error) {
	obj, err := s.lookup(ctx, c, kind, id)
	if err != nil {
		return nil, tenancy.Foreign, err
	}
	access := tenancy.AccessOf(obj, c)
	if access == tenancy.Foreign && kind == kindSnapshot {
		if access, err = s.groupAccess(ctx, c, obj); err != nil {
			return nil, tenancy.Foreign, err
		}
	}
	if access == tenancy.Foreign {
		return obj, access, status.Errorf(codes.FailedPrecondition,
			"management %s %s/%s was not created for cluster %s and is not shared with it (annotation %s)", kind, c.Namespace, id, c.Name, tenancy.SharedWithAnnotation)
	}
	return obj, access, nil
}

// groupAccess tells whether snap, a management VolumeSnapshot the cluster neither owns nor was
// shared, is a member of one of its group snapshots (Shared) or not (Foreign): its group, read
// by the member's ownerReference, must carry the cluster's UID label (tenancy.GroupMember).
func (s *controllerServer) groupAccess(ctx context.Context, c tenancy.Cluster, snap client.Object) (tenancy.Access, error) {
	ref, ok := tenancy.GroupOf(snap)
	if !ok {
		return tenancy.Foreign, nil
	}
	group, err := s.lookup(ctx, c, kindGroupSnapshot, ref.Name)
	switch {
	case status.Code(err) == codes.NotFound:
		return tenancy.Foreign, nil
	case err != nil:
		return tenancy.Foreign, err
	case tenancy.GroupMember(snap, group, c):
		return tenancy.Shared, nil
	}
	return tenancy.Foreign, nil
}

// lookup reads management object id of kind. The cache holds what the cluster owns; anything
// else (a shared object, a group snapshot's member, an object the cache has not seen yet) is
// read from the apiserver. A missing object or an invalid ID is NotFound.
func (s *controllerServer) lookup(ctx context.Context, c tenancy.Cluster, kind, id string) (client.Object, error) {
	if !request.ValidHandle(id) {
		return nil, status.Errorf(codes.NotFound, "%q is not the name of a management %s", id, kind)
	}
	obj := newObject(kind)
	key := client.ObjectKey{Namespace: c.Namespace, Name: id}
	err := s.mgmt.Get(ctx, key, obj)
	if apierrors.IsNotFound(err) {
		err = s.mgmt.Live().Get(ctx, key, obj)
	}
	switch {
	case apierrors.IsNotFound(err):
		return nil, status.Errorf(codes.NotFound, "management %s %s/%s does not exist", kind, c.Namespace, id)
	case err != nil:
		return nil, csiserver.APIError(err, "get management %s %s/%s", kind, c.Namespace, id)
	}
	return obj, nil
}

func newObject(kind string) client.Object {
	switch kind {
	case kindSnapshot:
		return &snapshotv1.VolumeSnapshot{}
	case kindGroupSnapshot:
		return &groupsnapshotv1.VolumeGroupSnapshot{}
	case kindVM:
		return &vmv1.VirtualMachine{}
	}
	return &corev1.PersistentVolumeClaim{}
}

// waitBound waits until the management PVC is Bound. When csi-provisioner drops the host this
// driver selected (the host has no room for the volume), the PVC, which never had a volume, is
// deleted and the call fails with ResourceExhausted, so that the guest scheduler picks another
// VM and nothing is left behind.
func (s *controllerServer) waitBound(ctx context.Context, pvc *corev1.PersistentVolumeClaim, host string) (*corev1.PersistentVolumeClaim, error) {
	got := &corev1.PersistentVolumeClaim{}
	placed := false
	var exhausted bool
	err := s.await(ctx, kindPVC, pvc.Name, got, func(found bool) (bool, error) {
		switch {
		case !found:
			return false, nil // the cache has not seen the create yet
		case got.DeletionTimestamp != nil:
			return false, status.Errorf(codes.Aborted, "management PVC %s/%s is being deleted", got.Namespace, got.Name)
		case got.Status.Phase == corev1.ClaimBound:
			return true, nil
		case got.Status.Phase == corev1.ClaimLost:
			return false, status.Errorf(codes.Internal, "management PVC %s/%s lost its volume %s", got.Namespace, got.Name, got.Spec.VolumeName)
		}
		selected := got.Annotations[selectedNodeAnnotation]
		placed = placed || (host != "" && selected == host)
		exhausted = placed && selected == ""
		return exhausted, nil
	})
	if err != nil {
		return nil, err
	}
	if exhausted {
		// This object's own warning, now: the one that says why no host had room, written
		// just before csi-provisioner gave the claim up.
		reason := s.warning(ctx, got, true)
		if err := s.deleteIfOwned(ctx, got); err != nil {
			return nil, err
		}
		return nil, status.Errorf(codes.ResourceExhausted, "host %s has no room for management PVC %s/%s%s", host, got.Namespace, got.Name, reason)
	}
	return got, nil
}

// deleteOwned deletes management object id of kind (a VolumeSnapshot or a VolumeGroupSnapshot)
// if the cluster owns it and, with wait, waits until it is gone. A missing object, or an ID that
// can name none, is success; one shared with the cluster (or a member of its group snapshots) is
// released: left alone; a foreign one is refused (FailedPrecondition).
func (s *controllerServer) deleteOwned(ctx context.Context, kind, id string, wait bool) error {
	if !request.ValidHandle(id) {
		return nil
	}
	c, err := s.cluster()
	if err != nil {
		return err
	}
	unlock, err := s.lock(id)
	if err != nil {
		return err
	}
	defer unlock()
	obj, access, err := s.accessible(ctx, c, kind, id)
	switch {
	case status.Code(err) == codes.NotFound:
		return nil
	case err != nil:
		return err
	case access == tenancy.Shared:
		klog.FromContext(ctx).Info("Released a management object shared with the cluster; it is not deleted", "kind", kind, "id", id)
		return nil
	}
	if err := s.deleteIfOwned(ctx, obj); err != nil {
		return err
	}
	if !wait {
		return nil
	}
	return s.await(ctx, kind, id, newObject(kind), func(found bool) (bool, error) { return !found, nil })
}

// deleteIfOwned deletes obj if it is the object that was read (UID precondition: never a newer
// one of the same name). A missing object is success.
func (s *controllerServer) deleteIfOwned(ctx context.Context, obj client.Object) error {
	if obj.GetDeletionTimestamp() != nil {
		return nil
	}
	uid := obj.GetUID()
	err := s.mgmt.Delete(ctx, obj, client.Preconditions{UID: &uid})
	if err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
		return csiserver.APIError(err, "delete %s/%s", obj.GetNamespace(), obj.GetName())
	}
	return nil
}

// await waits (csiserver.Await) until check reports done or fails. check sees obj as the
// cache has it (found is false when the cache has no such object). A wait that runs out
// answers DeadlineExceeded with the management side's latest warning about obj: the sidecar
// retries, and the guest object's Events show why it waits.
func (s *controllerServer) await(ctx context.Context, kind, name string, obj client.Object, check func(found bool) (bool, error)) error {
	ns := s.mgmt.Namespace()
	var failure error
	err := csiserver.Await(ctx, s.hub, await.Key{Kind: kind, Namespace: ns, Name: name}, fmt.Sprintf("%s %s/%s", kind, ns, name),
		func() string { return s.warning(ctx, obj, false) },
		func(ctx context.Context) (bool, error) {
			err := s.mgmt.Get(ctx, client.ObjectKey{Namespace: ns, Name: name}, obj)
			if err != nil && !apierrors.IsNotFound(err) {
				return false, err
			}
			done, f := check(err == nil)
			failure = f
			return done || f != nil, nil
		})
	if err != nil {
		return err
	}
	return failure
}

// warning returns ": <reason>: <message>" of the latest Warning Event about obj in the
// management cluster, "" if there is none or obj was never seen: fresh reads obj's Events now,
// otherwise the namespace's shared List answers (at most cfg.warningsPeriod old). It waits at
// most a second: the warning only adds to a message.
func (s *controllerServer) warning(ctx context.Context, obj client.Object, fresh bool) string {
	ctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	if fresh {
		return events.LatestWarning(ctx, s.mgmt.Live(), obj)
	}
	return s.warnings.Latest(ctx, obj)
}

// DeleteVolume deletes the management PVC of a volume the cluster created, once no VM uses it.
// A volume shared with the cluster is only released: it stays. A foreign one is refused.
func (s *controllerServer) DeleteVolume(ctx context.Context, req *csi.DeleteVolumeRequest) (*csi.DeleteVolumeResponse, error) {
	id := req.GetVolumeId()
	if id == "" {
		return nil, status.Error(codes.InvalidArgument, "volume_id is required")
	}
	if !request.ValidHandle(id) {
		return &csi.DeleteVolumeResponse{}, nil // no such volume can exist
	}
	c, err := s.cluster()
	if err != nil {
		return nil, err
	}
	unlock, err := s.lock(id)
	if err != nil {
		return nil, err
	}
	defer unlock()
	logger := klog.FromContext(ctx).WithValues("volumeID", id)
	// Only an owned volume is deleted. Deleting a guest PV of any other handle releases it and
	// touches nothing: a shared volume stays for its owner, and a guest PV naming a volume the
	// cluster may not use (or none) was never usable, so refusing would only leave the guest PV
	// stuck behind its finalizer.
	obj, access, err := s.accessible(ctx, c, kindPVC, id)
	switch {
	case status.Code(err) == codes.NotFound:
		return &csi.DeleteVolumeResponse{}, nil
	case access == tenancy.Foreign && status.Code(err) == codes.FailedPrecondition:
		logger.Info("Released a guest PV naming a management PVC the cluster may not use; the PVC is not touched", "reason", status.Convert(err).Message())
		return &csi.DeleteVolumeResponse{}, nil
	case err != nil:
		return nil, err
	case access == tenancy.Shared:
		logger.Info("Released a management PVC shared with the cluster; it is not deleted")
		return &csi.DeleteVolumeResponse{}, nil
	}
	// A deletion under way (a call retried while the management side releases the volume) was
	// checked before it began: only the wait is left.
	if obj.GetDeletionTimestamp() == nil {
		if err := s.notInUse(ctx, c, id); err != nil {
			return nil, err
		}
		if err := s.deleteIfOwned(ctx, obj); err != nil {
			return nil, err
		}
		logger.V(2).Info("Deleting management PVC")
	}
	if err := s.await(ctx, kindPVC, id, &corev1.PersistentVolumeClaim{}, func(found bool) (bool, error) { return !found, nil }); err != nil {
		return nil, err
	}
	return &csi.DeleteVolumeResponse{}, nil
}

// notInUse fails with FailedPrecondition while a VM of the namespace, of any cluster, has the
// claim in its spec or still in its status (detaching). Every answer is the apiserver's: a VM
// the cache shows with the claim (a DeleteVolume retried while its detach runs) is read live
// (liveHolder), one Get instead of a List of the namespace; otherwise a live List decides, since
// the cache may not have seen a publish yet and holds no other cluster's VMs.
func (s *controllerServer) notInUse(ctx context.Context, c tenancy.Cluster, claim string) error {
	inUse := func(vm *vmv1.VirtualMachine) error {
		return status.Errorf(codes.FailedPrecondition, "management PVC %s/%s is still attached to VirtualMachine %s", c.Namespace, claim, vm.Name)
	}
	cached := &vmv1.VirtualMachineList{}
	if err := s.mgmt.List(ctx, cached, client.InNamespace(c.Namespace)); err != nil {
		return csiserver.APIError(err, "list the VirtualMachines of namespace %s", c.Namespace)
	}
	holder, err := s.liveHolder(ctx, cached.Items, claim)
	switch {
	case err != nil:
		return err
	case holder != nil:
		return inUse(holder)
	}
	live := &vmv1.VirtualMachineList{}
	if err := s.mgmt.Live().List(ctx, live, client.InNamespace(c.Namespace)); err != nil {
		return csiserver.APIError(err, "list the VirtualMachines of namespace %s", c.Namespace)
	}
	for i := range live.Items {
		if usesClaim(&live.Items[i], claim) {
			return inUse(&live.Items[i])
		}
	}
	return nil
}

func (s *controllerServer) ValidateVolumeCapabilities(ctx context.Context, req *csi.ValidateVolumeCapabilitiesRequest) (*csi.ValidateVolumeCapabilitiesResponse, error) {
	switch {
	case req.GetVolumeId() == "":
		return nil, status.Error(codes.InvalidArgument, "volume_id is required")
	case len(req.GetVolumeCapabilities()) == 0:
		return nil, status.Error(codes.InvalidArgument, "volume_capabilities are required")
	}
	c, err := s.cluster()
	if err != nil {
		return nil, err
	}
	if _, _, err := s.accessible(ctx, c, kindPVC, req.GetVolumeId()); err != nil {
		return nil, err
	}
	if _, err := request.ParseVolumeParameters(req.GetParameters(), ""); err != nil {
		return &csi.ValidateVolumeCapabilitiesResponse{Message: status.Convert(err).Message()}, nil
	}
	if err := validateCapabilities(req.GetVolumeCapabilities()); err != nil {
		return &csi.ValidateVolumeCapabilitiesResponse{Message: status.Convert(err).Message()}, nil
	}
	return &csi.ValidateVolumeCapabilitiesResponse{Confirmed: &csi.ValidateVolumeCapabilitiesResponse_Confirmed{
		VolumeContext:      req.GetVolumeContext(),
		VolumeCapabilities: req.GetVolumeCapabilities(),
		Parameters:         req.GetParameters(),
	}}, nil
}

// GetCapacity reports the room for the guest class's management StorageClass on a host (the
// topology segment), or on all hosts that run the cluster's VMs, from the CSIStorageCapacity
// objects mgmt-csi's provisioner publishes.
func (s *controllerServer) GetCapacity(ctx context.Context, req *csi.GetCapacityRequest) (*csi.GetCapacityResponse, error) {
	if len(req.GetVolumeCapabilities()) > 0 {
		if err := validateCapabilities(req.GetVolumeCapabilities()); err != nil {
			return &csi.GetCapacityResponse{}, nil //nolint:nilerr // unsupported capabilities have no capacity
		}
	}
	params, err := request.ParseVolumeParameters(req.GetParameters(), s.cfg.storageClass)
	if err != nil {
		return nil, err
	}
	hosts := map[string]bool{}
	if h, ok := req.GetAccessibleTopology().GetSegments()[TopologyKey]; ok {
		hosts[h] = true
	} else {
		vms := &vmv1.VirtualMachineList{}
		if err := s.mgmt.List(ctx, vms); err != nil {
			return nil, csiserver.APIError(err, "list the cluster's VirtualMachines")
		}
		for _, vm := range vms.Items {
			if vm.Status.Host != "" {
				hosts[vm.Status.Host] = true
			}
		}
	}
	// Any recent List will do (resourceVersion 0: the apiserver's watch cache answers without
	// first catching up with etcd): the objects are themselves estimates, refreshed by
	// csi-provisioner, and csi-provisioner asks again after every volume it provisions.
	list := &storagev1.CSIStorageCapacityList{}
	if err := s.mgmt.Live().List(ctx, list, client.InNamespace(s.cfg.capacityNamespace), &client.ListOptions{Raw: &metav1.ListOptions{ResourceVersion: "0"}}); err != nil {
		return nil, csiserver.APIError(err, "list the management cluster's CSIStorageCapacity in namespace %s", s.cfg.capacityNamespace)
	}
	var available, largest int64
	for _, c := range list.Items {
		if (params.Class != "" && c.StorageClassName != params.Class) || c.NodeTopology == nil || !hosts[c.NodeTopology.MatchLabels[names.PmemTopologyKey]] {
			continue
		}
		if c.Capacity != nil {
			available += c.Capacity.Value()
		}
		if c.MaximumVolumeSize != nil {
			largest = max(largest, c.MaximumVolumeSize.Value())
		}
	}
	return &csi.GetCapacityResponse{AvailableCapacity: available, MaximumVolumeSize: wrapperspb.Int64(largest)}, nil
}

// ControllerExpandVolume grows the management PVC of a volume the cluster owns and waits until
// the management side reports the new size.
func (s *controllerServer) ControllerExpandVolume(ctx context.Context, req *csi.ControllerExpandVolumeRequest) (*csi.ControllerExpandVolumeResponse, error) {
	id := req.GetVolumeId()
	switch {
	case id == "":
		return nil, status.Error(codes.InvalidArgument, "volume_id is required")
	case req.GetCapacityRange() == nil:
		return nil, status.Error(codes.InvalidArgument, "capacity_range is required")
	}
	size, err := csiserver.RequestedSize(req.GetCapacityRange())
	if err != nil {
		return nil, err
	}
	if req.GetVolumeCapability() != nil {
		if err := validateCapabilities([]*csi.VolumeCapability{req.GetVolumeCapability()}); err != nil {
			return nil, err
		}
	}
	c, err := s.cluster()
	if err != nil {
		return nil, err
	}
	// The volume is locked only while its claim's request is written: the wait after it may
	// last until the volume is detached (a replicated one grows only then), which the
	// volume's ControllerUnpublishVolume must not wait behind.
	unlock, err := s.lock(id)
	if err != nil {
		return nil, err
	}
	err = s.requestSize(ctx, c, id, size)
	unlock()
	if err != nil {
		return nil, err
	}
	got := &corev1.PersistentVolumeClaim{}
	if err := s.await(ctx, kindPVC, id, got, func(found bool) (bool, error) {
		if !found {
			return false, status.Errorf(codes.NotFound, "management PVC %s/%s is gone", c.Namespace, id)
		}
		return capacityOf(got) >= size, nil
	}); err != nil {
		return nil, err
	}
	return &csi.ControllerExpandVolumeResponse{
		CapacityBytes:         capacityOf(got),
		NodeExpansionRequired: !isBlock(req.GetVolumeCapability()),
	}, nil
}

// requestSize asks for size in management PVC id of cluster c, which the cluster must own.
func (s *controllerServer) requestSize(ctx context.Context, c tenancy.Cluster, id string, size int64) error {
	pvc, err := s.ownedClaim(ctx, c, id, "expand it")
	if err != nil {
		return err
	}
	if err := s.update(ctx, pvc, func() bool {
		if requested := pvc.Spec.Resources.Requests[corev1.ResourceStorage]; requested.Value() >= size {
			return false
		}
		pvc.Spec.Resources.Requests[corev1.ResourceStorage] = *resource.NewQuantity(size, resource.BinarySI)
		klog.FromContext(ctx).V(2).Info("Expanding management PVC", "volumeID", id, "size", size)
		return true
	}); err != nil {
		return csiserver.APIError(err, "expand management PVC %s/%s", c.Namespace, id)
	}
	return nil
}

// ownedClaim returns management PVC id of cluster c, which the cluster must own to change it
// (what it is to do, for the error).
func (s *controllerServer) ownedClaim(ctx context.Context, c tenancy.Cluster, id, what string) (*corev1.PersistentVolumeClaim, error) {
	obj, access, err := s.accessible(ctx, c, kindPVC, id)
	if err != nil {
		return nil, err
	}
	if access != tenancy.Owned {
		return nil, status.Errorf(codes.FailedPrecondition, "management PVC %s/%s is shared with cluster %s, not owned by it: only the management cluster's admin can %s", c.Namespace, id, c.Name, what)
	}
	return obj.(*corev1.PersistentVolumeClaim), nil
}

// capacityOf is the size a management PVC is bound with.
func capacityOf(pvc *corev1.PersistentVolumeClaim) int64 {
	q := pvc.Status.Capacity[corev1.ResourceStorage]
	return q.Value()
}
