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
	"sigs.k8s.io/controller-runtime/pkg/client"

	pmemv1 "pvbridge.io/pkg/apis/pmem/v1alpha1"
	"pvbridge.io/pkg/tenancy"
)

func newTestGroupController(t *testing.T) *groupControllerServer {
	t.Helper()
	return &groupControllerServer{controllerServer: newTestController(t,
		pmemVolume("pvc-a", "host-1", gi), pmemVolume("pvc-b", "host-1", gi), pmemVolume("pvc-c", "host-2", gi))}
}

// members lists the group's PmemSnapshots as the node agent sees them.
func members(t *testing.T, s *groupControllerServer, id string) []*pmemv1.PmemSnapshot {
	t.Helper()
	m, err := s.groupMembers(t.Context(), id)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// cut does what the node agent does once it has cut the group: every member Ready.
func cut(t *testing.T, s *groupControllerServer, id string) {
	t.Helper()
	for _, m := range members(t, s, id) {
		now := metav1.Now()
		m.Status.Size = resource.NewQuantity(gi, resource.BinarySI)
		m.Status.CreationTime = &now
		meta.SetStatusCondition(&m.Status.Conditions, metav1.Condition{
			Type: pmemv1.ReadyCondition, Status: metav1.ConditionTrue, Reason: pmemv1.CreatedReason, ObservedGeneration: m.Generation,
		})
		if err := s.client.Status().Update(t.Context(), m); err != nil {
			t.Fatal(err)
		}
	}
}

func TestCreateVolumeGroupSnapshotRefuses(t *testing.T) {
	tests := []struct {
		name string
		req  *csi.CreateVolumeGroupSnapshotRequest
		code codes.Code
	}{
		{"no name", &csi.CreateVolumeGroupSnapshotRequest{SourceVolumeIds: []string{"pvc-a"}}, codes.InvalidArgument},
		{"no volumes", &csi.CreateVolumeGroupSnapshotRequest{Name: "groupsnapshot-1"}, codes.InvalidArgument},
		{"an empty volume ID", &csi.CreateVolumeGroupSnapshotRequest{Name: "groupsnapshot-1", SourceVolumeIds: []string{"pvc-a", ""}}, codes.InvalidArgument},
		{"a volume twice", &csi.CreateVolumeGroupSnapshotRequest{Name: "groupsnapshot-1", SourceVolumeIds: []string{"pvc-a", "pvc-a"}}, codes.InvalidArgument},
		{"an unknown volume", &csi.CreateVolumeGroupSnapshotRequest{Name: "groupsnapshot-1", SourceVolumeIds: []string{"pvc-a", "pvc-x"}}, codes.NotFound},
		{"volumes on two hosts", &csi.CreateVolumeGroupSnapshotRequest{Name: "groupsnapshot-1", SourceVolumeIds: []string{"pvc-a", "pvc-c"}}, codes.FailedPrecondition},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			s := newTestGroupController(t)
			_, err := s.CreateVolumeGroupSnapshot(t.Context(), tt.req)
			g.Expect(status.Code(err)).To(Equal(tt.code), "%v", err)
			g.Expect(members(t, s, "groupsnapshot-1")).To(BeEmpty(), "nothing recorded")
		})
	}
}

