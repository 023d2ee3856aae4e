package driver

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	. "github.com/onsi/gomega"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/validation"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pvbridge.io/mgmt-csi/internal/agent"
	"pvbridge.io/mgmt-csi/internal/ids"
	pmemv1 "pvbridge.io/pkg/apis/pmem/v1alpha1"
	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
)

// replicaNode is a node whose agent runs a replica server.
func replicaNode(name string, free int64) *pmemv1.PmemNode {
	n := pmemNode(name, free, free, true)
	n.Status.ReplicaAddress = name + ":10809"
	return n
}

func replicatedRequest(name string, n string, size int64) *csi.CreateVolumeRequest {
	return &csi.CreateVolumeRequest{
		Name: name, VolumeCapabilities: []*csi.VolumeCapability{blockCap},
		CapacityRange: &csi.CapacityRange{RequiredBytes: size},
		Parameters:    map[string]string{replicasParameter: n},
	}
}

// shortCall is a context for a call that answers DeadlineExceeded while the agents work.
func shortCall(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), 100*time.Millisecond)
	t.Cleanup(cancel)
	return ctx
}

func replicasOf(t *testing.T, s *controllerServer, id string) []pmemv1.PmemReplica {
	t.Helper()
	list := &pmemv1.PmemReplicaList{}
	if err := s.reader.List(t.Context(), list, client.MatchingLabels{pmemv1.VolumeLabel: id}); err != nil {
		t.Fatal(err)
	}
	return list.Items
}

// agentsCarve does what the node agents do: reports every replica of id ready.
func agentsCarve(t *testing.T, s *controllerServer, id string) {
	t.Helper()
	for _, r := range replicasOf(t, s, id) {
		r.Status.Device, r.Status.Address = "/dev/loop9", r.Spec.Node+":10809"
		r.Status.AllocatedSize = resource.NewQuantity(r.Spec.Size.Value(), resource.BinarySI)
		meta.SetStatusCondition(&r.Status.Conditions, metav1.Condition{
			Type: pmemv1.ReadyCondition, Status: metav1.ConditionTrue, Reason: pmemv1.CreatedReason, ObservedGeneration: r.Generation,
		})
		if err := s.client.Status().Update(t.Context(), &r); err != nil {
			t.Fatal(err)
		}
	}
}

func TestReplicaCount(t *testing.T) {
	for _, tc := range []struct {
		params map[string]string
		want   int32
		code   codes.Code
	}{
		{params: nil, want: 1},
		{params: map[string]string{replicasParameter: "1"}, want: 1},
		{params: map[string]string{replicasParameter: "3"}, want: 3},
		{params: map[string]string{replicasParameter: "0"}, code: codes.InvalidArgument},
		{params: map[string]string{replicasParameter: "4"}, code: codes.InvalidArgument},
		{params: map[string]string{replicasParameter: "two"}, code: codes.InvalidArgument},
		{params: map[string]string{replicasParameter: ""}, code: codes.InvalidArgument},
	} {
		g := NewWithT(t)
		got, err := replicaCount(tc.params)
		g.Expect(status.Code(err)).To(Equal(tc.code), "%v: %v", tc.params, err)
		g.Expect(got).To(Equal(tc.want))
	}
}

func TestReplicaNamesAreLabels(t *testing.T) {
	g := NewWithT(t)
	g.Expect(replicaName("pvc-0b3f7c1e-2f7a-4d0c-9b1e-4c2e8f0a1d2c", 1)).To(Equal("pvc-0b3f7c1e-2f7a-4d0c-9b1e-4c2e8f0a1d2c-r1"))
	long := strings.Repeat("v", 63)
	g.Expect(validation.IsDNS1123Label(replicaName(long, 0))).To(BeEmpty())
	g.Expect(replicaName(long, 0)).NotTo(Equal(replicaName(long, 1)))
}

