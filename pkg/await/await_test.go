package await

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	toolscache "k8s.io/client-go/tools/cache"
)

func pvc(name string) *corev1.PersistentVolumeClaim {
	return &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: name}}
}

func TestUntilReturnsWhenAnEventMakesTheConditionTrue(t *testing.T) {
	g := NewWithT(t)
	hub := NewHub()
	handler := hub.Handler("PVC")
	var ready atomic.Bool
	errc := make(chan error, 1)
	evaluated := make(chan struct{}, 10)
	go func() {
		errc <- hub.Until(t.Context(), Key{"PVC", "ns", "a"}, func() (bool, error) {
			evaluated <- struct{}{}
			return ready.Load(), nil
		})
	}()
	g.Eventually(evaluated).Should(Receive())

	handler.OnUpdate(nil, pvc("b")) // another object: no wake-up
	g.Consistently(evaluated, 50*time.Millisecond).ShouldNot(Receive())

	ready.Store(true)
	handler.OnUpdate(nil, pvc("a"))
	g.Eventually(errc).Should(Receive(BeNil()))
}

func TestUntilEndsWithTheContext(t *testing.T) {
	g := NewWithT(t)
	hub := NewHub()
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Millisecond)
	defer cancel()
	err := hub.Until(ctx, Key{"PVC", "ns", "a"}, func() (bool, error) { return false, nil })
	g.Expect(err).To(MatchError(context.DeadlineExceeded))
	g.Expect(hub.waiters).To(BeEmpty(), "the waiter unsubscribed")
}

func TestUntilReturnsTheConditionsError(t *testing.T) {
	g := NewWithT(t)
	boom := errors.New("boom")
	err := NewHub().Until(t.Context(), Key{"PVC", "ns", "a"}, func() (bool, error) { return false, boom })
	g.Expect(err).To(MatchError(boom))
}

func TestDeletionWakesWaitersThroughTombstones(t *testing.T) {
	g := NewWithT(t)
	hub := NewHub()
	var gone atomic.Bool
	errc := make(chan error, 1)
	go func() {
		errc <- hub.Until(t.Context(), Key{"PVC", "ns", "a"}, func() (bool, error) { return gone.Load(), nil })
	}()
	gone.Store(true)
	g.Eventually(func() bool {
		hub.Handler("PVC").OnDelete(toolscache.DeletedFinalStateUnknown{Key: "ns/a", Obj: pvc("a")})
		select {
		case err := <-errc:
			return err == nil
		default:
			return false
		}
	}).Should(BeTrue())
}
