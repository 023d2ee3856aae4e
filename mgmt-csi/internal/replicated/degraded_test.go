package replicated

import (
	"context"
	"errors"
	"testing"

	. "github.com/onsi/gomega"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/tools/events"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	clientfake "sigs.k8s.io/controller-runtime/pkg/client/fake"

	pmemv1 "pvbridge.io/pkg/apis/pmem/v1alpha1"
)

func replica(name, node, reason string) *pmemv1.PmemReplica {
	r := &pmemv1.PmemReplica{
		ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{pmemv1.VolumeLabel: "v"}},
		Spec:       pmemv1.PmemReplicaSpec{VolumeID: "v", Node: node, Size: resource.MustParse("1Gi")},
	}
	st := metav1.ConditionFalse
	if reason == pmemv1.CreatedReason {
		st = metav1.ConditionTrue
	}
	meta.SetStatusCondition(&r.Status.Conditions, metav1.Condition{Type: pmemv1.ReadyCondition, Status: st, Reason: reason, Message: "node " + node + " said so"})
	return r
}

// rebuilt makes r a replica made after its volume, in sync or not.
func rebuilt(r *pmemv1.PmemReplica, inSync bool) *pmemv1.PmemReplica {
	r.Spec.Rebuild = true
	if inSync {
		meta.SetStatusCondition(&r.Status.Conditions, metav1.Condition{Type: pmemv1.InSyncCondition, Status: metav1.ConditionTrue, Reason: pmemv1.RebuiltReason})
	}
	return r
}

// repairer records the volumes whose replicas it was asked to repair, and fails with err.
type repairer struct {
	volumes []string
	err     error
}

func (r *repairer) Repair(_ context.Context, vol *pmemv1.PmemVolume) error {
	r.volumes = append(r.volumes, vol.Name)
	return r.err
}