func TestCreateReplicatedVolume(t *testing.T) {
	g := NewWithT(t)
	s := newTestController(t, replicaNode("a", 2*gi), replicaNode("b", 4*gi), replicaNode("c", 3*gi),
		pmemNode("plain", 9*gi, 9*gi, true))
	req := replicatedRequest("pvc-1", "2", gi)
	req.AccessibilityRequirements = &csi.TopologyRequirement{Requisite: topology("a"), Preferred: topology("a")}

	_, err := s.CreateVolume(shortCall(t), req)
	g.Expect(status.Code(err)).To(Equal(codes.DeadlineExceeded), "the agents have not carved the replicas yet: %v", err)
	vol := &pmemv1.PmemVolume{}
	g.Expect(s.reader.Get(t.Context(), client.ObjectKey{Name: "pvc-1"}, vol)).To(Succeed())
	g.Expect(vol.Spec.Replicas).To(BeEquivalentTo(2))
	g.Expect(vol.Spec.Node).To(BeEmpty())
	g.Expect(vol.Finalizers).To(BeEmpty(), "no agent owns a replicated volume")
	replicas := replicasOf(t, s, "pvc-1")
	g.Expect(replicas).To(HaveLen(2))
	nodes := []string{replicas[0].Spec.Node, replicas[1].Spec.Node}
	g.Expect(nodes).To(ConsistOf("a", "b"), "the preferred node, then the most room; never the node without a replica server")
	for _, r := range replicas {
		g.Expect(r.Finalizers).To(ContainElement(agent.Finalizer))
		g.Expect(r.OwnerReferences).To(HaveLen(1))
		g.Expect(r.OwnerReferences[0].Name).To(Equal("pvc-1"))
		g.Expect(r.Spec.Size.Value()).To(Equal(gi))
	}

	_, err = s.CreateVolume(shortCall(t), req)
	g.Expect(status.Code(err)).To(Equal(codes.DeadlineExceeded))
	g.Expect(replicasOf(t, s, "pvc-1")).To(HaveLen(2), "a retry places nothing twice")

	agentsCarve(t, s, "pvc-1")
	resp, err := s.CreateVolume(t.Context(), req)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(resp.GetVolume().GetAccessibleTopology()).To(BeEmpty(), "a replicated volume is served on every node")
	g.Expect(resp.GetVolume().GetCapacityBytes()).To(Equal(gi))
	g.Expect(s.reader.Get(t.Context(), client.ObjectKey{Name: "pvc-1"}, vol)).To(Succeed())
	g.Expect(meta.IsStatusConditionTrue(vol.Status.Conditions, pmemv1.ReadyCondition)).To(BeTrue())

	_, err = s.CreateVolume(t.Context(), replicatedRequest("pvc-1", "3", gi))
	g.Expect(status.Code(err)).To(Equal(codes.AlreadyExists), "the same name with other replicas")
}

func TestCreateReplicatedVolumeRefusesWithoutSideEffects(t *testing.T) {
	clone := replicatedRequest("pvc-1", "2", gi)
	clone.VolumeContentSource = &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{
		Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: "pvc-src"}}}
	for _, tc := range []struct {
		name string
		req  *csi.CreateVolumeRequest
		code codes.Code
	}{
		{"more replicas than nodes with a replica server", replicatedRequest("pvc-1", "3", gi), codes.ResourceExhausted},
		{"no two nodes with room", replicatedRequest("pvc-1", "2", 3*gi), codes.ResourceExhausted},
		{"out of range", replicatedRequest("pvc-1", "4", gi), codes.InvalidArgument},
		{"from a volume on a node without a replica server", clone, codes.ResourceExhausted},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			s := newTestController(t, replicaNode("a", 2*gi), replicaNode("b", 4*gi), pmemNode("plain", 9*gi, 9*gi, true),
				pmemVolume("pvc-src", "plain", gi))
			_, err := s.CreateVolume(t.Context(), tc.req)
			g.Expect(status.Code(err)).To(Equal(tc.code), "%v", err)
			g.Expect(s.reader.Get(t.Context(), client.ObjectKey{Name: "pvc-1"}, &pmemv1.PmemVolume{})).NotTo(Succeed())
			g.Expect(replicasOf(t, s, "pvc-1")).To(BeEmpty())
		})
	}
}

