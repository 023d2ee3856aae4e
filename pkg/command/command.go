// Package command is the frame of pvbridge's binaries, so that each main.go holds only its
// flags and what it runs: logging and feature-gate flags, parsing with a usage text, a context
// that SIGINT and SIGTERM cancel, and exit codes.
package command

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/spf13/pflag"
	"k8s.io/component-base/featuregate"
	"k8s.io/component-base/logs"
	logsapi "k8s.io/component-base/logs/api/v1"
	_ "k8s.io/component-base/logs/json/register" // --logging-format=json: the format registers itself with logsapi
	"k8s.io/klog/v2"
)

// Main adds the logging and feature-gate flags to fs (made with pflag.ExitOnError), parses the
// command line — a bad flag or a stray argument prints the usage, headed by about, and exits 2 —
// sets up logging and calls run with a context that SIGINT or SIGTERM cancels. A failure of run
// is logged and exits 1.
func Main(fs *pflag.FlagSet, name, about string, run func(ctx context.Context) error) {
	logging := logsapi.NewLoggingConfiguration()
	features := featuregate.NewFeatureGate()
	if err := logsapi.AddFeatureGates(features); err != nil {
		panic(err) // only fails when a gate is added twice
	}
	logsapi.AddFlags(logging, fs)
	features.AddFlag(fs)
	fs.Usage = func() {
		fmt.Fprintf(os.Stderr, "Usage: %s [flags]\n\n%s\n\nFlags:\n", os.Args[0], about)
		fs.PrintDefaults()
	}
	_ = fs.Parse(os.Args[1:]) // ExitOnError: Parse exits on a bad flag.
	if fs.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "unexpected arguments: %v\n", fs.Args())
		fs.Usage()
		os.Exit(2)
	}

	logs.InitLogs()
	if err := logsapi.ValidateAndApply(logging, features); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx)
	stop()
	if err != nil {
		klog.Background().Error(err, name+" failed")
		klog.FlushAndExit(klog.ExitFlushTimeout, 1)
	}
	logs.FlushLogs()
}
