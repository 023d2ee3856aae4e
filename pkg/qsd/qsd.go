// Package qsd runs qemu-storage-daemons that outlive the agent that starts them, and talks to
// them over QMP. A daemon lives in a directory of its own (Dir): its QMP socket, its pid file
// and whatever its user keeps beside them. It runs with --daemonize in a session of its own, so
// a restarted agent finds it again as the holder of the lock on its pid file, never by a pid
// that a dead daemon may have left to another process.
//
// vm-operator's local hypervisor runs one per throttled disk; mgmt-csi's node agent one as its
// host's replica server and one per replicated volume it serves to the host (the target).
package qsd

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"
)

// Binary is the daemon, looked up in PATH.
const Binary = "qemu-storage-daemon"

// Files of a daemon's directory.
const (
	// SocketName is the daemon's QMP socket.
	SocketName = "qmp.sock"
	pidName    = "qsd.pid"
)

// MaxDirLen is the longest directory a daemon can have: its QMP socket's path must fit the 107
// bytes of a unix socket address.
const MaxDirLen = 107 - len("/"+SocketName)

// stopTimeout is how long a daemon has to exit after SIGTERM before it is killed.
const stopTimeout = 10 * time.Second

// Dir is the directory of one daemon.
type Dir string

// Path returns the path of name in the daemon's directory.
func (d Dir) Path(name string) string { return filepath.Join(string(d), name) }

// Start starts the daemon of d with args, which follow the daemon's own options (its pid
// file and its QMP monitor on d's socket), creating d if needed. qemu-storage-daemon
// --daemonize returns once what args ask for is up and its pid file written, or with the
// reason it failed, which the error carries.
func Start(ctx context.Context, d Dir, args ...string) error {
	if len(d) > MaxDirLen {
		return fmt.Errorf("the directory of a qemu-storage-daemon, %s, is longer than %d bytes", d, MaxDirLen)
	}
	if err := os.MkdirAll(string(d), 0o700); err != nil {
		return fmt.Errorf("create the daemon's directory: %w", err)
	}
	cmd := exec.CommandContext(ctx, Binary, append([]string{
		"--daemonize", "--pidfile", d.Path(pidName),
		"--chardev", "socket,id=qmp,server=on,wait=off,path=" + OptValue(d.Path(SocketName)),
		"--monitor", "chardev=qmp",
	}, args...)...)
	// In a session of its own from the start: a signal to the agent's process group does not
	// reach it even before it daemonizes.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("start %s: %w: %s", Binary, err, bytes.TrimSpace(out))
	}
	return nil
}

// OptValue escapes a value for QEMU's option syntax, where a comma is written twice.
func OptValue(s string) string { return strings.ReplaceAll(s, ",", ",,") }

// Pid returns the pid of the daemon of d; 0 if it does not run. qemu-storage-daemon holds a
// lock on its pid file for its whole life, so the holder of that lock is the daemon, never a
// process that reused the pid of a dead one.
func Pid(d Dir) (int, error) {
	f, err := os.Open(d.Path(pidName))
	if errors.Is(err, fs.ErrNotExist) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("open the daemon's pid file: %w", err)
	}
	defer f.Close()
	lock := unix.Flock_t{Type: unix.F_WRLCK, Whence: io.SeekStart}
	if err := unix.FcntlFlock(f.Fd(), unix.F_GETLK, &lock); err != nil {
		return 0, fmt.Errorf("read the lock of the daemon's pid file: %w", err)
	}
	if lock.Type == unix.F_UNLCK {
		return 0, nil
	}
	return int(lock.Pid), nil
}

// Stop stops the daemon of d, if it runs, and returns once it has exited: SIGTERM, on which it
// closes its exports (a FUSE export is unmounted), then SIGKILL if it has not exited within
// stopTimeout.
func Stop(ctx context.Context, d Dir) error { return signal(ctx, d, unix.SIGTERM) }

// Kill kills the daemon of d, if it runs, as a crash would (its FUSE export stays mounted, its
// connections are reset), and returns once it has exited.
func Kill(ctx context.Context, d Dir) error { return signal(ctx, d, unix.SIGKILL) }

// signal sends sig to the daemon of d, if it runs, and waits until it has exited, killing it
// if it has not within stopTimeout.
func signal(ctx context.Context, d Dir, sig unix.Signal) error {
	pid, err := Pid(d)
	if err != nil || pid == 0 {
		return err
	}
	fd, err := unix.PidfdOpen(pid, unix.PIDFD_NONBLOCK)
	if errors.Is(err, unix.ESRCH) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("open qemu-storage-daemon %d: %w", pid, err)
	}
	proc := os.NewFile(uintptr(fd), "pidfd") // pollable: non-blocking
	defer proc.Close()
	// The pidfd is the daemon's only if the daemon still holds its lock: the pid may have been
	// reused since it was read.
	switch again, err := Pid(d); {
	case err != nil:
		return err
	case again == 0:
		return nil
	case again != pid:
		return fmt.Errorf("qemu-storage-daemon %d replaced by %d while stopping it", pid, again)
	}
	if err := unix.PidfdSendSignal(fd, sig, nil, 0); err != nil && !errors.Is(err, unix.ESRCH) {
		return fmt.Errorf("signal qemu-storage-daemon %d: %w", pid, err)
	}
	tctx, cancel := context.WithTimeout(ctx, stopTimeout)
	err = waitExit(tctx, proc)
	cancel()
	if err == nil || ctx.Err() != nil || sig == unix.SIGKILL {
		return wrapErr(fmt.Sprintf("wait for qemu-storage-daemon %d to exit", pid), err)
	}
	klog.FromContext(ctx).Info("Killing qemu-storage-daemon that did not exit", "pid", pid, "dir", string(d))
	if err := unix.PidfdSendSignal(fd, unix.SIGKILL, nil, 0); err != nil && !errors.Is(err, unix.ESRCH) {
		return fmt.Errorf("kill qemu-storage-daemon %d: %w", pid, err)
	}
	return wrapErr(fmt.Sprintf("wait for qemu-storage-daemon %d to exit", pid), waitExit(ctx, proc))
}

// wrapErr wraps err, unless nil, with what was being done.
func wrapErr(doing string, err error) error {
	if err == nil {
		return nil
	}
	return fmt.Errorf("%s: %w", doing, err)
}

// waitExit waits until the process of the pidfd proc has exited, which the pidfd reports by
// becoming readable, or until ctx ends.
func waitExit(ctx context.Context, proc *os.File) error {
	rc, err := proc.SyscallConn()
	if err != nil {
		return err
	}
	if err := proc.SetReadDeadline(time.Time{}); err != nil {
		return err
	}
	stop := context.AfterFunc(ctx, func() { _ = proc.SetReadDeadline(time.Now()) })
	defer stop()
	err = rc.Read(func(fd uintptr) bool {
		fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}} //nolint:gosec // a descriptor fits
		n, err := unix.Poll(fds, 0)
		return n > 0 || err != nil
	})
	if ctx.Err() != nil {
		return context.Cause(ctx)
	}
	return err
}

// UnmountAll unmounts whatever is mounted on path: the FUSE export a killed daemon left.
func UnmountAll(path string) error {
	for {
		err := unix.Unmount(path, unix.MNT_DETACH)
		switch {
		case errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOENT):
			return nil // not a mount point (any more)
		case err != nil:
			return fmt.Errorf("unmount %s: %w", path, err)
		}
	}
}
