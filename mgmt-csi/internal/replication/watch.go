package replication

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"time"

	"k8s.io/klog/v2"

	"pvbridge.io/pkg/qsd"
)

// A replica that fails a request of the target's quorum (its server died, or the network to
// it stayed down longer than reconnectDelay) missed a write, or will. The quorum goes on
// without it, but keeps it as a child: if its server answered again, the nbd client would
// reconnect and the replica would get later writes but not the missed ones, and serve the
// stale ones to reads. So the target's agent watches each quorum's QUORUM_REPORT_BAD events,
// takes the replica out of the quorum (x-blockdev-change) and reports it faulted.

// replicasFile, in a target's directory, names its replicas in the order of its quorum's
// children (replica<i> is the i-th line).
const replicasFile = "replicas"

// watchRetry is how soon a watch whose connection broke connects again, while the daemon runs.
const watchRetry = time.Second

// Start watches the targets that run, and those opened later, until ctx ends: it is a
// controller-runtime Runnable of the node agent.
func (t *Targets) Start(ctx context.Context) error {
	t.mu.Lock()
	t.ctx = ctx
	t.mu.Unlock()
	running, err := t.Running()
	if err != nil {
		return err
	}
	for _, id := range running {
		t.watch(id)
	}
	<-ctx.Done()
	return nil
}

// watch watches the target of volumeID, unless it is watched already or the watches have not
// started (Start watches every target that runs then).
func (t *Targets) watch(volumeID string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.ctx == nil || t.watching[volumeID] {
		return
	}
	if t.watching == nil {
		t.watching = map[string]bool{}
	}
	t.watching[volumeID] = true
	ctx := klog.NewContext(t.ctx, klog.FromContext(t.ctx).WithValues("volumeID", volumeID))
	go func() {
		guarded, stop := context.WithCancel(ctx)
		defer stop()
		go t.guard(guarded, volumeID)
		defer func() {
			t.mu.Lock()
			delete(t.watching, volumeID)
			t.mu.Unlock()
		}()
		for {
			err := t.watchOnce(ctx, volumeID)
			select {
			case <-ctx.Done():
				return
			case <-time.After(watchRetry):
			}
			if pid, perr := qsd.Pid(t.dir(volumeID)); perr == nil && pid == 0 {
				return // the target is gone (closed, or it died: the next stage starts it again)
			}
			klog.FromContext(ctx).Error(err, "Watching the target's replicas; connecting again")
		}
	}()
}

// watchOnce follows the events of the target of volumeID until its connection breaks.
func (t *Targets) watchOnce(ctx context.Context, volumeID string) error {
	dd := t.dir(volumeID)
	events, err := qsd.Dial(ctx, dd)
	if err != nil {
		return err
	}
	defer events.Close()
	dropped := map[int]bool{} // the quorum reports a child again for every request it failed
	for {
		e, err := events.NextEvent()
		if err != nil {
			return err
		}
		if e.Event != "QUORUM_REPORT_BAD" {
			continue
		}
		var bad struct {
			NodeName string `json:"node-name"`
			Type     string `json:"type"`
			Error    string `json:"error"`
		}
		if err := json.Unmarshal(e.Data, &bad); err != nil {
			return fmt.Errorf("decode %s: %w", e.Event, err)
		}
		// Read at every report: a rebuild adds replicas.
		names, err := lines(dd.Path(replicasFile))
		if err != nil {
			return fmt.Errorf("read the target's replicas: %w", err)
		}
		i, err := strconv.Atoi(strings.TrimPrefix(bad.NodeName, "replica"))
		if err != nil || i < 0 || i >= len(names) || dropped[i] {
			continue // not a replica of ours, or one out already
		}
		why := fmt.Sprintf("the target on this volume's node failed a %s on it: %s", bad.Type, bad.Error)
		if err := drop(events, bad.NodeName); err != nil {
			klog.FromContext(ctx).Error(err, "Cannot take a failed replica out of the quorum", "replica", names[i])
			continue
		}
		dropped[i] = true
		klog.FromContext(ctx).Info("Took a failed replica out of the quorum", "replica", names[i], "why", why)
		if t.Faulted != nil {
			if err := t.Faulted(ctx, names[i], why); err != nil {
				klog.FromContext(ctx).Error(err, "Cannot report a faulted replica", "replica", names[i])
			}
		}
	}
}

// drop takes block node node out of the quorum of the target q is connected to; done when it
// is out already. The quorum names its children by the order they joined (children.<n>, and
// a child that leaves last gives its number to the next), so the child is found by its node.
func drop(q *qsd.Conn, node string) error {
	g, err := blockGraph(q)
	if err != nil {
		return err
	}
	child, in := g.child(quorumNode, node)
	if !in {
		return nil
	}
	return q.Execute("x-blockdev-change", map[string]any{"parent": quorumNode, "child": child}, nil)
}
