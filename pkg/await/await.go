// Package await lets a CSI call wait, by watch and never by polling, until an object in an
// informer cache satisfies a condition, bounded by the call's context. The driver registers
// Handler on its informers; a waiter re-evaluates its condition whenever an object with its key
// changes, so a wait costs nothing while nothing happens and ends as soon as the event arrives.
package await

import (
	"context"
	"sync"

	"k8s.io/apimachinery/pkg/api/meta"
	toolscache "k8s.io/client-go/tools/cache"
)

// Key names an object: its kind, namespace and name.
type Key struct {
	Kind, Namespace, Name string
}

// Hub fans informer events out to waiters.
type Hub struct {
	mu      sync.Mutex
	waiters map[Key]map[chan struct{}]struct{}
}

// NewHub returns a Hub with no waiters.
func NewHub() *Hub {
	return &Hub{waiters: map[Key]map[chan struct{}]struct{}{}}
}

// Handler returns the event handler to register on the informer of kind.
func (h *Hub) Handler(kind string) toolscache.ResourceEventHandler {
	notify := func(obj any) {
		if tomb, ok := obj.(toolscache.DeletedFinalStateUnknown); ok {
			obj = tomb.Obj
		}
		m, err := meta.Accessor(obj)
		if err != nil {
			return
		}
		h.notify(Key{Kind: kind, Namespace: m.GetNamespace(), Name: m.GetName()})
	}
	return toolscache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { notify(obj) },
		UpdateFunc: func(_, obj any) { notify(obj) },
		DeleteFunc: notify,
	}
}

// Notify wakes the waiters of key, as an event for it would; for changes a cache does not see.
func (h *Hub) Notify(key Key) { h.notify(key) }

func (h *Hub) notify(key Key) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for ch := range h.waiters[key] {
		select {
		case ch <- struct{}{}:
		default: // a wake-up is already pending
		}
	}
}

// Until evaluates done now and after every event for key until it reports true or an error,
// or ctx ends, in which case it returns ctx.Err(). done reads the cache; it runs in the
// caller's goroutine.
func (h *Hub) Until(ctx context.Context, key Key, done func() (bool, error)) error {
	ch := make(chan struct{}, 1)
	h.mu.Lock()
	if h.waiters[key] == nil {
		h.waiters[key] = map[chan struct{}]struct{}{}
	}
	h.waiters[key][ch] = struct{}{}
	h.mu.Unlock()
	defer func() {
		h.mu.Lock()
		delete(h.waiters[key], ch)
		if len(h.waiters[key]) == 0 {
			delete(h.waiters, key)
		}
		h.mu.Unlock()
	}()

	// Subscribed before the first evaluation, so no event between the two is lost.
	for {
		ok, err := done()
		if err != nil || ok {
			return err
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-ch:
		}
	}
}
