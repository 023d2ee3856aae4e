package agent

import (
	"context"
	"errors"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	clientfake "sigs.k8s.io/controller-runtime/pkg/client/fake"

	"pvbridge.io/mgmt-csi/internal/pmem"
	"pvbridge.io/mgmt-csi/internal/pmem/fake"
	pmemv1 "pvbridge.io/pkg/apis/pmem/v1alpha1"
)

// exporter is a replica server that records its exports.
type exporter struct {
	exports    map[string]string
	unexported []string
	err        error
}

func (e *exporter) Export(_ context.Context, name, device string) error {
	if e.err != nil {
		return e.err
	}
	e.exports[name] = device
	return nil
}

func (e *exporter) Unexport(_ context.Context, name string) error {
	delete(e.exports, name)
	e.unexported = append(e.unexported, name)
	return e.err
}

func (e *exporter) Exported(_ context.Context, name string) (bool, error) {
	_, ok := e.exports[name]
	return ok, e.err
}

func replica(name string, size int64, mutate ...func(*pmemv1.PmemReplica)) *pmemv1.PmemReplica {
	r := &pmemv1.PmemReplica{
		ObjectMeta: metav1.ObjectMeta{Name: name, Finalizers: []string{Finalizer}, Generation: 1},
		Spec:       pmemv1.PmemReplicaSpec{VolumeID: "v", Node: "host-a", Size: *resource.NewQuantity(size, resource.BinarySI)},
	}
	for _, m := range mutate {
		m(r)
	}
	return r
}

// withReady gives a replica the Ready condition of reason, as its agent reported it.
func withReady(reason string) func(*pmemv1.PmemReplica) {
	return func(r *pmemv1.PmemReplica) {
		st := metav1.ConditionFalse
		if reason == pmemv1.CreatedReason {
			st = metav1.ConditionTrue
		}
		r.Status.Device = "/dev/loop0"
		meta.SetStatusCondition(&r.Status.Conditions, metav1.Condition{Type: pmemv1.ReadyCondition, Status: st, Reason: reason, ObservedGeneration: 1})
	}
}

