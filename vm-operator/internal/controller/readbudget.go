package controller

import (
	"time"

	"pvbridge.io/pkg/budget"
)

// Each guest cluster's budget of API server reads that confirm a claim the cache does not show
// (or shows unbound). A well-behaved cluster needs such a read only for a claim bound a moment
// ago, once per new attach; a cluster that fills its VirtualMachines with entries for claims
// that do not exist would otherwise spend, with every status change, the operator's client
// rate limit (--kube-api-qps), which every tenant's attaches share.
const (
	liveReadsPerSecond = 5
	liveReadsBurst     = 50
	// unconfirmedRetry is how soon a reconcile that went by its cache for want of budget runs
	// again (the claim's own watch event usually comes first).
	unconfirmedRetry = time.Second
)

// newReadBudget returns the guest clusters' budgets of live reads, keyed by budgetKey.
func newReadBudget() *budget.Keyed {
	return budget.New(liveReadsPerSecond, liveReadsBurst)
}
