package driver

import (
	"context"
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
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"
	"sigs.k8s.io/controller-runtime/pkg/client/interceptor"

	"pvbridge.io/mgmt-csi/internal/agent"
	pmemv1 "pvbridge.io/pkg/apis/pmem/v1alpha1"
	"pvbridge.io/pkg/await"
	"pvbridge.io/pkg/tenancy"
)

const gi = int64(1 << 30)

var (
	mountCap = &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "xfs"}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
	}
	blockCap = &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
	}
)

func pmemNode(name string, free, largest int64, ready bool) *pmemv1.PmemNode {
	n := &pmemv1.PmemNode{ObjectMeta: metav1.ObjectMeta{Name: name}}
	n.Status.Free = resource.NewQuantity(free, resource.BinarySI)
	n.Status.LargestAllocatable = resource.NewQuantity(largest, resource.BinarySI)
	n.Status.Alignment = resource.NewQuantity(1<<20, resource.BinarySI)
	st := metav1.ConditionFalse
	if ready {
		st = metav1.ConditionTrue
	}
	meta.SetStatusCondition(&n.Status.Conditions, metav1.Condition{Type: pmemv1.ReadyCondition, Status: st, Reason: "Test"})
	return n
}

func pmemVolume(name, node string, size int64) *pmemv1.PmemVolume {
	return &pmemv1.PmemVolume{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec:       pmemv1.PmemVolumeSpec{Node: node, VolumeID: name, Size: *resource.NewQuantity(size, resource.BinarySI)},
	}
}

// newTestController serves a controller over a fake API holding objs; each PmemNode's host has
// its Node, as in a cluster, unless objs has one.
func newTestController(t *testing.T, objs ...client.Object) *controllerServer {
	t.Helper()
	scheme, err := newScheme()
	if err != nil {
		t.Fatal(err)
	}
	nodes := map[string]bool{}
	for _, o := range objs {
		if _, ok := o.(*corev1.Node); ok {
			nodes[o.GetName()] = true
		}
	}
	for _, o := range objs {
		if _, ok := o.(*pmemv1.PmemNode); ok && !nodes[o.GetName()] {
			objs = append(objs, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: o.GetName()}})
		}
	}
	c := fake.NewClientBuilder().WithScheme(scheme).WithObjects(objs...).
		WithStatusSubresource(&pmemv1.PmemVolume{}, &pmemv1.PmemNode{}, &pmemv1.PmemSnapshot{}, &pmemv1.PmemReplica{}).Build()
	return newControllerServer(c, c, c, await.NewHub())
}

func topology(nodes ...string) []*csi.Topology {
	var out []*csi.Topology
	for _, n := range nodes {
		out = append(out, &csi.Topology{Segments: map[string]string{TopologyKey: n}})
	}
	return out
}

