package agent

import (
	"context"
	"path/filepath"
	"sync"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	clientfake "sigs.k8s.io/controller-runtime/pkg/client/fake"
	"sigs.k8s.io/controller-runtime/pkg/client/interceptor"

	"pvbridge.io/mgmt-csi/internal/pmem/fake"
	pmemv1 "pvbridge.io/pkg/apis/pmem/v1alpha1"
	"pvbridge.io/pkg/hold"
)

func member(name, volumeID string, size int32) *pmemv1.PmemSnapshot {
	return &pmemv1.PmemSnapshot{
		ObjectMeta: metav1.ObjectMeta{Name: name, Finalizers: []string{Finalizer}, Generation: 1,
			Labels: map[string]string{pmemv1.GroupLabel: "groupsnapshot-1"}},
		Spec: pmemv1.PmemSnapshotSpec{Node: "host-a", SnapshotID: name, SourceVolumeID: volumeID,
			Group: &pmemv1.PmemSnapshotGroup{ID: "groupsnapshot-1", Size: size}},
	}
}

// replicatedMember is member name of replicated volume volumeID, cut from its replica here,
// which the back end holds as volume replica.
func replicatedMember(name, volumeID, replica string, size int32) *pmemv1.PmemSnapshot {
	m := member(name, volumeID, size)
	m.Spec.SourceReplica = replica
	return m
}

// servedBy is replicated volume id, served by node target ("" for none).
func servedBy(id, target string) *pmemv1.PmemVolume {
	return &pmemv1.PmemVolume{ObjectMeta: metav1.ObjectMeta{Name: id}, Spec: pmemv1.PmemVolumeSpec{VolumeID: id, Replicas: 2},
		Status: pmemv1.PmemVolumeStatus{Target: target}}
}

// newGroupHost returns an API server (a fake, whose calls funcs may intercept) holding members,
// and a back end of capacity holding the volumes v1 and v2.
func newGroupHost(ctx context.Context, g Gomega, capacity int64, funcs interceptor.Funcs, members ...*pmemv1.PmemSnapshot) (client.Client, *fake.Fake) {
	scheme := runtime.NewScheme()
	g.Expect(pmemv1.AddToScheme(scheme)).To(Succeed())
	objs := make([]client.Object, len(members))
	for i, m := range members {
		objs[i] = m
	}
	c := clientfake.NewClientBuilder().WithScheme(scheme).WithObjects(objs...).
		WithStatusSubresource(&pmemv1.PmemSnapshot{}).WithInterceptorFuncs(funcs).Build()
	b := fake.New(fake.Options{Capacity: capacity})
	for _, v := range []string{"v1", "v2"} {
		_, err := b.CreateVolume(ctx, v, mi, nil)
		g.Expect(err).NotTo(HaveOccurred())
	}
	return c, b
}

// holder is the host's holder: it records, when it holds and when it lets go, which snapshots
// the back end has, so that a test sees the members cut inside the hold.
type holder struct {
	backend *fake.Fake

	// released, when set, is told of each release.
	released chan struct{}

	mu                sync.Mutex
	asked             []string
	atHold, atRelease []string
	holds, releases   int
}

func (h *holder) snapshots() []string {
	snaps, _ := h.backend.ListSnapshots(context.Background())
	var ids []string
	for _, s := range snaps {
		ids = append(ids, s.ID)
	}
	return ids
}

func (h *holder) Hold(_ context.Context, ids []string) ([]string, func(context.Context) error, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.holds++
	h.asked, h.atHold = ids, h.snapshots()
	return ids[:1], func(context.Context) error {
		h.mu.Lock()
		defer h.mu.Unlock()
		h.releases++
		h.atRelease = h.snapshots()
		if h.released != nil {
			h.released <- struct{}{}
		}
		return nil
	}, nil
}

// serveHolder serves h on a socket of a test directory and returns its path.
func serveHolder(t *testing.T, h *holder) string {
	return serveHolderFor(t, h, 0)
}

// serveHolderFor serves h with a longest hold of maxHold (0: the default).
func serveHolderFor(t *testing.T, h *holder, maxHold time.Duration) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), hold.SocketName)
	l, err := hold.Listen(path)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = (&hold.Server{Holder: h, MaxHold: maxHold}).Serve(ctx, l)
	}()
	t.Cleanup(func() { cancel(); <-done })
	return path
}