func TestReplicatedVolumeOperations(t *testing.T) {
	g := NewWithT(t)
	s := newTestController(t, replicaNode("a", 2*gi), replicaNode("b", 4*gi), pmemNode("plain", 9*gi, 9*gi, true))
	_, err := s.CreateVolume(shortCall(t), replicatedRequest("pvc-1", "2", gi))
	g.Expect(status.Code(err)).To(Equal(codes.DeadlineExceeded))
	agentsCarve(t, s, "pvc-1")
	_, err = s.CreateVolume(t.Context(), replicatedRequest("pvc-1", "2", gi))
	g.Expect(err).NotTo(HaveOccurred())

	// A call again after a repair (the replica r1 replaced under another name): the volume as
	// it is, no replica made again under its first name.
	r1 := &pmemv1.PmemReplica{}
	g.Expect(s.reader.Get(t.Context(), client.ObjectKey{Name: replicaName("pvc-1", 1)}, r1)).To(Succeed())
	r1.Finalizers = nil
	g.Expect(s.client.Update(t.Context(), r1)).To(Succeed())
	g.Expect(s.client.Delete(t.Context(), r1)).To(Succeed())
	_, err = s.CreateVolume(t.Context(), replicatedRequest("pvc-1", "2", gi))
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(replicasOf(t, s, "pvc-1")).To(HaveLen(1))

	_, err = s.ControllerPublishVolume(t.Context(), &csi.ControllerPublishVolumeRequest{VolumeId: "pvc-1", NodeId: "plain", VolumeCapability: blockCap})
	g.Expect(err).NotTo(HaveOccurred(), "attached where it has no replica")

	// Clones are copied from a replica with the data, on its node: a replicated clone's first
	// replica (the others are rebuilt), a plain clone itself. A retry keeps the first choice.
	r0 := &pmemv1.PmemReplica{}
	g.Expect(s.reader.Get(t.Context(), client.ObjectKey{Name: replicaName("pvc-1", 0)}, r0)).To(Succeed())
	fromPVC1 := &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: "pvc-1"}}}
	clone := replicatedRequest("pvc-2", "2", gi)
	clone.VolumeContentSource = fromPVC1
	_, err = s.CreateVolume(shortCall(t), clone)
	g.Expect(status.Code(err)).To(Equal(codes.DeadlineExceeded))
	source := &pmemv1.PmemVolumeSource{VolumeID: "pvc-1", SourceReplica: r0.Name}
	g.Expect(replicasOf(t, s, "pvc-2")).To(ConsistOf(
		And(HaveField("Spec.Node", r0.Spec.Node), HaveField("Spec.Source", Equal(source)), HaveField("Spec.Rebuild", BeFalse())),
		And(HaveField("Spec.Node", Not(Equal(r0.Spec.Node))), HaveField("Spec.Source", BeNil()), HaveField("Spec.Rebuild", BeTrue())),
	))
	agentsCarve(t, s, "pvc-2")
	created, err := s.CreateVolume(t.Context(), clone)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(created.GetVolume().GetContentSource().GetVolume().GetVolumeId()).To(Equal("pvc-1"))
	plain := &csi.CreateVolumeRequest{Name: "pvc-3", VolumeCapabilities: []*csi.VolumeCapability{blockCap},
		CapacityRange: &csi.CapacityRange{RequiredBytes: gi}, VolumeContentSource: fromPVC1}
	_, err = s.CreateVolume(shortCall(t), plain)
	g.Expect(status.Code(err)).To(Equal(codes.DeadlineExceeded))
	vol := &pmemv1.PmemVolume{}
	g.Expect(s.reader.Get(t.Context(), client.ObjectKey{Name: "pvc-3"}, vol)).To(Succeed())
	g.Expect(vol.Spec).To(And(HaveField("Node", r0.Spec.Node), HaveField("Source", Equal(source))))

	// Deletion: the replicas first, each waiting for its agent; then the volume.
	_, err = s.DeleteVolume(shortCall(t), &csi.DeleteVolumeRequest{VolumeId: "pvc-1"})
	g.Expect(status.Code(err)).To(Equal(codes.DeadlineExceeded))
	g.Expect(s.reader.Get(t.Context(), client.ObjectKey{Name: "pvc-1"}, &pmemv1.PmemVolume{})).To(Succeed(), "the volume stays while a replica does")
	for _, r := range replicasOf(t, s, "pvc-1") {
		g.Expect(r.DeletionTimestamp).NotTo(BeNil())
		r.Finalizers = nil // the agent removed the replica
		g.Expect(s.client.Update(t.Context(), &r)).To(Succeed())
	}
	_, err = s.DeleteVolume(t.Context(), &csi.DeleteVolumeRequest{VolumeId: "pvc-1"})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(s.reader.Get(t.Context(), client.ObjectKey{Name: "pvc-1"}, &pmemv1.PmemVolume{})).NotTo(Succeed())
}

