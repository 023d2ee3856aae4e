package qemu

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"path/filepath"
	"sync"
	"testing"
	"time"

	. "github.com/onsi/gomega"
)

const greeting = `{"QMP": {"version": {"qemu": {"micro": 22, "minor": 2, "major": 7}, "package": " (Debian 1:7.2)"}, "capabilities": ["oob"]}}`

// request is a command as the fake server receives it.
type request struct {
	Execute   string          `json:"execute"`
	Arguments json.RawMessage `json:"arguments"`
	ID        json.RawMessage `json:"id"`
}

// fakeConn is the server side of one QMP connection.
type fakeConn struct {
	mu   sync.Mutex
	conn net.Conn
}

// send writes one line.
func (c *fakeConn) send(line string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	_, _ = fmt.Fprintln(c.conn, line)
}

// reply answers req with a return value (JSON).
func (c *fakeConn) reply(req request, ret string) {
	c.send(fmt.Sprintf(`{"return": %s, "id": %s}`, ret, req.ID))
}

func (c *fakeConn) fail(req request, class, desc string) {
	c.send(fmt.Sprintf(`{"error": {"class": %q, "desc": %q}, "id": %s}`, class, desc, req.ID))
}

func (c *fakeConn) event(name, data string) {
	c.send(fmt.Sprintf(`{"event": %q, "data": %s, "timestamp": {"seconds": 1, "microseconds": 2}}`, name, data))
}

// fakeServer serves one QMP connection on a unix socket and returns its path. It sends greet
// (nothing if empty), answers qmp_capabilities, and hands every other request to handle. The
// connection closes when handle returns false or the test ends.
func fakeServer(t *testing.T, greet string, handle func(c *fakeConn, req request) bool) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "qmp.sock")
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	t.Cleanup(func() {
		_ = l.Close()
		<-done
	})
	go func() {
		defer close(done)
		conn, err := l.Accept()
		if err != nil {
			return
		}
		defer conn.Close()
		go func() { // end the connection with the test
			<-t.Context().Done()
			_ = conn.Close()
		}()
		c := &fakeConn{conn: conn}
		if greet != "" {
			c.send(greet)
		}
		s := bufio.NewScanner(conn)
		for s.Scan() {
			var req request
			if err := json.Unmarshal(s.Bytes(), &req); err != nil {
				t.Errorf("fake QMP server: bad request %q: %v", s.Text(), err)
				return
			}
			if req.Execute == "qmp_capabilities" {
				c.reply(req, "{}")
				continue
			}
			if !handle(c, req) {
				return
			}
		}
	}()
	return path
}

func TestMonitorExecute(t *testing.T) {
	type status struct {
		Status  string `json:"status"`
		Running bool   `json:"running"`
	}
	tests := []struct {
		name   string
		handle func(c *fakeConn, req request) bool
		// args are the arguments of the command, and wantArgs how the server must see them.
		args     any
		wantArgs string
		want     status
		wantErr  error
	}{{
		name: "decodes the return value",
		handle: func(c *fakeConn, req request) bool {
			c.reply(req, `{"status": "running", "running": true, "singlestep": false}`)
			return true
		},
		want: status{Status: "running", Running: true},
	}, {
		name: "sends the arguments",
		handle: func(c *fakeConn, req request) bool {
			c.reply(req, fmt.Sprintf(`{"status": %q}`, req.Arguments))
			return true
		},
		args: map[string]string{"id": "vd1"},
		want: status{Status: `{"id":"vd1"}`},
	}, {
		name: "an error reply is a CommandError",
		handle: func(c *fakeConn, req request) bool {
			c.fail(req, "DeviceNotFound", "Device 'vd1' not found")
			return true
		},
		wantErr: &CommandError{Command: "query-status", Class: "DeviceNotFound", Desc: "Device 'vd1' not found"},
	}, {
		name: "events before the reply are not taken for it",
		handle: func(c *fakeConn, req request) bool {
			c.event("DEVICE_DELETED", `{"path": "/machine/peripheral/vd1/virtio-backend"}`)
			c.send(`{"return": {"status": "wrong"}, "id": 999999}`)
			c.reply(req, `{"status": "paused"}`)
			return true
		},
		want: status{Status: "paused"},
	}, {
		name: "a reply right before the server hangs up is not lost (QEMU's quit)",
		handle: func(c *fakeConn, req request) bool {
			c.reply(req, `{"status": "running"}`)
			return false
		},
		want: status{Status: "running"},
	}, {
		name: "a closed connection fails the command",
		handle: func(*fakeConn, request) bool {
			return false
		},
		wantErr: ErrMonitorClosed,
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			mon, err := Dial(t.Context(), fakeServer(t, greeting, tt.handle))
			g.Expect(err).NotTo(HaveOccurred())
			defer mon.Close()

			var got status
			err = mon.Execute(t.Context(), "query-status", tt.args, &got)
			if tt.wantErr != nil {
				g.Expect(err).To(MatchError(tt.wantErr))
				return
			}
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(got).To(Equal(tt.want))
		})
	}
}

func TestDial(t *testing.T) {
	tests := []struct {
		name    string
		greet   string
		wantErr string
	}{{
		name:  "reads the version from the greeting",
		greet: greeting,
	}, {
		name:    "a server that never greets fails when the context ends",
		wantErr: "context deadline exceeded",
	}, {
		name:    "a server that is not QMP is refused",
		greet:   `{"hello": "world"}`,
		wantErr: "not a QMP server",
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			path := fakeServer(t, tt.greet, func(*fakeConn, request) bool { return true })
			ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
			defer cancel()
			mon, err := Dial(ctx, path)
			if tt.wantErr != "" {
				g.Expect(err).To(MatchError(ContainSubstring(tt.wantErr)))
				return
			}
			g.Expect(err).NotTo(HaveOccurred())
			defer mon.Close()
			g.Expect(mon.Version().String()).To(Equal("7.2.22 (Debian 1:7.2)"))
		})
	}
}