func TestSnapshotReconcilerCutsAGroupWhileItsWritersAreHeld(t *testing.T) {
	tests := []struct {
		name    string
		members []*pmemv1.PmemSnapshot
		// noHolder leaves the hold socket unserved.
		noHolder bool
		// capacity is the back end's; 0 means 100 MiB.
		capacity int64
		// inUse: the volumes the holder does not hold (all but the first) are in use.
		inUse bool
		// replicated are the replicated volumes of members, as the API server has them.
		replicated []*pmemv1.PmemVolume
		// prepare sets the back end up before the reconcile (volumes v1 and v2 exist).
		prepare     func(ctx context.Context, g Gomega, b *fake.Fake)
		wantReason  string // of every member; "" when none is written
		wantRequeue bool
		wantErr     bool
		wantCut     []string // the back end's snapshots afterwards
		check       func(g Gomega, h *holder)
	}{
		{
			name:       "the members are cut inside one hold",
			members:    []*pmemv1.PmemSnapshot{member("snap-1", "v1", 2), member("snap-2", "v2", 2)},
			wantReason: pmemv1.CreatedReason, wantCut: []string{"snap-1", "snap-2"},
			check: func(g Gomega, h *holder) {
				g.Expect(h.asked).To(ConsistOf("v1", "v2"))
				g.Expect(h.atHold).To(BeEmpty())
				g.Expect(h.atRelease).To(ConsistOf("snap-1", "snap-2"))
				g.Expect(h.holds).To(Equal(1))
				g.Expect(h.releases).To(Equal(1))
			},
		},
		{
			name:        "no member is cut before the group is complete",
			members:     []*pmemv1.PmemSnapshot{member("snap-1", "v1", 2)},
			wantRequeue: true,
			check:       func(g Gomega, h *holder) { g.Expect(h.holds).To(BeZero()) },
		},
		{
			name:     "without a holder nothing is cut, and it is retried",
			members:  []*pmemv1.PmemSnapshot{member("snap-1", "v1", 2), member("snap-2", "v2", 2)},
			noHolder: true, wantReason: WritersNotHeldReason, wantErr: true,
		},
		{
			name:    "a volume in use that no holder holds refuses the group",
			members: []*pmemv1.PmemSnapshot{member("snap-1", "v1", 2), member("snap-2", "v2", 2)},
			inUse:   true, wantReason: WritersNotHeldReason, wantErr: true,
			check: func(g Gomega, h *holder) {
				g.Expect(h.atRelease).To(BeEmpty(), "nothing was cut")
				g.Expect(h.releases).To(Equal(1))
			},
		},
		{
			name:       "a replicated member no node serves is cut from its replica here, with no writer to hold",
			members:    []*pmemv1.PmemSnapshot{member("snap-1", "v1", 2), replicatedMember("snap-2", "r", "v2", 2)},
			replicated: []*pmemv1.PmemVolume{servedBy("r", "")},
			inUse:      true, // whatever its replica's device says: no target writes to it
			wantReason: pmemv1.CreatedReason, wantCut: []string{"snap-1", "snap-2"},
			check: func(g Gomega, h *holder) {
				snaps, err := h.backend.ListSnapshots(context.Background())
				g.Expect(err).NotTo(HaveOccurred())
				g.Expect(snaps).To(ContainElement(And(HaveField("ID", "snap-2"), HaveField("SourceVolumeID", "v2"))))
			},
		},
		{
			name:       "a replicated member served here with a writer no holder holds refuses the group",
			members:    []*pmemv1.PmemSnapshot{member("snap-1", "v1", 2), replicatedMember("snap-2", "r", "v2", 2)},
			replicated: []*pmemv1.PmemVolume{servedBy("r", "host-a")},
			inUse:      true, wantReason: WritersNotHeldReason, wantErr: true,
		},
		{
			name:       "a replicated member served here without a writer is cut",
			members:    []*pmemv1.PmemSnapshot{member("snap-1", "v1", 2), replicatedMember("snap-2", "r", "v2", 2)},
			replicated: []*pmemv1.PmemVolume{servedBy("r", "host-a")},
			wantReason: pmemv1.CreatedReason, wantCut: []string{"snap-1", "snap-2"},
		},
		{
			name:       "a replicated member that another node serves now refuses the group",
			members:    []*pmemv1.PmemSnapshot{member("snap-1", "v1", 2), replicatedMember("snap-2", "r", "v2", 2)},
			replicated: []*pmemv1.PmemVolume{servedBy("r", "host-b")},
			wantReason: WritersNotHeldReason, wantErr: true,
		},
		{
			name:       "a member that fails undoes the cut of the others",
			members:    []*pmemv1.PmemSnapshot{member("snap-1", "v1", 2), member("snap-2", "v2", 2)},
			capacity:   3 * mi, // room for one snapshot beside the volumes
			wantReason: pmemv1.InsufficientCapacityReason,
			check: func(g Gomega, h *holder) {
				g.Expect(h.atRelease).To(ConsistOf("snap-1"), "snap-1 was cut in the hold, then removed")
				g.Expect(h.releases).To(Equal(1))
			},
		},
		{
			name:    "the leftover of an interrupted cut is cut again with the others",
			members: []*pmemv1.PmemSnapshot{member("snap-1", "v1", 2), member("snap-2", "v2", 2)},
			prepare: func(ctx context.Context, g Gomega, b *fake.Fake) {
				_, err := b.CreateSnapshot(ctx, "snap-1", "v1")
				g.Expect(err).NotTo(HaveOccurred())
			},
			wantReason: pmemv1.CreatedReason, wantCut: []string{"snap-1", "snap-2"},
			check: func(g Gomega, h *holder) {
				g.Expect(h.atHold).To(BeEmpty(), "removed before the hold")
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			ctx := t.Context()
			capacity := tt.capacity
			if capacity == 0 {
				capacity = 100 * mi
			}
			c, b := newGroupHost(ctx, g, capacity, interceptor.Funcs{}, tt.members...)
			if tt.prepare != nil {
				tt.prepare(ctx, g, b)
			}
			h := &holder{backend: b}
			socket := filepath.Join(t.TempDir(), hold.SocketName)
			if !tt.noHolder {
				socket = serveHolder(t, h)
			}
			scheme := runtime.NewScheme()
			g.Expect(pmemv1.AddToScheme(scheme)).To(Succeed())
			api := clientfake.NewClientBuilder().WithScheme(scheme)
			for _, v := range tt.replicated {
				api = api.WithObjects(v)
			}
			r := &SnapshotReconciler{Client: c, Reader: api.Build(), Backend: b, Node: "host-a", Capacity: &NodeReporter{}, HoldSocket: socket,
				InUse:        func(string) (bool, error) { return tt.inUse, nil },
				TargetDevice: func(string) (string, error) { return "/dev/loop9", nil }}

			res, err := r.Reconcile(ctx, ctrl.Request{NamespacedName: client.ObjectKeyFromObject(tt.members[0])})
			g.Expect(err != nil).To(Equal(tt.wantErr), "error: %v", err)
			if tt.wantRequeue {
				g.Expect(res.RequeueAfter).To(BeNumerically(">", 0))
			} else {
				g.Expect(res.RequeueAfter).To(BeZero())
			}
			g.Expect(h.snapshots()).To(ConsistOf(tt.wantCut))
			for _, m := range tt.members {
				got := &pmemv1.PmemSnapshot{}
				g.Expect(c.Get(ctx, client.ObjectKeyFromObject(m), got)).To(Succeed())
				ready := meta.FindStatusCondition(got.Status.Conditions, pmemv1.ReadyCondition)
				if tt.wantReason == "" {
					g.Expect(ready).To(BeNil())
					continue
				}
				g.Expect(ready).NotTo(BeNil())
				g.Expect(ready.Reason).To(Equal(tt.wantReason), ready.Message)
			}
			if tt.wantReason == pmemv1.CreatedReason {
				got := &pmemv1.PmemSnapshot{}
				g.Expect(c.Get(ctx, client.ObjectKey{Name: "snap-1"}, got)).To(Succeed())
				g.Expect(meta.FindStatusCondition(got.Status.Conditions, pmemv1.ReadyCondition).Message).
					To(MatchRegexp(`cut with the 2 members of group snapshot groupsnapshot-1 while the writers of its volume were held for \d`))
				g.Expect(c.Get(ctx, client.ObjectKey{Name: "snap-2"}, got)).To(Succeed())
				g.Expect(meta.FindStatusCondition(got.Status.Conditions, pmemv1.ReadyCondition).Message).
					To(ContainSubstring("its volume had no writer to hold"))
			}
			if tt.check != nil {
				h.mu.Lock()
				defer h.mu.Unlock()
				tt.check(g, h)
			}
		})
	}
}

