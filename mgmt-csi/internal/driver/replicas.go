package driver

import (
	"context"
	"fmt"
	"slices"
	"sort"
	"strconv"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
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
	"pvbridge.io/pkg/csiserver"
	"pvbridge.io/pkg/hostloss"
	"pvbridge.io/pkg/names"
)

// A replicated volume (StorageClass parameter replicas, 2 or 3) is a PmemVolume without a node
// and a PmemReplica per copy, each on another node with a replica server; the node agents
// carve and export the replicas, and the node a volume is staged on writes to all of them
// (package replication). The controller places the replicas, waits for them and reports the
// volume Ready in its status; it deletes the replicas before the volume, which has no
// finalizer since no agent owns it.

const (
	// replicasParameter is the StorageClass parameter of the number of replicas.
	replicasParameter = names.ReplicasParam
	maxReplicas       = 3
	kindReplica       = "PmemReplica"
)

// replicaCount reads the replicas parameter: 1 when absent, else 1 to maxReplicas.
func replicaCount(params map[string]string) (int32, error) {
	v, ok := params[replicasParameter]
	if !ok {
		return 1, nil
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 1 || n > maxReplicas {
		return 0, status.Errorf(codes.InvalidArgument, "parameter %s: %q is not a number of replicas from 1 to %d", replicasParameter, v, maxReplicas)
	}
	return int32(n), nil //nolint:gosec // at most maxReplicas
}

// replicaName is the name of replica i of a volume: the object's, the device's and the
// export's. It is derived like a volume ID, so it is a DNS label of at most 63 characters.
func replicaName(volumeID string, i int) string {
	return ids.For("replica", volumeID+"-r"+strconv.Itoa(i))
}

// createReplicated records the replicated volume id of n replicas, places the replicas that
// are missing (a retried call finds those a previous one made) and waits until every one is
// ready. preferred nodes (the accessibility requirements) get a replica first, so that a
// WaitForFirstConsumer volume has one next to its consumer.
//
// A volume with a content source (a snapshot, or a volume of one replica) has its first replica
// made from it, on the source's node; the others are rebuilt from the volume (spec.rebuild),
// by the node that serves it or, while none does, by their own (Rebuilder).
func (s *controllerServer) createReplicated(ctx context.Context, req *csi.CreateVolumeRequest, id string, n int32, size int64) (*pmemv1.PmemVolume, error) {
	source, sourceNode, err := s.contentSource(ctx, req.GetVolumeContentSource(), size)
	if err != nil {
		return nil, err
	}
	preferred, limit := topologyNodes(req.GetAccessibilityRequirements()), req.GetCapacityRange().GetLimitBytes()
	if sourceNode != "" {
		preferred = []string{sourceNode}
	}
	vol := &pmemv1.PmemVolume{}
	err = s.reader.Get(ctx, client.ObjectKey{Name: id}, vol)
	switch {
	case apierrors.IsNotFound(err):
		vol = &pmemv1.PmemVolume{
			ObjectMeta: metav1.ObjectMeta{Name: id, Annotations: map[string]string{pmemv1.NameAnnotation: req.GetName()}},
			Spec:       pmemv1.PmemVolumeSpec{VolumeID: id, Replicas: n, Size: *resource.NewQuantity(size, resource.BinarySI), Source: source},
		}
		// Nothing is recorded for a volume that has not room enough.
		nodes, err := s.chooseReplicaNodes(ctx, vol, int(n), nil, preferred, limit)
		if err != nil {
			return nil, err
		}
		if sourceNode != "" && nodes[0] != sourceNode {
			return nil, status.Errorf(codes.ResourceExhausted, "volume %s: node %s, which holds its source, cannot take its first replica (no room or replica server, or it is drained or lost)", id, sourceNode)
		}
		if err := s.client.Create(ctx, vol); apierrors.IsAlreadyExists(err) {
			return nil, status.Errorf(codes.Aborted, "volume %s is being created concurrently", id)
		} else if err != nil {
			return nil, csiserver.APIError(err, "create PmemVolume %s", id)
		}
		klog.FromContext(ctx).V(2).Info("Recorded replicated volume", "replicas", n, "size", size)
	case err != nil:
		return nil, csiserver.APIError(err, "get PmemVolume %s", id)
	default:
		if vol.Spec.Replicas != n {
			return nil, status.Errorf(codes.AlreadyExists, "volume %s exists with %d replicas, not %d", id, vol.Spec.Replicas, n)
		}
		if err := compatibleVolume(vol, size, req.GetCapacityRange().GetLimitBytes(), source); err != nil {
			return nil, err
		}
		// A clone's first replica is copied on the node of the replica the first call chose.
		if src := vol.Spec.Source; src != nil && src.SourceReplica != "" {
			r := &pmemv1.PmemReplica{}
			if err := s.reader.Get(ctx, client.ObjectKey{Name: src.SourceReplica}, r); err != nil {
				return nil, csiserver.APIError(err, "get PmemReplica %s, the source of volume %s", src.SourceReplica, id)
			}
			sourceNode, preferred = r.Spec.Node, []string{r.Spec.Node}
		}
		if meta.IsStatusConditionTrue(vol.Status.Conditions, pmemv1.ReadyCondition) {
			// Made already: its replicas are the replicated-volume reconciler's to repair,
			// under names of their own.
			return vol, nil
		}
	}
	replicas, err := s.placeReplicas(ctx, vol, sourceNode, preferred, limit)
	if err != nil {
		return nil, err
	}
	for _, r := range replicas {
		if err := s.waitReplicaReady(ctx, r); err != nil {
			return nil, err
		}
	}
	return vol, s.reportReplicated(ctx, vol, replicas)
}

// sourceReplica chooses the replica of the replicated volume vol that a snapshot or a clone of
// it is copied from: one with the volume's data, exported, on a node neither lost nor drained
// (the first by name). Every write the volume acknowledged is on each such replica, so its
// reflinked copy is crash-consistent, as a volume of one replica's is; it is made on that node.
func (s *controllerServer) sourceReplica(ctx context.Context, vol *pmemv1.PmemVolume) (*pmemv1.PmemReplica, error) {
	replicas, err := s.replicasOf(ctx, vol.Name)
	if err != nil {
		return nil, err
	}
	slices.SortFunc(replicas, func(a, b pmemv1.PmemReplica) int { return strings.Compare(a.Name, b.Name) })
	var reasons []string
	for i := range replicas {
		r := &replicas[i]
		if !withData(r) {
			reasons = append(reasons, r.Name+": not live with the volume's data")
			continue
		}
		state, err := hostloss.StateOf(ctx, s.reader, s.apiReader, r.Spec.Node)
		if err != nil {
			return nil, csiserver.APIError(err, "read Node %s", r.Spec.Node)
		}
		if state != hostloss.Available {
			reasons = append(reasons, r.Name+": node "+r.Spec.Node+" "+string(state))
			continue
		}
		return r, nil
	}
	return nil, status.Errorf(codes.Unavailable, "volume %s has no replica to cut a snapshot from: %v", vol.Name, reasons)
}

// placeReplicas returns the volume's replicas, creating those it lacks on nodes that hold
// none of its replicas; the first one on sourceNode, from the volume's source, when it has one.
func (s *controllerServer) placeReplicas(ctx context.Context, vol *pmemv1.PmemVolume, sourceNode string, preferred []string, limit int64) ([]*pmemv1.PmemReplica, error) {
	existing, err := s.replicasOf(ctx, vol.Name)
	if err != nil {
		return nil, err
	}
	byName := map[string]*pmemv1.PmemReplica{}
	var taken []string
	for i := range existing {
		byName[existing[i].Name] = &existing[i]
		taken = append(taken, existing[i].Spec.Node)
	}
	var missing []int
	for i := range int(vol.Spec.Replicas) {
		if byName[replicaName(vol.Name, i)] == nil {
			missing = append(missing, i)
		}
	}
	var nodes []string
	if fromSource := vol.Spec.Source != nil && len(missing) > 0 && missing[0] == 0; fromSource {
		nodes, taken = []string{sourceNode}, append(taken, sourceNode)
		missing = missing[1:]
	}
	if len(missing) > 0 {
		more, err := s.chooseReplicaNodes(ctx, vol, len(missing), taken, preferred, limit)
		if err != nil {
			return nil, err
		}
		nodes = append(nodes, more...)
	}
	replicas := make([]*pmemv1.PmemReplica, 0, vol.Spec.Replicas)
	for i := range int(vol.Spec.Replicas) {
		name := replicaName(vol.Name, i)
		if r := byName[name]; r != nil {
			replicas = append(replicas, r)
			continue
		}
		node := nodes[0]
		nodes = nodes[1:]
		// The first replica of a volume with a source starts from it; the others are rebuilt.
		r := newReplica(vol, name, node, vol.Spec.Source != nil && i > 0)
		if i == 0 {
			r.Spec.Source = vol.Spec.Source
		}
		if err := s.client.Create(ctx, r); err != nil {
			if apierrors.IsAlreadyExists(err) {
				return nil, status.Errorf(codes.Aborted, "replica %s of volume %s is being created concurrently", name, vol.Name)
			}
			return nil, csiserver.APIError(err, "create PmemReplica %s", name)
		}
		klog.FromContext(ctx).V(2).Info("Placed replica", "replica", name, "node", node)
		replicas = append(replicas, r)
	}
	return replicas, nil
}

// newReplica is replica name of vol on node; rebuild for one made after the volume's first
// write.
func newReplica(vol *pmemv1.PmemVolume, name, node string, rebuild bool) *pmemv1.PmemReplica {
	return &pmemv1.PmemReplica{
		ObjectMeta: metav1.ObjectMeta{
			Name:       name,
			Labels:     map[string]string{pmemv1.VolumeLabel: vol.Name, pmemv1.NodeLabel: node},
			Finalizers: []string{agent.Finalizer},
			// The garbage collector removes what a deleted volume left; DeleteVolume removes
			// the replicas first.
			OwnerReferences: []metav1.OwnerReference{{
				APIVersion: pmemv1.GroupVersion.String(), Kind: kindVolume, Name: vol.Name, UID: vol.UID,
			}},
		},
		Spec: pmemv1.PmemReplicaSpec{VolumeID: vol.Name, Node: node, Size: vol.Spec.Size, Rebuild: rebuild},
	}
}

// chooseReplicaNodes picks n nodes for new replicas of vol: nodes with a replica server whose
// PMEM is ready and has room, neither lost nor drained (hostloss.StateOf, from the cache of
// the Nodes' taints that the replicated-volume reconciler watches), none of them in
// taken (the nodes of its other replicas); the preferred ones first, then those with the most
// room.
func (s *controllerServer) chooseReplicaNodes(ctx context.Context, vol *pmemv1.PmemVolume, n int, taken, preferred []string, limit int64) ([]string, error) {
	list := &pmemv1.PmemNodeList{}
	if err := s.reader.List(ctx, list); err != nil {
		return nil, csiserver.APIError(err, "list PmemNodes")
	}
	nodes := list.Items
	sort.SliceStable(nodes, func(i, j int) bool {
		pi, pj := slices.Contains(preferred, nodes[i].Name), slices.Contains(preferred, nodes[j].Name)
		if pi != pj {
			return pi
		}
		return largest(&nodes[i]) > largest(&nodes[j])
	})
	size := vol.Spec.Size.Value()
	var chosen, reasons []string
	for i := range nodes {
		node := &nodes[i]
		need := alignUp(size, alignment(node))
		switch {
		case slices.Contains(taken, node.Name):
			reasons = append(reasons, node.Name+": holds another replica")
		case node.Status.ReplicaAddress == "":
			reasons = append(reasons, node.Name+": no replica server")
		case !isReady(node.Status.Conditions):
			reasons = append(reasons, node.Name+": PMEM not ready")
		case limit > 0 && need > limit:
			reasons = append(reasons, fmt.Sprintf("%s: %d bytes aligned to %d exceed the limit", node.Name, size, alignment(node)))
		case need > largest(node):
			reasons = append(reasons, fmt.Sprintf("%s: %d bytes free in one extent", node.Name, largest(node)))
		default:
			state, err := hostloss.StateOf(ctx, s.reader, s.apiReader, node.Name)
			if err != nil {
				return nil, csiserver.APIError(err, "read Node %s", node.Name)
			}
			if state != hostloss.Available {
				reasons = append(reasons, node.Name+": "+string(state))
				continue
			}
			chosen = append(chosen, node.Name)
			if len(chosen) == n {
				return chosen, nil
			}
		}
	}
	return nil, status.Errorf(codes.ResourceExhausted,
		"volume %s needs %d replicas of %d bytes on distinct nodes, and %d more nodes have room for one (%d replicas placed before): %v",
		vol.Name, vol.Spec.Replicas, size, len(chosen), len(taken), reasons)
}

// waitReplicaReady waits until the node agent reports replica r ready at r's generation and
// size. A new replica its node had no room for is removed again, so that the next call places
// it elsewhere, and reported ResourceExhausted.
func (s *controllerServer) waitReplicaReady(ctx context.Context, r *pmemv1.PmemReplica) error {
	got := &pmemv1.PmemReplica{}
	var failure error
	err := csiserver.Await(ctx, s.hub, await.Key{Kind: kindReplica, Name: r.Name}, "replica "+r.Name, nil, func(ctx context.Context) (bool, error) {
		if err := s.reader.Get(ctx, client.ObjectKeyFromObject(r), got); err != nil {
			if apierrors.IsNotFound(err) {
				return false, nil // the cache has not seen our create yet
			}
			return false, err
		}
		switch {
		case got.DeletionTimestamp != nil:
			failure = status.Errorf(codes.Aborted, "replica %s is being deleted", r.Name)
			return true, nil
		case got.Generation < r.Generation:
			return false, nil // a cache that has not seen our growth yet
		}
		var ready bool
		ready, failure = readiness(got.Status.Conditions, got.Generation, got.Spec.Node)
		ready = ready && got.Status.AllocatedSize != nil && got.Status.AllocatedSize.Cmp(got.Spec.Size) >= 0
		return ready || failure != nil, nil
	})
	if err != nil {
		return err
	}
	if failure != nil && got.Status.Device == "" {
		if err := s.deleteObject(ctx, got); err != nil {
			return err
		}
	}
	if failure == nil {
		*r = *got
	}
	return failure
}

// expandReplicated grows the replicated volume vol to size while no node serves it: QEMU
// 7.2's quorum cannot resize, and a replica server fixes an export's size when it makes the
// export, so each replica grows and is exported again by its agent (agent.ReplicaReconciler)
// with no target on it. The volume's size is recorded first, conditional on the version that
// said no node serves it: a node that claims the volume meanwhile makes the record conflict
// (Aborted; the retry finds the volume served), and one that claims it afterwards finds
// replicas smaller than the volume, or not ready at their new size, and waits
// (VolumeDevices.replicas). A replica being made or rebuilt is waited for first (its copy is
// the old size), and every node must have room to grow its replica before any grows: a
// replica that failed to grow would keep the volume from being served.
func (s *controllerServer) expandReplicated(ctx context.Context, vol *pmemv1.PmemVolume, size int64) error {
	replicas, err := s.replicasOf(ctx, vol.Name)
	if err != nil {
		return err
	}
	var live []*pmemv1.PmemReplica
	for i := range replicas {
		if r := &replicas[i]; r.Live() {
			live = append(live, r)
		}
	}
	if vol.Spec.Size.Value() < size {
		if vol.Status.Target != "" {
			return status.Errorf(codes.FailedPrecondition,
				"volume %s is replicated and node %s serves it: a replicated volume grows only while no node serves it (its consumer stopped)", vol.Name, vol.Status.Target)
		}
		for _, r := range live {
			if err := s.canGrow(ctx, r, size); err != nil {
				return err
			}
		}
		if err := s.growVolume(ctx, vol, size); err != nil {
			return err
		}
	}
	for _, r := range live {
		if r.Spec.Size.Cmp(vol.Spec.Size) >= 0 {
			continue
		}
		patch := client.MergeFrom(r.DeepCopy())
		r.Spec.Size = vol.Spec.Size
		if err := s.client.Patch(ctx, r, patch); err != nil {
			return csiserver.APIError(err, "grow PmemReplica %s", r.Name)
		}
	}
	for _, r := range live {
		if err := s.waitReplicaReady(ctx, r); err != nil {
			return err
		}
	}
	return s.reportReplicated(ctx, vol, live)
}

// canGrow tells whether replica r may grow to size now: it has the volume's data and is ready,
// and its node has room for the difference.
func (s *controllerServer) canGrow(ctx context.Context, r *pmemv1.PmemReplica, size int64) error {
	if !withData(r) {
		return status.Errorf(codes.Unavailable, "volume %s: replica %s on node %s is being made or rebuilt; the volume grows once it is ready", r.Spec.VolumeID, r.Name, r.Spec.Node)
	}
	node := &pmemv1.PmemNode{}
	if err := s.reader.Get(ctx, client.ObjectKey{Name: r.Spec.Node}, node); err != nil {
		return csiserver.APIError(err, "get PmemNode %s", r.Spec.Node)
	}
	have := r.Spec.Size.Value()
	if a := r.Status.AllocatedSize; a != nil {
		have = a.Value()
	}
	if need := alignUp(size, alignment(node)) - have; need > largest(node) {
		return status.Errorf(codes.ResourceExhausted, "volume %s: node %s has %d bytes free in one extent, and its replica %s needs %d more to grow to %d bytes",
			r.Spec.VolumeID, r.Spec.Node, largest(node), r.Name, need, size)
	}
	return nil
}

// replicasOf lists the PmemReplicas of volume id.
func (s *controllerServer) replicasOf(ctx context.Context, id string) ([]pmemv1.PmemReplica, error) {
	list := &pmemv1.PmemReplicaList{}
	if err := s.reader.List(ctx, list, client.MatchingLabels{pmemv1.VolumeLabel: id}); err != nil {
		return nil, csiserver.APIError(err, "list the PmemReplicas of volume %s", id)
	}
	return list.Items, nil
}

// withData tells whether replica r is live, has its volume's data and is ready: a target may
// read it, a snapshot may be cut from it.
func withData(r *pmemv1.PmemReplica) bool {
	return r.Live() && r.HasData() && isReady(r.Status.Conditions)
}

// reportReplicated writes in the volume's status that its replicas are ready, with the size
// they all have.
func (s *controllerServer) reportReplicated(ctx context.Context, vol *pmemv1.PmemVolume, replicas []*pmemv1.PmemReplica) error {
	size := int64(-1)
	for _, r := range replicas {
		if a := r.Status.AllocatedSize; a != nil && (size < 0 || a.Value() < size) {
			size = a.Value()
		}
	}
	patch := client.MergeFrom(vol.DeepCopy())
	changed := meta.SetStatusCondition(&vol.Status.Conditions, metav1.Condition{
		Type: pmemv1.ReadyCondition, Status: metav1.ConditionTrue, Reason: pmemv1.CreatedReason,
		Message: fmt.Sprintf("%d replicas ready", len(replicas)), ObservedGeneration: vol.Generation,
	})
	if size >= 0 && (vol.Status.AllocatedSize == nil || vol.Status.AllocatedSize.Value() != size) {
		vol.Status.AllocatedSize = resource.NewQuantity(size, resource.BinarySI)
		changed = true
	}
	if !changed {
		return nil
	}
	if err := s.client.Status().Patch(ctx, vol, patch); err != nil {
		return csiserver.APIError(err, "update status of PmemVolume %s", vol.Name)
	}
	return nil
}

// deleteReplicas deletes the replicas of volume id, all at once, and waits until their agents
// removed them.
func (s *controllerServer) deleteReplicas(ctx context.Context, id string) error {
	replicas, err := s.replicasOf(ctx, id)
	if err != nil {
		return err
	}
	for i := range replicas {
		if err := s.deleteObject(ctx, &replicas[i]); err != nil {
			return err
		}
	}
	for _, r := range replicas {
		if err := s.deleteAndWait(ctx, kindReplica, r.Name, &pmemv1.PmemReplica{}); err != nil {
			return err
		}
	}
	return nil
}
