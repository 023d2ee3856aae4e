package command

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"testing"

	. "github.com/onsi/gomega"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/spf13/pflag"
	"k8s.io/klog/v2"
)

// TestMain runs Main itself when the test binary is started as a command by a test below.
func TestMain(m *testing.M) {
	if os.Getenv("PVBRIDGE_COMMAND_TEST") == "1" {
		fs := pflag.NewFlagSet(os.Args[0], pflag.ExitOnError)
		Main(fs, "probe", "v9.8.7", "A command for the tests.", func(context.Context) error {
			klog.Background().Info("Started", "answer", 42)
			return nil
		})
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// run starts the test binary as a command with args and returns its stdout, stderr and exit code.
func run(t *testing.T, args ...string) (string, string, int) {
	t.Helper()
	cmd := exec.CommandContext(t.Context(), os.Args[0], args...)
	cmd.Env = append(os.Environ(), "PVBRIDGE_COMMAND_TEST=1")
	var stdout, stderr strings.Builder
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	var exit *exec.ExitError
	switch {
	case errors.As(err, &exit):
		return stdout.String(), stderr.String(), exit.ExitCode()
	case err != nil:
		t.Fatal(err)
	}
	return stdout.String(), stderr.String(), 0
}

func TestLoggingFormats(t *testing.T) {
	t.Run("text", func(t *testing.T) {
		g := NewWithT(t)
		_, out, code := run(t)
		g.Expect(code).To(BeZero(), out)
		g.Expect(out).To(ContainSubstring(`"Started" answer=42`))
	})
	t.Run("json", func(t *testing.T) {
		g := NewWithT(t)
		_, out, code := run(t, "--logging-format=json")
		g.Expect(code).To(BeZero(), out)
		var entry map[string]any
		g.Expect(json.Unmarshal([]byte(strings.TrimSpace(out)), &entry)).To(Succeed(), out)
		g.Expect(entry).To(HaveKeyWithValue("msg", "Started"))
		g.Expect(entry).To(HaveKeyWithValue("answer", BeNumerically("==", 42)))
	})
}

func TestVersion(t *testing.T) {
	g := NewWithT(t)
	out, _, code := run(t, "--version")
	g.Expect(code).To(BeZero())
	g.Expect(out).To(Equal("probe v9.8.7\n"))
}

func TestUsageErrorsExit2(t *testing.T) {
	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{name: "an unknown logging format says why", args: []string{"--logging-format=yaml"}, want: "yaml"},
		{name: "a bad flag prints the usage, with the version", args: []string{"--no-such-flag"}, want: "A command for the tests. Version v9.8.7."},
		{name: "an argument prints the usage", args: []string{"stray"}, want: "unexpected arguments: [stray]"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			_, out, code := run(t, tc.args...)
			g.Expect(code).To(Equal(2))
			g.Expect(out).To(ContainSubstring(tc.want))
		})
	}
}

func TestBuildInfo(t *testing.T) {
	g := NewWithT(t)
	want := `# HELP pvbridge_build_info The build of this pvbridge component: its version (main.version, devel when unset) and Go version. Always 1.
# TYPE pvbridge_build_info gauge
pvbridge_build_info{component="probe",go_version="` + runtime.Version() + `",version="v9.8.7"} 1
`
	g.Expect(testutil.CollectAndCompare(BuildInfo("probe", "v9.8.7"), strings.NewReader(want))).To(Succeed())
}