// TestCreateVolumeRefusesWithoutSideEffects covers requests that must fail before anything is
// recorded: each leaves no PmemVolume behind.
func TestCreateVolumeRefusesWithoutSideEffects(t *testing.T) {
	tests := []struct {
		name string
		req  *csi.CreateVolumeRequest
		code codes.Code
	}{
		{"no name", &csi.CreateVolumeRequest{VolumeCapabilities: []*csi.VolumeCapability{mountCap}}, codes.InvalidArgument},
		{"no capabilities", &csi.CreateVolumeRequest{Name: "pvc-1"}, codes.InvalidArgument},
		{"multi-node access", &csi.CreateVolumeRequest{Name: "pvc-1", VolumeCapabilities: []*csi.VolumeCapability{{
			AccessType: mountCap.AccessType,
			AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER},
		}}}, codes.InvalidArgument},
		{"unknown filesystem", &csi.CreateVolumeRequest{Name: "pvc-1", VolumeCapabilities: []*csi.VolumeCapability{{
			AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "zfs"}},
			AccessMode: mountCap.AccessMode,
		}}}, codes.InvalidArgument},
		{"unknown parameter", &csi.CreateVolumeRequest{Name: "pvc-1", VolumeCapabilities: []*csi.VolumeCapability{mountCap},
			Parameters: map[string]string{"tier": "gold"}}, codes.InvalidArgument},
		{"invalid mutable parameter", &csi.CreateVolumeRequest{Name: "pvc-1", VolumeCapabilities: []*csi.VolumeCapability{mountCap},
			MutableParameters: map[string]string{"maxIOPS": "fast"}}, codes.InvalidArgument},
		{"required above limit", &csi.CreateVolumeRequest{Name: "pvc-1", VolumeCapabilities: []*csi.VolumeCapability{mountCap},
			CapacityRange: &csi.CapacityRange{RequiredBytes: 2 * gi, LimitBytes: gi}}, codes.InvalidArgument},
		{"no node with room", &csi.CreateVolumeRequest{Name: "pvc-1", VolumeCapabilities: []*csi.VolumeCapability{mountCap},
			CapacityRange: &csi.CapacityRange{RequiredBytes: 8 * gi}}, codes.ResourceExhausted},
		{"selected node has no room", &csi.CreateVolumeRequest{Name: "pvc-1", VolumeCapabilities: []*csi.VolumeCapability{mountCap},
			CapacityRange:             &csi.CapacityRange{RequiredBytes: 3 * gi},
			AccessibilityRequirements: &csi.TopologyRequirement{Requisite: topology("small"), Preferred: topology("small")}}, codes.ResourceExhausted},
		{"selected node not ready", &csi.CreateVolumeRequest{Name: "pvc-1", VolumeCapabilities: []*csi.VolumeCapability{mountCap},
			AccessibilityRequirements: &csi.TopologyRequirement{Requisite: topology("down")}}, codes.ResourceExhausted},
		{"unknown snapshot", &csi.CreateVolumeRequest{Name: "pvc-1", VolumeCapabilities: []*csi.VolumeCapability{mountCap},
			VolumeContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{
				Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: "snapshot-x"}}}}, codes.NotFound},
		{"unknown clone source", &csi.CreateVolumeRequest{Name: "pvc-1", VolumeCapabilities: []*csi.VolumeCapability{mountCap},
			VolumeContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{
				Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: "pvc-x"}}}}, codes.NotFound},
		{"clone smaller than its source", &csi.CreateVolumeRequest{Name: "pvc-1", VolumeCapabilities: []*csi.VolumeCapability{mountCap},
			CapacityRange: &csi.CapacityRange{RequiredBytes: gi},
			VolumeContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{
				Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: "pvc-src"}}}}, codes.OutOfRange},
		{"clone source outside the requirements", &csi.CreateVolumeRequest{Name: "pvc-1", VolumeCapabilities: []*csi.VolumeCapability{mountCap},
			CapacityRange:             &csi.CapacityRange{RequiredBytes: 2 * gi},
			AccessibilityRequirements: &csi.TopologyRequirement{Requisite: topology("small")},
			VolumeContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{
				Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: "pvc-src"}}}}, codes.ResourceExhausted},
		{"a guest's volume, the guest runs no VM", &csi.CreateVolumeRequest{Name: "pvc-1", VolumeCapabilities: []*csi.VolumeCapability{mountCap},
			Parameters: guestClaim("uid-idle-pvc-1")}, codes.ResourceExhausted},
		{"a guest's clone, its source outside its hosts", &csi.CreateVolumeRequest{Name: "pvc-1", VolumeCapabilities: []*csi.VolumeCapability{mountCap},
			Parameters: guestClaim("uid-small-pvc-1"), CapacityRange: &csi.CapacityRange{RequiredBytes: 2 * gi},
			VolumeContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{
				Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: "pvc-src"}}}}, codes.ResourceExhausted},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			s := newTestController(t,
				pmemNode("big", 4*gi, 4*gi, true), pmemNode("small", 2*gi, 2*gi, true), pmemNode("down", 9*gi, 9*gi, false),
				pmemVolume("pvc-src", "big", 2*gi), tenancyParams())
			_, err := s.CreateVolume(t.Context(), tt.req)
			g.Expect(status.Code(err)).To(Equal(tt.code), "%v", err)
			list := &pmemv1.PmemVolumeList{}
			g.Expect(s.reader.List(t.Context(), list)).To(Succeed())
			g.Expect(list.Items).To(HaveLen(1), "only the clone source exists")
		})
	}
}