// A group's members are counted against its namespace's snapshot quotas before any is recorded
// (and so cut): a group larger than the room left is refused with the numbers.
func TestCreateVolumeGroupSnapshotCountsItsMembersAgainstTheQuota(t *testing.T) {
	quota := func(name string, hard, used int64) *corev1.ResourceQuota {
		return &corev1.ResourceQuota{
			ObjectMeta: metav1.ObjectMeta{Namespace: "tenant-a", Name: name},
			Status: corev1.ResourceQuotaStatus{
				Hard: corev1.ResourceList{tenancy.SnapshotCountResource: *resource.NewQuantity(hard, resource.DecimalSI)},
				Used: corev1.ResourceList{tenancy.SnapshotCountResource: *resource.NewQuantity(used, resource.DecimalSI)},
			},
		}
	}
	params := map[string]string{groupSnapshotNamespaceParam: "tenant-a"}
	tests := []struct {
		name    string
		quotas  []*corev1.ResourceQuota
		params  map[string]string
		wantErr string // "" when the members are recorded
	}{
		{name: "room for both", quotas: []*corev1.ResourceQuota{quota("pvbridge-snapshots", 10, 8)}, params: params},
		{name: "room for one", quotas: []*corev1.ResourceQuota{quota("pvbridge-snapshots", 10, 9)}, params: params,
			wantErr: "a group snapshot of 2 members does not fit ResourceQuota tenant-a/pvbridge-snapshots: 9 of 10 VolumeSnapshots used, room for 1; no member is cut"},
		{name: "over the quota already", quotas: []*corev1.ResourceQuota{quota("pvbridge-snapshots", 10, 12)}, params: params,
			wantErr: "12 of 10 VolumeSnapshots used, room for 0"},
		{name: "the tightest of two quotas", quotas: []*corev1.ResourceQuota{quota("a", 100, 0), quota("b", 1, 0)}, params: params,
			wantErr: "ResourceQuota tenant-a/b: 0 of 1 VolumeSnapshots used, room for 1"},
		{name: "a quota of another namespace", quotas: []*corev1.ResourceQuota{quota("pvbridge-snapshots", 10, 10)},
			params: map[string]string{groupSnapshotNamespaceParam: "tenant-b"}},
		{name: "no namespace (a caller without --extra-create-metadata)", quotas: []*corev1.ResourceQuota{quota("pvbridge-snapshots", 0, 0)}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			objs := []client.Object{pmemVolume("pvc-a", "host-1", gi), pmemVolume("pvc-b", "host-1", gi)}
			for _, q := range tt.quotas {
				objs = append(objs, q)
			}
			s := &groupControllerServer{controllerServer: newTestController(t, objs...)}
			ctx, cancel := context.WithTimeout(t.Context(), 100*time.Millisecond)
			defer cancel()
			_, err := s.CreateVolumeGroupSnapshot(ctx, &csi.CreateVolumeGroupSnapshotRequest{
				Name: "groupsnapshot-1", SourceVolumeIds: []string{"pvc-a", "pvc-b"}, Parameters: tt.params,
			})
			if tt.wantErr != "" {
				g.Expect(status.Code(err)).To(Equal(codes.ResourceExhausted), "%v", err)
				g.Expect(err.Error()).To(ContainSubstring(tt.wantErr))
				g.Expect(members(t, s, "groupsnapshot-1")).To(BeEmpty(), "nothing recorded, nothing cut")
				return
			}
			g.Expect(status.Code(err)).To(Equal(codes.DeadlineExceeded), "recorded, waiting for the node agent: %v", err)
			g.Expect(members(t, s, "groupsnapshot-1")).To(HaveLen(2))
		})
	}
}

