package keylock

import (
	"sync"
	"sync/atomic"
	"testing"

	. "github.com/onsi/gomega"
)

func TestLocks(t *testing.T) {
	tests := []struct {
		name string
		run  func(g Gomega, l *Locks)
	}{
		{
			name: "a free key is taken",
			run:  func(g Gomega, l *Locks) { g.Expect(l.TryLock("a")).To(BeTrue()) },
		},
		{
			name: "a held key is refused",
			run: func(g Gomega, l *Locks) {
				g.Expect(l.TryLock("a")).To(BeTrue())
				g.Expect(l.TryLock("a")).To(BeFalse())
			},
		},
		{
			name: "other keys are independent",
			run: func(g Gomega, l *Locks) {
				g.Expect(l.TryLock("a")).To(BeTrue())
				g.Expect(l.TryLock("b")).To(BeTrue())
			},
		},
		{
			name: "an unlocked key can be taken again",
			run: func(g Gomega, l *Locks) {
				g.Expect(l.TryLock("a")).To(BeTrue())
				l.Unlock("a")
				g.Expect(l.TryLock("a")).To(BeTrue())
			},
		},
		{
			name: "unlocking a key that is not held panics",
			run: func(g Gomega, l *Locks) {
				g.Expect(func() { l.Unlock("a") }).To(PanicWith(ContainSubstring(`unlock of unlocked key a`)))
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tt.run(NewWithT(t), &Locks{})
		})
	}
}

func TestLocksAdmitOneHolderAtATime(t *testing.T) {
	g := NewWithT(t)
	var (
		l          Locks
		holders    atomic.Int32
		overlapped atomic.Bool
		wg         sync.WaitGroup
	)
	for range 16 {
		wg.Go(func() {
			for range 1000 {
				if !l.TryLock("volume") {
					continue
				}
				if holders.Add(1) > 1 {
					overlapped.Store(true)
				}
				holders.Add(-1)
				l.Unlock("volume")
			}
		})
	}
	wg.Wait()
	g.Expect(overlapped.Load()).To(BeFalse(), "two goroutines held the key at once")
}