// guestClaim is what csi-provisioner passes with --extra-create-metadata (and csi-resizer with
// --extra-modify-metadata) for the management PVC of that name in namespace tenant.
func guestClaim(name string) map[string]string {
	return map[string]string{pvcNameParameter: name, pvcNamespaceParameter: "tenant", "csi.storage.k8s.io/pv/name": "pv-1"}
}

// tenancyParams are the tenancy parameters of namespace tenant: guest cluster small runs VMs on
// host small, idle none.
func tenancyParams() *corev1.ConfigMap {
	return &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: "tenant", Name: tenancy.ParamsConfigMap}, Data: map[string]string{
		"small.uid": "uid-small", "small.hosts": "small",
		"idle.uid": "uid-idle", "idle.hosts": "",
	}}
}

// TestGuestHosts: a guest cluster's new volume goes only to the hosts of its VMs; the others
// anywhere.
func TestGuestHosts(t *testing.T) {
	for _, tc := range []struct {
		name   string
		params map[string]string
		objs   []client.Object
		want   []string
		code   codes.Code
	}{
		{name: "csi-provisioner without --extra-create-metadata", params: nil, objs: []client.Object{tenancyParams()}},
		{name: "a namespace without tenancy", params: guestClaim("uid-small-pvc-1")},
		{name: "an admin's claim", params: guestClaim("shared-data"), objs: []client.Object{tenancyParams()}},
		{name: "a guest's claim", params: guestClaim("uid-small-pvc-1"), objs: []client.Object{tenancyParams()}, want: []string{"small"}},
		{name: "a guest without VMs", params: guestClaim("uid-idle-pvc-1"), objs: []client.Object{tenancyParams()}, code: codes.ResourceExhausted},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			got, err := newTestController(t, tc.objs...).guestHosts(t.Context(), tc.params)
			g.Expect(status.Code(err)).To(Equal(tc.code), "%v", err)
			g.Expect(got).To(Equal(tc.want))
		})
	}
}

func TestChooseNode(t *testing.T) {
	nodes := []client.Object{pmemNode("a", 3*gi, 3*gi, true), pmemNode("b", 5*gi, 5*gi, true), pmemNode("c", 9*gi, 9*gi, false)}
	tests := []struct {
		name    string
		req     *csi.TopologyRequirement
		allowed []string
		size    int64
		want    string
	}{
		{"no requirements: the most room", nil, nil, gi, "b"},
		{"preferred first", &csi.TopologyRequirement{Preferred: topology("a", "b"), Requisite: topology("a", "b")}, nil, gi, "a"},
		{"next preferred when the first is full", &csi.TopologyRequirement{Preferred: topology("a", "b")}, nil, 4 * gi, "b"},
		{"requisite only", &csi.TopologyRequirement{Requisite: topology("a")}, nil, 2 * gi, "a"},
		{"a guest's: the most room among its hosts", nil, []string{"a", "c"}, gi, "a"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			got, err := newTestController(t, nodes...).chooseNode(t.Context(), tt.req, tt.allowed, tt.size, 0)
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(got).To(Equal(tt.want))
		})
	}
}

func TestCreateVolumeRepeatedWithAnotherSizeIsAlreadyExists(t *testing.T) {
	g := NewWithT(t)
	s := newTestController(t, pmemNode("a", 4*gi, 4*gi, true), pmemVolume("pvc-1", "a", gi))
	_, err := s.CreateVolume(t.Context(), &csi.CreateVolumeRequest{
		Name: "pvc-1", VolumeCapabilities: []*csi.VolumeCapability{mountCap},
		CapacityRange: &csi.CapacityRange{RequiredBytes: 2 * gi},
	})
	g.Expect(status.Code(err)).To(Equal(codes.AlreadyExists))
}

