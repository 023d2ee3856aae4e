package driver

import (
	"context"
	"fmt"
	"slices"
	"sort"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"
	"google.golang.org/protobuf/types/known/wrapperspb"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/klog/v2"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pvbridge.io/mgmt-csi/internal/agent"
	"pvbridge.io/mgmt-csi/internal/ids"
	pmemv1 "pvbridge.io/pkg/apis/pmem/v1alpha1"
	"pvbridge.io/pkg/await"
	"pvbridge.io/pkg/budget"
	"pvbridge.io/pkg/csiserver"
	"pvbridge.io/pkg/keylock"
	"pvbridge.io/pkg/names"
)

const (
	// TopologyKey is the topology segment of a volume: the node whose PMEM holds it.
	TopologyKey = names.PmemTopologyKey

	kindVolume   = "PmemVolume"
	kindSnapshot = "PmemSnapshot"
)

// controllerServer is the central controller. It records the intent of every volume and
// snapshot as a PmemVolume or PmemSnapshot object, which the node agent of the chosen node
// realizes, and waits for the result by watch. All state is in those objects: a restarted
// controller, or a retried call, finds the object and continues where the last one left off.
type controllerServer struct {
	csi.UnimplementedControllerServer

	// client writes to the apiserver; reader reads the informer cache that hub watches;
	// apiReader reads the apiserver (what the cache does not hold).
	client    client.Client
	reader    client.Reader
	apiReader client.Reader
	hub       *await.Hub
	locks     *keylock.Locks
	// modifies is each guest cluster's budget of VolumeAttributesClass changes (modifyBudget).
	modifies *budget.Keyed
}

var _ csi.ControllerServer = (*controllerServer)(nil)

func newControllerServer(c client.Client, reader, apiReader client.Reader, hub *await.Hub) *controllerServer {
	return &controllerServer{client: c, reader: reader, apiReader: apiReader, hub: hub, locks: &keylock.Locks{},
		modifies: budget.New(modifiesPerSecond, modifiesBurst)}
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
		csi.ControllerServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER,
		csi.ControllerServiceCapability_RPC_MODIFY_VOLUME,
	), nil
}

func (s *controllerServer) CreateVolume(ctx context.Context, req *csi.CreateVolumeRequest) (*csi.CreateVolumeResponse, error) {
	if req.GetName() == "" {
		return nil, status.Error(codes.InvalidArgument, "name is required")
	}
	if err := validateCapabilities(req.GetVolumeCapabilities()); err != nil {
		return nil, err
	}
	if err := validateParameters(req.GetParameters()); err != nil {
		return nil, err
	}
	if err := validateMutableParameters(req.GetMutableParameters()); err != nil {
		return nil, err
	}
	size, err := csiserver.RequestedSize(req.GetCapacityRange())
	if err != nil {
		return nil, err
	}
	replicas, err := replicaCount(req.GetParameters())
	if err != nil {
		return nil, err
	}
	id := ids.For("pvc", req.GetName())
	if !s.locks.TryLock(id) {
		return nil, status.Errorf(codes.Aborted, "an operation on volume %s is in progress", id)
	}
	defer s.locks.Unlock(id)
	logger := klog.FromContext(ctx).WithValues("volumeID", id)
	ctx = klog.NewContext(ctx, logger)
	if replicas > 1 {
		vol, err := s.createReplicated(ctx, req, id, replicas, size)
		if err != nil {
			return nil, err
		}
		return &csi.CreateVolumeResponse{Volume: csiVolume(vol, req.GetVolumeContentSource())}, nil
	}

	source, sourceNode, err := s.contentSource(ctx, req.GetVolumeContentSource(), size)
	if err != nil {
		return nil, err
	}

	vol := &pmemv1.PmemVolume{}
	err = s.reader.Get(ctx, client.ObjectKey{Name: id}, vol)
	switch {
	case apierrors.IsNotFound(err):
		// A volume without requirements of its own goes to its guest cluster's hosts, if any.
		var allowed []string
		if len(topologyNodes(req.GetAccessibilityRequirements())) == 0 {
			if allowed, err = s.guestHosts(ctx, req.GetParameters()); err != nil {
				return nil, err
			}
		}
		node := sourceNode
		switch {
		case node == "":
			if node, err = s.chooseNode(ctx, req.GetAccessibilityRequirements(), allowed, size, req.GetCapacityRange().GetLimitBytes()); err != nil {
				return nil, err
			}
		case !topologyAllows(req.GetAccessibilityRequirements(), node):
			return nil, status.Errorf(codes.ResourceExhausted, "the source of volume %s is on node %s, which the accessibility requirements exclude", id, node)
		case allowed != nil && !slices.Contains(allowed, node):
			return nil, status.Errorf(codes.ResourceExhausted, "the source of volume %s is on node %s, where its guest cluster runs no VirtualMachine (its hosts: %v)", id, node, allowed)
		}
		if vol, err = s.createVolumeObject(ctx, id, req.GetName(), node, size, source); err != nil {
			return nil, err
		}
		logger.V(2).Info("Recorded volume", "node", node, "size", size)
	case err != nil:
		return nil, csiserver.APIError(err, "get PmemVolume %s", id)
	default:
		if vol.Spec.Replicas > 1 {
			return nil, status.Errorf(codes.AlreadyExists, "volume %s exists with %d replicas, not 1", id, vol.Spec.Replicas)
		}
		if err := compatibleVolume(vol, size, req.GetCapacityRange().GetLimitBytes(), source); err != nil {
			return nil, err
		}
	}
	if vol, err = s.waitVolumeReady(ctx, vol); err != nil {
		return nil, err
	}
	return &csi.CreateVolumeResponse{Volume: csiVolume(vol, req.GetVolumeContentSource())}, nil
}

