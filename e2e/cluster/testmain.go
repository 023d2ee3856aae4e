package cluster

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
)

// labRootPrefix begins the root of every lab on the machine (NewRoot): short, for the sockets
// below it, and known, so that a lab's namespaces can tell the other labs' mounts (containerd.go).
var labRootPrefix = filepath.Join(os.TempDir(), "pvb-")

// NewRoot makes the root directory of a new lab.
func NewRoot() (string, error) {
	return os.MkdirTemp(filepath.Dir(labRootPrefix), filepath.Base(labRootPrefix))
}

// RunTests is the TestMain of a package whose tests share one lab: it starts a lab under a short
// temporary root, lets setup start what the tests need, runs them and stops the lab. The lab's
// directory (logs, state) is kept when a test failed, or when PVBRIDGE_KEEP_LAB is set.
func RunTests(m *testing.M, setup func(ctx context.Context, lab *Lab) error) int {
	bin, err := DefaultBinaries()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	root, err := NewRoot()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	lab, err := NewLab(root, bin)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	stop := func() {
		if err := lab.Stop(); err != nil {
			fmt.Fprintln(os.Stderr, "stop lab:", err)
		}
	}
	if err := setup(context.Background(), lab); err != nil {
		stop()
		fmt.Fprintf(os.Stderr, "start the lab: %v (logs below %s)\n", err, root)
		return 1
	}
	code := m.Run()
	stop()
	if code == 0 && os.Getenv("PVBRIDGE_KEEP_LAB") == "" {
		_ = os.RemoveAll(root)
	} else {
		fmt.Fprintln(os.Stderr, "lab kept in", root)
	}
	return code
}
