package driver

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	groupsnapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumegroupsnapshot/v1"
	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	. "github.com/onsi/gomega"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/uuid"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pvbridge.io/guest-csi/internal/request"
	"pvbridge.io/pkg/tenancy"
)

// Requests that cannot be served are refused before the management cluster is asked.
func TestCreateVolumeGroupSnapshotValidation(t *testing.T) {
	s := &groupControllerServer{controllerServer: &controllerServer{}}
	for _, tc := range []struct {
		name string
		req  *csi.CreateVolumeGroupSnapshotRequest
		msg  string
	}{
		{"no name", &csi.CreateVolumeGroupSnapshotRequest{SourceVolumeIds: []string{"a"}}, "name is required"},
		{"no volumes", &csi.CreateVolumeGroupSnapshotRequest{Name: "groupsnapshot-1"}, "source_volume_ids are required"},
		{"a volume twice", &csi.CreateVolumeGroupSnapshotRequest{Name: "groupsnapshot-1", SourceVolumeIds: []string{"b", "a", "b"}}, "holds volume b twice"},
		{"an empty volume ID", &csi.CreateVolumeGroupSnapshotRequest{Name: "groupsnapshot-1", SourceVolumeIds: []string{"a", ""}}, "holds an empty volume ID"},
		{"an unknown parameter", &csi.CreateVolumeGroupSnapshotRequest{Name: "groupsnapshot-1", SourceVolumeIds: []string{"a"},
			Parameters: map[string]string{"mgmtGroupClass": "x"}}, `parameter "mgmtGroupClass" is not supported (only mgmtVolumeGroupSnapshotClass)`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := s.CreateVolumeGroupSnapshot(t.Context(), tc.req)
			expectCodeIn(NewWithT(t), err, codes.InvalidArgument, tc.msg)
		})
	}
}