// A replicated volume grows only while no node serves it. Served, or with a replica being
// rebuilt, or a node without room for its replica's growth, it is refused and nothing
// changes; else the volume's size is recorded, then each replica's, and the call answers once
// the agents report every replica ready at its new size.
func TestExpandReplicatedVolume(t *testing.T) {
	g := NewWithT(t)
	s := newTestController(t, replicaNode("a", 2*gi), replicaNode("b", 4*gi))
	_, err := s.CreateVolume(shortCall(t), replicatedRequest("pvc-1", "2", gi))
	g.Expect(status.Code(err)).To(Equal(codes.DeadlineExceeded))
	agentsCarve(t, s, "pvc-1")
	_, err = s.CreateVolume(t.Context(), replicatedRequest("pvc-1", "2", gi))
	g.Expect(err).NotTo(HaveOccurred())
	expand := func(ctx context.Context, size int64) (*csi.ControllerExpandVolumeResponse, error) {
		return s.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: "pvc-1", CapacityRange: &csi.CapacityRange{RequiredBytes: size}})
	}
	vol := &pmemv1.PmemVolume{}
	sizes := func() []int64 {
		g.Expect(s.reader.Get(t.Context(), client.ObjectKey{Name: "pvc-1"}, vol)).To(Succeed())
		out := []int64{vol.Spec.Size.Value()}
		for _, r := range replicasOf(t, s, "pvc-1") {
			out = append(out, r.Spec.Size.Value())
		}
		return out
	}
	setTarget := func(node string) {
		g.Expect(s.reader.Get(t.Context(), client.ObjectKey{Name: "pvc-1"}, vol)).To(Succeed())
		vol.Status.Target = node
		g.Expect(s.client.Status().Update(t.Context(), vol)).To(Succeed())
	}

	setTarget("a")
	_, err = expand(t.Context(), 2*gi)
	g.Expect(status.Code(err)).To(Equal(codes.FailedPrecondition), "served by a: %v", err)
	g.Expect(err.Error()).To(ContainSubstring("node a serves it"))
	g.Expect(sizes()).To(Equal([]int64{gi, gi, gi}))
	setTarget("")

	_, err = expand(t.Context(), 4*gi)
	g.Expect(status.Code(err)).To(Equal(codes.ResourceExhausted), "node a has 2 GiB free, its replica needs 3 more: %v", err)
	g.Expect(sizes()).To(Equal([]int64{gi, gi, gi}))

	r1 := &pmemv1.PmemReplica{}
	g.Expect(s.reader.Get(t.Context(), client.ObjectKey{Name: replicaName("pvc-1", 1)}, r1)).To(Succeed())
	r1.Spec.Rebuild = true // a replacement being rebuilt
	g.Expect(s.client.Update(t.Context(), r1)).To(Succeed())
	_, err = expand(t.Context(), 2*gi)
	g.Expect(status.Code(err)).To(Equal(codes.Unavailable), "%v", err)
	g.Expect(sizes()).To(Equal([]int64{gi, gi, gi}))
	r1.Spec.Rebuild = false
	g.Expect(s.client.Update(t.Context(), r1)).To(Succeed())

	_, err = expand(shortCall(t), 2*gi)
	g.Expect(status.Code(err)).To(Equal(codes.DeadlineExceeded), "the agents have not grown the replicas yet: %v", err)
	g.Expect(sizes()).To(Equal([]int64{2 * gi, 2 * gi, 2 * gi}))
	agentsCarve(t, s, "pvc-1")
	resp, err := expand(t.Context(), 2*gi)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(resp.GetCapacityBytes()).To(Equal(2 * gi))
	g.Expect(resp.GetNodeExpansionRequired()).To(BeTrue(), "a filesystem grows on the node")
	g.Expect(s.reader.Get(t.Context(), client.ObjectKey{Name: "pvc-1"}, vol)).To(Succeed())
	g.Expect(allocated(vol)).To(Equal(2*gi), "reported in the volume's status")
	resp, err = expand(t.Context(), gi)
	g.Expect(err).NotTo(HaveOccurred(), "smaller than it is: nothing to do")
	g.Expect(resp.GetCapacityBytes()).To(Equal(2 * gi))
}

