package pmem

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"

	"k8s.io/klog/v2"
)

// Runner runs a storage tool (lvm, ndctl) and returns its standard output. A failed command
// returns a *CommandError. The lvm and ndctl back ends take one, so that tests replay recorded
// output instead of touching devices.
type Runner interface {
	Run(ctx context.Context, name string, args ...string) ([]byte, error)
}

// ExecRunner runs commands on the host, in the C locale (back ends match English messages).
type ExecRunner struct{}

var _ Runner = ExecRunner{}

// Run implements Runner.
func (ExecRunner) Run(ctx context.Context, name string, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, name, args...)
	// LVM_SUPPRESS_FD_WARNINGS: lvm complains on stderr about descriptors it inherits.
	cmd.Env = append(os.Environ(), "LC_ALL=C", "LVM_SUPPRESS_FD_WARNINGS=1")
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	klog.FromContext(ctx).V(5).Info("Running command", "command", commandLine(name, args))
	if err := cmd.Run(); err != nil {
		return stdout.Bytes(), &CommandError{
			Command: commandLine(name, args),
			Stderr:  strings.TrimSpace(stderr.String()),
			Err:     err,
		}
	}
	return stdout.Bytes(), nil
}

// CommandError is a command that failed: it did not start or exited non-zero.
type CommandError struct {
	// Command is the command line.
	Command string
	// Stderr is what the command wrote to standard error.
	Stderr string
	// Err is the error from running it, e.g. an *exec.ExitError.
	Err error
}

func (e *CommandError) Error() string {
	if e.Stderr == "" {
		return fmt.Sprintf("%s: %v", e.Command, e.Err)
	}
	return fmt.Sprintf("%s: %v: %s", e.Command, e.Err, e.Stderr)
}

func (e *CommandError) Unwrap() error { return e.Err }

// stderrContains tells whether err is a CommandError whose standard error contains any of
// substrings.
func stderrContains(err error, substrings ...string) bool {
	var cmdErr *CommandError
	if !errors.As(err, &cmdErr) {
		return false
	}
	for _, s := range substrings {
		if strings.Contains(cmdErr.Stderr, s) {
			return true
		}
	}
	return false
}

func commandLine(name string, args []string) string {
	return strings.Join(append([]string{name}, args...), " ")
}
