// Package console talks to a VM's serial console on a unix socket (the qemu driver's
// serial.sock): it reads until the output matches, and runs shell commands in a guest that
// serves a shell there (the busybox guest of hack/build-guest.sh).
package console

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"regexp"
	"strconv"
	"strings"
)

// Console is a connection to a serial console. It is not safe for concurrent use.
type Console struct {
	conn net.Conn
	r    *bufio.Reader
	out  []byte // what was read and not consumed yet
	tag  int
}

// Dial connects to the console's socket at path.
func Dial(path string) (*Console, error) {
	conn, err := net.Dial("unix", path)
	if err != nil {
		return nil, err
	}
	return &Console{conn: conn, r: bufio.NewReader(conn)}, nil
}

// Close closes the connection.
func (c *Console) Close() error { return c.conn.Close() }

// Expect reads until re matches the output (at most until ctx's deadline), consumes the output
// up to the match's end, and returns the submatches.
func (c *Console) Expect(ctx context.Context, re *regexp.Regexp) ([]string, error) {
	deadline, _ := ctx.Deadline()
	if err := c.conn.SetReadDeadline(deadline); err != nil {
		return nil, err
	}
	buf := make([]byte, 4096)
	for {
		if m := re.FindSubmatchIndex(c.out); m != nil {
			var subs []string
			for i := 0; i < len(m); i += 2 {
				if m[i] < 0 {
					subs = append(subs, "")
					continue
				}
				subs = append(subs, string(c.out[m[i]:m[i+1]]))
			}
			c.out = c.out[m[1]:]
			return subs, nil
		}
		n, err := c.r.Read(buf)
		c.out = append(c.out, buf[:n]...)
		if err != nil {
			return nil, fmt.Errorf("%w; console output so far: %q", err, c.out)
		}
	}
}

// Output runs a shell command in the guest and returns its output without the surrounding
// white space; an exit code other than 0 is an error that carries the output.
func (c *Console) Output(ctx context.Context, command string) (string, error) {
	out, rc, err := c.Run(ctx, command)
	if err == nil && rc != 0 {
		err = fmt.Errorf("%s: exit code %d: %s", command, rc, out)
	}
	return strings.TrimSpace(out), err
}

// Run runs a shell command in the guest and returns its output and exit code.
func (c *Console) Run(ctx context.Context, command string) (string, int, error) {
	c.tag++
	if _, err := fmt.Fprintf(c.conn, "echo BEGIN-%d; %s; echo END-%d rc=$?\n", c.tag, command, c.tag); err != nil {
		return "", 0, err
	}
	// The shell echoes the command line; only the output has BEGIN-n at a line's end.
	re := regexp.MustCompile(fmt.Sprintf(`(?s)BEGIN-%d\r?\n(.*?)END-%d rc=(\d+)`, c.tag, c.tag))
	m, err := c.Expect(ctx, re)
	if err != nil {
		return "", 0, err
	}
	rc, _ := strconv.Atoi(m[2])
	return strings.ReplaceAll(m[1], "\r", ""), rc, nil
}
