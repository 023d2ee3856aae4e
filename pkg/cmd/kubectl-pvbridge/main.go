// Command kubectl-pvbridge is a kubectl plugin for pvbridge's operators, with kubectl's own
// conventions (cobra and cli-runtime: --kubeconfig, --context, -n, -o, completion):
//
//   - `kubectl pvbridge trace pvc <name>` (or `trace pv <name>`) prints the chain of objects a
//     guest volume is made of in both clusters and, for the step that holds it, which object
//     and why;
//   - `kubectl pvbridge hosts` lists the management hosts: their state, PMEM, VMs and replicas;
//   - `kubectl pvbridge vm <name>` shows a VirtualMachine's host and volumes;
//   - `kubectl pvbridge drain-host <host>` drains a management host before its maintenance,
//     and `--undo` brings it back;
//   - `kubectl pvbridge version`, and `completion` for the shells.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"runtime/debug"

	"github.com/spf13/cobra"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/cli-runtime/pkg/genericclioptions"
	"k8s.io/cli-runtime/pkg/genericiooptions"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/yaml"

	pmemv1 "pvbridge.io/pkg/apis/pmem/v1alpha1"
	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
)

// Exit codes: done (a chain whose every step is, a host drained), a failure (to read the
// clusters, a name that is not there), a bad command line, not done.
const (
	exitDone     = 0
	exitError    = 1
	exitUsage    = 2
	exitNotReady = 3
)

// version is set at build time with -ldflags "-X main.version=<version>"; else the module's.
var version = ""

func main() {
	os.Exit(run(context.Background(), os.Args[1:], genericiooptions.IOStreams{In: os.Stdin, Out: os.Stdout, ErrOut: os.Stderr}))
}

// run runs the command line args and returns the exit code.
func run(ctx context.Context, args []string, streams genericiooptions.IOStreams) int {
	root := newRootCommand(streams)
	root.SetArgs(args)
	err := root.ExecuteContext(ctx)
	var usage usageError
	switch {
	case err == nil:
		return exitDone
	case errors.Is(err, errNotDone):
		return exitNotReady
	case errors.As(err, &usage):
		fmt.Fprintf(streams.ErrOut, "Error: %v\nSee '%s --help'.\n", err, usage.command)
		return exitUsage
	default:
		fmt.Fprintln(streams.ErrOut, "Error:", err)
		return exitError
	}
}

// errNotDone ends a command whose work is not done yet (a step that waits, replicas that stay
// on a drained host): exit code 3, after the command printed why.
var errNotDone = errors.New("not done")

// usageError is a bad command line: exit code 2.
type usageError struct {
	command string
	err     error
}

func (e usageError) Error() string { return e.err.Error() }

// exactArgs is cobra.ExactArgs as a usage error.
func exactArgs(n int) cobra.PositionalArgs {
	return func(cmd *cobra.Command, args []string) error {
		if err := cobra.ExactArgs(n)(cmd, args); err != nil {
			return usageError{cmd.CommandPath(), err}
		}
		return nil
	}
}

// newRootCommand returns `kubectl pvbridge` and its subcommands, which share kubectl's
// connection flags (the cluster each command reads: the management cluster, or for trace the
// guest's).
func newRootCommand(streams genericiooptions.IOStreams) *cobra.Command {
	flags := genericclioptions.NewConfigFlags(true)
	root := &cobra.Command{
		Use:   "kubectl pvbridge",
		Short: "Operate pvbridge: trace a guest volume, list hosts and VMs, drain a host",
		Long: `kubectl pvbridge operates pvbridge, the paravirtual CSI bridge of Cluster API guest
clusters. The connection flags (--kubeconfig, --context, -n, ...) pick the management
cluster, except for trace, where they pick the guest cluster and --mgmt-kubeconfig the
management one. Exit codes: 0 done, 1 failed, 2 bad command line, 3 not done yet.`,
		SilenceUsage:  true,
		SilenceErrors: true,
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) > 0 {
				return usageError{cmd.CommandPath(), fmt.Errorf("unknown command %q", args[0])}
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, _ []string) error { return cmd.Help() },
	}
	root.SetIn(streams.In)
	root.SetOut(streams.Out)
	root.SetErr(streams.ErrOut)
	root.SetFlagErrorFunc(func(cmd *cobra.Command, err error) error { return usageError{cmd.CommandPath(), err} })
	flags.AddFlags(root.PersistentFlags())
	root.AddCommand(
		newTraceCommand(flags, streams),
		newHostsCommand(flags, streams),
		newVMCommand(flags, streams),
		newDrainHostCommand(flags, streams),
		newVersionCommand(streams),
	)
	return root
}

// newScheme holds what the commands read: Kubernetes' kinds and pvbridge's.
func newScheme() (*runtime.Scheme, error) {
	scheme := runtime.NewScheme()
	return scheme, errors.Join(clientgoscheme.AddToScheme(scheme), vmv1.AddToScheme(scheme), pmemv1.AddToScheme(scheme))
}

// newClient returns a client of the cluster getter's flags pick and the namespace they name
// (-n, else the context's, else "default").
func newClient(getter genericclioptions.RESTClientGetter) (client.Client, string, error) {
	scheme, err := newScheme()
	if err != nil {
		return nil, "", err
	}
	cfg, err := getter.ToRESTConfig()
	if err != nil {
		return nil, "", err
	}
	namespace, _, err := getter.ToRawKubeConfigLoader().Namespace()
	if err != nil {
		return nil, "", err
	}
	c, err := client.New(cfg, client.Options{Scheme: scheme})
	return c, namespace, err
}

// output is the -o flag of a command that prints a report: a table, or the report as JSON or
// YAML for scripts.
type output string

// add adds the flag to cmd, whose run is refused a format other than these.
func (o *output) add(cmd *cobra.Command) {
	cmd.Flags().StringVarP((*string)(o), "output", "o", "", "Output format: empty for a table, json or yaml.")
	cmd.PreRunE = func(cmd *cobra.Command, _ []string) error {
		if *o != "" && *o != "json" && *o != "yaml" {
			return usageError{cmd.CommandPath(), fmt.Errorf("--output %q is none of json, yaml (or empty, a table)", string(*o))}
		}
		return nil
	}
}

// print writes report as JSON or YAML, or as a table with table when o is empty.
func (o output) print(w io.Writer, report any, table func(io.Writer)) error {
	switch o {
	case "json":
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		return enc.Encode(report)
	case "yaml":
		out, err := yaml.Marshal(report)
		if err != nil {
			return err
		}
		_, err = w.Write(out)
		return err
	}
	table(w)
	return nil
}

func newVersionCommand(streams genericiooptions.IOStreams) *cobra.Command {
	return &cobra.Command{
		Use:   "version",
		Short: "Print the plugin's version",
		Args:  exactArgs(0),
		RunE: func(*cobra.Command, []string) error {
			fmt.Fprintln(streams.Out, "kubectl-pvbridge", versionString())
			return nil
		},
	}
}

// versionString is the version stamped at build time, else the module version Go recorded
// (go install of a tag), else "devel".
func versionString() string {
	if version != "" {
		return version
	}
	if info, ok := debug.ReadBuildInfo(); ok && info.Main.Version != "" && info.Main.Version != "(devel)" {
		return info.Main.Version
	}
	return "devel"
}
