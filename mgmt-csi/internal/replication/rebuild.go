package replication

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"

	"k8s.io/klog/v2"

	"pvbridge.io/pkg/qsd"
)

// A rebuild gives a running target a new replica and copies the volume into it while writes go
// on (docs/replication-research.md §6; 7.2 refuses a mirror of a quorum under a writable FUSE
// export): the new replica's NBD node joins the quorum, so that every write from then on
// reaches it, and a full backup of the quorum into a second NBD node of the same export copies
// the rest. The backup's copy-before-write copies a region's old data before a write to it goes
// through the quorum, so the new replica ends with the volume as it is.

// rebuiltFile, in a target's directory, names the replicas whose rebuild finished, a line each.
const rebuiltFile = "rebuilt"

// ErrNotServed is Rebuild's error for a volume whose target does not run on this host.
var ErrNotServed = errors.New("the volume's target does not run on this host")

// Rebuild adds replica r, a remote one whose server exports it, to the running target of
// volumeID and copies the volume into it; it returns once the copy is done, from when on r has
// every write the volume acknowledges. Calling it again for the same replica waits for a copy
// in progress, or does nothing once it is done, or copies again one that was interrupted.
func (t *Targets) Rebuild(ctx context.Context, volumeID string, r Replica) error {
	if r.local() {
		return fmt.Errorf("replica %s: a rebuild copies into a remote replica", r.Name)
	}
	dd := t.dir(volumeID)
	if pid, err := qsd.Pid(dd); err != nil {
		return err
	} else if pid == 0 {
		return ErrNotServed
	}
	log := klog.FromContext(ctx).WithValues("volumeID", volumeID, "replica", r.Name)
	if done, err := lines(dd.Path(rebuiltFile)); err != nil || slices.Contains(done, r.Name) {
		return err
	}
	q, err := qsd.DialSocket(ctx, dd.Path(controlSocket))
	if err != nil {
		return fmt.Errorf("rebuild replica %s of volume %s: %w", r.Name, volumeID, err)
	}
	defer q.Close()

	// Into the quorum, recorded first so that the watch knows the child the quorum may report.
	names, err := lines(dd.Path(replicasFile))
	if err != nil {
		return err
	}
	i := slices.Index(names, r.Name)
	if i < 0 {
		i = len(names)
		if err := appendLine(dd.Path(replicasFile), r.Name); err != nil {
			return err
		}
	}
	// The copy's NBD node and its backup job share a name.
	node, copyNode := "replica"+strconv.Itoa(i), "rebuild"+strconv.Itoa(i)
	graph, err := blockGraph(q)
	if err != nil {
		return err
	}
	if _, in := graph.child(quorumNode, node); !in {
		if err := addNBD(q, graph, node, r); err != nil {
			return err
		}
		if err := q.Execute("x-blockdev-change", map[string]any{"parent": quorumNode, "node": node}, nil); err != nil {
			return err
		}
		log.Info("Added a replica to the target's quorum")
	}

	// The copy: a job of this name that runs is awaited, otherwise one is started.
	var jobs []struct {
		ID string `json:"device"` // the job's ID, when it has one
	}
	if err := q.Execute("query-block-jobs", nil, &jobs); err != nil {
		return err
	}
	running := false
	for _, j := range jobs {
		running = running || j.ID == copyNode
	}
	if !running {
		if err := addNBD(q, graph, copyNode, r); err != nil {
			return err
		}
		if err := q.Execute("blockdev-backup", map[string]any{
			"job-id": copyNode, "device": quorumNode, "target": copyNode, "sync": "full", "auto-dismiss": true,
		}, nil); err != nil {
			return err
		}
		log.Info("Copying the volume into the replica")
	}
	if err := awaitJob(q, copyNode); err != nil {
		return fmt.Errorf("copy volume %s into replica %s: %w", volumeID, r.Name, err)
	}
	if err := q.Execute("blockdev-del", map[string]any{"node-name": copyNode}, nil); err != nil {
		return err
	}
	log.Info("Rebuilt the replica")
	return appendLine(dd.Path(rebuiltFile), r.Name)
}