func TestDialNoServer(t *testing.T) {
	g := NewWithT(t)
	_, err := Dial(t.Context(), filepath.Join(t.TempDir(), "qmp.sock"))
	g.Expect(isNotServing(err)).To(BeTrue(), "%v", err)
}

func TestMonitorMatchesRepliesByID(t *testing.T) {
	g := NewWithT(t)
	var first request
	firstArrived := make(chan struct{})
	path := fakeServer(t, greeting, func(c *fakeConn, req request) bool {
		if req.Execute == "one" { // hold it back, and answer it after the second
			first = req
			close(firstArrived)
			return true
		}
		c.reply(req, `"second"`)
		c.reply(first, `"first"`)
		return true
	})
	mon, err := Dial(t.Context(), path)
	g.Expect(err).NotTo(HaveOccurred())
	defer mon.Close()

	results := make(chan string, 1)
	go func() {
		var s string
		_ = mon.Execute(t.Context(), "one", nil, &s)
		results <- "one=" + s
	}()
	<-firstArrived
	var s string
	g.Expect(mon.Execute(t.Context(), "two", nil, &s)).To(Succeed())
	g.Expect(s).To(Equal("second"))
	g.Eventually(results).Should(Receive(Equal("one=first")))
}

func TestMonitorExecuteHonoursContext(t *testing.T) {
	g := NewWithT(t)
	path := fakeServer(t, greeting, func(*fakeConn, request) bool { return true }) // never answers
	mon, err := Dial(t.Context(), path)
	g.Expect(err).NotTo(HaveOccurred())
	defer mon.Close()

	ctx, cancel := context.WithTimeout(t.Context(), 50*time.Millisecond)
	defer cancel()
	g.Expect(mon.Execute(ctx, "query-status", nil, nil)).To(MatchError(context.DeadlineExceeded))
	g.Expect(mon.Err()).NotTo(HaveOccurred(), "the monitor stays usable")
}

func TestSubscription(t *testing.T) {
	deleted := func(device string) func(Event) bool {
		return func(ev Event) bool {
			var data struct {
				Device string `json:"device"`
			}
			return ev.Event == "DEVICE_DELETED" && json.Unmarshal(ev.Data, &data) == nil && data.Device == device
		}
	}
	tests := []struct {
		name string
		// events are sent by the server after the command "go" is answered; close ends the
		// connection after them.
		events  [][2]string
		close   bool
		wantErr error
	}{{
		name: "waits for the matching event, skipping others",
		events: [][2]string{
			{"DEVICE_DELETED", `{"path": "/machine/peripheral/vd1/virtio-backend"}`},
			{"DEVICE_DELETED", `{"device": "vd2", "path": "/machine/peripheral/vd2"}`},
			{"DEVICE_DELETED", `{"device": "vd1", "path": "/machine/peripheral/vd1"}`},
		},
	}, {
		name:    "an event that never comes ends with the context",
		events:  [][2]string{{"RESUME", `{}`}},
		wantErr: context.DeadlineExceeded,
	}, {
		name:   "events that came before the connection closed are still delivered",
		events: [][2]string{{"DEVICE_DELETED", `{"device": "vd1", "path": "/machine/peripheral/vd1"}`}},
		close:  true,
	}, {
		name:    "a closed connection ends the wait",
		close:   true,
		wantErr: ErrMonitorClosed,
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			path := fakeServer(t, greeting, func(c *fakeConn, req request) bool {
				c.reply(req, "{}")
				for _, ev := range tt.events {
					c.event(ev[0], ev[1])
				}
				return !tt.close
			})
			mon, err := Dial(t.Context(), path)
			g.Expect(err).NotTo(HaveOccurred())
			defer mon.Close()

			sub := mon.Subscribe()
			defer sub.Close()
			g.Expect(mon.Execute(t.Context(), "go", nil, nil)).To(Succeed())
			if tt.close {
				g.Eventually(mon.Done()).Should(BeClosed())
			}
			ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
			defer cancel()
			ev, err := sub.Wait(ctx, deleted("vd1"))
			if tt.wantErr != nil {
				g.Expect(err).To(MatchError(tt.wantErr))
				return
			}
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(ev.Event).To(Equal("DEVICE_DELETED"))
			g.Expect(ev.Timestamp.Seconds).To(Equal(int64(1)))
		})
	}
}

func TestSubscriptionMissesNothingWhileBehind(t *testing.T) {
	g := NewWithT(t)
	const n = 1000
	path := fakeServer(t, greeting, func(c *fakeConn, req request) bool {
		for i := range n {
			c.event("E", fmt.Sprintf(`{"i": %d}`, i))
		}
		c.reply(req, "{}")
		return true
	})
	mon, err := Dial(t.Context(), path)
	g.Expect(err).NotTo(HaveOccurred())
	defer mon.Close()
	sub := mon.Subscribe()
	defer sub.Close()

	// The reader never blocks on a slow subscriber: the reply comes through behind n events.
	g.Expect(mon.Execute(t.Context(), "go", nil, nil)).To(Succeed())
	for i := range n {
		ev, err := sub.Next(t.Context())
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(string(ev.Data)).To(Equal(fmt.Sprintf(`{"i": %d}`, i)))
	}
}