// Repair replaces a faulted replica by one to rebuild, on a node without a live replica of the
// volume and neither lost nor drained, and deletes it; a retry makes no second one; a lost
// node's faulted replica, whose agent never acts again, is released.
func TestRepairReplacesFaulted(t *testing.T) {
	g := NewWithT(t)
	node := func(name string) *corev1.Node { return &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}} }
	lost := node("lost")
	lost.Spec.Taints = []corev1.Taint{{Key: corev1.TaintNodeOutOfService, Effect: corev1.TaintEffectNoExecute}}
	drained := node("drained")
	drained.Spec.Taints = []corev1.Taint{{Key: vmv1.DrainTaint, Effect: corev1.TaintEffectNoSchedule}}
	s := newTestController(t, replicaNode("a", 8*gi), replicaNode("b", 4*gi), replicaNode("lost", 9*gi), replicaNode("c", 2*gi),
		replicaNode("drained", 9*gi), node("a"), node("b"), node("c"), lost, drained)
	vol := &pmemv1.PmemVolume{
		ObjectMeta: metav1.ObjectMeta{Name: "pvc-1", UID: "vol-uid"},
		Spec:       pmemv1.PmemVolumeSpec{VolumeID: "pvc-1", Replicas: 2, Size: *resource.NewQuantity(gi, resource.BinarySI)},
	}
	g.Expect(s.client.Create(t.Context(), vol)).To(Succeed())
	fault := func(name, node string) {
		r := newReplica(vol, name, node, false)
		r.UID = types.UID(name + "-uid")
		g.Expect(s.client.Create(t.Context(), r)).To(Succeed())
		meta.SetStatusCondition(&r.Status.Conditions, metav1.Condition{Type: pmemv1.ReadyCondition, Status: metav1.ConditionFalse, Reason: pmemv1.FaultedReason})
		g.Expect(s.client.Status().Update(t.Context(), r)).To(Succeed())
	}
	g.Expect(s.client.Create(t.Context(), newReplica(vol, "pvc-1-r0", "a", false))).To(Succeed())
	fault("pvc-1-r1", "b")

	g.Expect(s.Repair(t.Context(), vol)).To(Succeed())
	g.Expect(s.Repair(t.Context(), vol)).To(Succeed(), "again: nothing more")
	var live []pmemv1.PmemReplica
	for _, r := range replicasOf(t, s, "pvc-1") {
		if r.Name == "pvc-1-r1" {
			g.Expect(r.DeletionTimestamp).NotTo(BeNil(), "the faulted replica is deleted; its agent frees it")
			continue
		}
		live = append(live, r)
	}
	g.Expect(live).To(HaveLen(2))
	g.Expect(live).To(ContainElement(And(
		HaveField("Spec.Rebuild", BeTrue()), HaveField("Spec.Node", Equal("b")),
		HaveField("Labels", HaveKeyWithValue(pmemv1.NodeLabel, "b")), HaveField("Finalizers", ContainElement(agent.Finalizer)),
	)), "the node with the most room that holds no live replica, never the lost or the drained one")

	// A replica faulted on a lost node: released, since no agent will.
	fault("pvc-1-r9", "lost")
	g.Expect(s.Repair(t.Context(), vol)).To(Succeed())
	names := []string{}
	for _, r := range replicasOf(t, s, "pvc-1") {
		names = append(names, r.Name)
		g.Expect(r.Spec.Node).NotTo(Equal("lost"))
	}
	g.Expect(names).NotTo(ContainElement("pvc-1-r9"), "gone: its finalizer removed")
	g.Expect(names).To(HaveLen(4), "r0, the deleting r1, and a replacement for each")
}

