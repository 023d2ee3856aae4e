package budget

import (
	"fmt"
	"testing"
	"time"

	. "github.com/onsi/gomega"
)

func TestKeyed(t *testing.T) {
	g := NewWithT(t)
	b := New(5, 50)
	now := time.Now()
	allowed := 0
	for range 100 {
		if b.AllowAt("tenant-a/flooder", now) {
			allowed++
		}
	}
	g.Expect(allowed).To(Equal(50), "one cluster's budget stops at its burst")
	g.Expect(b.AllowAt("tenant-a/neighbour", now)).To(BeTrue(), "a neighbour's budget is its own")
	g.Expect(b.AllowAt("tenant-b/flooder", now)).To(BeTrue(), "a cluster of the same name in another namespace has its own")
	g.Expect(b.AllowAt("tenant-a/flooder", now.Add(time.Second/5))).To(BeTrue(), "the budget refills")
	g.Expect((*Keyed)(nil).AllowAt("tenant-a/flooder", now)).To(BeTrue(), "no budget allows everything")
}

func TestKeyedDropsIdleBuckets(t *testing.T) {
	g := NewWithT(t)
	b := New(5, 50)
	start := time.Now()
	for i := range kept - 1 {
		b.AllowAt(fmt.Sprintf("idle-%d", i), start)
	}
	later := start.Add(time.Minute)
	for range 50 {
		b.AllowAt("busy", later)
	}
	g.Expect(b.buckets).To(HaveLen(kept))

	b.AllowAt("new", later)
	g.Expect(b.buckets).To(HaveLen(2), "the buckets that refilled are dropped, the busy one stays")
	g.Expect(b.buckets).To(HaveKey("busy"))
	g.Expect(b.AllowAt("busy", later)).To(BeFalse(), "a busy bucket keeps what it spent")
}
