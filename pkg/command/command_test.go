package command

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"strings"
	"testing"

	. "github.com/onsi/gomega"
	"github.com/spf13/pflag"
	"k8s.io/klog/v2"
)

// TestMain runs Main itself when the test binary is started as a command by a test below.
func TestMain(m *testing.M) {
	if os.Getenv("PVBRIDGE_COMMAND_TEST") == "1" {
		fs := pflag.NewFlagSet(os.Args[0], pflag.ExitOnError)
		Main(fs, "probe", "A command for the tests.", func(context.Context) error {
			klog.Background().Info("Started", "answer", 42)
			return nil
		})
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// run starts the test binary as a command with args and returns its stderr and exit code.
func run(t *testing.T, args ...string) (string, int) {
	t.Helper()
	cmd := exec.CommandContext(t.Context(), os.Args[0], args...)
	cmd.Env = append(os.Environ(), "PVBRIDGE_COMMAND_TEST=1")
	var stderr strings.Builder
	cmd.Stderr = &stderr
	err := cmd.Run()
	var exit *exec.ExitError
	switch {
	case errors.As(err, &exit):
		return stderr.String(), exit.ExitCode()
	case err != nil:
		t.Fatal(err)
	}
	return stderr.String(), 0
}

func TestLoggingFormats(t *testing.T) {
	t.Run("text", func(t *testing.T) {
		g := NewWithT(t)
		out, code := run(t)
		g.Expect(code).To(BeZero(), out)
		g.Expect(out).To(ContainSubstring(`"Started" answer=42`))
	})
	t.Run("json", func(t *testing.T) {
		g := NewWithT(t)
		out, code := run(t, "--logging-format=json")
		g.Expect(code).To(BeZero(), out)
		var entry map[string]any
		g.Expect(json.Unmarshal([]byte(strings.TrimSpace(out)), &entry)).To(Succeed(), out)
		g.Expect(entry).To(HaveKeyWithValue("msg", "Started"))
		g.Expect(entry).To(HaveKeyWithValue("answer", BeNumerically("==", 42)))
	})
	t.Run("an unknown format exits 2 and says why", func(t *testing.T) {
		g := NewWithT(t)
		out, code := run(t, "--logging-format=yaml")
		g.Expect(code).To(Equal(2))
		g.Expect(out).To(ContainSubstring("yaml"))
	})
}