func TestCreateVolumeGroupSnapshot(t *testing.T) {
	g := NewWithT(t)
	s := newTestGroupController(t)
	req := &csi.CreateVolumeGroupSnapshotRequest{Name: "groupsnapshot-1", SourceVolumeIds: []string{"pvc-b", "pvc-a"}}

	ctx, cancel := context.WithTimeout(t.Context(), 100*time.Millisecond)
	defer cancel()
	_, err := s.CreateVolumeGroupSnapshot(ctx, req)
	g.Expect(status.Code(err)).To(Equal(codes.DeadlineExceeded), "%v", err)
	got := members(t, s, "groupsnapshot-1")
	g.Expect(got).To(HaveLen(2), "one member per volume, left for the retry")
	for _, m := range got {
		g.Expect(m.Spec.Node).To(Equal("host-1"))
		g.Expect(m.Spec.Group).To(Equal(&pmemv1.PmemSnapshotGroup{ID: "groupsnapshot-1", Size: 2}))
		g.Expect(m.Labels).To(HaveKeyWithValue(pmemv1.GroupLabel, "groupsnapshot-1"))
	}

	_, err = s.CreateVolumeGroupSnapshot(t.Context(), &csi.CreateVolumeGroupSnapshotRequest{Name: "groupsnapshot-1", SourceVolumeIds: []string{"pvc-a"}})
	g.Expect(status.Code(err)).To(Equal(codes.AlreadyExists), "the name is taken by a group of other volumes: %v", err)

	cut(t, s, "groupsnapshot-1")
	resp, err := s.CreateVolumeGroupSnapshot(t.Context(), req)
	g.Expect(err).NotTo(HaveOccurred())
	group := resp.GetGroupSnapshot()
	g.Expect(group.GetGroupSnapshotId()).To(Equal("groupsnapshot-1"))
	g.Expect(group.GetReadyToUse()).To(BeTrue())
	g.Expect(group.GetCreationTime()).NotTo(BeNil())
	g.Expect(group.GetSnapshots()).To(HaveLen(2))
	var sources []string
	for _, snap := range group.GetSnapshots() {
		g.Expect(snap.GetGroupSnapshotId()).To(Equal("groupsnapshot-1"))
		g.Expect(snap.GetReadyToUse()).To(BeTrue())
		g.Expect(snap.GetSizeBytes()).To(Equal(gi))
		sources = append(sources, snap.GetSourceVolumeId())
	}
	g.Expect(sources).To(ConsistOf("pvc-a", "pvc-b"))

	again, err := s.CreateVolumeGroupSnapshot(t.Context(), req)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(again.GetGroupSnapshot().GetSnapshots()).To(Equal(group.GetSnapshots()), "idempotent")

	get, err := s.GetVolumeGroupSnapshot(t.Context(), &csi.GetVolumeGroupSnapshotRequest{GroupSnapshotId: "groupsnapshot-1"})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(get.GetGroupSnapshot().GetSnapshots()).To(Equal(group.GetSnapshots()))
	_, err = s.GetVolumeGroupSnapshot(t.Context(), &csi.GetVolumeGroupSnapshotRequest{GroupSnapshotId: "groupsnapshot-2"})
	g.Expect(status.Code(err)).To(Equal(codes.NotFound))

	// Deletion waits for the node agent; without one the members are left being deleted.
	ctx, cancel = context.WithTimeout(t.Context(), 100*time.Millisecond)
	defer cancel()
	_, err = s.DeleteVolumeGroupSnapshot(ctx, &csi.DeleteVolumeGroupSnapshotRequest{GroupSnapshotId: "groupsnapshot-1"})
	g.Expect(status.Code(err)).To(Equal(codes.DeadlineExceeded), "%v", err)
	for _, m := range members(t, s, "groupsnapshot-1") {
		g.Expect(m.DeletionTimestamp).NotTo(BeNil(), "member %s is being deleted", m.Name)
	}
	_, err = s.DeleteVolumeGroupSnapshot(t.Context(), &csi.DeleteVolumeGroupSnapshotRequest{GroupSnapshotId: "groupsnapshot-9"})
	g.Expect(err).NotTo(HaveOccurred(), "a missing group is deleted")
}

// A failed group is removed whole, so that a retry cuts it anew; but one whose cut outlasted
// the hold stays, failed, so that a retry answers at once instead of holding the writers again.
func TestCreateVolumeGroupSnapshotOfAFailedGroup(t *testing.T) {
	for _, tt := range []struct {
		reason, message string
		wantRemoved     bool
	}{
		{pmemv1.InsufficientCapacityReason, "no room for the snapshot", true},
		{pmemv1.HoldExpiredReason, "cutting the 2 members took longer than the host's longest hold of their writers", false},
	} {
		t.Run(tt.reason, func(t *testing.T) {
			g := NewWithT(t)
			s := newTestGroupController(t)
			req := &csi.CreateVolumeGroupSnapshotRequest{Name: "groupsnapshot-1", SourceVolumeIds: []string{"pvc-a", "pvc-b"}}
			ctx, cancel := context.WithTimeout(t.Context(), 100*time.Millisecond)
			defer cancel()
			_, err := s.CreateVolumeGroupSnapshot(ctx, req)
			g.Expect(status.Code(err)).To(Equal(codes.DeadlineExceeded))

			m := members(t, s, "groupsnapshot-1")[0]
			meta.SetStatusCondition(&m.Status.Conditions, metav1.Condition{
				Type: pmemv1.ReadyCondition, Status: metav1.ConditionFalse, Reason: tt.reason,
				Message: tt.message, ObservedGeneration: m.Generation,
			})
			g.Expect(s.client.Status().Update(t.Context(), m)).To(Succeed())
			for range 2 {
				_, err = s.CreateVolumeGroupSnapshot(t.Context(), req)
				g.Expect(status.Code(err)).To(Equal(codes.ResourceExhausted), "%v", err)
				g.Expect(err.Error()).To(ContainSubstring(tt.message))
				if tt.wantRemoved {
					break
				}
			}
			for _, m := range members(t, s, "groupsnapshot-1") {
				g.Expect(m.DeletionTimestamp != nil).To(Equal(tt.wantRemoved))
			}
		})
	}
}

