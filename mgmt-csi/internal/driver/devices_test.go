package driver

import (
	"testing"

	. "github.com/onsi/gomega"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"
	clientfake "sigs.k8s.io/controller-runtime/pkg/client/fake"

	"pvbridge.io/mgmt-csi/internal/pmem/fake"
	"pvbridge.io/mgmt-csi/internal/replication"
	pmemv1 "pvbridge.io/pkg/apis/pmem/v1alpha1"
)

// replicaOn is replica i of volume v on node, as its agent reports it with reason.
func replicaOn(i int, node, reason string) *pmemv1.PmemReplica {
	r := &pmemv1.PmemReplica{
		ObjectMeta: metav1.ObjectMeta{Name: replicaName("v", i), Labels: map[string]string{pmemv1.VolumeLabel: "v"}},
		Spec:       pmemv1.PmemReplicaSpec{VolumeID: "v", Node: node, Size: *resource.NewQuantity(gi, resource.BinarySI)},
		Status:     pmemv1.PmemReplicaStatus{Address: node + ":10809", Device: "/dev/loop" + node},
	}
	if reason != "" {
		st := metav1.ConditionFalse
		if reason == pmemv1.CreatedReason {
			st = metav1.ConditionTrue
		}
		meta.SetStatusCondition(&r.Status.Conditions, metav1.Condition{Type: pmemv1.ReadyCondition, Status: st, Reason: reason})
	}
	return r
}

// toRebuild makes r a replica made after its volume (spec.rebuild), in sync or not.
func toRebuild(r *pmemv1.PmemReplica, inSync bool) *pmemv1.PmemReplica {
	r.Spec.Rebuild = true
	if inSync {
		meta.SetStatusCondition(&r.Status.Conditions, metav1.Condition{Type: pmemv1.InSyncCondition, Status: metav1.ConditionTrue, Reason: pmemv1.RebuiltReason})
	}
	return r
}

func TestReplicasOfAStagedVolume(t *testing.T) {
	// The fake back end's first device, which the local replica gets.
	const localDevice = "/dev/fake1"
	vol := &pmemv1.PmemVolume{
		ObjectMeta: metav1.ObjectMeta{Name: "v"},
		Spec:       pmemv1.PmemVolumeSpec{VolumeID: "v", Replicas: 2, Size: *resource.NewQuantity(gi, resource.BinarySI)},
	}
	for _, tc := range []struct {
		name    string
		objs    []client.Object
		want    []replication.Replica
		code    codes.Code
		noTargs bool
	}{
		{
			name: "the local replica directly, from the back end; the other over the network",
			objs: []client.Object{vol, replicaOn(0, "b", pmemv1.CreatedReason), replicaOn(1, "a", pmemv1.CreatedReason)},
			want: []replication.Replica{
				{Name: replicaName("v", 0), Address: "b:10809"},
				{Name: replicaName("v", 1), Address: "a:10809", Device: localDevice},
			},
		},
		{
			name: "a faulted replica is left out",
			objs: []client.Object{vol, replicaOn(0, "b", pmemv1.FaultedReason), replicaOn(1, "c", pmemv1.CreatedReason)},
			want: []replication.Replica{{Name: replicaName("v", 1), Address: "c:10809"}},
		},
		{
			name: "a replica on a lost node is faulted and left out",
			objs: []client.Object{vol, replicaOn(0, "lost", pmemv1.CreatedReason), replicaOn(1, "c", pmemv1.CreatedReason)},
			want: []replication.Replica{{Name: replicaName("v", 1), Address: "c:10809"}},
		},
		{
			name: "a replica being made is waited for",
			objs: []client.Object{vol, replicaOn(0, "b", pmemv1.PendingReason), replicaOn(1, "c", pmemv1.CreatedReason)},
			code: codes.Aborted,
		},
		{
			name: "a replica not reported yet is waited for",
			objs: []client.Object{vol, replicaOn(0, "b", ""), replicaOn(1, "c", pmemv1.CreatedReason)},
			code: codes.Aborted,
		},
		{
			name: "a replica smaller than its volume is waited for: it grows, while no node serves the volume",
			objs: []client.Object{vol, replicaOn(0, "b", pmemv1.CreatedReason), func() *pmemv1.PmemReplica {
				r := replicaOn(1, "c", pmemv1.CreatedReason)
				r.Spec.Size = *resource.NewQuantity(gi/2, resource.BinarySI)
				return r
			}()},
			code: codes.Aborted,
		},
		{
			name: "a replica not recorded yet is waited for",
			objs: []client.Object{vol, replicaOn(1, "c", pmemv1.CreatedReason)},
			code: codes.Aborted,
		},
		{
			name: "a replica to rebuild is left out until it is in sync: the serving node copies it in",
			objs: []client.Object{vol, replicaOn(0, "b", pmemv1.FaultedReason), toRebuild(replicaOn(2, "c", pmemv1.CreatedReason), false), replicaOn(1, "a", pmemv1.CreatedReason)},
			want: []replication.Replica{{Name: replicaName("v", 1), Address: "a:10809", Device: localDevice}},
		},
		{
			name: "a rebuilt replica in sync is one as the others",
			objs: []client.Object{vol, toRebuild(replicaOn(2, "c", pmemv1.CreatedReason), true), replicaOn(1, "a", pmemv1.CreatedReason)},
			want: []replication.Replica{
				{Name: replicaName("v", 2), Address: "c:10809"},
				{Name: replicaName("v", 1), Address: "a:10809", Device: localDevice},
			},
		},
		{
			name: "every replica faulted",
			objs: []client.Object{vol, replicaOn(0, "b", pmemv1.FaultedReason), replicaOn(1, "c", pmemv1.FaultedReason)},
			code: codes.FailedPrecondition,
		},
		{name: "no such volume", code: codes.NotFound},
		{name: "a volume of another node", objs: []client.Object{pmemVolume("v", "b", gi)}, code: codes.NotFound},
		{
			name: "a node without keys", noTargs: true,
			objs: []client.Object{vol, replicaOn(0, "b", pmemv1.CreatedReason), replicaOn(1, "c", pmemv1.CreatedReason)},
			code: codes.InvalidArgument,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			scheme, err := newScheme()
			g.Expect(err).NotTo(HaveOccurred())
			nodes := []client.Object{node("a", false), node("b", false), node("c", false), node("lost", true)}
			backend := fake.New(fake.Options{Capacity: 4 * gi})
			local, err := backend.CreateVolume(t.Context(), replicaName("v", 1), gi, nil)
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(local.Device).To(Equal(localDevice))
			c := clientfake.NewClientBuilder().WithScheme(scheme).WithObjects(append(tc.objs, nodes...)...).
				WithStatusSubresource(&pmemv1.PmemReplica{}).Build()
			d := VolumeDevices{Backend: backend, Node: "a", Targets: &replication.Targets{}, Reader: c, Writer: c}
			if tc.noTargs {
				d.Targets = nil
			}
			_, got, err := d.replicas(t.Context(), "v")
			g.Expect(status.Code(statusError(err))).To(Equal(tc.code), "%v", err)
			g.Expect(got).To(ConsistOf(tc.want))
			for _, o := range tc.objs {
				if r, ok := o.(*pmemv1.PmemReplica); ok && r.Spec.Node == "lost" {
					g.Expect(c.Get(t.Context(), client.ObjectKeyFromObject(r), r)).To(Succeed())
					g.Expect(meta.FindStatusCondition(r.Status.Conditions, pmemv1.ReadyCondition).Reason).To(Equal(pmemv1.FaultedReason))
				}
			}
		})
	}
}