// contentSource resolves a CreateVolume content source to a PmemVolume source and the node
// that holds it: a restored or cloned volume lands where its data is.
func (s *controllerServer) contentSource(ctx context.Context, src *csi.VolumeContentSource, size int64) (*pmemv1.PmemVolumeSource, string, error) {
	switch {
	case src == nil:
		return nil, "", nil
	case src.GetSnapshot() != nil:
		id := src.GetSnapshot().GetSnapshotId()
		snap := &pmemv1.PmemSnapshot{}
		if err := s.getOrNotFound(ctx, id, snap, "snapshot"); err != nil {
			return nil, "", err
		}
		if !isReady(snap.Status.Conditions) {
			return nil, "", status.Errorf(codes.Aborted, "snapshot %s is not ready yet", id)
		}
		if snap.Status.Size != nil && size < snap.Status.Size.Value() {
			return nil, "", status.Errorf(codes.OutOfRange, "snapshot %s needs a volume of at least %d bytes", id, snap.Status.Size.Value())
		}
		return &pmemv1.PmemVolumeSource{SnapshotID: id}, snap.Spec.Node, nil
	case src.GetVolume() != nil:
		id := src.GetVolume().GetVolumeId()
		vol := &pmemv1.PmemVolume{}
		if err := s.getOrNotFound(ctx, id, vol, "volume"); err != nil {
			return nil, "", err
		}
		if size < vol.Spec.Size.Value() {
			return nil, "", status.Errorf(codes.OutOfRange, "a clone of volume %s needs at least %d bytes", id, vol.Spec.Size.Value())
		}
		if vol.Spec.Replicas > 1 {
			// Copied from one of its replicas, on that replica's node, as a snapshot is cut.
			r, err := s.sourceReplica(ctx, vol)
			if err != nil {
				return nil, "", err
			}
			return &pmemv1.PmemVolumeSource{VolumeID: id, SourceReplica: r.Name}, r.Spec.Node, nil
		}
		return &pmemv1.PmemVolumeSource{VolumeID: id}, vol.Spec.Node, nil
	default:
		return nil, "", status.Error(codes.InvalidArgument, "volume_content_source has neither a snapshot nor a volume")
	}
}