// A group snapshot is a management VolumeGroupSnapshot that selects its members by a label
// guest-csi puts on them first and takes off once the group is ready; the answer waits for the
// group and every member snapshot, and names each member's management VolumeSnapshot.
func TestGroupSnapshots(t *testing.T) {
	g := NewWithT(t)
	e := newGuestEnv(t, envOptions{})
	a, b, c := e.createVolume(t, "member-a"), e.createVolume(t, "member-b"), e.createVolume(t, "member-c")
	guestUID := string(uuid.NewUUID())
	req := &csi.CreateVolumeGroupSnapshotRequest{
		Name: request.GroupSnapshotPrefix + guestUID, SourceVolumeIds: []string{b, a},
		Parameters: map[string]string{request.ParamMgmtGroupSnapshotClass: "pmem-group", request.ParamGroupName: "nightly", request.ParamGroupNamespace: "default"},
	}
	name := e.cluster.UID + "-" + guestUID

	// Taken by the management side only once released: until then the call waits and
	// answers DeadlineExceeded, with the members labelled and the VolumeGroupSnapshot made.
	e.resp.holdGroups.Store(true)
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Second)
	_, err := e.groups.CreateVolumeGroupSnapshot(ctx, req)
	cancel()
	expectCodeIn(g, err, codes.DeadlineExceeded, "VolumeGroupSnapshot "+e.ns+"/"+name+" is not ready yet")
	vgs := &groupsnapshotv1.VolumeGroupSnapshot{}
	g.Expect(e.admin.Get(t.Context(), client.ObjectKey{Namespace: e.ns, Name: name}, vgs)).To(Succeed())
	g.Expect(vgs.Labels).To(Equal(e.cluster.Labels()))
	g.Expect(vgs.Annotations).To(Equal(map[string]string{tenancy.CSINameAnnotation: req.Name, tenancy.GuestSnapshotAnnotation: "default/nightly"}))
	g.Expect(vgs.Spec.Source.Selector).To(Equal(&metav1.LabelSelector{MatchLabels: map[string]string{
		tenancy.ClusterUIDLabel: e.cluster.UID, tenancy.VolumeGroupLabel: guestUID,
	}}))
	g.Expect(vgs.Spec.VolumeGroupSnapshotClassName).To(HaveValue(Equal("pmem-group")))
	g.Expect(e.groupOf(t, a, b, c)).To(Equal([]string{guestUID, guestUID, ""}), "the members, and only they, are labelled")

	// While the group is taken, a member is in no other group, and the group has its members.
	other := &csi.CreateVolumeGroupSnapshotRequest{Name: request.GroupSnapshotPrefix + string(uuid.NewUUID()), SourceVolumeIds: []string{c, a}}
	_, err = call(t, e.groups.CreateVolumeGroupSnapshot, other)
	expectCodeIn(g, err, codes.Aborted, "management PVC "+e.ns+"/"+a+" is a member of VolumeGroupSnapshot "+e.ns+"/"+name+", which is being taken")
	otherMembers := proto.Clone(req).(*csi.CreateVolumeGroupSnapshotRequest)
	otherMembers.SourceVolumeIds = []string{a, c}
	_, err = call(t, e.groups.CreateVolumeGroupSnapshot, otherMembers)
	expectCodeIn(g, err, codes.AlreadyExists, "exists for volumes "+slices.Min([]string{a, b})+", "+slices.Max([]string{a, b}))

	e.resp.holdGroups.Store(false)
	resp, err := retried(t, e.groups.CreateVolumeGroupSnapshot, req)
	g.Expect(err).NotTo(HaveOccurred())
	group := resp.GetGroupSnapshot()
	g.Expect(group.GetGroupSnapshotId()).To(Equal(name))
	g.Expect(group.GetReadyToUse()).To(BeTrue())
	g.Expect(group.GetCreationTime()).NotTo(BeNil())
	g.Expect(group.GetSnapshots()).To(ConsistOf(e.memberOf(t, name, a), e.memberOf(t, name, b)))
	g.Expect(e.groupOf(t, a, b)).To(Equal([]string{"", ""}), "a ready group lets its claims go")

	again, err := call(t, e.groups.CreateVolumeGroupSnapshot, req)
	g.Expect(err).NotTo(HaveOccurred(), "CreateVolumeGroupSnapshot is idempotent")
	g.Expect(proto.Equal(again.GetGroupSnapshot(), group)).To(BeTrue(), "%v", again.GetGroupSnapshot())
	_, err = call(t, e.groups.CreateVolumeGroupSnapshot, otherMembers)
	expectCodeIn(g, err, codes.AlreadyExists, "exists for other volumes")
	got, err := call(t, e.groups.GetVolumeGroupSnapshot, &csi.GetVolumeGroupSnapshotRequest{GroupSnapshotId: name, SnapshotIds: []string{group.GetSnapshots()[0].GetSnapshotId()}})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(proto.Equal(got.GetGroupSnapshot(), group)).To(BeTrue(), "%v", got.GetGroupSnapshot())
	_, err = call(t, e.groups.GetVolumeGroupSnapshot, &csi.GetVolumeGroupSnapshotRequest{GroupSnapshotId: name, SnapshotIds: []string{"snapshot-0"}})
	expectCodeIn(g, err, codes.InvalidArgument, "snapshot_ids name snapshot-0, which is no member snapshot")

	// The other group's label on c, left by its refused call, is its own; a's is gone. A label
	// of a group that no longer exists is stale and is overwritten.
	_, err = retried(t, e.groups.CreateVolumeGroupSnapshot, other)
	g.Expect(err).NotTo(HaveOccurred())
	pvc := e.claimOf(t, c)
	patch := client.MergeFrom(pvc.DeepCopy())
	pvc.Labels[tenancy.VolumeGroupLabel] = "a-group-that-is-gone"
	g.Expect(e.admin.Patch(t.Context(), pvc, patch)).To(Succeed())
	_, err = retried(t, e.groups.CreateVolumeGroupSnapshot, &csi.CreateVolumeGroupSnapshotRequest{Name: request.GroupSnapshotPrefix + string(uuid.NewUUID()), SourceVolumeIds: []string{c}})
	g.Expect(err).NotTo(HaveOccurred())

	// A member restores like any snapshot, and is deleted only with its group.
	member := group.GetSnapshots()[0]
	restored, err := retried(t, e.ctrl.CreateVolume, restoreReq("restored", member.GetSnapshotId()))
	g.Expect(err).NotTo(HaveOccurred())
	e.expectRestoredFrom(t, restored.GetVolume().GetVolumeId(), member.GetSnapshotId())
	_, err = call(t, e.ctrl.DeleteSnapshot, &csi.DeleteSnapshotRequest{SnapshotId: member.GetSnapshotId()})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(e.admin.Get(t.Context(), client.ObjectKey{Namespace: e.ns, Name: member.GetSnapshotId()}, &snapshotv1.VolumeSnapshot{})).To(Succeed(), "a member is released, not deleted")

	_, err = call(t, e.groups.DeleteVolumeGroupSnapshot, &csi.DeleteVolumeGroupSnapshotRequest{GroupSnapshotId: name, SnapshotIds: []string{member.GetSnapshotId()}})
	g.Expect(err).NotTo(HaveOccurred())
	g.Eventually(func() error {
		return e.admin.Get(t.Context(), client.ObjectKey{Namespace: e.ns, Name: member.GetSnapshotId()}, &snapshotv1.VolumeSnapshot{})
	}).WithTimeout(eventually).Should(MatchError(apierrors.IsNotFound, "NotFound"), "the members go with their group")
	g.Expect(e.admin.Get(t.Context(), client.ObjectKeyFromObject(vgs), vgs)).To(MatchError(apierrors.IsNotFound, "NotFound"))
	_, err = call(t, e.groups.DeleteVolumeGroupSnapshot, &csi.DeleteVolumeGroupSnapshotRequest{GroupSnapshotId: name})
	g.Expect(err).NotTo(HaveOccurred(), "DeleteVolumeGroupSnapshot is idempotent")
	_, err = call(t, e.groups.GetVolumeGroupSnapshot, &csi.GetVolumeGroupSnapshotRequest{GroupSnapshotId: name})
	expectCodeIn(g, err, codes.NotFound, "does not exist")
}

