package replication

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"k8s.io/klog/v2"

	"pvbridge.io/mgmt-csi/internal/loop"
	"pvbridge.io/pkg/qsd"
)

// Names in a target's daemon and directory.
const (
	quorumNode = "quorum"
	// exportFile is the regular file over which the daemon mounts its FUSE export.
	exportFile = "disk"
	// deviceFile names the loop device over the export.
	deviceFile = "device"
	// controlSocket is the daemon's second QMP socket, for commands while a watch holds the
	// first.
	controlSocket = "ctl.sock"
	// reconnectDelay is how long, in seconds, a request to a replica whose server went away
	// waits for it to come back before it fails and the quorum goes on without that replica:
	// the stall a dead host costs a writer (docs/replication-research.md §6).
	reconnectDelay = 2
)

// Replica is one replica a target writes to: on this host, its Device; on another host, the
// Address of that host's Server, which exports it as Name.
type Replica struct {
	Name    string
	Device  string
	Address string
}

func (r Replica) local() bool { return r.Device != "" }

// Targets runs the targets of the replicated volumes attached to this host, and, once started
// (Start), watches them.
type Targets struct {
	// RunDir holds a directory per target, named after its volume; it must be short, since
	// the daemons' QMP sockets are in it.
	RunDir string
	// KeysDir is the directory of the keys file, keys.psk, whose PSKUser key the replica
	// servers accept.
	KeysDir string
	// Faulted is told of each replica that a target's quorum gave up on, once it is out of the
	// quorum for good, and why.
	Faulted func(ctx context.Context, replica, why string) error
	// Placement is where the targets' daemons run on the host.
	Placement qsd.Placement
	// StallBound is how long a target's requests may be in flight without one completing
	// before the replicas that did not answer are cut off (stall.go); zero: DefaultStallBound.
	StallBound time.Duration

	mu       sync.Mutex
	ctx      context.Context // of the watches, once started
	watching map[string]bool // volume IDs
}

func (t *Targets) dir(volumeID string) qsd.Dir { return qsd.Dir(filepath.Join(t.RunDir, volumeID)) }

// Open brings up the target of volumeID over replicas, unless it runs, and returns the loop
// device over its export: the volume's disk on this host. A write through the device is
// acknowledged once every replica has it, and reads come from the first replica, which is the
// local one when this host holds one. Open does not change the replicas of a target that
// runs.
func (t *Targets) Open(ctx context.Context, volumeID string, replicas []Replica) (string, error) {
	if len(replicas) == 0 {
		return "", fmt.Errorf("the target of volume %s needs a replica", volumeID)
	}
	dd := t.dir(volumeID)
	pid, err := qsd.Pid(dd)
	if err != nil {
		return "", err
	}
	if pid == 0 {
		// What a daemon that died left: its loop device, its export's mount.
		if err := t.clear(ctx, dd); err != nil {
			return "", err
		}
		args, err := t.args(dd, replicas)
		if err != nil {
			return "", err
		}
		if err := os.MkdirAll(string(dd), 0o700); err != nil {
			return "", fmt.Errorf("create the target's directory: %w", err)
		}
		if err := os.WriteFile(dd.Path(exportFile), nil, 0o600); err != nil {
			return "", fmt.Errorf("create the target's export file: %w", err)
		}
		if err := os.WriteFile(dd.Path(replicasFile), []byte(names(ordered(replicas))), 0o600); err != nil {
			return "", fmt.Errorf("record the target's replicas: %w", err)
		}
		if err := t.Placement.Start(ctx, dd, args...); err != nil {
			return "", fmt.Errorf("start the target of volume %s: %w", volumeID, err)
		}
		klog.FromContext(ctx).Info("Started target", "volumeID", volumeID, "replicas", len(replicas))
	}
	t.watch(volumeID)
	dev, err := loopOf(dd)
	if err != nil || dev != "" {
		return dev, err
	}
	// Not with direct I/O: QEMU 7.2's FUSE export corrupts concurrent writes, which a loop
	// device with direct I/O sends (vm-operator's throttled disks, attachLoop, say more).
	if dev, err = loop.Attach(dd.Path(exportFile)); err != nil {
		return "", err
	}
	if err := os.WriteFile(dd.Path(deviceFile), []byte(dev), 0o600); err != nil {
		return "", fmt.Errorf("record the target's loop device: %w", err)
	}
	return dev, nil
}

// loopOf returns the loop device over the export of the target of dd, "" if there is none:
// the one its directory names while that is still over the export (one sysfs read; kubelet
// asks for a staged volume's device every minute), else found among every loop device.
func loopOf(dd qsd.Dir) (string, error) {
	file := dd.Path(exportFile)
	if data, err := os.ReadFile(dd.Path(deviceFile)); err == nil && loop.Backing(string(data)) == file {
		return string(data), nil
	}
	attached, err := loop.Attachments()
	if err != nil {
		return "", err
	}
	if devs := attached[file]; len(devs) > 0 {
		return devs[0], nil
	}
	return "", nil
}