func TestCreateVolumeAnswersDeadlineExceededWhileTheAgentWorks(t *testing.T) {
	g := NewWithT(t)
	s := newTestController(t, pmemNode("a", 4*gi, 4*gi, true))
	ctx, cancel := context.WithTimeout(t.Context(), 100*time.Millisecond)
	defer cancel()
	_, err := s.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-1", VolumeCapabilities: []*csi.VolumeCapability{mountCap}})
	g.Expect(status.Code(err)).To(Equal(codes.DeadlineExceeded))
	vol := &pmemv1.PmemVolume{}
	g.Expect(s.reader.Get(t.Context(), client.ObjectKey{Name: "pvc-1"}, vol)).To(Succeed(), "the intent stays for the retry")
	g.Expect(vol.Spec.Node).To(Equal("a"))
	g.Expect(vol.Finalizers).To(ContainElement(agent.Finalizer))
}

func TestConcurrentCallsForOneVolumeAreAborted(t *testing.T) {
	g := NewWithT(t)
	s := newTestController(t)
	g.Expect(s.locks.TryLock("pvc-1")).To(BeTrue())
	_, err := s.DeleteVolume(t.Context(), &csi.DeleteVolumeRequest{VolumeId: "pvc-1"})
	g.Expect(status.Code(err)).To(Equal(codes.Aborted))
}

func TestControllerPublishVolume(t *testing.T) {
	tests := []struct {
		name string
		req  *csi.ControllerPublishVolumeRequest
		code codes.Code
	}{
		{"the volume's node", &csi.ControllerPublishVolumeRequest{VolumeId: "pvc-1", NodeId: "a", VolumeCapability: blockCap}, codes.OK},
		{"another node", &csi.ControllerPublishVolumeRequest{VolumeId: "pvc-1", NodeId: "b", VolumeCapability: blockCap}, codes.FailedPrecondition},
		{"unknown volume", &csi.ControllerPublishVolumeRequest{VolumeId: "pvc-x", NodeId: "a", VolumeCapability: blockCap}, codes.NotFound},
		{"unknown node", &csi.ControllerPublishVolumeRequest{VolumeId: "pvc-1", NodeId: "x", VolumeCapability: blockCap}, codes.NotFound},
		{"no volume ID", &csi.ControllerPublishVolumeRequest{NodeId: "a", VolumeCapability: blockCap}, codes.InvalidArgument},
		{"no node ID", &csi.ControllerPublishVolumeRequest{VolumeId: "pvc-1", VolumeCapability: blockCap}, codes.InvalidArgument},
		{"no capability", &csi.ControllerPublishVolumeRequest{VolumeId: "pvc-1", NodeId: "a"}, codes.InvalidArgument},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			s := newTestController(t, pmemNode("a", gi, gi, true), pmemNode("b", gi, gi, true), pmemVolume("pvc-1", "a", gi))
			_, err := s.ControllerPublishVolume(t.Context(), tt.req)
			g.Expect(status.Code(err)).To(Equal(tt.code), "%v", err)
		})
	}
}

func TestControllerModifyVolume(t *testing.T) {
	tests := []struct {
		name string
		req  *csi.ControllerModifyVolumeRequest
		code codes.Code
		msg  string
	}{
		{"limits", &csi.ControllerModifyVolumeRequest{VolumeId: "pvc-1", MutableParameters: map[string]string{"maxIOPS": "100", "maxBytesPerSecond": "8Mi"}}, codes.OK, ""},
		{"no limits", &csi.ControllerModifyVolumeRequest{VolumeId: "pvc-1"}, codes.OK, ""},
		{"a misspelt limit", &csi.ControllerModifyVolumeRequest{VolumeId: "pvc-1", MutableParameters: map[string]string{"maxIops": "100"}}, codes.InvalidArgument, `maxIops "100": unknown parameter`},
		{"a bad value", &csi.ControllerModifyVolumeRequest{VolumeId: "pvc-1", MutableParameters: map[string]string{"maxBytesPerSecond": "-1"}}, codes.InvalidArgument, "negative"},
		{"unknown volume", &csi.ControllerModifyVolumeRequest{VolumeId: "pvc-x"}, codes.NotFound, "pvc-x"},
		{"no volume ID", &csi.ControllerModifyVolumeRequest{}, codes.InvalidArgument, "volume_id"},
		{"csi-resizer's claim metadata", &csi.ControllerModifyVolumeRequest{VolumeId: "pvc-1", MutableParameters: guestClaim("uid-small-pvc-1")}, codes.OK, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			s := newTestController(t, pmemVolume("pvc-1", "a", gi), tenancyParams())
			_, err := s.ControllerModifyVolume(t.Context(), tt.req)
			g.Expect(status.Code(err)).To(Equal(tt.code), "%v", err)
			g.Expect(status.Convert(err).Message()).To(ContainSubstring(tt.msg))
		})
	}
}