// A guest reaches no group snapshot but its own, and restores no member of another cluster's.
func TestGroupSnapshotsOfOthers(t *testing.T) {
	g := NewWithT(t)
	e := newGuestEnv(t, envOptions{})
	own := e.createVolume(t, "own")
	shared := e.importClaim(t, "shared", map[string]string{tenancy.SharedWithAnnotation: e.cluster.Name})

	_, err := call(t, e.groups.CreateVolumeGroupSnapshot, &csi.CreateVolumeGroupSnapshotRequest{Name: "groupsnapshot-shared", SourceVolumeIds: []string{own, shared}})
	expectCodeIn(g, err, codes.FailedPrecondition, "management PVC "+e.ns+"/"+shared+" is shared with cluster alpha, not owned by it")

	// Another cluster's group of the namespace, with a member of its own.
	otherUID := string(uuid.NewUUID())
	theirs := &groupsnapshotv1.VolumeGroupSnapshot{
		ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: otherUID + "-group", Labels: tenancy.Cluster{Name: "beta", UID: otherUID}.Labels()},
		Spec: groupsnapshotv1.VolumeGroupSnapshotSpec{Source: groupsnapshotv1.VolumeGroupSnapshotSource{
			Selector: &metav1.LabelSelector{MatchLabels: map[string]string{tenancy.ClusterUIDLabel: otherUID}},
		}},
	}
	g.Expect(e.admin.Create(t.Context(), theirs)).To(Succeed())
	member := &snapshotv1.VolumeSnapshot{
		ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "snapshot-0123456789abcdef", OwnerReferences: []metav1.OwnerReference{{
			APIVersion: groupsnapshotv1.SchemeGroupVersion.String(), Kind: "VolumeGroupSnapshot", Name: theirs.Name, UID: theirs.UID,
		}}},
		Spec: snapshotv1.VolumeSnapshotSpec{Source: snapshotv1.VolumeSnapshotSource{PersistentVolumeClaimName: ptr.To(shared)}},
	}
	g.Expect(e.admin.Create(t.Context(), member)).To(Succeed())

	refused := "was not created for cluster alpha and is not shared with it"
	_, err = call(t, e.groups.DeleteVolumeGroupSnapshot, &csi.DeleteVolumeGroupSnapshotRequest{GroupSnapshotId: theirs.Name})
	expectCodeIn(g, err, codes.FailedPrecondition, refused)
	_, err = call(t, e.groups.GetVolumeGroupSnapshot, &csi.GetVolumeGroupSnapshotRequest{GroupSnapshotId: theirs.Name})
	expectCodeIn(g, err, codes.FailedPrecondition, refused)
	_, err = call(t, e.ctrl.CreateVolume, restoreReq("restored", member.Name))
	expectCodeIn(g, err, codes.FailedPrecondition, refused)
	_, err = call(t, e.ctrl.DeleteSnapshot, &csi.DeleteSnapshotRequest{SnapshotId: member.Name})
	expectCodeIn(g, err, codes.FailedPrecondition, refused)
	g.Expect(e.admin.Get(t.Context(), client.ObjectKeyFromObject(theirs), theirs)).To(Succeed(), "nothing of another cluster is touched")

	// A group named after this cluster but labelled for the other (written where the policy
	// is not enforced, or an admin's): its label, not its name, tells whose its members are.
	spoof := theirs.DeepCopy()
	spoof.ObjectMeta = metav1.ObjectMeta{Namespace: e.ns, Name: e.cluster.UID + "-spoof", Labels: theirs.Labels}
	g.Expect(e.admin.Create(t.Context(), spoof)).To(Succeed())
	spoofed := member.DeepCopy()
	spoofed.ObjectMeta = metav1.ObjectMeta{Namespace: e.ns, Name: "snapshot-fedcba9876543210", OwnerReferences: []metav1.OwnerReference{{
		APIVersion: groupsnapshotv1.SchemeGroupVersion.String(), Kind: "VolumeGroupSnapshot", Name: spoof.Name, UID: spoof.UID,
	}}}
	g.Expect(e.admin.Create(t.Context(), spoofed)).To(Succeed())
	_, err = call(t, e.ctrl.CreateVolume, restoreReq("restored-spoofed", spoofed.Name))
	expectCodeIn(g, err, codes.FailedPrecondition, refused)
}

