// Package budget keeps a token bucket per guest cluster for work that every tenant shares (the
// management apiserver's reads, changes of a disk's I/O limits): a cluster that spends its own
// budget does not spend its neighbours'.
package budget

import (
	"sync"
	"time"

	"golang.org/x/time/rate"
)

// kept bounds the buckets kept; past it, the full (idle) ones are dropped.
const kept = 1024

// Keyed holds a token bucket per key (a guest cluster: its namespace and name). A nil *Keyed
// allows everything.
type Keyed struct {
	limit rate.Limit
	burst int

	mu      sync.Mutex
	buckets map[string]*rate.Limiter
}

// New returns budgets of burst tokens each, refilled at perSecond.
func New(perSecond rate.Limit, burst int) *Keyed {
	return &Keyed{limit: perSecond, burst: burst, buckets: map[string]*rate.Limiter{}}
}

// Allow takes one token from the budget of key and reports whether there was one.
func (b *Keyed) Allow(key string) bool {
	return b.AllowAt(key, time.Now())
}

// AllowAt is Allow at the time now.
func (b *Keyed) AllowAt(key string, now time.Time) bool {
	if b == nil {
		return true
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	l := b.buckets[key]
	if l == nil {
		if len(b.buckets) >= kept {
			for k, other := range b.buckets {
				if other.TokensAt(now) >= float64(b.burst) {
					delete(b.buckets, k)
				}
			}
		}
		l = rate.NewLimiter(b.limit, b.burst)
		b.buckets[key] = l
	}
	return l.AllowN(now, 1)
}