// A replicated member is cut on the node that serves its volume, where the group's writers are
// held, from its replica there; a volume no node serves, from a replica as a snapshot of its
// own is. A group whose volumes are served on two nodes, or served where the volume has no
// replica, is refused and nothing is recorded.
func TestCreateVolumeGroupSnapshotOfReplicatedVolumes(t *testing.T) {
	replicated := func(name, target string, nodes ...string) []client.Object {
		vol := &pmemv1.PmemVolume{
			ObjectMeta: metav1.ObjectMeta{Name: name},
			Spec:       pmemv1.PmemVolumeSpec{VolumeID: name, Replicas: int32(len(nodes)), Size: *resource.NewQuantity(gi, resource.BinarySI)},
			Status:     pmemv1.PmemVolumeStatus{Target: target},
		}
		objs := []client.Object{vol}
		for i, node := range nodes {
			r := newReplica(vol, replicaName(name, i), node, false)
			r.Status.Address = node + ":10809"
			meta.SetStatusCondition(&r.Status.Conditions, metav1.Condition{Type: pmemv1.ReadyCondition, Status: metav1.ConditionTrue, Reason: pmemv1.CreatedReason})
			objs = append(objs, r)
		}
		return objs
	}
	objs := []client.Object{pmemVolume("pvc-a", "host-1", gi), pmemNode("host-1", 9*gi, 9*gi, true), pmemNode("host-2", 9*gi, 9*gi, true),
		&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "host-1"}}, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "host-2"}}}
	objs = append(objs, replicated("pvc-r", "host-1", "host-2", "host-1")...)   // served on host-1
	objs = append(objs, replicated("pvc-s", "host-2", "host-1", "host-2")...)   // served on host-2
	objs = append(objs, replicated("pvc-u", "", "host-1", "host-2")...)         // served nowhere
	objs = append(objs, replicated("pvc-far", "host-3", "host-1", "host-2")...) // served where it has no replica
	for _, tc := range []struct {
		name    string
		sources []string
		code    codes.Code
		want    map[string][2]string // volume → its member's node and replica
	}{
		{name: "served on the plain volume's node", sources: []string{"pvc-a", "pvc-r"}, code: codes.DeadlineExceeded,
			want: map[string][2]string{"pvc-a": {"host-1", ""}, "pvc-r": {"host-1", replicaName("pvc-r", 1)}}},
		{name: "served nowhere: its first replica by name", sources: []string{"pvc-u"}, code: codes.DeadlineExceeded,
			want: map[string][2]string{"pvc-u": {"host-1", replicaName("pvc-u", 0)}}},
		{name: "served on another node than the plain volume's", sources: []string{"pvc-a", "pvc-s"}, code: codes.FailedPrecondition},
		{name: "served where it has no replica", sources: []string{"pvc-far"}, code: codes.FailedPrecondition},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			s := &groupControllerServer{controllerServer: newTestController(t, objs...)}
			_, err := s.CreateVolumeGroupSnapshot(shortCall(t), &csi.CreateVolumeGroupSnapshotRequest{Name: "groupsnapshot-1", SourceVolumeIds: tc.sources})
			g.Expect(status.Code(err)).To(Equal(tc.code), "%v", err)
			got := map[string][2]string{}
			for _, m := range members(t, s, "groupsnapshot-1") {
				got[m.Spec.SourceVolumeID] = [2]string{m.Spec.Node, m.Spec.SourceReplica}
				g.Expect(m.Labels).To(HaveKeyWithValue(pmemv1.NodeLabel, m.Spec.Node))
			}
			if tc.want == nil {
				tc.want = map[string][2]string{}
			}
			g.Expect(got).To(Equal(tc.want))
		})
	}
}
