// Package keylock serializes operations per key (a volume ID, a target path) without making
// anyone wait: a second operation on a key that is held is refused, so that a CSI driver can
// answer it with ABORTED ("an operation for this volume is pending") and the CO retries later.
// The CSI spec lets a CO lose track of calls in flight after a restart and issue them again;
// refusing is safer and simpler than queueing behind a call that may take minutes.
package keylock

import "sync"

// Locks is a set of held keys. The zero value is ready to use; a Locks must not be copied after
// first use.
type Locks struct {
	mu   sync.Mutex
	held map[string]struct{}
}

// TryLock takes key and reports true, or reports false without waiting when key is held.
func (l *Locks) TryLock(key string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if _, ok := l.held[key]; ok {
		return false
	}
	if l.held == nil {
		l.held = make(map[string]struct{})
	}
	l.held[key] = struct{}{}
	return true
}

// Unlock releases key. Releasing a key that is not held panics: it is a bug in the caller, like
// unlocking an unlocked sync.Mutex.
func (l *Locks) Unlock(key string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if _, ok := l.held[key]; !ok {
		panic("keylock: unlock of unlocked key " + key)
	}
	delete(l.held, key)
}
