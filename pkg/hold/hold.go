// Package hold is how mgmt-csi's node agent has the writers of a host's volumes held while it
// cuts a group snapshot: the host's holder (the vm-operator host agent, which pauses the VMs'
// I/O to their disks) serves a unix socket beside mgmt-csi's CSI socket, and a cut takes a
// lease on it for the volumes of the group.
//
// A lease lasts as long as its connection: the client sends one request (the volume IDs), the
// server holds what it can and answers with the IDs it holds, and it lets go when the client
// sends a release, closes the connection or dies, or when the server's longest hold passes,
// whichever comes first. The answer to the release says how long the writers were held and
// whether the hold had expired before it: a cut that outlived its hold is not consistent. The
// longest hold bounds the holding itself too: a hold that takes longer is refused
// (ErrHoldOverrun), and let go once the holder has it.
//
// The server holds one lease at a time; a second client waits for the first to end.
package hold

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	"k8s.io/klog/v2"
)

// SocketName is the socket's file name, in the directory of mgmt-csi's node socket (both the
// host agent and mgmt-csi's node plugin mount that directory).
const SocketName = "hold.sock"

// SocketBeside returns the path of the hold socket beside the CSI socket csiSocket (a path or
// a unix:// endpoint).
func SocketBeside(csiSocket string) string {
	if len(csiSocket) > len("unix://") && csiSocket[:len("unix://")] == "unix://" {
		csiSocket = csiSocket[len("unix://"):]
	}
	return filepath.Join(filepath.Dir(csiSocket), SocketName)
}

// ErrNoHolder is returned when nothing serves the socket (no holder on this host, or it is not running).
var ErrNoHolder = errors.New("no holder serves the hold socket")

// ErrExpired is returned when the server let go before the release, after its longest hold.
var ErrExpired = errors.New("the hold expired before its release")

// Holder holds the writers of volumes.
type Holder interface {
	// Hold holds the writers of those of volumeIDs it knows (for a VM host: the disks of the
	// volumes attached to its VMs) and returns their IDs, and release, which lets them go. It
	// holds nothing when it returns an error.
	Hold(ctx context.Context, volumeIDs []string) (held []string, release func(context.Context) error, err error)
}

type request struct {
	VolumeIDs []string `json:"volumeIDs"`
}

type holdResponse struct {
	Held  []string `json:"held"`
	Error string   `json:"error,omitempty"`
	// Overrun: the holding took longer than the longest hold (ErrHoldOverrun).
	Overrun bool `json:"overrun,omitempty"`
}

type releaseResponse struct {
	HeldMillis int64  `json:"heldMillis"`
	Expired    bool   `json:"expired,omitempty"`
	Error      string `json:"error,omitempty"`
}

// Server serves a Holder on a unix socket.
type Server struct {
	Holder Holder
	// MaxHold is the longest a lease holds the writers; 0 means DefaultMaxHold.
	MaxHold time.Duration

	mu sync.Mutex // one lease at a time
}

// DefaultMaxHold bounds a hold when the server does not say: cutting a group by reflinks takes
// milliseconds a member, and a guest whose I/O stalls this long starts to time out.
const DefaultMaxHold = 10 * time.Second

// Listen listens on the unix socket path, replacing a stale socket a previous run left.
func Listen(path string) (net.Listener, error) {
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("remove stale hold socket %s: %w", path, err)
	}
	l, err := net.Listen("unix", path)
	if err != nil {
		return nil, fmt.Errorf("listen on hold socket %s: %w", path, err)
	}
	return l, nil
}

// Serve answers leases on l until ctx ends, then closes l.
func (s *Server) Serve(ctx context.Context, l net.Listener) error {
	go func() {
		<-ctx.Done()
		_ = l.Close()
	}()
	for {
		conn, err := l.Accept()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("accept on hold socket: %w", err)
		}
		go s.serve(ctx, conn)
	}
}

