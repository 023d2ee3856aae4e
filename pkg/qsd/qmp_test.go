package qsd

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"net"
	"os"
	"path/filepath"
	"testing"

	. "github.com/onsi/gomega"
)

// monitor serves one QMP connection on d's socket as a daemon would: the greeting, then for
// each command the lines script gives it (events and the reply), in order.
func monitor(t *testing.T, d Dir, script map[string][]string) {
	t.Helper()
	l, err := net.Listen("unix", d.Path(SocketName))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = l.Close() })
	go func() {
		conn, err := l.Accept()
		if err != nil {
			return
		}
		defer conn.Close()
		_, _ = conn.Write([]byte(`{"QMP": {"version": {}, "capabilities": []}}` + "\n"))
		in := bufio.NewScanner(conn)
		for in.Scan() {
			var cmd struct {
				Execute string `json:"execute"`
			}
			if json.Unmarshal(in.Bytes(), &cmd) != nil {
				return
			}
			lines, ok := script[cmd.Execute]
			if !ok {
				lines = []string{`{"return": {}}`}
			}
			for _, line := range lines {
				_, _ = conn.Write([]byte(line + "\n"))
			}
		}
	}()
}

func TestConn(t *testing.T) {
	g := NewWithT(t)
	dir, err := os.MkdirTemp("", "qmp-") // short: a socket path
	g.Expect(err).NotTo(HaveOccurred())
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	d := Dir(filepath.Join(dir, "d"))
	g.Expect(os.Mkdir(string(d), 0o700)).To(Succeed())
	monitor(t, d, map[string][]string{
		"query-block-exports": {
			`{"event": "QUORUM_REPORT_BAD", "data": {"node-name": "replica1", "type": "write"}}`,
			`{"return": [{"id": "vol-a"}]}`,
		},
		"blockdev-del": {`{"error": {"class": "GenericError", "desc": "Failed to find node with node-name='x'"}}`},
		"x-blockdev-change": {
			`{"return": {}}`,
			`{"event": "BLOCK_EXPORT_DELETED", "data": {"id": "vol-a"}}`,
		},
		"blockdev-backup": {
			`{"return": {}}`,
			`{"event": "BLOCK_JOB_READY", "data": {"device": "j"}}`,
			`{"event": "BLOCK_JOB_COMPLETED", "data": {"device": "j", "error": "No space left on device"}}`,
		},
	})

	q, err := Dial(t.Context(), d)
	g.Expect(err).NotTo(HaveOccurred())
	defer q.Close()

	var exports []struct {
		ID string `json:"id"`
	}
	g.Expect(q.Execute("query-block-exports", nil, &exports)).To(Succeed(), "an event before the reply does not stop it")
	g.Expect(exports).To(HaveLen(1))
	g.Expect(exports[0].ID).To(Equal("vol-a"))

	err = q.Execute("blockdev-del", map[string]any{"node-name": "x"}, nil)
	var cerr *CommandError
	g.Expect(err).To(BeAssignableToTypeOf(cerr))
	g.Expect(err).To(MatchError(ContainSubstring("qmp blockdev-del: GenericError: Failed to find node")))

	g.Expect(q.Execute("x-blockdev-change", nil, nil)).To(Succeed())
	e, err := q.NextEvent()
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(e.Event).To(Equal("QUORUM_REPORT_BAD"), "the event that came before a reply is kept for NextEvent")
	g.Expect(string(e.Data)).To(ContainSubstring(`"replica1"`))
	e, err = q.NextEvent()
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(e.Event).To(Equal("BLOCK_EXPORT_DELETED"), "then the next one from the connection")

	// Await skips the events it is not waiting for and returns what the awaited one says.
	g.Expect(q.Execute("blockdev-backup", nil, nil)).To(Succeed())
	var skipped []string
	err = q.Await(func(e Event) (bool, error) {
		if e.Event != "BLOCK_JOB_COMPLETED" {
			skipped = append(skipped, e.Event)
			return false, nil
		}
		return true, errors.New(string(e.Data))
	})
	g.Expect(err).To(MatchError(ContainSubstring("No space left")))
	g.Expect(skipped).To(Equal([]string{"BLOCK_JOB_READY"}))

	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	_, err = Dial(ctx, d)
	g.Expect(err).To(HaveOccurred(), "an ended context dials nothing")
}
