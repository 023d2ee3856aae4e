package events

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"
	"sigs.k8s.io/controller-runtime/pkg/client/interceptor"
)

// claim is the object the Events are about.
var claim = &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "data", UID: "uid-data"}}

// event returns an Event of type kind about the object of uid that last happened at.
func event(name string, uid types.UID, kind, reason string, at time.Time) *corev1.Event {
	return &corev1.Event{
		ObjectMeta:     metav1.ObjectMeta{Namespace: "ns", Name: name},
		InvolvedObject: corev1.ObjectReference{Kind: "PersistentVolumeClaim", Namespace: "ns", Name: "data", UID: uid},
		Type:           kind, Reason: reason, Message: reason + " happened",
		LastTimestamp: metav1.NewTime(at),
	}
}

// newClient returns a fake client that answers the field selectors the apiserver supports on
// Events and counts the Lists it serves.
func newClient(lists *atomic.Int32, objs ...client.Object) client.WithWatch {
	scheme := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(scheme); err != nil {
		panic(err)
	}
	return fake.NewClientBuilder().WithScheme(scheme).WithObjects(objs...).
		WithIndex(&corev1.Event{}, "type", func(o client.Object) []string { return []string{o.(*corev1.Event).Type} }).
		WithIndex(&corev1.Event{}, "involvedObject.uid", func(o client.Object) []string { return []string{string(o.(*corev1.Event).InvolvedObject.UID)} }).
		WithInterceptorFuncs(interceptor.Funcs{List: func(ctx context.Context, c client.WithWatch, list client.ObjectList, opts ...client.ListOption) error {
			lists.Add(1)
			return c.List(ctx, list, opts...)
		}}).
		Build()
}

func TestLatestWarning(t *testing.T) {
	now := time.Now()
	for _, tc := range []struct {
		name   string
		events []client.Object
		obj    client.Object
		want   string
	}{
		{name: "none", want: ""},
		{
			name: "the latest warning of the object",
			events: []client.Object{
				event("old", "uid-data", corev1.EventTypeWarning, "Old", now.Add(-time.Minute)),
				event("new", "uid-data", corev1.EventTypeWarning, "New", now),
				event("normal", "uid-data", corev1.EventTypeNormal, "Provisioned", now.Add(time.Second)),
				event("other", "uid-other", corev1.EventTypeWarning, "Other", now.Add(time.Second)),
			},
			want: ": New: New happened",
		},
		{
			name:   "an object never seen has none",
			events: []client.Object{event("any", "", corev1.EventTypeWarning, "Any", now)},
			obj:    &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "data"}},
			want:   "",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			obj := tc.obj
			if obj == nil {
				obj = claim
			}
			var lists atomic.Int32
			c := newClient(&lists, tc.events...)
			g.Expect(LatestWarning(t.Context(), c, obj)).To(Equal(tc.want))
			g.Expect(NewWarnings(c, time.Hour).Latest(t.Context(), obj)).To(Equal(tc.want), "the namespace's List answers as the object's own")
		})
	}
}

func TestWarningsListOncePerPeriod(t *testing.T) {
	g := NewWithT(t)
	var lists atomic.Int32
	c := newClient(&lists, event("first", "uid-data", corev1.EventTypeWarning, "First", time.Now()))
	other := &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "other", UID: "uid-other"}}

	w := NewWarnings(c, time.Hour)
	g.Expect(w.Latest(t.Context(), claim)).To(Equal(": First: First happened"))
	g.Expect(w.Latest(t.Context(), other)).To(BeEmpty())
	g.Expect(c.Create(t.Context(), event("second", "uid-data", corev1.EventTypeWarning, "Second", time.Now().Add(time.Second)))).To(Succeed())
	g.Expect(w.Latest(t.Context(), claim)).To(Equal(": First: First happened"), "within the period, the first List answers")
	g.Expect(lists.Load()).To(BeEquivalentTo(1), "one List for every caller of the period")

	w = NewWarnings(c, 0)
	g.Expect(w.Latest(t.Context(), claim)).To(Equal(": Second: Second happened"), "a period over lists again")
	g.Expect(lists.Load()).To(BeEquivalentTo(2))
}

func TestWarningsKeepTheirAnswerWhenAListFails(t *testing.T) {
	g := NewWithT(t)
	var lists atomic.Int32
	c := newClient(&lists, event("first", "uid-data", corev1.EventTypeWarning, "First", time.Now()))
	failing := interceptor.NewClient(c, interceptor.Funcs{List: func(context.Context, client.WithWatch, client.ObjectList, ...client.ListOption) error {
		return context.DeadlineExceeded
	}})

	w := NewWarnings(c, 0)
	g.Expect(w.Latest(t.Context(), claim)).To(Equal(": First: First happened"))
	w.reader = failing
	g.Expect(w.Latest(t.Context(), claim)).To(Equal(": First: First happened"), "the last answer stands")
}