// A group whose status writes failed part way (a conflict or an error under load) is finished
// by the next reconcile, and every member says how it was cut (whether the writers of its
// volume were held, and how long) as if the writes had all gone through: once every member
// says so, without a second hold; before, by a new cut of the whole group.
func TestSnapshotReconcilerFinishesAGroupWhoseStatusWritesFailed(t *testing.T) {
	tests := []struct {
		name string
		// fail refuses the first status write it matches.
		fail      func(snap *pmemv1.PmemSnapshot) bool
		wantHolds int
	}{
		{
			name: "a Ready write refused",
			fail: func(snap *pmemv1.PmemSnapshot) bool {
				return snap.Name == "snap-1" && meta.IsStatusConditionTrue(snap.Status.Conditions, pmemv1.ReadyCondition)
			},
			wantHolds: 1,
		},
		{
			name: "a write of how a member was cut refused",
			fail: func(snap *pmemv1.PmemSnapshot) bool {
				c := meta.FindStatusCondition(snap.Status.Conditions, pmemv1.ReadyCondition)
				return snap.Name == "snap-2" && c != nil && c.Reason == CutReason
			},
			wantHolds: 2,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			ctx := t.Context()
			failed := false
			c, b := newGroupHost(ctx, g, 100*mi, interceptor.Funcs{
				SubResourcePatch: func(ctx context.Context, c client.Client, sub string, obj client.Object, patch client.Patch, opts ...client.SubResourcePatchOption) error {
					if snap := obj.(*pmemv1.PmemSnapshot); !failed && tt.fail(snap) {
						failed = true
						return apierrors.NewConflict(pmemv1.GroupVersion.WithResource("pmemsnapshots").GroupResource(), snap.Name, nil)
					}
					return c.SubResource(sub).Patch(ctx, obj, patch, opts...)
				},
			}, member("snap-1", "v1", 2), member("snap-2", "v2", 2))
			h := &holder{backend: b}
			r := &SnapshotReconciler{Client: c, Backend: b, Node: "host-a", Capacity: &NodeReporter{}, HoldSocket: serveHolder(t, h),
				InUse: func(string) (bool, error) { return false, nil }}
			req := ctrl.Request{NamespacedName: client.ObjectKey{Name: "snap-2"}}

			_, err := r.Reconcile(ctx, req)
			g.Expect(err).To(HaveOccurred(), "a status write was refused")
			_, err = r.Reconcile(ctx, req)
			g.Expect(err).NotTo(HaveOccurred())

			g.Expect(h.snapshots()).To(ConsistOf("snap-1", "snap-2"))
			h.mu.Lock()
			defer h.mu.Unlock()
			g.Expect(h.holds).To(Equal(tt.wantHolds))
			want := map[string]string{
				"snap-1": `^cut with the 2 members of group snapshot groupsnapshot-1 while the writers of its volume were held for \d`,
				"snap-2": `^cut with the 2 members of group snapshot groupsnapshot-1; its volume had no writer to hold$`,
			}
			for name, msg := range want {
				got := &pmemv1.PmemSnapshot{}
				g.Expect(c.Get(ctx, client.ObjectKey{Name: name}, got)).To(Succeed())
				ready := meta.FindStatusCondition(got.Status.Conditions, pmemv1.ReadyCondition)
				g.Expect(ready.Status).To(Equal(metav1.ConditionTrue), name)
				g.Expect(ready.Message).To(MatchRegexp(msg), name)
			}
		})
	}
}