// chooseNode picks the node for a new volume: the first node of the preferred topologies, then
// of the requisite ones, whose largest allocatable extent fits the volume; with no
// requirements, the node with the most room. csi-provisioner with --strict-topology passes the
// node the scheduler selected as the only candidate, so a WaitForFirstConsumer volume lands
// there or not at all (ResourceExhausted makes the scheduler try another node). allowed (nil:
// any) narrows the choice without requirements to a guest cluster's hosts.
func (s *controllerServer) chooseNode(ctx context.Context, req *csi.TopologyRequirement, allowed []string, size, limit int64) (string, error) {
	nodes := &pmemv1.PmemNodeList{}
	if err := s.reader.List(ctx, nodes); err != nil {
		return "", csiserver.APIError(err, "list PmemNodes")
	}
	byName := map[string]*pmemv1.PmemNode{}
	for i := range nodes.Items {
		byName[nodes.Items[i].Name] = &nodes.Items[i]
	}
	candidates := topologyNodes(req)
	if len(candidates) == 0 {
		candidates = slices.Clone(allowed)
		if allowed == nil {
			for _, n := range nodes.Items {
				candidates = append(candidates, n.Name)
			}
		}
		sort.SliceStable(candidates, func(i, j int) bool {
			return largest(byName[candidates[i]]) > largest(byName[candidates[j]])
		})
	}
	var reasons []string
	for _, name := range candidates {
		n, ok := byName[name]
		switch {
		case !ok:
			reasons = append(reasons, name+": no PmemNode")
		case !isReady(n.Status.Conditions):
			reasons = append(reasons, name+": PMEM not ready")
		case limit > 0 && alignUp(size, alignment(n)) > limit:
			reasons = append(reasons, fmt.Sprintf("%s: %d bytes aligned to %d exceed the limit", name, size, alignment(n)))
		case alignUp(size, alignment(n)) > largest(n):
			reasons = append(reasons, fmt.Sprintf("%s: %d bytes free in one extent", name, largest(n)))
		default:
			return name, nil
		}
	}
	if len(reasons) == 0 {
		return "", status.Error(codes.ResourceExhausted, "no node has PMEM")
	}
	return "", status.Errorf(codes.ResourceExhausted, "no node has room for %d bytes: %v", size, reasons)
}

func (s *controllerServer) createVolumeObject(ctx context.Context, id, name, node string, size int64, src *pmemv1.PmemVolumeSource) (*pmemv1.PmemVolume, error) {
	vol := &pmemv1.PmemVolume{
		ObjectMeta: metav1.ObjectMeta{
			Name:        id,
			Labels:      map[string]string{pmemv1.NodeLabel: node},
			Annotations: map[string]string{pmemv1.NameAnnotation: name},
			Finalizers:  []string{agent.Finalizer},
		},
		Spec: pmemv1.PmemVolumeSpec{
			Node:     node,
			VolumeID: id,
			Size:     *resource.NewQuantity(size, resource.BinarySI),
			Source:   src,
		},
	}
	err := s.client.Create(ctx, vol)
	if apierrors.IsAlreadyExists(err) {
		// Created by a call this controller no longer remembers; the caller compares it.
		return nil, status.Errorf(codes.Aborted, "volume %s is being created concurrently", id)
	}
	if err != nil {
		return nil, csiserver.APIError(err, "create PmemVolume %s", id)
	}
	return vol, nil
}

// compatibleVolume checks that an existing volume satisfies a repeated CreateVolume.
func compatibleVolume(vol *pmemv1.PmemVolume, size, limit int64, src *pmemv1.PmemVolumeSource) error {
	have := vol.Spec.Size.Value()
	if vol.Status.AllocatedSize != nil {
		have = vol.Status.AllocatedSize.Value()
	}
	if have < size || (limit > 0 && have > limit) {
		return status.Errorf(codes.AlreadyExists, "volume %s exists with %d bytes, which does not fit the requested range", vol.Name, have)
	}
	// The replica a replicated source was copied from is the first call's choice.
	var want pmemv1.PmemVolumeSource
	if src != nil {
		want = *src
		want.SourceReplica = ""
	}
	var got pmemv1.PmemVolumeSource
	if vol.Spec.Source != nil {
		got = *vol.Spec.Source
		got.SourceReplica = ""
	}
	if got != want {
		return status.Errorf(codes.AlreadyExists, "volume %s exists with another content source", vol.Name)
	}
	return nil
}

