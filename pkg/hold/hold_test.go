package hold_test

import (
	"context"
	"errors"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	. "github.com/onsi/gomega"

	"pvbridge.io/pkg/hold"
)

// holder records what it holds; it knows the volumes in known.
type holder struct {
	known []string
	err   error
	// slow, when set, keeps Hold from holding until it is closed (a freeze that writes back
	// through a slow disk).
	slow chan struct{}

	mu       sync.Mutex
	holding  []string
	released chan struct{}
}

func (h *holder) Hold(_ context.Context, ids []string) ([]string, func(context.Context) error, error) {
	if h.err != nil {
		return nil, nil, h.err
	}
	if h.slow != nil {
		<-h.slow
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.holding != nil {
		return nil, nil, errors.New("two holds at once")
	}
	held := []string{}
	for _, id := range ids {
		if slices.Contains(h.known, id) {
			held = append(held, id)
		}
	}
	h.holding = held
	return held, func(context.Context) error {
		h.mu.Lock()
		defer h.mu.Unlock()
		h.holding = nil
		h.released <- struct{}{}
		return nil
	}, nil
}

func (h *holder) isHolding() bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.holding != nil
}

func serve(t *testing.T, h *holder, maxHold time.Duration) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), hold.SocketName)
	l, err := hold.Listen(path)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- (&hold.Server{Holder: h, MaxHold: maxHold}).Serve(ctx, l) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	})
	return path
}

func TestLease(t *testing.T) {
	t.Run("holds the volumes the holder knows until the release", func(t *testing.T) {
		g := NewWithT(t)
		h := &holder{known: []string{"a", "b"}, released: make(chan struct{}, 1)}
		path := serve(t, h, time.Minute)
		lease, err := hold.Acquire(t.Context(), path, []string{"a", "b", "c"})
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(lease.Held).To(Equal([]string{"a", "b"}))
		g.Expect(h.isHolding()).To(BeTrue())
		heldFor, err := lease.Release(t.Context())
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(heldFor).To(BeNumerically(">=", 0))
		g.Expect(h.isHolding()).To(BeFalse(), "released before the answer")
	})
	t.Run("lets go when the client goes away", func(t *testing.T) {
		g := NewWithT(t)
		h := &holder{known: []string{"a"}, released: make(chan struct{}, 1)}
		path := serve(t, h, time.Minute)
		lease, err := hold.Acquire(t.Context(), path, []string{"a"})
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(lease.Held).To(Equal([]string{"a"}))
		hold.CloseForTest(lease)
		g.Eventually(h.released).Should(Receive())
	})
	t.Run("a lease past the longest hold is released and says so", func(t *testing.T) {
		g := NewWithT(t)
		h := &holder{known: []string{"a"}, released: make(chan struct{}, 1)}
		path := serve(t, h, 10*time.Millisecond)
		lease, err := hold.Acquire(t.Context(), path, []string{"a"})
		g.Expect(err).NotTo(HaveOccurred())
		g.Eventually(h.released).Should(Receive(), "the server lets go by itself")
		_, err = lease.Release(t.Context())
		g.Expect(err).To(MatchError(hold.ErrExpired))
	})
	t.Run("a hold that takes longer than the longest hold is refused, and let go once held", func(t *testing.T) {
		g := NewWithT(t)
		h := &holder{known: []string{"a"}, released: make(chan struct{}, 1), slow: make(chan struct{})}
		path := serve(t, h, 10*time.Millisecond)
		_, err := hold.Acquire(t.Context(), path, []string{"a"})
		g.Expect(err).To(MatchError(hold.ErrHoldOverrun), "refused while the holder still holds")
		g.Expect(err).To(MatchError(ContainSubstring("holding the writers took longer than the longest hold, 10ms: refused, and let go once held")))
		close(h.slow)
		g.Eventually(h.released).Should(Receive(), "let go as soon as the holder has it")
		g.Expect(h.isHolding()).To(BeFalse())
	})
	t.Run("one lease at a time", func(t *testing.T) {
		g := NewWithT(t)
		h := &holder{known: []string{"a"}, released: make(chan struct{}, 2)}
		path := serve(t, h, time.Minute)
		first, err := hold.Acquire(t.Context(), path, []string{"a"})
		g.Expect(err).NotTo(HaveOccurred())
		second := make(chan error, 1)
		go func() {
			lease, err := hold.Acquire(t.Context(), path, []string{"a"})
			if err == nil {
				_, err = lease.Release(t.Context())
			}
			second <- err
		}()
		g.Consistently(second, 50*time.Millisecond).ShouldNot(Receive(), "waits for the first lease")
		_, err = first.Release(t.Context())
		g.Expect(err).NotTo(HaveOccurred())
		g.Eventually(second).Should(Receive(BeNil()), "the holder never saw two holds at once")
	})
	t.Run("a holder's error reaches the client and nothing is held", func(t *testing.T) {
		g := NewWithT(t)
		h := &holder{err: errors.New("the VM vm-1 does not answer")}
		path := serve(t, h, time.Minute)
		_, err := hold.Acquire(t.Context(), path, []string{"a"})
		g.Expect(err).To(MatchError(ContainSubstring("the VM vm-1 does not answer")))
	})
	t.Run("no server", func(t *testing.T) {
		g := NewWithT(t)
		_, err := hold.Acquire(t.Context(), filepath.Join(t.TempDir(), hold.SocketName), []string{"a"})
		g.Expect(err).To(MatchError(hold.ErrNoHolder))
	})
}

func TestSocketBeside(t *testing.T) {
	g := NewWithT(t)
	g.Expect(hold.SocketBeside("unix:///var/lib/kubelet/plugins/pmem.csi.pvbridge.io/csi.sock")).
		To(Equal("/var/lib/kubelet/plugins/pmem.csi.pvbridge.io/hold.sock"))
	g.Expect(hold.SocketBeside("/csi/csi.sock")).To(Equal("/csi/hold.sock"))
}
