package main

import (
	"encoding/json"
	"io"
	"strings"
	"testing"

	. "github.com/onsi/gomega"
	"k8s.io/cli-runtime/pkg/genericiooptions"
	"sigs.k8s.io/yaml"
)

func TestCommandLine(t *testing.T) {
	for _, tt := range []struct {
		name     string
		args     []string
		wantCode int
		wantOut  string // in stdout
		wantErr  string // in stderr
	}{
		{name: "no command prints the help", wantCode: exitDone, wantOut: "Available Commands:"},
		{name: "-h prints the help", args: []string{"-h"}, wantCode: exitDone, wantOut: "drain-host"},
		{name: "a command's help", args: []string{"trace", "--help"}, wantCode: exitDone, wantOut: "--mgmt-kubeconfig"},
		{name: "kubectl's connection flags", args: []string{"hosts", "--help"}, wantCode: exitDone, wantOut: "--context"},
		{name: "version", args: []string{"version"}, wantCode: exitDone, wantOut: "kubectl-pvbridge devel"},
		{name: "completion", args: []string{"completion", "bash"}, wantCode: exitDone, wantOut: "bash completion"},
		{name: "an unknown command", args: []string{"bogus"}, wantCode: exitUsage, wantErr: `unknown command "bogus"`},
		{name: "an unknown flag", args: []string{"hosts", "--bogus"}, wantCode: exitUsage, wantErr: "unknown flag: --bogus"},
		{name: "trace without a name", args: []string{"trace", "pvc", "--mgmt-kubeconfig=x"}, wantCode: exitUsage, wantErr: "want pvc NAME or pv NAME"},
		{name: "trace of another kind", args: []string{"trace", "pod", "x", "--mgmt-kubeconfig=x"}, wantCode: exitUsage, wantErr: "want pvc NAME or pv NAME"},
		{name: "trace without the management cluster", args: []string{"trace", "pvc", "x"}, wantCode: exitUsage, wantErr: "--mgmt-kubeconfig is required"},
		{name: "an unknown output format", args: []string{"hosts", "-o", "xml"}, wantCode: exitUsage, wantErr: `--output "xml"`},
		{name: "drain-host without a host", args: []string{"drain-host"}, wantCode: exitUsage, wantErr: "accepts 1 arg(s)"},
		{name: "vm with two names", args: []string{"vm", "a", "b"}, wantCode: exitUsage, wantErr: "accepts 1 arg(s)"},
		{name: "a kubeconfig that is not there", args: []string{"hosts", "--kubeconfig=/nonexistent/kubeconfig"}, wantCode: exitError, wantErr: "management cluster:"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			streams, _, out, errOut := genericiooptions.NewTestIOStreams()
			g.Expect(run(t.Context(), tt.args, streams)).To(Equal(tt.wantCode), "stdout:\n%s\nstderr:\n%s", out, errOut)
			g.Expect(out.String()).To(ContainSubstring(tt.wantOut))
			g.Expect(errOut.String()).To(ContainSubstring(tt.wantErr))
			if tt.wantCode == exitUsage {
				g.Expect(errOut.String()).To(ContainSubstring("--help"), "a usage error points at the help")
			}
		})
	}
}

func TestOutputFormats(t *testing.T) {
	rows := []hostRow{{Name: "host-a", State: "Ready", PmemFree: "1Gi", VMs: 2}}
	for _, tt := range []struct {
		format output
		decode func([]byte, any) error
	}{
		{format: "json", decode: json.Unmarshal},
		{format: "yaml", decode: func(b []byte, v any) error { return yaml.Unmarshal(b, v) }},
	} {
		t.Run(string(tt.format), func(t *testing.T) {
			g := NewWithT(t)
			var b strings.Builder
			g.Expect(tt.format.print(&b, rows, func(w io.Writer) { t.Fatal("a table with -o") })).To(Succeed())
			var got []hostRow
			g.Expect(tt.decode([]byte(b.String()), &got)).To(Succeed())
			g.Expect(got).To(Equal(rows))
		})
	}
	g := NewWithT(t)
	var b strings.Builder
	g.Expect(output("").print(&b, rows, func(w io.Writer) { printHosts(w, rows) })).To(Succeed())
	g.Expect(b.String()).To(MatchRegexp(`(?m)^HOST +STATE +PMEM +FREE .*\nhost-a +Ready +- +1Gi `))
}
