package agent

import (
	"context"
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

const mi = int64(1 << 20)

func volume(name string, size int64, mutate ...func(*pmemv1.PmemVolume)) *pmemv1.PmemVolume {
	v := &pmemv1.PmemVolume{
		ObjectMeta: metav1.ObjectMeta{Name: name, Finalizers: []string{Finalizer}, Generation: 1},
		Spec:       pmemv1.PmemVolumeSpec{Node: "host-a", VolumeID: name, Size: *resource.NewQuantity(size, resource.BinarySI)},
	}
	for _, m := range mutate {
		m(v)
	}
	return v
}

func TestVolumeReconciler(t *testing.T) {
	tests := []struct {
		name string
		vol  *pmemv1.PmemVolume
		// prepare sets the back end up before the reconcile.
		prepare     func(ctx context.Context, g Gomega, b *fake.Fake)
		wantReason  string
		wantRequeue bool
		wantErr     bool
		wantGone    bool
		// check inspects the back end afterwards.
		check func(ctx context.Context, g Gomega, b *fake.Fake)
	}{
		{
			name: "a new volume is made and reported ready", vol: volume("v", 10*mi),
			wantReason: pmemv1.CreatedReason,
			check: func(ctx context.Context, g Gomega, b *fake.Fake) {
				v, err := b.GetVolume(ctx, "v")
				g.Expect(err).NotTo(HaveOccurred())
				g.Expect(v.Size).To(Equal(10 * mi))
			},
		},
		{
			name: "no room is final for this spec", vol: volume("v", 200*mi),
			wantReason: pmemv1.InsufficientCapacityReason,
		},
		{
			name: "a missing source is final", vol: volume("v", 10*mi, func(v *pmemv1.PmemVolume) {
				v.Spec.Source = &pmemv1.PmemVolumeSource{SnapshotID: "gone"}
			}),
			wantReason: pmemv1.SourceNotFoundReason,
		},
		{
			name: "a back-end failure is retried", vol: volume("v", 10*mi),
			prepare: func(_ context.Context, _ Gomega, b *fake.Fake) {
				b.InjectError(fake.CreateVolume, context.DeadlineExceeded)
			},
			wantReason: pmemv1.FailedReason, wantErr: true,
		},
		{
			name: "a device that disappeared is never recreated empty",
			vol: volume("v", 10*mi, func(v *pmemv1.PmemVolume) {
				v.Status.Device = "/dev/loop7"
			}),
			wantReason: pmemv1.FailedReason,
			check: func(ctx context.Context, g Gomega, b *fake.Fake) {
				_, err := b.GetVolume(ctx, "v")
				g.Expect(err).To(MatchError(pmem.ErrNotFound))
			},
		},
		{
			name: "a larger spec grows the volume", vol: volume("v", 20*mi),
			prepare: func(ctx context.Context, g Gomega, b *fake.Fake) {
				_, err := b.CreateVolume(ctx, "v", 10*mi, nil)
				g.Expect(err).NotTo(HaveOccurred())
			},
			wantReason: pmemv1.CreatedReason,
			check: func(ctx context.Context, g Gomega, b *fake.Fake) {
				v, err := b.GetVolume(ctx, "v")
				g.Expect(err).NotTo(HaveOccurred())
				g.Expect(v.Size).To(Equal(20 * mi))
			},
		},
		{
			name: "a deleted volume in use waits", vol: volume("v", 10*mi, func(v *pmemv1.PmemVolume) {
				v.DeletionTimestamp = &metav1.Time{Time: time.Now()}
			}),
			prepare: func(ctx context.Context, g Gomega, b *fake.Fake) {
				_, err := b.CreateVolume(ctx, "v", 10*mi, nil)
				g.Expect(err).NotTo(HaveOccurred())
				b.SetInUse("v", true)
			},
			wantReason: pmemv1.InUseReason, wantRequeue: true,
		},
		{
			name: "a deleted volume is removed, then its object", vol: volume("v", 10*mi, func(v *pmemv1.PmemVolume) {
				v.DeletionTimestamp = &metav1.Time{Time: time.Now()}
			}),
			prepare: func(ctx context.Context, g Gomega, b *fake.Fake) {
				_, err := b.CreateVolume(ctx, "v", 10*mi, nil)
				g.Expect(err).NotTo(HaveOccurred())
			},
			wantGone: true,
			check: func(ctx context.Context, g Gomega, b *fake.Fake) {
				_, err := b.GetVolume(ctx, "v")
				g.Expect(err).To(MatchError(pmem.ErrNotFound))
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			ctx := t.Context()
			scheme := runtime.NewScheme()
			g.Expect(pmemv1.AddToScheme(scheme)).To(Succeed())
			c := clientfake.NewClientBuilder().WithScheme(scheme).WithObjects(tt.vol).
				WithStatusSubresource(&pmemv1.PmemVolume{}, &pmemv1.PmemNode{}).Build()
			b := fake.New(fake.Options{Capacity: 100 * mi})
			if tt.prepare != nil {
				tt.prepare(ctx, g, b)
			}
			r := &VolumeReconciler{Client: c, Backend: b, Node: "host-a", Capacity: &NodeReporter{}}

			res, err := r.Reconcile(ctx, ctrl.Request{NamespacedName: client.ObjectKeyFromObject(tt.vol)})
			g.Expect(err != nil).To(Equal(tt.wantErr), "error: %v", err)
			if tt.wantRequeue {
				g.Expect(res.RequeueAfter).To(BeNumerically(">", 0))
			} else {
				g.Expect(res.RequeueAfter).To(BeZero())
			}

			got := &pmemv1.PmemVolume{}
			err = c.Get(ctx, client.ObjectKeyFromObject(tt.vol), got)
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
				tt.check(ctx, g, b)
			}
		})
	}
}

func TestVolumeReconcilerIgnoresOtherNodes(t *testing.T) {
	g := NewWithT(t)
	scheme := runtime.NewScheme()
	g.Expect(pmemv1.AddToScheme(scheme)).To(Succeed())
	vol := volume("v", mi, func(v *pmemv1.PmemVolume) { v.Spec.Node = "host-b" })
	c := clientfake.NewClientBuilder().WithScheme(scheme).WithObjects(vol).Build()
	b := fake.New(fake.Options{})
	r := &VolumeReconciler{Client: c, Backend: b, Node: "host-a", Capacity: &NodeReporter{}}
	_, err := r.Reconcile(t.Context(), ctrl.Request{NamespacedName: client.ObjectKeyFromObject(vol)})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(b.Calls(fake.CreateVolume)).To(BeZero())
}