// A group whose cut outlasts the hold (a back end that copies each member in full) is undone
// and given up, with the reason: trying again would hold the writers again, for as long.
func TestSnapshotReconcilerGivesUpAGroupWhoseCutOutlastsTheHold(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	c, b := newGroupHost(ctx, g, 100*mi, interceptor.Funcs{}, member("snap-1", "v1", 2), member("snap-2", "v2", 2))
	h := &holder{backend: b, released: make(chan struct{}, 1)}
	socket := serveHolderFor(t, h, 10*time.Millisecond)
	// The cut of v2 (which the holder does not hold) lasts until the server let go at the
	// longest hold.
	slow := func(string) (bool, error) {
		<-h.released
		return false, nil
	}
	r := &SnapshotReconciler{Client: c, Backend: b, Node: "host-a", Capacity: &NodeReporter{}, HoldSocket: socket, InUse: slow}
	req := ctrl.Request{NamespacedName: client.ObjectKey{Name: "snap-1"}}

	res, err := r.Reconcile(ctx, req)
	g.Expect(err).NotTo(HaveOccurred(), "given up, not retried")
	g.Expect(res.RequeueAfter).To(BeZero())
	g.Expect(h.snapshots()).To(BeEmpty(), "what was cut is removed")
	for _, name := range []string{"snap-1", "snap-2"} {
		got := &pmemv1.PmemSnapshot{}
		g.Expect(c.Get(ctx, client.ObjectKey{Name: name}, got)).To(Succeed())
		ready := meta.FindStatusCondition(got.Status.Conditions, pmemv1.ReadyCondition)
		g.Expect(ready.Reason).To(Equal(pmemv1.HoldExpiredReason), name)
		g.Expect(ready.Message).To(HavePrefix("cutting the 2 members took longer than the host's longest hold of their writers: not tried again"))
		g.Expect(ready.Message).To(ContainSubstring(hold.ErrExpired.Error()))
	}

	_, err = r.Reconcile(ctx, req)
	g.Expect(err).NotTo(HaveOccurred())
	h.mu.Lock()
	defer h.mu.Unlock()
	g.Expect(h.holds).To(Equal(1), "the writers are not held again")
}
