package pmem

import (
	"context"
	"fmt"
	"slices"
	"sync"
)

// keyLocks serializes the operations on one volume or snapshot while operations on others go
// on. An operation holds the keys of everything it reads or writes (a new volume and its
// source, a snapshot and its volume) for its whole length, data copy included. Keys are taken
// in sorted order, so two operations with overlapping keys cannot deadlock.
type keyLocks struct {
	mu sync.Mutex
	// held maps a held key to a channel closed when it is released.
	held map[string]chan struct{}
}

// lock takes keys, waiting at most until ctx ends, and returns the function that releases them.
func (k *keyLocks) lock(ctx context.Context, keys ...string) (func(), error) {
	keys = slices.Compact(slices.Sorted(slices.Values(keys)))
	var got []string
	release := func() {
		for _, key := range got {
			k.unlock(key)
		}
	}
	for _, key := range keys {
		if err := k.lockOne(ctx, key); err != nil {
			release()
			return nil, err
		}
		got = append(got, key)
	}
	return release, nil
}

func (k *keyLocks) lockOne(ctx context.Context, key string) error {
	for {
		k.mu.Lock()
		if k.held == nil {
			k.held = map[string]chan struct{}{}
		}
		released, busy := k.held[key]
		if !busy {
			k.held[key] = make(chan struct{})
			k.mu.Unlock()
			return nil
		}
		k.mu.Unlock()
		select {
		case <-released:
		case <-ctx.Done():
			return fmt.Errorf("wait for another operation on %s: %w", key, ctx.Err())
		}
	}
}

func (k *keyLocks) unlock(key string) {
	k.mu.Lock()
	released := k.held[key]
	delete(k.held, key)
	k.mu.Unlock()
	close(released)
}

func volumeKey(id string) string   { return "volume/" + id }
func snapshotKey(id string) string { return "snapshot/" + id }

// sourceKey is the key of src, "" without one.
func sourceKey(src *Source) string {
	switch {
	case src == nil:
		return ""
	case src.SnapshotID != "":
		return snapshotKey(src.SnapshotID)
	case src.VolumeID != "":
		return volumeKey(src.VolumeID)
	}
	return ""
}