// Repair moves a live replica off a drained node: a replacement to rebuild elsewhere first; the
// drained one stays while the replacement has no data, and while a target writes to it (the
// serving node retires it); it is deleted once retired, or once in sync when no node serves the
// volume.
func TestRepairMovesReplicasOffDrainedNodes(t *testing.T) {
	drained := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "d"}}
	drained.Spec.Taints = []corev1.Taint{{Key: vmv1.DrainTaint, Effect: corev1.TaintEffectNoSchedule}}
	for _, target := range []string{"a", ""} {
		t.Run("target "+target, func(t *testing.T) {
			g := NewWithT(t)
			s := newTestController(t, replicaNode("a", 8*gi), replicaNode("b", 4*gi), replicaNode("d", 9*gi), drained.DeepCopy())
			vol := &pmemv1.PmemVolume{
				ObjectMeta: metav1.ObjectMeta{Name: "pvc-1", UID: "vol-uid"},
				Spec:       pmemv1.PmemVolumeSpec{VolumeID: "pvc-1", Replicas: 2, Size: *resource.NewQuantity(gi, resource.BinarySI)},
				Status:     pmemv1.PmemVolumeStatus{Target: target},
			}
			g.Expect(s.client.Create(t.Context(), vol)).To(Succeed())
			g.Expect(s.client.Create(t.Context(), newReplica(vol, "pvc-1-r0", "a", false))).To(Succeed())
			onDrained := newReplica(vol, "pvc-1-r1", "d", false)
			onDrained.UID = "r1-uid"
			g.Expect(s.client.Create(t.Context(), onDrained)).To(Succeed())
			get := func(name string) *pmemv1.PmemReplica {
				r := &pmemv1.PmemReplica{}
				g.Expect(s.client.Get(t.Context(), client.ObjectKey{Name: name}, r)).To(Succeed())
				return r
			}

			g.Expect(s.Repair(t.Context(), vol)).To(Succeed())
			g.Expect(s.Repair(t.Context(), vol)).To(Succeed(), "again: nothing more")
			replicas := replicasOf(t, s, "pvc-1")
			g.Expect(replicas).To(HaveLen(3))
			var repl string
			for _, r := range replicas {
				g.Expect(r.DeletionTimestamp).To(BeNil(), "%s: none goes before its replacement has the data", r.Name)
				if r.Spec.Rebuild {
					g.Expect(r.Spec.Node).To(Equal("b"), "the replacement: on the node with room that is not drained")
					g.Expect(r.Annotations).To(HaveKeyWithValue(pmemv1.ReplacesAnnotation, "pvc-1-r1"))
					repl = r.Name
				}
			}

			r := get(repl)
			meta.SetStatusCondition(&r.Status.Conditions, metav1.Condition{Type: pmemv1.InSyncCondition, Status: metav1.ConditionTrue, Reason: pmemv1.RebuiltReason})
			g.Expect(s.client.Status().Update(t.Context(), r)).To(Succeed())
			g.Expect(s.Repair(t.Context(), vol)).To(Succeed())
			if target != "" {
				g.Expect(get("pvc-1-r1").DeletionTimestamp).To(BeNil(), "in a target: the serving node retires it first")
				r := get("pvc-1-r1")
				meta.SetStatusCondition(&r.Status.Conditions, metav1.Condition{Type: pmemv1.ReadyCondition, Status: metav1.ConditionFalse, Reason: pmemv1.RetiredReason})
				g.Expect(s.client.Status().Update(t.Context(), r)).To(Succeed())
				g.Expect(s.Repair(t.Context(), vol)).To(Succeed())
			}
			g.Expect(get("pvc-1-r1").DeletionTimestamp).NotTo(BeNil(), "deleted; its agent frees it")
			g.Expect(replicasOf(t, s, "pvc-1")).To(HaveLen(3), "no replacement of the replacement")
		})
	}
}

