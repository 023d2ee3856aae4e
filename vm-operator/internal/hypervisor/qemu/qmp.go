package qemu

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"strconv"
	"sync"
	"time"
)

// Error classes of QMP replies that callers act on.
const (
	// ClassGenericError is the class of most failures; the description says what went wrong.
	ClassGenericError = "GenericError"
	// ClassDeviceNotFound: the device or QOM path named in the command does not exist.
	ClassDeviceNotFound = "DeviceNotFound"
	// ClassCommandNotFound: QEMU does not know the command.
	ClassCommandNotFound = "CommandNotFound"
)

// CommandError is a QMP error reply to a command.
type CommandError struct {
	// Command is the command that failed.
	Command string
	// Class is QEMU's error class, e.g. ClassGenericError.
	Class string
	// Desc is QEMU's human-readable description.
	Desc string
}

func (e *CommandError) Error() string {
	return fmt.Sprintf("qmp %s: %s: %s", e.Command, e.Class, e.Desc)
}

// IsClass reports whether err is a CommandError of the given class.
func IsClass(err error, class string) bool {
	var cerr *CommandError
	return errors.As(err, &cerr) && cerr.Class == class
}

// ErrMonitorClosed is returned for commands and event waits on a monitor whose connection is
// closed, by Close or because QEMU went away.
var ErrMonitorClosed = errors.New("qmp monitor closed")

// Event is an asynchronous QMP event, such as DEVICE_DELETED.
type Event struct {
	// Event is the event's name.
	Event string `json:"event"`
	// Data is the event's payload; its shape depends on the event.
	Data json.RawMessage `json:"data,omitempty"`
	// Timestamp is when QEMU emitted the event.
	Timestamp struct {
		Seconds      int64 `json:"seconds"`
		Microseconds int64 `json:"microseconds"`
	} `json:"timestamp"`
}

// Version is the QEMU version a monitor's greeting announced.
type Version struct {
	Major, Minor, Micro int
	// Package is the distribution's build, e.g. " (Debian 1:7.2+dfsg-7+deb12u18+b3)".
	Package string
}

func (v Version) String() string {
	return fmt.Sprintf("%d.%d.%d%s", v.Major, v.Minor, v.Micro, v.Package)
}

// Monitor is a connection to a QEMU Machine Protocol (QMP) server. Commands may be executed
// concurrently: each carries an id that QEMU echoes in its reply. Events are delivered to every
// Subscription open when they arrive.
type Monitor struct {
	conn    net.Conn
	version Version

	writeMu sync.Mutex // serializes writes to conn

	mu      sync.Mutex // guards the fields below
	nextID  uint64
	pending map[string]chan message
	subs    map[*Subscription]struct{}
	err     error // why the monitor closed; set once, before done is closed

	done chan struct{}
}

// message is any line QMP sends: a greeting, a reply (with return or error) or an event.
type message struct {
	Greeting *struct {
		Version struct {
			QEMU struct {
				Major int `json:"major"`
				Minor int `json:"minor"`
				Micro int `json:"micro"`
			} `json:"qemu"`
			Package string `json:"package"`
		} `json:"version"`
	} `json:"QMP,omitempty"`
	ID     json.RawMessage `json:"id,omitempty"`
	Return json.RawMessage `json:"return,omitempty"`
	Error  *struct {
		Class string `json:"class"`
		Desc  string `json:"desc"`
	} `json:"error,omitempty"`
	Event
}

// Dial connects to the QMP unix socket at path and negotiates capabilities. ctx bounds the
// handshake only.
func Dial(ctx context.Context, path string) (*Monitor, error) {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "unix", path)
	if err != nil {
		return nil, fmt.Errorf("connect to QMP socket: %w", err)
	}
	m, err := NewMonitor(ctx, conn)
	if err != nil {
		return nil, err
	}
	return m, nil
}

