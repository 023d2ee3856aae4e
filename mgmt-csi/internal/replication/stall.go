package replication

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"
	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"pvbridge.io/pkg/qsd"
)

// A replica server that stops answering without closing its connections (a hung host, a
// network that drops every packet, a stopped process) stalls every write of the targets that
// write to it for as long as TCP keeps the connection, which is forever when the peer's kernel
// still acknowledges (a stopped process): QEMU 7.2's nbd client has no request timeout. So
// each target has a guard: it reads its loop device's counters, and once requests have been in
// flight for the stall bound without one completing, it destroys (SOCK_DESTROY) each of the
// daemon's TCP connections that last sent after it last received, that is, a request without
// its reply. The nbd client then fails the request once reconnectDelay has passed, the quorum
// reports the replica bad, and the watch faults it as it does a dead one
// (docs/replication-research.md §6).

// DefaultStallBound is how long a target's requests may be in flight without one completing
// before its guard gives up on the replicas that did not answer: well above a loaded host's
// slowest write, well below the minutes a stalled writer (a database, a journal) tolerates.
const DefaultStallBound = 15 * time.Second

func (t *Targets) stallBound() time.Duration {
	if t.StallBound > 0 {
		return t.StallBound
	}
	return DefaultStallBound
}

// guard watches the target of volumeID for stalls until ctx ends (its watch's).
func (t *Targets) guard(ctx context.Context, volumeID string) {
	bound := t.stallBound()
	tick := time.NewTicker(bound / 5)
	defer tick.Stop()
	var done uint64     // requests the loop device completed, when last read
	var since time.Time // since when done has not changed while requests were in flight
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		dd := t.dir(volumeID)
		pid, err := qsd.Pid(dd)
		if err == nil && pid == 0 {
			since = time.Time{}
			continue // between a daemon and the next: its watch decides
		}
		var dev string
		if err == nil {
			dev, err = loopOf(dd)
		}
		var c loopCounters
		if err == nil && dev != "" {
			c, err = readLoopCounters(dev)
		}
		if err != nil {
			klog.FromContext(ctx).Error(err, "Cannot read the target's progress")
			continue
		}
		now := time.Now()
		if c.inFlight == 0 || c.done != done || since.IsZero() {
			done, since = c.done, now
			continue
		}
		if now.Sub(since) < bound {
			continue
		}
		cut, err := cutUnanswered(pid)
		if err != nil {
			klog.FromContext(ctx).Error(err, "Cannot cut the connections of replicas that do not answer")
			continue
		}
		log := klog.FromContext(ctx)
		if cut == 0 {
			log = log.V(2) // still stalled on connections cut before, whose requests fail within reconnectDelay
		}
		log.Info("Requests were in flight without completing; cut the connections to replicas that did not answer",
			"inFlight", c.inFlight, "stalledFor", now.Sub(since).Round(time.Second), "connections", cut)
		since = now
	}
}

// loopCounters are what a loop device's stat says of its progress.
type loopCounters struct {
	done     uint64 // requests completed: reads, writes, discards and flushes
	inFlight uint64
}

// readLoopCounters reads /sys/block/<dev>/stat (Documentation/block/stat.rst): reads, writes,
// in flight, discards (kernel 4.18), flushes (5.5).
func readLoopCounters(dev string) (loopCounters, error) {
	data, err := os.ReadFile(filepath.Join("/sys/block", filepath.Base(dev), "stat"))
	if err != nil {
		return loopCounters{}, err
	}
	return parseLoopCounters(string(data))
}

func parseLoopCounters(stat string) (loopCounters, error) {
	fields := strings.Fields(stat)
	if len(fields) < 11 {
		return loopCounters{}, fmt.Errorf("a block device's stat of %d fields: %q", len(fields), stat)
	}
	value := func(i int) (uint64, error) {
		if i >= len(fields) {
			return 0, nil
		}
		return strconv.ParseUint(fields[i], 10, 64)
	}
	var c loopCounters
	var err error
	for _, i := range []int{0, 4, 11, 15} {
		v, verr := value(i)
		c.done += v
		err = errors.Join(err, verr)
	}
	c.inFlight, _ = value(8)
	if err != nil {
		return loopCounters{}, fmt.Errorf("a block device's stat %q: %w", stat, err)
	}
	return c, nil
}

