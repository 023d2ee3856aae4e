package controller

import (
	"fmt"
	"testing"
	"time"

	. "github.com/onsi/gomega"
)

func TestReadBudget(t *testing.T) {
	g := NewWithT(t)
	var b readBudget
	now := time.Now()
	allowed := 0
	for range 2 * liveReadsBurst {
		if b.allowAt("tenant-a/flooder", now) {
			allowed++
		}
	}
	g.Expect(allowed).To(Equal(liveReadsBurst), "one cluster's reads stop at its burst")
	g.Expect(b.allowAt("tenant-a/neighbour", now)).To(BeTrue(), "a neighbour's budget is its own")
	g.Expect(b.allowAt("tenant-b/flooder", now)).To(BeTrue(), "a cluster of the same name in another namespace has its own")
	g.Expect(b.allowAt("tenant-a/flooder", now.Add(time.Second/liveReadsPerSecond))).To(BeTrue(), "the budget refills")
}

func TestReadBudgetDropsIdleBuckets(t *testing.T) {
	g := NewWithT(t)
	var b readBudget
	start := time.Now()
	for i := range liveReadsKept - 1 {
		b.allowAt(fmt.Sprintf("idle-%d", i), start)
	}
	later := start.Add(time.Minute)
	for range liveReadsBurst {
		b.allowAt("busy", later)
	}
	g.Expect(b.buckets).To(HaveLen(liveReadsKept))

	b.allowAt("new", later)
	g.Expect(b.buckets).To(HaveLen(2), "the buckets that refilled are dropped, the busy one stays")
	g.Expect(b.buckets).To(HaveKey("busy"))
	g.Expect(b.allowAt("busy", later)).To(BeFalse(), "a busy bucket keeps what it spent")
}