// NewMonitor reads the QMP greeting from conn and negotiates capabilities. It owns conn from
// then on, also when it fails. ctx bounds the handshake only.
func NewMonitor(ctx context.Context, conn net.Conn) (*Monitor, error) {
	// Reads and writes fail as soon as ctx ends, so that a server that never greets (QEMU
	// serves one QMP client at a time) cannot hang the handshake.
	stop := context.AfterFunc(ctx, func() { _ = conn.SetDeadline(time.Now()) })
	defer stop()

	m := &Monitor{
		conn:    conn,
		pending: map[string]chan message{},
		subs:    map[*Subscription]struct{}{},
		done:    make(chan struct{}),
	}
	r := bufio.NewReader(conn)
	dec := json.NewDecoder(r)
	var greeting message
	if err := dec.Decode(&greeting); err != nil {
		_ = conn.Close()
		return nil, fmt.Errorf("read QMP greeting: %w", contextError(ctx, err))
	}
	if greeting.Greeting == nil {
		_ = conn.Close()
		return nil, fmt.Errorf("read QMP greeting: not a QMP server")
	}
	v := greeting.Greeting.Version
	m.version = Version{Major: v.QEMU.Major, Minor: v.QEMU.Minor, Micro: v.QEMU.Micro, Package: v.Package}

	go m.read(dec)
	if err := m.Execute(ctx, "qmp_capabilities", nil, nil); err != nil {
		_ = m.Close()
		return nil, contextError(ctx, err)
	}
	if !stop() {
		// ctx ended while the handshake completed: the deadline may have been set already.
		_ = m.Close()
		return nil, fmt.Errorf("qmp_capabilities: %w", ctx.Err())
	}
	return m, nil
}

// contextError prefers ctx's error over the I/O error that the deadline it set caused.
func contextError(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return ctx.Err()
	}
	return err
}

// Version is the QEMU version the server announced.
func (m *Monitor) Version() Version { return m.version }

// Done is closed when the connection is closed.
func (m *Monitor) Done() <-chan struct{} { return m.done }

// Err says why the monitor closed (ErrMonitorClosed wrapping the cause), or nil while it is open.
func (m *Monitor) Err() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.err
}

// Close closes the connection. Pending commands and event waits fail with ErrMonitorClosed.
func (m *Monitor) Close() error {
	m.shutdown(nil)
	return nil
}

func (m *Monitor) shutdown(cause error) {
	m.mu.Lock()
	if m.err != nil {
		m.mu.Unlock()
		return
	}
	if cause == nil {
		m.err = ErrMonitorClosed
	} else {
		m.err = fmt.Errorf("%w: %w", ErrMonitorClosed, cause)
	}
	m.mu.Unlock()
	_ = m.conn.Close()
	close(m.done)
}

// read dispatches every message from the server until the connection ends.
func (m *Monitor) read(dec *json.Decoder) {
	for {
		var msg message
		if err := dec.Decode(&msg); err != nil {
			m.shutdown(err)
			return
		}
		m.mu.Lock()
		switch {
		case msg.Event.Event != "":
			for s := range m.subs {
				s.push(msg.Event)
			}
		case msg.ID != nil:
			id := string(msg.ID)
			if ch, ok := m.pending[id]; ok {
				delete(m.pending, id)
				ch <- msg // buffered: never blocks
			}
		}
		// A reply without id answers a line QEMU could not parse; our lines always parse, so
		// there is no one to give it to.
		m.mu.Unlock()
	}
}