func (s *Server) serve(ctx context.Context, conn net.Conn) {
	defer func() { _ = conn.Close() }()
	log := klog.FromContext(ctx).WithName("hold")
	r := bufio.NewReader(conn)
	var req request
	if err := readLine(r, &req); err != nil {
		log.Error(err, "Reading a hold request")
		return
	}
	s.mu.Lock()
	locked := true
	unlock := func() {
		if locked {
			locked = false
			s.mu.Unlock()
		}
	}
	defer unlock()

	maxHold := s.MaxHold
	if maxHold <= 0 {
		maxHold = DefaultMaxHold
	}
	// The writers stall from the moment the holder starts holding them (a filesystem freeze
	// writes its dirty data back first): the lease's length counts from there, and bounds the
	// holding too. A hold that overruns it (a freeze writing back through a slow disk) is
	// refused at once and let go as soon as the holder has it (a freeze cannot be
	// interrupted), before the next lease.
	log.V(2).Info("Starting to hold writers", "volumeIDs", req.VolumeIDs, "maxHold", maxHold)
	start := time.Now()
	hctx, cancel := context.WithTimeout(ctx, maxHold)
	defer cancel()
	got := s.hold(hctx, req.VolumeIDs)
	var h holding
	select {
	case h = <-got:
	case <-hctx.Done():
		resp := holdResponse{Error: maxHold.String() + ": refused, and let go once held", Overrun: true}
		log.Error(ErrHoldOverrun, "Holding writers", "volumeIDs", req.VolumeIDs, "maxHold", maxHold)
		_ = writeLine(conn, resp)
		if h = <-got; h.err == nil {
			if err := h.release(context.WithoutCancel(ctx)); err != nil {
				log.Error(err, "Releasing writers held past the longest hold", "volumeIDs", h.held)
			}
			log.Info("Released writers held past the longest hold", "volumeIDs", h.held, "heldAfter", time.Since(start))
		}
		return
	}
	held, release, err := h.held, h.release, h.err
	if err != nil {
		log.Error(err, "Holding writers", "volumeIDs", req.VolumeIDs)
		_ = writeLine(conn, holdResponse{Error: err.Error()})
		return
	}
	log.V(2).Info("Holding writers", "volumeIDs", req.VolumeIDs, "held", held)
	if err := writeLine(conn, holdResponse{Held: held}); err != nil {
		log.Error(err, "Answering a hold")
	}

	// Wait for the release (any line) or the end of the connection, at most maxHold.
	done := make(chan struct{})
	go func() {
		_, _ = r.ReadString('\n')
		close(done)
	}()
	expired := false
	timer := time.NewTimer(maxHold - time.Since(start))
	defer timer.Stop()
	select {
	case <-done:
	case <-timer.C:
		expired = true
	case <-ctx.Done():
		expired = true
	}
	// Let go even when ctx has ended: a held VM must never stay held.
	relErr := release(context.WithoutCancel(ctx))
	heldFor := time.Since(start)
	unlock()
	log.V(2).Info("Released writers", "volumeIDs", held, "heldFor", heldFor, "expired", expired)
	if relErr != nil {
		log.Error(relErr, "Releasing writers", "volumeIDs", held)
	}
	if expired {
		<-done // the client's release or close
	}
	resp := releaseResponse{HeldMillis: heldFor.Milliseconds(), Expired: expired}
	if relErr != nil {
		resp.Error = relErr.Error()
	}
	_ = writeLine(conn, resp)
}

// ErrHoldOverrun is returned when holding the writers took longer than the longest hold.
var ErrHoldOverrun = errors.New("holding the writers took longer than the longest hold")

// holding is what a Holder's Hold returned.
type holding struct {
	held    []string
	release func(context.Context) error
	err     error
}

// hold asks the holder to hold the writers of volumeIDs and delivers what it did.
func (s *Server) hold(ctx context.Context, volumeIDs []string) <-chan holding {
	got := make(chan holding, 1)
	go func() {
		held, release, err := s.Holder.Hold(ctx, volumeIDs)
		got <- holding{held, release, err}
	}()
	return got
}

// Lease is a hold a client has.
type Lease struct {
	// Held lists the volumes whose writers the server holds.
	Held []string
	conn net.Conn
	r    *bufio.Reader
}

// Acquire asks the server on the socket path to hold the writers of volumeIDs and returns the
// lease once it does. ErrNoHolder when nothing serves the socket.
func Acquire(ctx context.Context, path string, volumeIDs []string) (*Lease, error) {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "unix", path)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) || errors.Is(err, syscall.ECONNREFUSED) {
			return nil, fmt.Errorf("%w (%s): %w", ErrNoHolder, path, err)
		}
		return nil, fmt.Errorf("dial hold socket %s: %w", path, err)
	}
	if deadline, ok := ctx.Deadline(); ok {
		_ = conn.SetDeadline(deadline)
	}
	stop := context.AfterFunc(ctx, func() { _ = conn.SetDeadline(time.Now()) })
	defer stop()
	l := &Lease{conn: conn, r: bufio.NewReader(conn)}
	var resp holdResponse
	err = writeLine(conn, request{VolumeIDs: volumeIDs})
	if err == nil {
		err = readLine(l.r, &resp)
	}
	switch {
	case err != nil:
	case resp.Overrun:
		err = fmt.Errorf("%w, %s", ErrHoldOverrun, resp.Error)
	case resp.Error != "":
		err = errors.New(resp.Error)
	}
	if err != nil {
		_ = conn.Close()
		return nil, fmt.Errorf("hold the writers of %v: %w", volumeIDs, err)
	}
	_ = conn.SetDeadline(time.Time{})
	l.Held = resp.Held
	return l, nil
}

// Release lets the writers go and returns how long they were held, from the start of the
// holding to the end of the letting go. ErrExpired when the server
// had let go before (the lease outlived its longest hold).
func (l *Lease) Release(ctx context.Context) (time.Duration, error) {
	defer func() { _ = l.conn.Close() }()
	if deadline, ok := ctx.Deadline(); ok {
		_ = l.conn.SetDeadline(deadline)
	}
	var resp releaseResponse
	_, err := io.WriteString(l.conn, "release\n")
	if err == nil {
		err = readLine(l.r, &resp)
	}
	if err != nil {
		return 0, fmt.Errorf("release the hold: %w", err)
	}
	heldFor := time.Duration(resp.HeldMillis) * time.Millisecond
	switch {
	case resp.Error != "":
		return heldFor, fmt.Errorf("release the hold: %s", resp.Error)
	case resp.Expired:
		return heldFor, fmt.Errorf("%w (after %s)", ErrExpired, heldFor)
	}
	return heldFor, nil
}

func writeLine(w io.Writer, v any) error {
	data, err := json.Marshal(v)
	if err != nil {
		return err
	}
	_, err = w.Write(append(data, '\n'))
	return err
}

func readLine(r *bufio.Reader, v any) error {
	line, err := r.ReadBytes('\n')
	if err != nil {
		return err
	}
	return json.Unmarshal(line, v)
}
