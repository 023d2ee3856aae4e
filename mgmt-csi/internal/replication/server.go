// Package replication is the data path of replicated volumes, on QEMU's block layer
// (docs/design.md, "Replicated volumes"). Each host that holds replicas runs a Server: one
// qemu-storage-daemon with an NBD server that exports every replica of the host. Each host
// that a replicated volume is attached to runs a Target for it: a qemu-storage-daemon whose
// quorum writes to every replica (the local one directly, the others over NBD), exported as
// FUSE, with a loop device over the export that the host hands to the VM or the pod.
//
// Both daemons outlive the agent (package qsd); everything here is idempotent, so a restarted
// agent calls the same methods again and finds what runs.
package replication

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"

	"k8s.io/klog/v2"

	"pvbridge.io/pkg/qsd"
)

// PSKUser is the user of the pre-shared key with which targets connect to replica servers:
// the keys file of both holds a line "pvbridge:<hexadecimal key>". QEMU 7.2's NBD server does
// not check the user against an authorization list (docs/replication-research.md §6), so the
// key itself is the secret: only the hosts' agents hold it, never a guest.
const PSKUser = "pvbridge"

// Server is the replica server of a host.
type Server struct {
	// Dir is the daemon's directory.
	Dir qsd.Dir
	// Address is the host:port the NBD server listens on, reachable from the other hosts and
	// not from guests.
	Address string
	// KeysDir is the directory of the keys file, keys.psk, whose key clients must prove.
	KeysDir string
	// Placement is where the daemon runs on the host.
	Placement qsd.Placement
}

// Export exports the block device as name, starting the server if it does not run. Exporting
// again what is exported already changes nothing.
func (s *Server) Export(ctx context.Context, name, device string) error {
	q, err := s.connect(ctx)
	if err != nil {
		return err
	}
	defer q.Close()
	exports, err := exports(q)
	if err != nil || slices.Contains(exports, name) {
		return err
	}
	// A node left by an export whose deletion was cut short.
	if err := deleteNode(q, name); err != nil {
		return err
	}
	if err := q.Execute("blockdev-add", map[string]any{
		"driver": "host_device", "node-name": nodeName(name), "filename": device,
		// What a target wrote is on the device when it is acknowledged. No lock: the host's
		// target may open the device as its local replica too (one writer, see Target).
		"cache": map[string]any{"direct": true}, "locking": "off",
	}, nil); err != nil {
		return fmt.Errorf("open replica %s: %w", name, err)
	}
	if err := q.Execute("block-export-add", map[string]any{
		"type": "nbd", "id": name, "node-name": nodeName(name), "name": name, "writable": true,
	}, nil); err != nil {
		return fmt.Errorf("export replica %s: %w", name, err)
	}
	klog.FromContext(ctx).V(2).Info("Exported replica", "replica", name, "device", device, "address", s.Address)
	return nil
}

// Unexport ends the export name, dropping its clients, and closes its device. It is done when
// the server does not run.
func (s *Server) Unexport(ctx context.Context, name string) error {
	q, err := s.running(ctx)
	if err != nil || q == nil {
		return err
	}
	defer q.Close()
	err = q.Execute("block-export-del", map[string]any{"id": name, "mode": "hard"}, nil)
	if err != nil && !isNotFound(err) {
		return fmt.Errorf("end the export of replica %s: %w", name, err)
	}
	// The export goes once its clients are gone, asynchronously, and says so in an event.
	for {
		exports, err := exports(q)
		if err != nil {
			return err
		}
		if !slices.Contains(exports, name) {
			return deleteNode(q, name)
		}
		if err := deleted(q, name); err != nil {
			return fmt.Errorf("wait for the export of replica %s to end: %w", name, err)
		}
	}
}

// deleted waits for the event that says the export name is gone.
func deleted(q *qsd.Conn, name string) error {
	return q.Await(func(e qsd.Event) (bool, error) {
		var data struct {
			ID string `json:"id"`
		}
		return e.Event == "BLOCK_EXPORT_DELETED" && json.Unmarshal(e.Data, &data) == nil && data.ID == name, nil
	})
}

// Exports lists the names the server exports; none when it does not run.
func (s *Server) Exports(ctx context.Context) ([]string, error) {
	q, err := s.running(ctx)
	if err != nil || q == nil {
		return nil, err
	}
	defer q.Close()
	return exports(q)
}

// Exported reports whether the server runs and exports name.
func (s *Server) Exported(ctx context.Context, name string) (bool, error) {
	exports, err := s.Exports(ctx)
	return slices.Contains(exports, name), err
}

// running returns a connection to the server; nil when it does not run.
func (s *Server) running(ctx context.Context) (*qsd.Conn, error) {
	pid, err := qsd.Pid(s.Dir)
	if err != nil || pid == 0 {
		return nil, err
	}
	return qsd.Dial(ctx, s.Dir)
}

// Stop stops the server, which ends every export.
func (s *Server) Stop(ctx context.Context) error { return s.Placement.Stop(ctx, s.Dir) }

// connect returns a connection to the server, which it starts if it does not run.
func (s *Server) connect(ctx context.Context) (*qsd.Conn, error) {
	pid, err := qsd.Pid(s.Dir)
	if err != nil {
		return nil, err
	}
	if pid == 0 {
		host, port, err := net.SplitHostPort(s.Address)
		if err != nil {
			return nil, fmt.Errorf("replica server address %q: %w", s.Address, err)
		}
		if err := s.Placement.Start(ctx, s.Dir,
			"--object", "tls-creds-psk,id=tls,endpoint=server,dir="+qsd.OptValue(s.KeysDir),
			"--nbd-server", "addr.type=inet,addr.host="+qsd.OptValue(host)+",addr.port="+port+",tls-creds=tls",
		); err != nil {
			return nil, err
		}
		klog.FromContext(ctx).Info("Started the replica server", "address", s.Address, "dir", string(s.Dir))
	}
	return qsd.Dial(ctx, s.Dir)
}

// exports lists the ids of the daemon's exports (each is the replica's name).
func exports(q *qsd.Conn) ([]string, error) {
	var list []struct {
		ID string `json:"id"`
	}
	if err := q.Execute("query-block-exports", nil, &list); err != nil {
		return nil, err
	}
	ids := make([]string, 0, len(list))
	for _, e := range list {
		ids = append(ids, e.ID)
	}
	return ids, nil
}

// nodeName is the name of the block node of the replica name: QEMU's node names have at most
// 31 characters, export names (and ids) are longer.
func nodeName(name string) string {
	sum := sha256.Sum256([]byte(name))
	return "replica-" + hex.EncodeToString(sum[:])[:20]
}

// deleteNode closes the block node of the replica name, if the daemon has it.
func deleteNode(q *qsd.Conn, name string) error {
	err := q.Execute("blockdev-del", map[string]any{"node-name": nodeName(name)}, nil)
	if err != nil && !isNotFound(err) {
		return fmt.Errorf("close replica %s: %w", name, err)
	}
	return nil
}

// isNotFound reports whether err is QEMU's answer about an export or node it does not have.
// QEMU 7.2 answers both with a GenericError ("Export 'x' is not found", "Failed to find node
// with node-name='x'").
func isNotFound(err error) bool {
	var cerr *qsd.CommandError
	if !errors.As(err, &cerr) {
		return false
	}
	return cerr.Class == "DeviceNotFound" || strings.Contains(cerr.Desc, "is not found") || strings.Contains(cerr.Desc, "Failed to find node")
}
