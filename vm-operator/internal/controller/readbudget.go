package controller

import (
	"sync"
	"time"

	"golang.org/x/time/rate"
)

// Each guest cluster's budget of API server reads that confirm a claim the cache does not show
// (or shows unbound). A well-behaved cluster needs such a read only for a claim bound a moment
// ago, once per new attach; a cluster that fills its VirtualMachines with entries for claims
// that do not exist would otherwise spend, with every status change, the operator's client
// rate limit (--kube-api-qps), which every tenant's attaches share.
const (
	liveReadsPerSecond = 5
	liveReadsBurst     = 50
	// liveReadsKept bounds the budgets kept; past it, the full (idle) ones are dropped.
	liveReadsKept = 1024
	// unconfirmedRetry is how soon a reconcile that went by its cache for want of budget runs
	// again (the claim's own watch event usually comes first).
	unconfirmedRetry = time.Second
)

// readBudget holds a token bucket per guest cluster (namespace and Cluster API cluster name).
// Its zero value is ready to use.
type readBudget struct {
	mu      sync.Mutex
	buckets map[string]*rate.Limiter
}

// allow takes one read from the budget of key and reports whether there was one. Without one,
// the caller goes by its cache and looks again after unconfirmedRetry.
func (b *readBudget) allow(key string) bool {
	return b.allowAt(key, time.Now())
}

func (b *readBudget) allowAt(key string, now time.Time) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.buckets == nil {
		b.buckets = map[string]*rate.Limiter{}
	}
	l := b.buckets[key]
	if l == nil {
		if len(b.buckets) >= liveReadsKept {
			for k, other := range b.buckets {
				if other.TokensAt(now) >= liveReadsBurst {
					delete(b.buckets, k)
				}
			}
		}
		l = rate.NewLimiter(liveReadsPerSecond, liveReadsBurst)
		b.buckets[key] = l
	}
	return l.AllowN(now, 1)
}
