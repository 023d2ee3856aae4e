package local

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"time"
)

// qmpConn is a connection to the QMP monitor of a disk's qemu-storage-daemon, for one command
// at a time. The qemu driver has a full client; this is the little the local driver needs, so
// that the two drivers stay apart.
type qmpConn struct {
	ctx  context.Context
	conn net.Conn
	dec  *json.Decoder
	stop func() bool
}

// dialQMP connects to the QMP socket at path and negotiates capabilities. Every read and
// write fails once ctx ends, so that a daemon that does not answer cannot hang the caller.
func dialQMP(ctx context.Context, path string) (*qmpConn, error) {
	var dialer net.Dialer
	conn, err := dialer.DialContext(ctx, "unix", path)
	if err != nil {
		return nil, fmt.Errorf("connect to the QMP socket of qemu-storage-daemon: %w", err)
	}
	q := &qmpConn{ctx: ctx, conn: conn, dec: json.NewDecoder(conn)}
	q.stop = context.AfterFunc(ctx, func() { _ = conn.SetDeadline(time.Now()) })
	var greeting struct {
		QMP json.RawMessage `json:"QMP"`
	}
	if err := q.dec.Decode(&greeting); err != nil {
		q.close()
		return nil, fmt.Errorf("read the QMP greeting of qemu-storage-daemon: %w", q.cause(err))
	}
	if greeting.QMP == nil {
		q.close()
		return nil, errors.New("read the QMP greeting of qemu-storage-daemon: not a QMP server")
	}
	if err := q.execute("qmp_capabilities", nil); err != nil {
		q.close()
		return nil, err
	}
	return q, nil
}

// execute runs command with arguments (nil for none) and waits for its reply, skipping the
// events that come before it; a QMP error reply is an error with QEMU's class and description.
func (q *qmpConn) execute(command string, arguments any) error {
	line, err := json.Marshal(struct {
		Execute   string `json:"execute"`
		Arguments any    `json:"arguments,omitempty"`
	}{command, arguments})
	if err != nil {
		return fmt.Errorf("qmp %s: %w", command, err)
	}
	if _, err := q.conn.Write(append(line, '\n')); err != nil {
		return fmt.Errorf("qmp %s: %w", command, q.cause(err))
	}
	for {
		var reply struct {
			Event  string          `json:"event"`
			Return json.RawMessage `json:"return"`
			Error  *struct {
				Class string `json:"class"`
				Desc  string `json:"desc"`
			} `json:"error"`
		}
		if err := q.dec.Decode(&reply); err != nil {
			return fmt.Errorf("qmp %s: %w", command, q.cause(err))
		}
		switch {
		case reply.Event != "":
			continue
		case reply.Error != nil:
			return fmt.Errorf("qmp %s: %s: %s", command, reply.Error.Class, reply.Error.Desc)
		}
		return nil
	}
}

// cause prefers the context's error over the I/O error that the deadline it set caused.
func (q *qmpConn) cause(err error) error {
	if q.ctx.Err() != nil {
		return context.Cause(q.ctx)
	}
	return err
}

func (q *qmpConn) close() {
	q.stop()
	_ = q.conn.Close()
}