func TestReplicaReconciler(t *testing.T) {
	deleted := func(r *pmemv1.PmemReplica) { r.DeletionTimestamp = &metav1.Time{Time: time.Now()} }
	carved := func(ctx context.Context, g Gomega, b *fake.Fake, _ *exporter) {
		_, err := b.CreateVolume(ctx, "v-r0", 10*mi, nil)
		g.Expect(err).NotTo(HaveOccurred())
	}
	tests := []struct {
		name        string
		rep         *pmemv1.PmemReplica
		prepare     func(ctx context.Context, g Gomega, b *fake.Fake, e *exporter)
		wantReason  string
		wantErr     bool
		wantRequeue bool
		wantGone    bool
		check       func(ctx context.Context, g Gomega, b *fake.Fake, e *exporter, got *pmemv1.PmemReplica)
	}{
		{
			name: "a new replica is carved, exported and reported with the server's address", rep: replica("v-r0", 10*mi),
			wantReason: pmemv1.CreatedReason, wantRequeue: true,
			check: func(ctx context.Context, g Gomega, b *fake.Fake, e *exporter, got *pmemv1.PmemReplica) {
				v, err := b.GetVolume(ctx, "v-r0")
				g.Expect(err).NotTo(HaveOccurred())
				g.Expect(e.exports).To(Equal(map[string]string{"v-r0": v.Device}))
				g.Expect(got.Status.Device).To(Equal(v.Device))
				g.Expect(got.Status.Address).To(Equal("192.0.2.1:10809"))
				g.Expect(got.Status.AllocatedSize.Value()).To(Equal(10 * mi))
			},
		},
		{
			name: "the first replica of a restored volume starts from the snapshot",
			rep: replica("v-r0", 10*mi, func(r *pmemv1.PmemReplica) {
				r.Spec.Source = &pmemv1.PmemVolumeSource{SnapshotID: "snap-1"}
			}),
			prepare: func(ctx context.Context, g Gomega, b *fake.Fake, _ *exporter) {
				_, err := b.CreateVolume(ctx, "old-r1", 10*mi, nil)
				g.Expect(err).NotTo(HaveOccurred())
				_, err = b.CreateSnapshot(ctx, "snap-1", "old-r1")
				g.Expect(err).NotTo(HaveOccurred())
			},
			wantReason: pmemv1.CreatedReason, wantRequeue: true,
		},
		{
			name: "the first replica of a clone of a replicated volume is copied from the source's replica on this node",
			rep: replica("v-r0", 10*mi, func(r *pmemv1.PmemReplica) {
				r.Spec.Source = &pmemv1.PmemVolumeSource{VolumeID: "src", SourceReplica: "src-r1"}
			}),
			prepare: func(ctx context.Context, g Gomega, b *fake.Fake, _ *exporter) {
				_, err := b.CreateVolume(ctx, "src-r1", 10*mi, nil) // no back-end volume "src" here
				g.Expect(err).NotTo(HaveOccurred())
			},
			wantReason: pmemv1.CreatedReason, wantRequeue: true,
		},
		{
			name: "a replica whose snapshot is gone is never made empty (the source reaches the back end)",
			rep: replica("v-r0", 10*mi, func(r *pmemv1.PmemReplica) {
				r.Spec.Source = &pmemv1.PmemVolumeSource{SnapshotID: "snap-gone"}
			}),
			wantReason: pmemv1.SourceNotFoundReason,
		},
		{
			name: "a ready replica still exported is checked again later", rep: replica("v-r0", 10*mi, withReady(pmemv1.CreatedReason)),
			prepare: func(ctx context.Context, g Gomega, b *fake.Fake, e *exporter) {
				carved(ctx, g, b, e)
				e.exports["v-r0"] = "/dev/loop0"
			},
			wantReason: pmemv1.CreatedReason, wantRequeue: true,
		},
		{
			name: "a grown replica grows and is exported again, at its new size",
			rep: replica("v-r0", 20*mi, withReady(pmemv1.CreatedReason), func(r *pmemv1.PmemReplica) {
				r.Generation = 2
				r.Status.AllocatedSize = resource.NewQuantity(10*mi, resource.BinarySI)
			}),
			prepare: func(ctx context.Context, g Gomega, b *fake.Fake, e *exporter) {
				carved(ctx, g, b, e)
				e.exports["v-r0"] = "/dev/loop0"
			},
			wantReason: pmemv1.CreatedReason, wantRequeue: true,
			check: func(ctx context.Context, g Gomega, b *fake.Fake, e *exporter, got *pmemv1.PmemReplica) {
				v, err := b.GetVolume(ctx, "v-r0")
				g.Expect(err).NotTo(HaveOccurred())
				g.Expect(v.Size).To(Equal(20 * mi))
				g.Expect(e.unexported).To(Equal([]string{"v-r0"}), "its old export ended")
				g.Expect(e.exports).To(Equal(map[string]string{"v-r0": v.Device}))
				g.Expect(got.Status.AllocatedSize.Value()).To(Equal(20 * mi))
				g.Expect(meta.FindStatusCondition(got.Status.Conditions, pmemv1.ReadyCondition).ObservedGeneration).To(BeEquivalentTo(2))
			},
		},
		{
			name: "a ready replica whose export is gone is faulted, never exported again", rep: replica("v-r0", 10*mi, withReady(pmemv1.CreatedReason)),
			prepare:    carved,
			wantReason: pmemv1.FaultedReason,
			check: func(_ context.Context, g Gomega, _ *fake.Fake, e *exporter, _ *pmemv1.PmemReplica) {
				g.Expect(e.exports).To(BeEmpty())
			},
		},
		{
			name: "a faulted replica stays faulted", rep: replica("v-r0", 10*mi, withReady(pmemv1.FaultedReason)),
			prepare:    carved,
			wantReason: pmemv1.FaultedReason,
			check: func(_ context.Context, g Gomega, _ *fake.Fake, e *exporter, _ *pmemv1.PmemReplica) {
				g.Expect(e.exports).To(BeEmpty())
			},
		},
		{
			name: "a replica whose server fails is not ready, and retried", rep: replica("v-r0", 10*mi),
			prepare: func(_ context.Context, _ Gomega, _ *fake.Fake, e *exporter) {
				e.err = errors.New("qmp block-export-add: GenericError: boom")
			},
			wantReason: pmemv1.FailedReason, wantErr: true,
		},
		{
			name: "no room is final for this spec", rep: replica("v-r0", 200*mi),
			wantReason: pmemv1.InsufficientCapacityReason,
			check: func(_ context.Context, g Gomega, _ *fake.Fake, e *exporter, _ *pmemv1.PmemReplica) {
				g.Expect(e.exports).To(BeEmpty())
			},
		},
		{
			name:       "a device that disappeared is never exported empty",
			rep:        replica("v-r0", 10*mi, func(r *pmemv1.PmemReplica) { r.Status.Device = "/dev/loop7" }),
			wantReason: pmemv1.FailedReason,
			check: func(ctx context.Context, g Gomega, b *fake.Fake, e *exporter, _ *pmemv1.PmemReplica) {
				_, err := b.GetVolume(ctx, "v-r0")
				g.Expect(err).To(MatchError(pmem.ErrNotFound))
				g.Expect(e.exports).To(BeEmpty())
			},
		},
		{
			name: "a deleted replica in use waits", rep: replica("v-r0", 10*mi, deleted),
			prepare: func(ctx context.Context, g Gomega, b *fake.Fake, e *exporter) {
				carved(ctx, g, b, e)
				b.SetInUse("v-r0", true)
			},
			wantReason: pmemv1.InUseReason, wantRequeue: true,
		},
		{
			name: "a deleted replica's export ends, then its device, then its object", rep: replica("v-r0", 10*mi, deleted),
			prepare: func(ctx context.Context, g Gomega, b *fake.Fake, e *exporter) {
				carved(ctx, g, b, e)
				e.exports["v-r0"] = "/dev/loop0"
			},
			wantGone: true,
			check: func(ctx context.Context, g Gomega, b *fake.Fake, e *exporter, _ *pmemv1.PmemReplica) {
				_, err := b.GetVolume(ctx, "v-r0")
				g.Expect(err).To(MatchError(pmem.ErrNotFound))
				g.Expect(e.exports).To(BeEmpty())
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			ctx := t.Context()
			scheme := runtime.NewScheme()
			g.Expect(pmemv1.AddToScheme(scheme)).To(Succeed())
			c := clientfake.NewClientBuilder().WithScheme(scheme).WithObjects(tt.rep).
				WithStatusSubresource(&pmemv1.PmemReplica{}).Build()
			b := fake.New(fake.Options{Capacity: 100 * mi})
			e := &exporter{exports: map[string]string{}}
			if tt.prepare != nil {
				tt.prepare(ctx, g, b, e)
			}
			r := &ReplicaReconciler{Client: c, Backend: b, Node: "host-a", Server: e, Address: "192.0.2.1:10809", Capacity: &NodeReporter{}}

			res, err := r.Reconcile(ctx, ctrl.Request{NamespacedName: client.ObjectKeyFromObject(tt.rep)})
			g.Expect(err != nil).To(Equal(tt.wantErr), "error: %v", err)
			if tt.wantRequeue {
				g.Expect(res.RequeueAfter).To(BeNumerically(">", 0))
			} else {
				g.Expect(res.RequeueAfter).To(BeZero())
			}

			got := &pmemv1.PmemReplica{}
			err = c.Get(ctx, client.ObjectKeyFromObject(tt.rep), got)
			if tt.wantGone {
				g.Expect(client.IgnoreNotFound(err)).To(Succeed())
				g.Expect(err).To(HaveOccurred(), "the finalizer is gone, and with it the object")
			} else {
				g.Expect(err).NotTo(HaveOccurred())
				ready := meta.FindStatusCondition(got.Status.Conditions, pmemv1.ReadyCondition)
				g.Expect(ready).NotTo(BeNil())
				g.Expect(ready.Reason).To(Equal(tt.wantReason))
				g.Expect(ready.ObservedGeneration).To(Equal(got.Generation))
			}
			if tt.check != nil {
				tt.check(ctx, g, b, e, got)
			}
		})
	}
}

func TestReplicaReconcilerIgnoresOtherNodes(t *testing.T) {
	g := NewWithT(t)
	scheme := runtime.NewScheme()
	g.Expect(pmemv1.AddToScheme(scheme)).To(Succeed())
	rep := replica("v-r1", mi, func(r *pmemv1.PmemReplica) { r.Spec.Node = "host-b" })
	c := clientfake.NewClientBuilder().WithScheme(scheme).WithObjects(rep).Build()
	b := fake.New(fake.Options{})
	e := &exporter{exports: map[string]string{}}
	r := &ReplicaReconciler{Client: c, Backend: b, Node: "host-a", Server: e, Capacity: &NodeReporter{}}
	_, err := r.Reconcile(t.Context(), ctrl.Request{NamespacedName: client.ObjectKeyFromObject(rep)})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(b.Calls(fake.CreateVolume)).To(BeZero())
	g.Expect(e.exports).To(BeEmpty())
}