// cutUnanswered destroys the established TCP connections of process pid that last received
// before they last sent (a request awaits its reply), and returns how many it destroyed.
func cutUnanswered(pid int) (int, error) {
	inodes, err := socketInodes(pid)
	if err != nil {
		return 0, err
	}
	cut := 0
	for _, family := range []uint8{unix.AF_INET, unix.AF_INET6} {
		socks, err := netlink.SocketDiagTCPInfo(family)
		if err != nil && !errors.Is(err, netlink.ErrDumpInterrupted) {
			return cut, fmt.Errorf("list the host's TCP connections: %w", err)
		}
		for _, s := range socks {
			m, info := s.InetDiagMsg, s.TCPInfo
			if m == nil || info == nil || !inodes[uint64(m.INode)] || m.State != unix.BPF_TCP_ESTABLISHED ||
				info.Last_data_recv <= info.Last_data_sent {
				continue
			}
			if err := destroy(family, m.ID); err != nil {
				return cut, fmt.Errorf("destroy the connection %s:%d → %s:%d: %w", m.ID.Source, m.ID.SourcePort, m.ID.Destination, m.ID.DestinationPort, err)
			}
			cut++
		}
	}
	return cut, nil
}

// socketInodes returns the inodes of the sockets process pid has open.
func socketInodes(pid int) (map[uint64]bool, error) {
	dir := filepath.Join("/proc", strconv.Itoa(pid), "fd")
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	inodes := map[uint64]bool{}
	for _, e := range entries {
		link, err := os.Readlink(filepath.Join(dir, e.Name()))
		if err != nil {
			continue // closed since
		}
		if v, ok := strings.CutPrefix(link, "socket:["); ok {
			if n, err := strconv.ParseUint(strings.TrimSuffix(v, "]"), 10, 64); err == nil {
				inodes[n] = true
			}
		}
	}
	return inodes, nil
}

// destroy destroys the TCP socket id (SOCK_DESTROY, as `ss -K` does; the kernel needs
// CONFIG_INET_DIAG_DESTROY, the caller CAP_NET_ADMIN): its owner's next and pending calls
// fail with ECONNABORTED.
func destroy(family uint8, id netlink.SocketID) error {
	req := nl.NewNetlinkRequest(nl.SOCK_DESTROY, unix.NLM_F_ACK)
	req.AddData(&destroyRequest{family: family, id: id})
	_, err := req.Execute(unix.NETLINK_INET_DIAG, 0)
	return err
}

// destroyRequest is a struct inet_diag_req_v2 naming one TCP socket.
type destroyRequest struct {
	family uint8
	id     netlink.SocketID
}

func (r *destroyRequest) Len() int { return 56 }

func (r *destroyRequest) Serialize() []byte {
	b := make([]byte, r.Len())
	b[0], b[1] = r.family, unix.IPPROTO_TCP
	binary.NativeEndian.PutUint32(b[4:], 1<<unix.BPF_TCP_ESTABLISHED)
	binary.BigEndian.PutUint16(b[8:], r.id.SourcePort)
	binary.BigEndian.PutUint16(b[10:], r.id.DestinationPort)
	addr := func(ip []byte) []byte {
		if r.family == unix.AF_INET {
			return ip[len(ip)-4:]
		}
		return ip
	}
	copy(b[12:28], addr(r.id.Source.To16()))
	copy(b[28:44], addr(r.id.Destination.To16()))
	binary.NativeEndian.PutUint32(b[44:], r.id.Interface)
	binary.NativeEndian.PutUint32(b[48:], r.id.Cookie[0])
	binary.NativeEndian.PutUint32(b[52:], r.id.Cookie[1])
	return b
}