func TestDegraded(t *testing.T) {
	for _, tc := range []struct {
		name       string
		replicas   []*pmemv1.PmemReplica
		notReady   bool // the volume is still being made
		wantStatus metav1.ConditionStatus
		wantReason string
		wantEvent  string // its message's part
		// repairErr fails the repair, which is then tried again after RepairRetry
		repairErr error
	}{
		{
			name:       "every replica serves",
			replicas:   []*pmemv1.PmemReplica{replica("v-r0", "a", pmemv1.CreatedReason), replica("v-r1", "b", pmemv1.CreatedReason)},
			wantStatus: metav1.ConditionFalse, wantReason: pmemv1.AllReplicasReason,
		},
		{
			name:       "a replica being made is no fault",
			replicas:   []*pmemv1.PmemReplica{replica("v-r0", "a", pmemv1.CreatedReason), replica("v-r1", "b", pmemv1.PendingReason)},
			notReady:   true,
			wantStatus: metav1.ConditionFalse, wantReason: pmemv1.AllReplicasReason,
		},
		{
			name:       "replicas not all made yet: no replica is missing",
			replicas:   []*pmemv1.PmemReplica{replica("v-r0", "a", pmemv1.PendingReason)},
			notReady:   true,
			wantStatus: metav1.ConditionFalse, wantReason: pmemv1.AllReplicasReason,
		},
		{
			name:       "a faulted replica degrades the volume, with an Event",
			replicas:   []*pmemv1.PmemReplica{replica("v-r0", "a", pmemv1.CreatedReason), replica("v-r1", "b", pmemv1.FaultedReason)},
			wantStatus: metav1.ConditionTrue, wantReason: pmemv1.ReplicaFaultedReason,
			wantEvent: "v-r1 on node b (node b said so)",
		},
		{
			name:       "a faulted replica that no host can take yet: tried again at a steady pace",
			replicas:   []*pmemv1.PmemReplica{replica("v-r0", "a", pmemv1.CreatedReason), replica("v-r1", "b", pmemv1.FaultedReason)},
			wantStatus: metav1.ConditionTrue, wantReason: pmemv1.ReplicaFaultedReason,
			wantEvent: "v-r1 on node b", repairErr: errors.New("no node has room"),
		},
		{
			name:       "a volume still being made is not repaired",
			replicas:   []*pmemv1.PmemReplica{replica("v-r0", "a", pmemv1.CreatedReason), replica("v-r1", "b", pmemv1.FaultedReason)},
			notReady:   true,
			wantStatus: metav1.ConditionTrue, wantReason: pmemv1.ReplicaFaultedReason, wantEvent: "v-r1 on node b",
		},
		{
			name:       "a replica being rebuilt: the volume misses one",
			replicas:   []*pmemv1.PmemReplica{replica("v-r0", "a", pmemv1.CreatedReason), rebuilt(replica("v-x", "b", pmemv1.CreatedReason), false)},
			wantStatus: metav1.ConditionTrue, wantReason: pmemv1.ReplicasMissingReason,
			wantEvent: "1 of 2 replicas have the volume's data; rebuilding: v-x on node b",
		},
		{
			name:       "a rebuilt replica in sync",
			replicas:   []*pmemv1.PmemReplica{replica("v-r0", "a", pmemv1.CreatedReason), rebuilt(replica("v-x", "b", pmemv1.CreatedReason), true)},
			wantStatus: metav1.ConditionFalse, wantReason: pmemv1.AllReplicasReason,
		},
		{
			name: "a retired replica is out of the volume, whose replica elsewhere took its place",
			replicas: []*pmemv1.PmemReplica{
				replica("v-r0", "a", pmemv1.CreatedReason), replica("v-r1", "b", pmemv1.RetiredReason),
				rebuilt(replica("v-x", "c", pmemv1.CreatedReason), true),
			},
			wantStatus: metav1.ConditionFalse, wantReason: pmemv1.AllReplicasReason,
		},
		{
			name:       "a deleted replica",
			replicas:   []*pmemv1.PmemReplica{replica("v-r0", "a", pmemv1.CreatedReason)},
			wantStatus: metav1.ConditionTrue, wantReason: pmemv1.ReplicasMissingReason, wantEvent: "1 of 2 replicas have the volume's data",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			scheme := runtime.NewScheme()
			g.Expect(pmemv1.AddToScheme(scheme)).To(Succeed())
			vol := &pmemv1.PmemVolume{
				ObjectMeta: metav1.ObjectMeta{Name: "v"},
				Spec:       pmemv1.PmemVolumeSpec{VolumeID: "v", Replicas: 2, Size: resource.MustParse("1Gi")},
			}
			if !tc.notReady {
				meta.SetStatusCondition(&vol.Status.Conditions, metav1.Condition{Type: pmemv1.ReadyCondition, Status: metav1.ConditionTrue, Reason: pmemv1.CreatedReason})
				// As the reconciler left it when the volume was made: whole.
				meta.SetStatusCondition(&vol.Status.Conditions, metav1.Condition{Type: pmemv1.DegradedCondition, Status: metav1.ConditionFalse, Reason: pmemv1.AllReplicasReason, Message: "2 replicas"})
			}
			objs := []client.Object{vol}
			for _, r := range tc.replicas {
				objs = append(objs, r)
			}
			c := clientfake.NewClientBuilder().WithScheme(scheme).WithObjects(objs...).WithStatusSubresource(vol).Build()
			rec := events.NewFakeRecorder(4)
			repl := &repairer{err: tc.repairErr}
			r := &Reconciler{Client: c, Recorder: rec, Repairer: repl}
			before := degraded.count()

			for range 2 { // the second pass changes nothing and says nothing again
				res, err := r.Reconcile(t.Context(), ctrl.Request{NamespacedName: client.ObjectKeyFromObject(vol)})
				g.Expect(err).NotTo(HaveOccurred())
				if tc.repairErr != nil {
					g.Expect(res.RequeueAfter).To(Equal(RepairRetry))
				} else {
					g.Expect(res.IsZero()).To(BeTrue())
				}
			}
			g.Expect(c.Get(t.Context(), client.ObjectKeyFromObject(vol), vol)).To(Succeed())
			cond := meta.FindStatusCondition(vol.Status.Conditions, pmemv1.DegradedCondition)
			g.Expect(cond).NotTo(BeNil())
			g.Expect(cond.Status).To(Equal(tc.wantStatus))
			g.Expect(cond.Reason).To(Equal(tc.wantReason))
			if tc.wantEvent != "" {
				g.Expect(cond.Message).To(ContainSubstring(tc.wantEvent))
				g.Expect(rec.Events).To(HaveLen(1))
				g.Expect(<-rec.Events).To(And(ContainSubstring(tc.wantReason), ContainSubstring(tc.wantEvent)))
				g.Expect(degraded.count()).To(Equal(before + 1))
			} else {
				g.Expect(rec.Events).To(BeEmpty())
			}
			if tc.notReady {
				g.Expect(repl.volumes).To(BeEmpty(), "a volume being made is not repaired")
			} else {
				g.Expect(repl.volumes).To(Equal([]string{"v", "v"}), "a Ready volume is repaired in each pass")
			}

			g.Expect(c.Delete(t.Context(), vol)).To(Succeed())
			_, err := r.Reconcile(t.Context(), ctrl.Request{NamespacedName: client.ObjectKeyFromObject(vol)})
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(degraded.count()).To(Equal(0), "a deleted volume is degraded no more")
		})
	}
}
