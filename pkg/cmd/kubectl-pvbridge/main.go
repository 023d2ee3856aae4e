// Command kubectl-pvbridge is a kubectl plugin for pvbridge's operators: `kubectl pvbridge trace
// pvc <name>` (or `trace pv <name>`) prints the chain of objects a guest volume is made of in
// both clusters and, for the step that holds it, which object and why; `kubectl pvbridge
// drain-host <host>` drains a management host before its maintenance, and `--undo` brings it
// back.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"

	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/controller-runtime/pkg/client"

	pmemv1 "pvbridge.io/pkg/apis/pmem/v1alpha1"
	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
)

// Exit codes: done (a chain whose every step is, a host drained), not done, a failure to read
// the clusters, a bad command line.
const (
	exitDone     = 0
	exitError    = 1
	exitUsage    = 2
	exitNotReady = 3
)

const usage = `Usage:
  kubectl pvbridge trace (pvc NAME [-n NAMESPACE] | pv NAME) --mgmt-kubeconfig FILE [flags]
  kubectl pvbridge drain-host HOST [--undo] [--wait DURATION] [flags]

Run a command with --help for its flags.
`

func main() {
	os.Exit(run(context.Background(), os.Args[1:], os.Stdout, os.Stderr))
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) > 0 {
		switch args[0] {
		case "trace":
			return runTrace(ctx, args[1:], stdout, stderr)
		case "drain-host":
			return runDrainHost(ctx, args[1:], stdout, stderr)
		}
	}
	fmt.Fprint(stderr, usage)
	return exitUsage
}

// newScheme holds what the commands read: Kubernetes' kinds and pvbridge's.
func newScheme() (*runtime.Scheme, error) {
	scheme := runtime.NewScheme()
	return scheme, errors.Join(clientgoscheme.AddToScheme(scheme), vmv1.AddToScheme(scheme), pmemv1.AddToScheme(scheme))
}

// reader returns a client of the cluster of kubeconfig (kubectl's loading rules when empty) and
// the namespace of its context ("default" when it names none).
func reader(kubeconfig string, scheme *runtime.Scheme) (client.Client, string, error) {
	rules := clientcmd.NewDefaultClientConfigLoadingRules()
	rules.ExplicitPath = kubeconfig
	loader := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules, &clientcmd.ConfigOverrides{})
	cfg, err := loader.ClientConfig()
	if err != nil {
		return nil, "", err
	}
	namespace, _, err := loader.Namespace()
	if err != nil {
		return nil, "", err
	}
	c, err := client.New(cfg, client.Options{Scheme: scheme})
	return c, namespace, err
}