// ordered returns replicas with the local one first: the quorum reads from it.
func ordered(replicas []Replica) []Replica {
	replicas = slices.Clone(replicas)
	slices.SortStableFunc(replicas, func(a, b Replica) int {
		switch {
		case a.local() == b.local():
			return 0
		case a.local():
			return -1
		}
		return 1
	})
	return replicas
}

// names lists the replicas' names, a line each.
func names(replicas []Replica) string {
	var b strings.Builder
	for _, r := range replicas {
		b.WriteString(r.Name + "\n")
	}
	return b.String()
}

// args are the daemon's options for a target over replicas: a node per replica (replica<i>,
// child i of the quorum), the local one first, a quorum over them, and its FUSE export.
func (t *Targets) args(dd qsd.Dir, replicas []Replica) ([]string, error) {
	replicas = ordered(replicas)
	var children []string
	args := []string{
		// A second monitor for commands (Rebuild): the watch holds the first for its events.
		"--chardev", "socket,id=ctl,server=on,wait=off,path=" + qsd.OptValue(dd.Path(controlSocket)), "--monitor", "chardev=ctl",
		// The key of the replica servers, for the remote replicas and those a rebuild adds.
		"--object", "tls-creds-psk,id=tls,endpoint=client,username=" + PSKUser + ",dir=" + qsd.OptValue(t.KeysDir),
	}
	for i, r := range replicas {
		node := "replica" + strconv.Itoa(i)
		children = append(children, "children."+strconv.Itoa(i)+"="+node)
		if r.local() {
			// No lock: the host's replica server exports the same device to other hosts.
			args = append(args, "--blockdev", "driver=host_device,node-name="+node+",cache.direct=on,locking=off,filename="+qsd.OptValue(r.Device))
			continue
		}
		opts, err := nbdNode(node, r)
		if err != nil {
			return nil, err
		}
		arg, err := json.Marshal(opts)
		if err != nil {
			return nil, err
		}
		args = append(args, "--blockdev", string(arg))
	}
	// vote-threshold=1: one replica that has a write is enough to go on when the others fail,
	// but a write is acknowledged only once every replica has answered. read-pattern=fifo:
	// reads come from the first replica that answers them, in order, without a vote.
	args = append(args,
		"--blockdev", "driver=quorum,node-name="+quorumNode+","+strings.Join(children, ",")+",vote-threshold=1,read-pattern=fifo",
		"--export", "type=fuse,id=export,node-name="+quorumNode+",writable=on,mountpoint="+qsd.OptValue(dd.Path(exportFile)),
	)
	return args, nil
}

// nbdNode is the block node, named node, of remote replica r: an NBD client of its server, with
// the servers' key, that waits reconnectDelay for a server that went away.
func nbdNode(node string, r Replica) (map[string]any, error) {
	host, port, err := net.SplitHostPort(r.Address)
	if err != nil {
		return nil, fmt.Errorf("address %q of replica %s: %w", r.Address, r.Name, err)
	}
	return map[string]any{
		"driver": "nbd", "node-name": node, "server": map[string]any{"type": "inet", "host": host, "port": port},
		"export": r.Name, "tls-creds": "tls", "reconnect-delay": reconnectDelay,
	}, nil
}

// Running lists the volumes whose targets run on this host.
func (t *Targets) Running() ([]string, error) {
	entries, err := os.ReadDir(t.RunDir)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("list the targets: %w", err)
	}
	var ids []string
	for _, e := range entries {
		if pid, err := qsd.Pid(t.dir(e.Name())); err == nil && pid != 0 {
			ids = append(ids, e.Name())
		}
	}
	return ids, nil
}

// Device returns the loop device of the target of volumeID; "" if it does not run.
func (t *Targets) Device(volumeID string) (string, error) {
	dd := t.dir(volumeID)
	pid, err := qsd.Pid(dd)
	if err != nil || pid == 0 {
		return "", err
	}
	return loopOf(dd)
}

// Close takes the target of volumeID down: its loop device (loop.ErrInUse while it is
// mounted or open), then its daemon, which flushes every replica as it exits.
func (t *Targets) Close(ctx context.Context, volumeID string) error {
	if err := t.clear(ctx, t.dir(volumeID)); err != nil {
		return fmt.Errorf("close the target of volume %s: %w", volumeID, err)
	}
	return nil
}

// clear removes what a target of dd has on the host, in this order: the loop devices over its
// export, the daemon, the export's mount that a killed daemon left, and the directory.
func (t *Targets) clear(ctx context.Context, dd qsd.Dir) error {
	if _, err := os.Stat(string(dd)); errors.Is(err, os.ErrNotExist) {
		return nil // no target (a loop device over its export is detached before it goes)
	}
	file := dd.Path(exportFile)
	attached, err := loop.Attachments()
	if err != nil {
		return err
	}
	for _, dev := range attached[file] {
		if err := loop.Detach(ctx, dev); err != nil {
			return err
		}
	}
	if err := t.Placement.Stop(ctx, dd); err != nil {
		return err
	}
	if err := qsd.UnmountAll(file); err != nil {
		return err
	}
	if err := os.RemoveAll(string(dd)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove the target's directory: %w", err)
	}
	return nil
}