// waitVolumeReady waits until the node agent reports the volume ready at the spec of vol (as
// this controller last wrote or read it) or a newer one. A new volume the node had no room for
// (or whose source is gone) is removed again, so that nothing is left behind, and reported
// ResourceExhausted (NotFound).
func (s *controllerServer) waitVolumeReady(ctx context.Context, vol *pmemv1.PmemVolume) (*pmemv1.PmemVolume, error) {
	got := &pmemv1.PmemVolume{}
	var failure error
	err := csiserver.Await(ctx, s.hub, await.Key{Kind: kindVolume, Name: vol.Name}, "volume "+vol.Name, nil, func(ctx context.Context) (bool, error) {
		if err := s.reader.Get(ctx, client.ObjectKeyFromObject(vol), got); err != nil {
			if apierrors.IsNotFound(err) {
				return false, nil // the cache has not seen our create yet
			}
			return false, err
		}
		switch {
		case got.DeletionTimestamp != nil:
			failure = status.Errorf(codes.Aborted, "volume %s is being deleted", vol.Name)
			return true, nil
		// A cache that has not seen our write yet (an expansion) reports the old generation
		// as ready.
		case got.Generation < vol.Generation:
			return false, nil
		}
		var ready bool
		ready, failure = readiness(got.Status.Conditions, got.Generation, got.Spec.Node)
		return ready || failure != nil, nil
	})
	if err != nil {
		return nil, err
	}
	if failure != nil {
		// A volume whose device was never made is only intent: removing it leaves nothing
		// behind. One that exists (an expansion failed) is never touched.
		if got.Status.Device == "" {
			if err := s.deleteObject(ctx, got); err != nil {
				return nil, err
			}
		}
		return nil, failure
	}
	return got, nil
}

func (s *controllerServer) DeleteVolume(ctx context.Context, req *csi.DeleteVolumeRequest) (*csi.DeleteVolumeResponse, error) {
	id := req.GetVolumeId()
	if id == "" {
		return nil, status.Error(codes.InvalidArgument, "volume_id is required")
	}
	if !s.locks.TryLock(id) {
		return nil, status.Errorf(codes.Aborted, "an operation on volume %s is in progress", id)
	}
	defer s.locks.Unlock(id)
	// A replicated volume's replicas first: the volume is the record of what to delete.
	if err := s.deleteReplicas(ctx, id); err != nil {
		return nil, err
	}
	if err := s.deleteAndWait(ctx, kindVolume, id, &pmemv1.PmemVolume{}); err != nil {
		return nil, err
	}
	return &csi.DeleteVolumeResponse{}, nil
}

// deleteAndWait deletes object name of kind and waits until the node agent has removed its data
// and the object is gone. A missing object is success.
func (s *controllerServer) deleteAndWait(ctx context.Context, kind, name string, obj client.Object) error {
	key := client.ObjectKey{Name: name}
	if err := s.reader.Get(ctx, key, obj); apierrors.IsNotFound(err) {
		return nil
	} else if err != nil {
		return csiserver.APIError(err, "get %s %s", kind, name)
	}
	if err := s.deleteObject(ctx, obj); err != nil {
		return err
	}
	var inUse string
	err := csiserver.Await(ctx, s.hub, await.Key{Kind: kind, Name: name}, kind+" "+name, nil, func(ctx context.Context) (bool, error) {
		err := s.reader.Get(ctx, key, obj)
		if apierrors.IsNotFound(err) {
			return true, nil
		}
		if c := conditionsOf(obj); c != nil && c.Reason == pmemv1.InUseReason {
			inUse = c.Message
			return true, nil
		}
		return false, err
	})
	if err != nil {
		return err
	}
	if inUse != "" {
		return status.Errorf(codes.FailedPrecondition, "%s %s is in use: %s", kind, name, inUse)
	}
	return nil
}

// deleteObject deletes obj if it is the object we read (UID precondition: never a newer one
// of the same name).
func (s *controllerServer) deleteObject(ctx context.Context, obj client.Object) error {
	if obj.GetDeletionTimestamp() != nil {
		return nil
	}
	uid := obj.GetUID()
	err := s.client.Delete(ctx, obj, client.Preconditions{UID: &uid})
	if err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
		return csiserver.APIError(err, "delete %s", obj.GetName())
	}
	return nil
}