// Execute runs command with arguments (nil for none) and decodes the reply's return value into
// result (nil to discard it). A QMP error reply is a *CommandError. If ctx ends first, Execute
// returns ctx's error; the command may still take effect.
func (m *Monitor) Execute(ctx context.Context, command string, arguments, result any) error {
	ch := make(chan message, 1)
	m.mu.Lock()
	if m.err != nil {
		err := m.err
		m.mu.Unlock()
		return fmt.Errorf("qmp %s: %w", command, err)
	}
	m.nextID++
	id := strconv.FormatUint(m.nextID, 10)
	m.pending[id] = ch
	m.mu.Unlock()
	forget := func() {
		m.mu.Lock()
		delete(m.pending, id)
		m.mu.Unlock()
	}

	line, err := json.Marshal(struct {
		Execute   string          `json:"execute"`
		Arguments any             `json:"arguments,omitempty"`
		ID        json.RawMessage `json:"id"`
	}{command, arguments, json.RawMessage(id)})
	if err != nil {
		forget()
		return fmt.Errorf("qmp %s: encode: %w", command, err)
	}
	if err := m.write(ctx, append(line, '\n')); err != nil {
		forget()
		return fmt.Errorf("qmp %s: %w", command, err)
	}

	var msg message
	select {
	case msg = <-ch:
	case <-m.done:
		// The reader delivers a reply before it sees the connection end (QEMU answers `quit`
		// and hangs up): take a reply that came.
		select {
		case msg = <-ch:
		default:
			forget()
			return fmt.Errorf("qmp %s: %w", command, m.Err())
		}
	case <-ctx.Done():
		forget()
		return fmt.Errorf("qmp %s: %w", command, ctx.Err())
	}
	if msg.Error != nil {
		return &CommandError{Command: command, Class: msg.Error.Class, Desc: msg.Error.Desc}
	}
	if result == nil {
		return nil
	}
	if err := json.Unmarshal(msg.Return, result); err != nil {
		return fmt.Errorf("qmp %s: decode reply: %w", command, err)
	}
	return nil
}

func (m *Monitor) write(ctx context.Context, line []byte) error {
	m.writeMu.Lock()
	defer m.writeMu.Unlock()
	// A server that stops reading must not block the writer beyond ctx.
	deadline, _ := ctx.Deadline() // zero: no deadline
	if err := m.conn.SetWriteDeadline(deadline); err != nil {
		return err
	}
	if _, err := m.conn.Write(line); err != nil {
		if e := m.Err(); e != nil {
			return e
		}
		return contextError(ctx, err)
	}
	return nil
}

// Subscribe starts collecting events. Subscribe before running the command whose event you
// await, so that the event cannot slip by. Close the subscription when done.
func (m *Monitor) Subscribe() *Subscription {
	s := &Subscription{m: m, notify: make(chan struct{}, 1)}
	m.mu.Lock()
	m.subs[s] = struct{}{}
	m.mu.Unlock()
	return s
}

// Subscription queues the events of a Monitor, without bound and without ever blocking the
// monitor, from Subscribe until Close.
type Subscription struct {
	m      *Monitor
	notify chan struct{} // has a token when queue may be non-empty

	mu    sync.Mutex
	queue []Event
}

func (s *Subscription) push(ev Event) {
	s.mu.Lock()
	s.queue = append(s.queue, ev)
	s.mu.Unlock()
	select {
	case s.notify <- struct{}{}:
	default:
	}
}

// Next returns the oldest event not returned yet, waiting for one until ctx ends or the monitor
// closes. Events that arrived before the monitor closed are still returned.
func (s *Subscription) Next(ctx context.Context) (Event, error) {
	closed := false
	for {
		s.mu.Lock()
		if len(s.queue) > 0 {
			ev := s.queue[0]
			s.queue = s.queue[1:]
			s.mu.Unlock()
			return ev, nil
		}
		s.mu.Unlock()
		if closed {
			return Event{}, s.m.Err()
		}
		select {
		case <-s.notify:
		case <-s.m.done:
			closed = true // drain what came before
		case <-ctx.Done():
			return Event{}, ctx.Err()
		}
	}
}

// Wait returns the first event for which match is true, skipping the others.
func (s *Subscription) Wait(ctx context.Context, match func(Event) bool) (Event, error) {
	for {
		ev, err := s.Next(ctx)
		if err != nil {
			return Event{}, err
		}
		if match(ev) {
			return ev, nil
		}
	}
}

// Close stops collecting events.
func (s *Subscription) Close() {
	s.m.mu.Lock()
	delete(s.m.subs, s)
	s.m.mu.Unlock()
}
