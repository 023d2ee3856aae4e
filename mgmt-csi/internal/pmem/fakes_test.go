package pmem

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
)

// call is a command a test expects and what it answers: stdout (a testdata file when it starts
// with "@"), or a failure with stderr.
type call struct {
	cmd    string
	stdout string
	stderr string
	fail   bool
}

// replayRunner is a Runner that checks each command against the next expected call, exactly,
// and replays its recorded output. Unexpected and missing commands fail the test.
type replayRunner struct {
	t     *testing.T
	mu    sync.Mutex
	calls []call
}

func replay(t *testing.T, dir string, calls ...call) *replayRunner {
	t.Helper()
	for i, c := range calls {
		if file, ok := strings.CutPrefix(c.stdout, "@"); ok {
			data, err := os.ReadFile(filepath.Join("testdata", dir, file))
			if err != nil {
				t.Fatal(err)
			}
			calls[i].stdout = string(data)
		}
	}
	r := &replayRunner{t: t, calls: calls}
	t.Cleanup(func() {
		r.mu.Lock()
		defer r.mu.Unlock()
		for _, c := range r.calls {
			t.Errorf("expected command not run: %s", c.cmd)
		}
	})
	return r
}

func (r *replayRunner) Run(_ context.Context, name string, args ...string) ([]byte, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	got := commandLine(name, args)
	if len(r.calls) == 0 {
		r.t.Errorf("unexpected command: %s", got)
		return nil, fmt.Errorf("unexpected command %s", got)
	}
	want := r.calls[0]
	r.calls = r.calls[1:]
	if got != want.cmd {
		r.t.Errorf("command:\n got: %s\nwant: %s", got, want.cmd)
		return nil, fmt.Errorf("unexpected command %s", got)
	}
	if want.fail {
		return []byte(want.stdout), &CommandError{Command: got, Stderr: want.stderr, Err: fmt.Errorf("exit status 5")}
	}
	return []byte(want.stdout), nil
}

// fakeIO is a BlockIO that records what it is asked to do and keeps the records written with
// WriteAt (by device and offset) for ReadAt; everything else reads as zeroes.
type fakeIO struct {
	mu      sync.Mutex
	ops     []string
	records map[string]map[int64][]byte
	// fail makes the operations whose description starts with it fail.
	fail string
}

func (f *fakeIO) record(op string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.ops = append(f.ops, op)
	if f.fail != "" && strings.HasPrefix(op, f.fail) {
		return fmt.Errorf("injected failure: %s", op)
	}
	return nil
}

func (f *fakeIO) Copy(_ context.Context, dst, src string, offset, length int64) error {
	if err := f.record(fmt.Sprintf("copy %s %s %d %d", dst, src, offset, length)); err != nil {
		return err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	for off, p := range f.records[src] {
		if off >= offset && off < offset+length {
			f.put(dst, off, p)
		}
	}
	return nil
}

func (f *fakeIO) Zero(_ context.Context, dev string, offset, length int64) error {
	if err := f.record(fmt.Sprintf("zero %s %d %d", dev, offset, length)); err != nil {
		return err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	for off := range f.records[dev] {
		if off >= offset && off < offset+length {
			delete(f.records[dev], off)
		}
	}
	return nil
}

func (f *fakeIO) ReadAt(_ context.Context, dev string, p []byte, offset int64) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	clear(p)
	copy(p, f.records[dev][offset])
	return nil
}

func (f *fakeIO) WriteAt(_ context.Context, dev string, p []byte, offset int64) error {
	if err := f.record(fmt.Sprintf("write %s %d", dev, offset)); err != nil {
		return err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.put(dev, offset, slices.Clone(p))
	return nil
}

func (f *fakeIO) put(dev string, offset int64, p []byte) {
	if f.records == nil {
		f.records = map[string]map[int64][]byte{}
	}
	if f.records[dev] == nil {
		f.records[dev] = map[int64][]byte{}
	}
	f.records[dev][offset] = p
}

func (f *fakeIO) operations() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.ops)
}

// errAny in a test table accepts any error.
var errAny = errors.New("any error")

// nowRunner shows the time in a pmem.pvbridge.io/created=<Unix nanoseconds> tag as <now>, so
// that replayed commands can be exact.
type nowRunner struct{ r Runner }

func (n nowRunner) Run(ctx context.Context, name string, args ...string) ([]byte, error) {
	args = slices.Clone(args)
	for i, a := range args {
		if strings.HasPrefix(a, tagCreated) {
			args[i] = tagCreated + "<now>"
		}
	}
	return n.r.Run(ctx, name, args...)
}