// Retire takes replica name out of the running target of volumeID, as a drain does once other
// replicas took its place: the quorum, drained of its requests first, stops writing to it and
// reading from it (the next replica serves reads), and its block node is deleted, which closes
// its connection to its server, or its device. Done when it is out already; ErrNotServed when
// the target does not run on this host.
func (t *Targets) Retire(ctx context.Context, volumeID, name string) error {
	dd := t.dir(volumeID)
	if pid, err := qsd.Pid(dd); err != nil {
		return err
	} else if pid == 0 {
		return ErrNotServed
	}
	names, err := lines(dd.Path(replicasFile))
	if err != nil {
		return err
	}
	i := slices.Index(names, name)
	if i < 0 {
		return nil
	}
	q, err := qsd.DialSocket(ctx, dd.Path(controlSocket))
	if err != nil {
		return fmt.Errorf("retire replica %s of volume %s: %w", name, volumeID, err)
	}
	defer q.Close()
	node := "replica" + strconv.Itoa(i)
	graph, err := blockGraph(q)
	if err != nil {
		return err
	}
	if !graph.has(node) {
		return nil
	}
	if child, in := graph.child(quorumNode, node); in {
		if err := q.Execute("x-blockdev-change", map[string]any{"parent": quorumNode, "child": child}, nil); err != nil {
			return fmt.Errorf("take replica %s out of the quorum of volume %s: %w", name, volumeID, err)
		}
	}
	if err := q.Execute("blockdev-del", map[string]any{"node-name": node}, nil); err != nil {
		return fmt.Errorf("close replica %s of volume %s: %w", name, volumeID, err)
	}
	klog.FromContext(ctx).Info("Took a replica out of the target", "volumeID", volumeID, "replica", name)
	return nil
}

// addNBD adds block node node, an NBD client of remote replica r, unless graph has it.
func addNBD(q *qsd.Conn, graph *graph, node string, r Replica) error {
	if graph.has(node) {
		return nil
	}
	opts, err := nbdNode(node, r)
	if err != nil {
		return err
	}
	return q.Execute("blockdev-add", opts, nil)
}

// awaitJob waits for the end of job (BLOCK_JOB_COMPLETED, or CANCELLED) and returns its error.
func awaitJob(q *qsd.Conn, job string) error {
	return q.Await(func(e qsd.Event) (bool, error) {
		if e.Event != "BLOCK_JOB_COMPLETED" && e.Event != "BLOCK_JOB_CANCELLED" {
			return false, nil
		}
		var done struct {
			Device string `json:"device"`
			Error  string `json:"error"`
		}
		if err := json.Unmarshal(e.Data, &done); err != nil {
			return true, fmt.Errorf("decode %s: %w", e.Event, err)
		}
		switch {
		case done.Device != job:
			return false, nil
		case e.Event == "BLOCK_JOB_CANCELLED":
			return true, errors.New("cancelled")
		case done.Error != "":
			return true, errors.New(done.Error)
		}
		return true, nil
	})
}

// graph is what x-debug-query-block-graph says of a daemon's block nodes: the nodes by id
// (block nodes are named), and the edges from parent to child, each named as the parent calls
// that child (a quorum's are children.<n>).
type graph struct {
	Nodes []struct {
		ID   int    `json:"id"`
		Name string `json:"name"`
	} `json:"nodes"`
	Edges []struct {
		Parent int    `json:"parent"`
		Child  int    `json:"child"`
		Name   string `json:"name"`
	} `json:"edges"`
}

func blockGraph(q *qsd.Conn) (*graph, error) {
	g := &graph{}
	if err := q.Execute("x-debug-query-block-graph", nil, g); err != nil {
		return nil, err
	}
	return g, nil
}

func (g *graph) id(name string) (int, bool) {
	for _, n := range g.Nodes {
		if n.Name == name {
			return n.ID, true
		}
	}
	return 0, false
}

func (g *graph) has(name string) bool {
	_, ok := g.id(name)
	return ok
}

// child returns the name under which node parent has node child, if it has it.
func (g *graph) child(parent, child string) (string, bool) {
	p, okp := g.id(parent)
	c, okc := g.id(child)
	if !okp || !okc {
		return "", false
	}
	for _, e := range g.Edges {
		if e.Parent == p && e.Child == c {
			return e.Name, true
		}
	}
	return "", false
}

// lines returns the lines of file; none if it does not exist.
func lines(file string) ([]string, error) {
	data, err := os.ReadFile(file)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	return strings.Fields(string(data)), nil
}

// appendLine appends line to file, synced.
func appendLine(file, line string) error {
	f, err := os.OpenFile(file, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600)
	if err != nil {
		return err
	}
	_, err = f.WriteString(line + "\n")
	if err == nil {
		err = f.Sync()
	}
	return errors.Join(err, f.Close())
}
