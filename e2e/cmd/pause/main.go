// Command pause is the lab's pod sandbox process, what registry.k8s.io/pause is in a cluster
// (whose sources the module proxy does not serve): it holds the pod's namespaces, reaps the
// orphans it inherits as the pod's PID 1, and exits on SIGINT or SIGTERM.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	sig := make(chan os.Signal, 8)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for s := range sig {
		if s != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			var ws syscall.WaitStatus
			if pid, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil); pid <= 0 || err != nil {
				break
			}
		}
	}
}
