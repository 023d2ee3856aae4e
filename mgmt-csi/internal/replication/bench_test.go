package replication

import (
	"context"
	"crypto/rand"
	"fmt"
	"os"
	"slices"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"golang.org/x/sys/unix"

	"pvbridge.io/pkg/qsd"
)

// BenchmarkReplicatedWrites measures, in one run and against the same back end (loop devices
// over sparse files standing for each host's PMEM, replica servers on 127.0.0.1), what each
// replica costs a writer on the block device: a plain volume (its loop device, as a volume of
// one replica is served), then a target over 1, 2 and 3 replicas (the local one and NBD
// clients of the others, through the quorum, FUSE and the target's loop device). It prints
// the latency of a synced 4 KiB write (written then fsync'd, at random 4 KiB offsets) p50 and
// p99, the throughput of 64 MiB written in 1 MiB pieces and fsync'd, and the stall a writer
// sees when a replica's server is killed under it (the nbd client's reconnect delay, then the
// quorum goes on without the replica), and the throughput of a rebuild of the whole volume
// into a new replica on another host.
func BenchmarkReplicatedWrites(b *testing.B) {
	const size = 256 * mib
	g := NewWithT(b)
	for range b.N {
		s := newSandbox(b)
		local := s.replica(b, "a", size)
		remotes := []string{s.replica(b, "b", size), s.replica(b, "c", size)}
		var servers []*Server
		for i, dev := range remotes {
			srv := s.server(b, fmt.Sprintf("server-%d", i))
			g.Expect(srv.Export(b.Context(), "vol-"+string(rune('b'+i)), dev)).To(Succeed())
			servers = append(servers, srv)
		}
		targets := s.targets(b)
		open := func(n int) string {
			replicas := []Replica{{Name: "vol-a", Device: local}}
			for i := range n - 1 {
				replicas = append(replicas, Replica{Name: "vol-" + string(rune('b'+i)), Address: servers[i].Address})
			}
			dev, err := targets.Open(b.Context(), "vol", replicas)
			g.Expect(err).NotTo(HaveOccurred())
			return dev
		}
		measure(g, "plain", local)
		for n := 1; n <= 3; n++ {
			measure(g, fmt.Sprintf("%d_replicas", n), open(n))
			g.Expect(targets.Close(context.Background(), "vol")).To(Succeed())
		}
		stall := killedUnder(g, open(2), servers[0].Dir)
		fmt.Printf("BENCH replicated_kill_stall %.2f s\n", stall.Seconds())
		// The degraded volume gets a new replica: the whole volume copied over NBD.
		start := time.Now()
		g.Expect(targets.Rebuild(b.Context(), "vol", Replica{Name: "vol-c", Address: servers[1].Address})).To(Succeed())
		fmt.Printf("BENCH replicated_rebuild %.1f MB/s\n", float64(size)/time.Since(start).Seconds()/1e6)
		g.Expect(targets.Close(context.Background(), "vol")).To(Succeed())
	}
}

// measure prints the synced 4 KiB write latency and the sequential throughput of dev.
func measure(g Gomega, name, dev string) {
	f, err := os.OpenFile(dev, os.O_RDWR, 0)
	g.Expect(err).NotTo(HaveOccurred())
	defer f.Close()
	page := make([]byte, 4096)
	_, _ = rand.Read(page)
	var offsets [2]byte
	latencies := make([]time.Duration, 0, 300)
	for range cap(latencies) {
		_, _ = rand.Read(offsets[:])
		off := int64(offsets[0])<<8 | int64(offsets[1]) // one of 64 Ki pages: the first 256 MiB
		start := time.Now()
		_, err := f.WriteAt(page, off*4096)
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(f.Sync()).To(Succeed())
		latencies = append(latencies, time.Since(start))
	}
	slices.Sort(latencies)
	pct := func(p float64) float64 { return latencies[int(p*float64(len(latencies)-1))].Seconds() * 1000 }
	fmt.Printf("BENCH replicated_sync_write_4k_p50_%s %.2f ms\n", name, pct(0.5))
	fmt.Printf("BENCH replicated_sync_write_4k_p99_%s %.2f ms\n", name, pct(0.99))

	chunk := make([]byte, mib)
	_, _ = rand.Read(chunk)
	start := time.Now()
	for i := range int64(64) {
		_, err := f.WriteAt(chunk, i*mib)
		g.Expect(err).NotTo(HaveOccurred())
	}
	g.Expect(f.Sync()).To(Succeed())
	fmt.Printf("BENCH replicated_seq_write_%s %.1f MB/s\n", name, 64/time.Since(start).Seconds()*float64(mib)/1e6)
	g.Expect(unix.IoctlSetInt(int(f.Fd()), unix.BLKFLSBUF, 0)).To(Succeed())
}

// killedUnder kills the replica server of dd while a writer makes synced 4 KiB writes through
// dev, and returns the longest write.
func killedUnder(g Gomega, dev string, dd qsd.Dir) time.Duration {
	f, err := os.OpenFile(dev, os.O_RDWR, 0)
	g.Expect(err).NotTo(HaveOccurred())
	defer f.Close()
	page := make([]byte, 4096)
	var longest time.Duration
	for i := range int64(200) {
		if i == 20 {
			g.Expect(qsd.Kill(context.Background(), dd)).To(Succeed())
		}
		start := time.Now()
		_, err := f.WriteAt(page, i*4096)
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(f.Sync()).To(Succeed())
		longest = max(longest, time.Since(start))
	}
	return longest
}