// node is a management host's Node; a lost one carries the out-of-service taint.
func node(name string, lost bool) *corev1.Node {
	n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}}
	if lost {
		n.Spec.Taints = []corev1.Taint{{Key: corev1.TaintNodeOutOfService, Value: "nodeshutdown", Effect: corev1.TaintEffectNoExecute}}
	}
	return n
}

func TestOneNodeServesAReplicatedVolume(t *testing.T) {
	for _, tc := range []struct {
		name, target, want string
		code               codes.Code
	}{
		{name: "no node serves it: this one claims it", want: "a"},
		{name: "this node serves it already", target: "a", want: "a"},
		{name: "another node serves it", target: "b", want: "b", code: codes.FailedPrecondition},
		{name: "a lost node served it: this one takes over", target: "lost", want: "a"},
		{name: "a deleted node served it: this one takes over", target: "gone", want: "a"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			scheme, err := newScheme()
			g.Expect(err).NotTo(HaveOccurred())
			vol := &pmemv1.PmemVolume{
				ObjectMeta: metav1.ObjectMeta{Name: "v"},
				Spec:       pmemv1.PmemVolumeSpec{VolumeID: "v", Replicas: 2, Size: *resource.NewQuantity(gi, resource.BinarySI)},
				Status:     pmemv1.PmemVolumeStatus{Target: tc.target},
			}
			c := clientfake.NewClientBuilder().WithScheme(scheme).WithObjects(vol, node("lost", true), node("b", false)).WithStatusSubresource(vol).Build()
			d := VolumeDevices{Node: "a", Reader: c, Writer: c}
			g.Expect(c.Get(t.Context(), client.ObjectKeyFromObject(vol), vol)).To(Succeed())
			g.Expect(status.Code(statusError(d.claim(t.Context(), vol)))).To(Equal(tc.code))
			g.Expect(c.Get(t.Context(), client.ObjectKeyFromObject(vol), vol)).To(Succeed())
			g.Expect(vol.Status.Target).To(Equal(tc.want))

			g.Expect(d.release(t.Context(), "v")).To(Succeed())
			g.Expect(c.Get(t.Context(), client.ObjectKeyFromObject(vol), vol)).To(Succeed())
			if tc.want == "a" {
				g.Expect(vol.Status.Target).To(BeEmpty(), "released")
			} else {
				g.Expect(vol.Status.Target).To(Equal(tc.want), "another node's claim is not this node's to release")
			}
		})
	}
}

// The serving node rebuilds a replica made to replace another once its agent exports it, not
// before, and not again once it is in sync; never a faulted one, nor one made with its volume.
func TestAwaitsRebuild(t *testing.T) {
	deleting := toRebuild(replicaOn(2, "c", pmemv1.CreatedReason), false)
	now := metav1.Now()
	deleting.DeletionTimestamp = &now
	stale := toRebuild(replicaOn(2, "c", pmemv1.CreatedReason), false)
	stale.Generation = 2 // its agent has not seen the last change
	for _, tc := range []struct {
		name string
		r    *pmemv1.PmemReplica
		want bool
	}{
		{"exported, not in sync", toRebuild(replicaOn(2, "c", pmemv1.CreatedReason), false), true},
		{"in sync", toRebuild(replicaOn(2, "c", pmemv1.CreatedReason), true), false},
		{"not exported yet", toRebuild(replicaOn(2, "c", pmemv1.PendingReason), false), false},
		{"faulted", toRebuild(replicaOn(2, "c", pmemv1.FaultedReason), false), false},
		{"being deleted", deleting, false},
		{"reported for an older generation", stale, false},
		{"made with its volume", replicaOn(1, "c", pmemv1.CreatedReason), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			NewWithT(t).Expect(awaitsRebuild(tc.r)).To(Equal(tc.want))
		})
	}
}