// TestModifyBudget: a guest cluster that changes its claims' classes past its budget is
// refused, ResourceExhausted (csi-resizer retries), and its neighbours and the admin are not.
func TestModifyBudget(t *testing.T) {
	g := NewWithT(t)
	params := tenancyParams()
	params.Data["other.uid"], params.Data["other.hosts"] = "uid-other", "small"
	s := newTestController(t, pmemVolume("pvc-1", "a", gi), params)
	modify := func(claim string) error {
		_, err := s.ControllerModifyVolume(t.Context(), &csi.ControllerModifyVolumeRequest{VolumeId: "pvc-1", MutableParameters: guestClaim(claim)})
		return err
	}
	for range modifiesBurst {
		g.Expect(modify("uid-small-pvc-1")).To(Succeed())
	}
	err := modify("uid-small-pvc-2")
	g.Expect(status.Code(err)).To(Equal(codes.ResourceExhausted), "%v", err)
	g.Expect(status.Convert(err).Message()).To(Equal(
		"guest cluster tenant/small has spent its budget of VolumeAttributesClass changes (20 at once, then one every 6 s): PVC tenant/uid-small-pvc-2 changes class when the budget allows"))
	g.Expect(modify("uid-other-pvc-1")).To(Succeed(), "a neighbour in the same namespace has its own budget")
	for range modifiesBurst + 1 {
		g.Expect(modify("shared-data")).To(Succeed(), "the admin's claims have no budget")
	}
}

func TestGetCapacity(t *testing.T) {
	tests := []struct {
		name          string
		req           *csi.GetCapacityRequest
		available, mx int64
	}{
		{"one node", &csi.GetCapacityRequest{AccessibleTopology: topology("a")[0]}, 3 * gi, 2 * gi},
		{"all ready nodes", &csi.GetCapacityRequest{}, 8 * gi, 5 * gi},
		{"a node not ready", &csi.GetCapacityRequest{AccessibleTopology: topology("c")[0]}, 0, 0},
		{"an unknown node", &csi.GetCapacityRequest{AccessibleTopology: topology("x")[0]}, 0, 0},
		{"an unsupported capability", &csi.GetCapacityRequest{VolumeCapabilities: []*csi.VolumeCapability{{
			AccessType: blockCap.AccessType,
			AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY},
		}}}, 0, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			s := newTestController(t, pmemNode("a", 3*gi, 2*gi, true), pmemNode("b", 5*gi, 5*gi, true), pmemNode("c", 7*gi, 7*gi, false))
			resp, err := s.GetCapacity(t.Context(), tt.req)
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(resp.GetAvailableCapacity()).To(Equal(tt.available))
			g.Expect(resp.GetMaximumVolumeSize().GetValue()).To(Equal(tt.mx))
		})
	}
}