func (s *controllerServer) ControllerPublishVolume(ctx context.Context, req *csi.ControllerPublishVolumeRequest) (*csi.ControllerPublishVolumeResponse, error) {
	switch {
	case req.GetVolumeId() == "":
		return nil, status.Error(codes.InvalidArgument, "volume_id is required")
	case req.GetNodeId() == "":
		return nil, status.Error(codes.InvalidArgument, "node_id is required")
	case req.GetVolumeCapability() == nil:
		return nil, status.Error(codes.InvalidArgument, "volume_capability is required")
	}
	if err := validateCapabilities([]*csi.VolumeCapability{req.GetVolumeCapability()}); err != nil {
		return nil, err
	}
	vol := &pmemv1.PmemVolume{}
	if err := s.getOrNotFound(ctx, req.GetVolumeId(), vol, "volume"); err != nil {
		return nil, err
	}
	if err := s.getOrNotFound(ctx, req.GetNodeId(), &pmemv1.PmemNode{}, "node"); err != nil {
		return nil, err
	}
	// A replicated volume is served on any node, by a target over its replicas.
	if vol.Spec.Replicas <= 1 && vol.Spec.Node != req.GetNodeId() {
		return nil, status.Errorf(codes.FailedPrecondition, "volume %s lives in the PMEM of node %s and cannot be attached to node %s", vol.Name, vol.Spec.Node, req.GetNodeId())
	}
	// The node agent finds the device by volume ID; nothing needs to travel in the context.
	return &csi.ControllerPublishVolumeResponse{}, nil
}

func (s *controllerServer) ControllerUnpublishVolume(_ context.Context, req *csi.ControllerUnpublishVolumeRequest) (*csi.ControllerUnpublishVolumeResponse, error) {
	if req.GetVolumeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "volume_id is required")
	}
	// Publishing changes nothing on the node, so there is nothing to undo.
	return &csi.ControllerUnpublishVolumeResponse{}, nil
}

