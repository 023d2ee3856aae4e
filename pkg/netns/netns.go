// Package netns runs code in another network namespace: the host agents start the processes
// that must outlive their containers (a VM's QEMU, the qemu-storage-daemons of replicated
// volumes) in the host's, so that their network does not go with the pod's.
package netns

import (
	"fmt"
	"os"
	"runtime"

	"golang.org/x/sys/unix"
)

// Run runs f on an OS thread that has joined the network namespace at path (a
// /proc/<pid>/ns/net or /run/netns/<name> file), so that a process f starts, and a tap f makes,
// are in that namespace; "" runs f as it is. The thread is never handed back to the Go runtime:
// it ends with f's goroutine.
func Run(path string, f func() error) error {
	if path == "" {
		return f()
	}
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // not unlocked: the thread's namespace is not the process's
		ns, err := os.Open(path)
		if err != nil {
			errc <- fmt.Errorf("network namespace: %w", err)
			return
		}
		defer ns.Close()
		if err := unix.Setns(int(ns.Fd()), unix.CLONE_NEWNET); err != nil {
			errc <- fmt.Errorf("join network namespace %s: %w", path, err)
			return
		}
		errc <- f()
	}()
	return <-errc
}
