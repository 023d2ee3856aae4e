package qsd

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"time"
)

// Conn is a connection to the QMP monitor of a qemu-storage-daemon, for one command at a time.
// vm-operator's qemu driver has a full client for QEMU itself; this is the little that
// driving a daemon needs.
type Conn struct {
	ctx  context.Context
	conn net.Conn
	dec  *json.Decoder
	stop func() bool
	// events are those that came before a command's reply, for NextEvent.
	events []Event
}

// Dial connects to the QMP socket of the daemon of d and negotiates capabilities. Every read
// and write fails once ctx ends, so that a daemon that does not answer cannot hang the caller.
func Dial(ctx context.Context, d Dir) (*Conn, error) { return DialSocket(ctx, d.Path(SocketName)) }

// DialSocket connects to a QMP socket of a daemon at path, as Dial does: a daemon started with
// a second monitor (--chardev and --monitor in Start's args) serves one connection on each.
func DialSocket(ctx context.Context, path string) (*Conn, error) {
	var dialer net.Dialer
	conn, err := dialer.DialContext(ctx, "unix", path)
	if err != nil {
		return nil, fmt.Errorf("connect to the QMP socket of qemu-storage-daemon: %w", err)
	}
	q := &Conn{ctx: ctx, conn: conn, dec: json.NewDecoder(conn)}
	q.stop = context.AfterFunc(ctx, func() { _ = conn.SetDeadline(time.Now()) })
	var greeting struct {
		QMP json.RawMessage `json:"QMP"`
	}
	if err := q.dec.Decode(&greeting); err != nil {
		q.Close()
		return nil, fmt.Errorf("read the QMP greeting of qemu-storage-daemon: %w", q.cause(err))
	}
	if greeting.QMP == nil {
		q.Close()
		return nil, errors.New("read the QMP greeting of qemu-storage-daemon: not a QMP server")
	}
	if err := q.Execute("qmp_capabilities", nil, nil); err != nil {
		q.Close()
		return nil, err
	}
	return q, nil
}

// CommandError is a QMP error reply.
type CommandError struct {
	Command, Class, Desc string
}

func (e *CommandError) Error() string {
	return fmt.Sprintf("qmp %s: %s: %s", e.Command, e.Class, e.Desc)
}

// Execute runs command with arguments (nil for none) and waits for its reply, and decodes what
// it returns into reply unless that is nil. A QMP error reply is a *CommandError. Events that
// come before the reply are kept for NextEvent.
func (q *Conn) Execute(command string, arguments, reply any) error {
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
		var r struct {
			Event  string          `json:"event"`
			Data   json.RawMessage `json:"data"`
			Return json.RawMessage `json:"return"`
			Error  *struct {
				Class string `json:"class"`
				Desc  string `json:"desc"`
			} `json:"error"`
		}
		if err := q.dec.Decode(&r); err != nil {
			return fmt.Errorf("qmp %s: %w", command, q.cause(err))
		}
		switch {
		case r.Event != "":
			q.events = append(q.events, Event{Event: r.Event, Data: r.Data})
			continue
		case r.Error != nil:
			return &CommandError{Command: command, Class: r.Error.Class, Desc: r.Error.Desc}
		case reply != nil:
			if err := json.Unmarshal(r.Return, reply); err != nil {
				return fmt.Errorf("qmp %s: decode the reply: %w", command, err)
			}
		}
		return nil
	}
}

// Event is an asynchronous QMP event.
type Event struct {
	// Event is the event's name, e.g. QUORUM_REPORT_BAD.
	Event string `json:"event"`
	// Data is the event's payload; its shape depends on the event.
	Data json.RawMessage `json:"data,omitempty"`
}

// NextEvent returns the daemon's next event, waiting for it until the connection's context
// ends. Not concurrently with Execute: both read the connection. A daemon's QMP monitor serves
// one connection at a time, so a watch executes its commands on the connection it watches.
func (q *Conn) NextEvent() (Event, error) {
	if len(q.events) > 0 {
		e := q.events[0]
		q.events = q.events[1:]
		return e, nil
	}
	for {
		var e Event
		if err := q.dec.Decode(&e); err != nil {
			return Event{}, fmt.Errorf("read a QMP event: %w", q.cause(err))
		}
		if e.Event != "" {
			return e, nil
		}
	}
}

// Await reads the daemon's events until match says one is the one awaited, and returns the
// error match gives for it (an event that reports a failure), or the connection's.
func (q *Conn) Await(match func(Event) (bool, error)) error {
	for {
		e, err := q.NextEvent()
		if err != nil {
			return err
		}
		if done, err := match(e); done || err != nil {
			return err
		}
	}
}

// cause prefers the context's error over the I/O error that the deadline it set caused.
func (q *Conn) cause(err error) error {
	if q.ctx.Err() != nil {
		return context.Cause(q.ctx)
	}
	return err
}

// Close closes the connection.
func (q *Conn) Close() {
	q.stop()
	_ = q.conn.Close()
}