func TestListSnapshotsPages(t *testing.T) {
	g := NewWithT(t)
	var objs []client.Object
	for _, name := range []string{"snapshot-c", "snapshot-a", "snapshot-b"} {
		s := &pmemv1.PmemSnapshot{ObjectMeta: metav1.ObjectMeta{Name: name},
			Spec: pmemv1.PmemSnapshotSpec{Node: "a", SnapshotID: name, SourceVolumeID: "pvc-1"}}
		meta.SetStatusCondition(&s.Status.Conditions, metav1.Condition{Type: pmemv1.ReadyCondition, Status: metav1.ConditionTrue, Reason: "Test"})
		objs = append(objs, s)
	}
	s := newTestController(t, objs...)

	page, err := s.ListSnapshots(t.Context(), &csi.ListSnapshotsRequest{MaxEntries: 2})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(page.GetEntries()).To(HaveLen(2))
	g.Expect(page.GetEntries()[0].GetSnapshot().GetSnapshotId()).To(Equal("snapshot-a"))
	g.Expect(page.GetNextToken()).To(Equal("2"))

	page, err = s.ListSnapshots(t.Context(), &csi.ListSnapshotsRequest{StartingToken: page.GetNextToken()})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(page.GetEntries()).To(HaveLen(1))
	g.Expect(page.GetNextToken()).To(BeEmpty())

	_, err = s.ListSnapshots(t.Context(), &csi.ListSnapshotsRequest{StartingToken: "nine"})
	g.Expect(status.Code(err)).To(Equal(codes.Aborted))

	one, err := s.ListSnapshots(t.Context(), &csi.ListSnapshotsRequest{SnapshotId: "snapshot-b"})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(one.GetEntries()).To(HaveLen(1))
}

// TestControllerExpandVolumeWaitsForTheCacheToSeeTheGrowth covers an informer cache that lags
// behind the controller's own write: the Ready condition of the old generation says nothing
// about the new size, so the call waits (and answers DeadlineExceeded for the resizer to retry)
// instead of reporting the old capacity as the new one.
func TestControllerExpandVolumeWaitsForTheCacheToSeeTheGrowth(t *testing.T) {
	tests := []struct {
		name         string
		staleCache   bool
		code         codes.Code
		wantCapacity int64
	}{
		{name: "the cache has not seen the growth", staleCache: true, code: codes.DeadlineExceeded},
		{name: "the cache has seen the agent grow the volume", code: codes.OK, wantCapacity: 2 * gi},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			scheme, err := newScheme()
			g.Expect(err).NotTo(HaveOccurred())
			vol := pmemVolume("pvc-1", "a", gi)
			vol.Generation = 1
			vol.Status.AllocatedSize = resource.NewQuantity(gi, resource.BinarySI)
			meta.SetStatusCondition(&vol.Status.Conditions, metav1.Condition{
				Type: pmemv1.ReadyCondition, Status: metav1.ConditionTrue, Reason: "Test", ObservedGeneration: 1,
			})
			// The apiserver bumps the generation of a changed spec; the node agent then grows
			// the volume and reports it ready at that generation.
			grow := interceptor.Funcs{Patch: func(ctx context.Context, c client.WithWatch, obj client.Object, patch client.Patch, opts ...client.PatchOption) error {
				if err := c.Patch(ctx, obj, patch, opts...); err != nil {
					return err
				}
				v := obj.(*pmemv1.PmemVolume)
				v.Generation++
				if err := c.Update(ctx, v); err != nil {
					return err
				}
				v.Status.AllocatedSize = ptr.To(v.Spec.Size)
				meta.SetStatusCondition(&v.Status.Conditions, metav1.Condition{
					Type: pmemv1.ReadyCondition, Status: metav1.ConditionTrue, Reason: "Test", ObservedGeneration: v.Generation,
				})
				return c.Status().Update(ctx, v)
			}}
			c := fake.NewClientBuilder().WithScheme(scheme).WithObjects(vol.DeepCopy()).
				WithStatusSubresource(&pmemv1.PmemVolume{}).WithInterceptorFuncs(grow).Build()
			var reader client.Reader = c
			if tt.staleCache {
				reader = fake.NewClientBuilder().WithScheme(scheme).WithObjects(vol.DeepCopy()).Build()
			}
			s := newControllerServer(c, reader, c, await.NewHub())

			ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
			defer cancel()
			resp, err := s.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{
				VolumeId: "pvc-1", CapacityRange: &csi.CapacityRange{RequiredBytes: 2 * gi}, VolumeCapability: blockCap,
			})
			g.Expect(status.Code(err)).To(Equal(tt.code), "%v", err)
			g.Expect(resp.GetCapacityBytes()).To(Equal(tt.wantCapacity))
		})
	}
}