// groupOf returns the tenancy.VolumeGroupLabel of each management PVC, "" for none.
func (e *guestEnv) groupOf(t *testing.T, ids ...string) []string {
	t.Helper()
	labels := make([]string, 0, len(ids))
	for _, id := range ids {
		labels = append(labels, e.claimOf(t, id).Labels[tenancy.VolumeGroupLabel])
	}
	return labels
}

// memberOf matches the member snapshot of management VolumeGroupSnapshot group whose source is
// volume: its management VolumeSnapshot, named by snapshot-controller, ready, of the volume's
// size.
func (e *guestEnv) memberOf(t *testing.T, group, volume string) any {
	t.Helper()
	snaps := &snapshotv1.VolumeSnapshotList{}
	NewWithT(t).Expect(e.admin.List(t.Context(), snaps, client.InNamespace(e.ns))).To(Succeed())
	i := slices.IndexFunc(snaps.Items, func(s snapshotv1.VolumeSnapshot) bool {
		return len(s.OwnerReferences) == 1 && s.OwnerReferences[0].Name == group && ptr.Deref(s.Spec.Source.PersistentVolumeClaimName, "") == volume
	})
	NewWithT(t).Expect(i).NotTo(Equal(-1), "no member snapshot of %s in %s", volume, group)
	return And(
		HaveField("SnapshotId", And(HavePrefix("snapshot-"), Equal(snaps.Items[i].Name))),
		HaveField("SourceVolumeId", volume),
		HaveField("GroupSnapshotId", group),
		HaveField("ReadyToUse", true),
		HaveField("SizeBytes", envMountSize),
		HaveField("CreationTime", Not(BeNil())),
	)
}