func (s *controllerServer) ValidateVolumeCapabilities(ctx context.Context, req *csi.ValidateVolumeCapabilitiesRequest) (*csi.ValidateVolumeCapabilitiesResponse, error) {
	if req.GetVolumeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "volume_id is required")
	}
	if len(req.GetVolumeCapabilities()) == 0 {
		return nil, status.Error(codes.InvalidArgument, "volume_capabilities are required")
	}
	if err := s.getOrNotFound(ctx, req.GetVolumeId(), &pmemv1.PmemVolume{}, "volume"); err != nil {
		return nil, err
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

// GetCapacity reports the free PMEM of the node a topology segment names, or of all nodes.
func (s *controllerServer) GetCapacity(ctx context.Context, req *csi.GetCapacityRequest) (*csi.GetCapacityResponse, error) {
	if len(req.GetVolumeCapabilities()) > 0 {
		if err := validateCapabilities(req.GetVolumeCapabilities()); err != nil {
			return &csi.GetCapacityResponse{}, nil //nolint:nilerr // unsupported capabilities have no capacity
		}
	}
	nodes := &pmemv1.PmemNodeList{}
	if err := s.reader.List(ctx, nodes); err != nil {
		return nil, csiserver.APIError(err, "list PmemNodes")
	}
	want, byTopology := req.GetAccessibleTopology().GetSegments()[TopologyKey]
	var available, maxSize int64
	for i := range nodes.Items {
		n := &nodes.Items[i]
		if (byTopology && n.Name != want) || !isReady(n.Status.Conditions) {
			continue
		}
		if n.Status.Free != nil {
			available += n.Status.Free.Value()
		}
		maxSize = max(maxSize, largest(n))
	}
	return &csi.GetCapacityResponse{
		AvailableCapacity: available,
		MaximumVolumeSize: wrapperspb.Int64(maxSize),
	}, nil
}

func (s *controllerServer) ControllerExpandVolume(ctx context.Context, req *csi.ControllerExpandVolumeRequest) (*csi.ControllerExpandVolumeResponse, error) {
	id := req.GetVolumeId()
	if id == "" {
		return nil, status.Error(codes.InvalidArgument, "volume_id is required")
	}
	if req.GetCapacityRange() == nil {
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
	if !s.locks.TryLock(id) {
		return nil, status.Errorf(codes.Aborted, "an operation on volume %s is in progress", id)
	}
	defer s.locks.Unlock(id)

	vol := &pmemv1.PmemVolume{}
	if err := s.getOrNotFound(ctx, id, vol, "volume"); err != nil {
		return nil, err
	}
	if vol.Spec.Replicas > 1 {
		err = s.expandReplicated(ctx, vol, size)
	} else {
		if vol.Spec.Size.Value() < size {
			if err := s.growVolume(ctx, vol, size); err != nil {
				return nil, err
			}
		}
		vol, err = s.waitVolumeReady(ctx, vol)
	}
	if err != nil {
		return nil, err
	}
	// A filesystem must grow on the node too; a raw block device is ready as it is.
	block := req.GetVolumeCapability().GetBlock() != nil
	return &csi.ControllerExpandVolumeResponse{
		CapacityBytes:         allocated(vol),
		NodeExpansionRequired: !block,
	}, nil
}

// growVolume records size as vol's, conditional on the version of vol read: what was decided
// on that version (a replicated volume no node serves) still holds.
func (s *controllerServer) growVolume(ctx context.Context, vol *pmemv1.PmemVolume, size int64) error {
	patch := client.MergeFromWithOptions(vol.DeepCopy(), client.MergeFromWithOptimisticLock{})
	vol.Spec.Size = *resource.NewQuantity(size, resource.BinarySI)
	if err := s.client.Patch(ctx, vol, patch); err != nil {
		return csiserver.APIError(err, "grow PmemVolume %s", vol.Name)
	}
	klog.FromContext(ctx).V(2).Info("Growing volume", "volumeID", vol.Name, "size", size)
	return nil
}

// ControllerModifyVolume accepts a VolumeAttributesClass's parameters, the I/O limits of the
// volume's disk in a VM (pkg/qos). The PMEM volume itself has nothing to change: csi-resizer
// then names the class on the PV, and the host agent of a VM that has the volume attached
// gives its disk the limits, live (the VM's status.volumes names the class once it has).
func (s *controllerServer) ControllerModifyVolume(ctx context.Context, req *csi.ControllerModifyVolumeRequest) (*csi.ControllerModifyVolumeResponse, error) {
	id := req.GetVolumeId()
	if id == "" {
		return nil, status.Error(codes.InvalidArgument, "volume_id is required")
	}
	if err := validateMutableParameters(req.GetMutableParameters()); err != nil {
		return nil, err
	}
	if err := s.getOrNotFound(ctx, id, &pmemv1.PmemVolume{}, "volume"); err != nil {
		return nil, err
	}
	if err := s.modifyBudget(ctx, req.GetMutableParameters()); err != nil {
		return nil, err
	}
	return &csi.ControllerModifyVolumeResponse{}, nil
}

func (s *controllerServer) CreateSnapshot(ctx context.Context, req *csi.CreateSnapshotRequest) (*csi.CreateSnapshotResponse, error) {
	switch {
	case req.GetName() == "":
		return nil, status.Error(codes.InvalidArgument, "name is required")
	case req.GetSourceVolumeId() == "":
		return nil, status.Error(codes.InvalidArgument, "source_volume_id is required")
	}
	id := ids.For("snapshot", req.GetName())
	if !s.locks.TryLock(id) {
		return nil, status.Errorf(codes.Aborted, "an operation on snapshot %s is in progress", id)
	}
	defer s.locks.Unlock(id)

	snap := &pmemv1.PmemSnapshot{}
	err := s.reader.Get(ctx, client.ObjectKey{Name: id}, snap)
	switch {
	case apierrors.IsNotFound(err):
		vol := &pmemv1.PmemVolume{}
		if err := s.getOrNotFound(ctx, req.GetSourceVolumeId(), vol, "volume"); err != nil {
			return nil, err
		}
		node, replica := vol.Spec.Node, ""
		if vol.Spec.Replicas > 1 {
			r, err := s.sourceReplica(ctx, vol)
			if err != nil {
				return nil, err
			}
			node, replica = r.Spec.Node, r.Name
		}
		snap = &pmemv1.PmemSnapshot{
			ObjectMeta: metav1.ObjectMeta{
				Name:        id,
				Labels:      map[string]string{pmemv1.NodeLabel: node},
				Annotations: map[string]string{pmemv1.NameAnnotation: req.GetName()},
				Finalizers:  []string{agent.Finalizer},
			},
			Spec: pmemv1.PmemSnapshotSpec{Node: node, SnapshotID: id, SourceVolumeID: vol.Name, SourceReplica: replica},
		}
		if err := s.client.Create(ctx, snap); apierrors.IsAlreadyExists(err) {
			return nil, status.Errorf(codes.Aborted, "snapshot %s is being created concurrently", id)
		} else if err != nil {
			return nil, csiserver.APIError(err, "create PmemSnapshot %s", id)
		}
	case err != nil:
		return nil, csiserver.APIError(err, "get PmemSnapshot %s", id)
	case snap.Spec.SourceVolumeID != req.GetSourceVolumeId():
		return nil, status.Errorf(codes.AlreadyExists, "snapshot %s exists for volume %s", id, snap.Spec.SourceVolumeID)
	}

	failure, err := s.awaitSnapshot(ctx, snap)
	if err != nil {
		return nil, err
	}
	if failure != nil {
		if err := s.deleteObject(ctx, snap); err != nil {
			return nil, err
		}
		return nil, failure
	}
	return &csi.CreateSnapshotResponse{Snapshot: csiSnapshot(snap)}, nil
}

// awaitSnapshot waits until the node agent has cut snap (updating it) or failed to for good
// (failure, with the CSI code of its reason).
func (s *controllerServer) awaitSnapshot(ctx context.Context, snap *pmemv1.PmemSnapshot) (failure, err error) {
	id := snap.Name
	err = csiserver.Await(ctx, s.hub, await.Key{Kind: kindSnapshot, Name: id}, "snapshot "+id, nil, func(ctx context.Context) (bool, error) {
		if err := s.reader.Get(ctx, client.ObjectKey{Name: id}, snap); err != nil {
			return false, client.IgnoreNotFound(err)
		}
		var ready bool
		ready, failure = readiness(snap.Status.Conditions, snap.Generation, snap.Spec.Node)
		return ready || failure != nil, nil
	})
	return failure, err
}

func (s *controllerServer) DeleteSnapshot(ctx context.Context, req *csi.DeleteSnapshotRequest) (*csi.DeleteSnapshotResponse, error) {
	id := req.GetSnapshotId()
	if id == "" {
		return nil, status.Error(codes.InvalidArgument, "snapshot_id is required")
	}
	if !s.locks.TryLock(id) {
		return nil, status.Errorf(codes.Aborted, "an operation on snapshot %s is in progress", id)
	}
	defer s.locks.Unlock(id)
	if err := s.deleteAndWait(ctx, kindSnapshot, id, &pmemv1.PmemSnapshot{}); err != nil {
		return nil, err
	}
	return &csi.DeleteSnapshotResponse{}, nil
}

// ListSnapshots lists the ready snapshots in name order. starting_token is the index of the
// first entry to return.
func (s *controllerServer) ListSnapshots(ctx context.Context, req *csi.ListSnapshotsRequest) (*csi.ListSnapshotsResponse, error) {
	list := &pmemv1.PmemSnapshotList{}
	if err := s.reader.List(ctx, list); err != nil {
		return nil, csiserver.APIError(err, "list PmemSnapshots")
	}
	var entries []*csi.ListSnapshotsResponse_Entry
	for i := range list.Items {
		snap := &list.Items[i]
		if (req.GetSnapshotId() != "" && snap.Name != req.GetSnapshotId()) ||
			(req.GetSourceVolumeId() != "" && snap.Spec.SourceVolumeID != req.GetSourceVolumeId()) ||
			!isReady(snap.Status.Conditions) {
			continue
		}
		entries = append(entries, &csi.ListSnapshotsResponse_Entry{Snapshot: csiSnapshot(snap)})
	}
	slices.SortFunc(entries, func(a, b *csi.ListSnapshotsResponse_Entry) int {
		return strings.Compare(a.GetSnapshot().GetSnapshotId(), b.GetSnapshot().GetSnapshotId())
	})

	page, next, err := csiserver.Page(entries, req.GetStartingToken(), req.GetMaxEntries())
	if err != nil {
		return nil, err
	}
	return &csi.ListSnapshotsResponse{Entries: page, NextToken: next}, nil
}

// getOrNotFound reads object name from the cache; NotFound names what is missing.
func (s *controllerServer) getOrNotFound(ctx context.Context, name string, obj client.Object, what string) error {
	err := s.reader.Get(ctx, client.ObjectKey{Name: name}, obj)
	switch {
	case apierrors.IsNotFound(err):
		return status.Errorf(codes.NotFound, "%s %s does not exist", what, name)
	case err != nil:
		return csiserver.APIError(err, "get %s %s", what, name)
	}
	return nil
}

// readiness reads the Ready condition a node agent reports on a PmemVolume or PmemSnapshot of
// generation gen on node: ready, not yet (also while the condition is of an older generation),
// or failed for good with the CSI code of its reason.
func readiness(conditions []metav1.Condition, gen int64, node string) (bool, error) {
	c := meta.FindStatusCondition(conditions, pmemv1.ReadyCondition)
	switch {
	case c == nil || c.ObservedGeneration < gen:
		return false, nil
	case c.Status == metav1.ConditionTrue:
		return true, nil
	case c.Reason == pmemv1.InsufficientCapacityReason:
		return false, status.Errorf(codes.ResourceExhausted, "node %s: %s", node, c.Message)
	case c.Reason == pmemv1.SourceNotFoundReason:
		return false, status.Errorf(codes.NotFound, "node %s: %s", node, c.Message)
	case c.Reason == pmemv1.HoldExpiredReason:
		return false, status.Errorf(codes.ResourceExhausted, "node %s: %s", node, c.Message)
	}
	return false, nil
}

// csiVolume is vol as CreateVolume answers it: accessible from its node, or from every node
// when it is replicated (no topology).
func csiVolume(vol *pmemv1.PmemVolume, src *csi.VolumeContentSource) *csi.Volume {
	v := &csi.Volume{VolumeId: vol.Name, CapacityBytes: allocated(vol), ContentSource: src}
	if vol.Spec.Node != "" {
		v.AccessibleTopology = []*csi.Topology{{Segments: map[string]string{TopologyKey: vol.Spec.Node}}}
	}
	return v
}

func csiSnapshot(snap *pmemv1.PmemSnapshot) *csi.Snapshot {
	out := &csi.Snapshot{
		SnapshotId:     snap.Name,
		SourceVolumeId: snap.Spec.SourceVolumeID,
		ReadyToUse:     isReady(snap.Status.Conditions),
	}
	if snap.Status.Size != nil {
		out.SizeBytes = snap.Status.Size.Value()
	}
	if snap.Status.CreationTime != nil {
		out.CreationTime = timestamppb.New(snap.Status.CreationTime.Time)
	}
	return out
}

func allocated(vol *pmemv1.PmemVolume) int64 {
	if vol.Status.AllocatedSize != nil {
		return vol.Status.AllocatedSize.Value()
	}
	return vol.Spec.Size.Value()
}

func largest(n *pmemv1.PmemNode) int64 {
	if n == nil || n.Status.LargestAllocatable == nil {
		return 0
	}
	return n.Status.LargestAllocatable.Value()
}

func alignment(n *pmemv1.PmemNode) int64 {
	if n.Status.Alignment == nil || n.Status.Alignment.Value() <= 0 {
		return 1
	}
	return n.Status.Alignment.Value()
}

func alignUp(size, alignment int64) int64 {
	if r := size % alignment; r != 0 {
		return size + alignment - r
	}
	return size
}

func isReady(conditions []metav1.Condition) bool {
	return meta.IsStatusConditionTrue(conditions, pmemv1.ReadyCondition)
}

// conditionsOf returns the Ready condition of a PmemVolume, PmemSnapshot or PmemReplica.
func conditionsOf(obj client.Object) *metav1.Condition {
	switch o := obj.(type) {
	case *pmemv1.PmemVolume:
		return meta.FindStatusCondition(o.Status.Conditions, pmemv1.ReadyCondition)
	case *pmemv1.PmemSnapshot:
		return meta.FindStatusCondition(o.Status.Conditions, pmemv1.ReadyCondition)
	case *pmemv1.PmemReplica:
		return meta.FindStatusCondition(o.Status.Conditions, pmemv1.ReadyCondition)
	}
	return nil
}
