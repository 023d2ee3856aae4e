// Package command is the frame of pvbridge's binaries, so that each main.go holds only its
// flags and what it runs: logging and feature-gate flags, --version, parsing with a usage text,
// a context that SIGINT and SIGTERM cancel, exit codes, and the build information metric.
package command

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"runtime"
	"syscall"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/spf13/pflag"
	"k8s.io/component-base/featuregate"
	"k8s.io/component-base/logs"
	logsapi "k8s.io/component-base/logs/api/v1"
	_ "k8s.io/component-base/logs/json/register" // --logging-format=json: the format registers itself with logsapi
	"k8s.io/klog/v2"
	"sigs.k8s.io/controller-runtime/pkg/metrics"
)

// Main adds the logging and feature-gate flags and --version to fs (made with
// pflag.ExitOnError), parses the command line — a bad flag or a stray argument prints the usage,
// headed by about and the version, and exits 2; --version prints the name and version and exits
// 0 — registers the build information (BuildInfo) with controller-runtime's metrics registry,
// sets up logging and calls run with a context that SIGINT or SIGTERM cancels. A failure of run
// is logged and exits 1.
func Main(fs *pflag.FlagSet, name, version, about string, run func(ctx context.Context) error) {
	printVersion := fs.Bool("version", false, "print the version and exit")
	logging := logsapi.NewLoggingConfiguration()
	features := featuregate.NewFeatureGate()
	if err := logsapi.AddFeatureGates(features); err != nil {
		panic(err) // only fails when a gate is added twice
	}
	logsapi.AddFlags(logging, fs)
	features.AddFlag(fs)
	fs.Usage = func() {
		fmt.Fprintf(os.Stderr, "Usage: %s [flags]\n\n%s Version %s.\n\nFlags:\n", os.Args[0], about, version)
		fs.PrintDefaults()
	}
	_ = fs.Parse(os.Args[1:]) // ExitOnError: Parse exits on a bad flag.
	if *printVersion {
		fmt.Println(name, version)
		os.Exit(0)
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "unexpected arguments: %v\n", fs.Args())
		fs.Usage()
		os.Exit(2)
	}

	metrics.Registry.MustRegister(BuildInfo(name, version))
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

// BuildInfo is the gauge pvbridge_build_info{component, version, go_version}, always 1: which
// build of each component a Prometheus scrapes, as kubernetes_build_info says of Kubernetes'.
// Main registers it with controller-runtime's metrics registry; a component that serves a
// registry of its own registers it there too.
func BuildInfo(component, version string) prometheus.Collector {
	g := prometheus.NewGauge(prometheus.GaugeOpts{
		Name:        "pvbridge_build_info",
		Help:        "The build of this pvbridge component: its version (main.version, devel when unset) and Go version. Always 1.",
		ConstLabels: prometheus.Labels{"component": component, "version": version, "go_version": runtime.Version()},
	})
	g.Set(1)
	return g
}