// A snapshot of a replicated volume is cut from one replica with its data, on that replica's
// node; a volume restored from it has its first replica made from the snapshot there, and the
// others rebuilt.
func TestReplicatedSnapshotAndRestore(t *testing.T) {
	g := NewWithT(t)
	drained := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "d"}}
	drained.Spec.Taints = []corev1.Taint{{Key: vmv1.DrainTaint, Effect: corev1.TaintEffectNoSchedule}}
	s := newTestController(t, replicaNode("a", 8*gi), replicaNode("b", 4*gi), replicaNode("c", 2*gi), replicaNode("d", 9*gi), drained)
	req := replicatedRequest("pvc-1", "2", gi)
	req.AccessibilityRequirements = &csi.TopologyRequirement{Preferred: topology("b")}
	_, err := s.CreateVolume(shortCall(t), req)
	g.Expect(status.Code(err)).To(Equal(codes.DeadlineExceeded))
	agentsCarve(t, s, "pvc-1")
	_, err = s.CreateVolume(t.Context(), req)
	g.Expect(err).NotTo(HaveOccurred())
	r0, r1 := replicaName("pvc-1", 0), replicaName("pvc-1", 1)
	fault := func(name string) {
		r := &pmemv1.PmemReplica{}
		g.Expect(s.reader.Get(t.Context(), client.ObjectKey{Name: name}, r)).To(Succeed())
		meta.SetStatusCondition(&r.Status.Conditions, metav1.Condition{Type: pmemv1.ReadyCondition, Status: metav1.ConditionFalse, Reason: pmemv1.FaultedReason})
		g.Expect(s.client.Status().Update(t.Context(), r)).To(Succeed())
	}
	// cut does what the node agent does: the snapshot of id is ready.
	cut := func(id string) *pmemv1.PmemSnapshot {
		snap := &pmemv1.PmemSnapshot{}
		g.Expect(s.reader.Get(t.Context(), client.ObjectKey{Name: id}, snap)).To(Succeed())
		snap.Status.Size = resource.NewQuantity(gi, resource.BinarySI)
		meta.SetStatusCondition(&snap.Status.Conditions, metav1.Condition{Type: pmemv1.ReadyCondition, Status: metav1.ConditionTrue, Reason: pmemv1.CreatedReason, ObservedGeneration: snap.Generation})
		g.Expect(s.client.Status().Update(t.Context(), snap)).To(Succeed())
		return snap
	}

	snapReq := &csi.CreateSnapshotRequest{Name: "snap-1", SourceVolumeId: "pvc-1"}
	_, err = s.CreateSnapshot(shortCall(t), snapReq)
	g.Expect(status.Code(err)).To(Equal(codes.DeadlineExceeded), "the agent has not cut it yet")
	snap := cut(ids.For("snapshot", "snap-1"))
	g.Expect(snap.Spec).To(And(HaveField("Node", "b"), HaveField("SourceReplica", r0), HaveField("SourceVolumeID", "pvc-1")),
		"cut from the first replica by name, on its node")
	resp, err := s.CreateSnapshot(t.Context(), snapReq)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(resp.GetSnapshot().GetSourceVolumeId()).To(Equal("pvc-1"))

	fault(r0)
	_, err = s.CreateSnapshot(shortCall(t), &csi.CreateSnapshotRequest{Name: "snap-2", SourceVolumeId: "pvc-1"})
	g.Expect(status.Code(err)).To(Equal(codes.DeadlineExceeded))
	g.Expect(cut(ids.For("snapshot", "snap-2")).Spec.SourceReplica).To(Equal(r1), "never from a faulted replica")
	fault(r1)
	_, err = s.CreateSnapshot(t.Context(), &csi.CreateSnapshotRequest{Name: "snap-3", SourceVolumeId: "pvc-1"})
	g.Expect(status.Code(err)).To(Equal(codes.Unavailable), "no replica with the data")

	restore := replicatedRequest("pvc-2", "2", gi)
	restore.VolumeContentSource = &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{
		Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: snap.Name}}}
	_, err = s.CreateVolume(shortCall(t), restore)
	g.Expect(status.Code(err)).To(Equal(codes.DeadlineExceeded))
	vol := &pmemv1.PmemVolume{}
	g.Expect(s.reader.Get(t.Context(), client.ObjectKey{Name: "pvc-2"}, vol)).To(Succeed())
	g.Expect(vol.Spec.Source).To(Equal(&pmemv1.PmemVolumeSource{SnapshotID: snap.Name}))
	replicas := replicasOf(t, s, "pvc-2")
	g.Expect(replicas).To(ConsistOf(
		And(HaveField("Spec.Node", "b"), HaveField("Spec.Source", Equal(vol.Spec.Source)), HaveField("Spec.Rebuild", BeFalse())),
		And(HaveField("Spec.Node", "a"), HaveField("Spec.Source", BeNil()), HaveField("Spec.Rebuild", BeTrue())),
	), "the first from the snapshot, on its node; the other rebuilt, never on the drained node")
	agentsCarve(t, s, "pvc-2")
	created, err := s.CreateVolume(t.Context(), restore)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(created.GetVolume().GetContentSource().GetSnapshot().GetSnapshotId()).To(Equal(snap.Name))

	// A snapshot on a drained node: no volume is recorded.
	onDrained := &pmemv1.PmemSnapshot{
		ObjectMeta: metav1.ObjectMeta{Name: "snap-d"},
		Spec:       pmemv1.PmemSnapshotSpec{Node: "d", SnapshotID: "snap-d", SourceVolumeID: "pvc-x"},
	}
	g.Expect(s.client.Create(t.Context(), onDrained)).To(Succeed())
	cut("snap-d")
	restore = replicatedRequest("pvc-3", "2", gi)
	restore.VolumeContentSource = &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{
		Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: "snap-d"}}}
	_, err = s.CreateVolume(t.Context(), restore)
	g.Expect(status.Code(err)).To(Equal(codes.ResourceExhausted))
	g.Expect(s.reader.Get(t.Context(), client.ObjectKey{Name: "pvc-3"}, &pmemv1.PmemVolume{})).NotTo(Succeed())
}
