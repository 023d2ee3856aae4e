package cluster

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"time"
)

// stopTimeout is how long a process gets after SIGTERM before it is killed.
const stopTimeout = 10 * time.Second

// Command is a lab daemon to start.
type Command struct {
	// Name identifies the process in logs and errors, e.g. "mgmt/kubelet".
	Name string
	// Bin and Args are the command line.
	Bin  string
	Args []string
	// Env is added to the lab process's environment.
	Env []string
	// Dir is the working directory; it is created if missing.
	Dir string
	// LogPath receives stdout and stderr, appended.
	LogPath string
}

// Process is a lab daemon running in its own process group, so that stopping it also stops
// whatever it started. Its pid is recorded under the lab's pids/ directory while it runs, which is
// what the reaper kills if the process that owns the lab dies without stopping it.
type Process struct {
	Command

	lab     *Lab
	cmd     *exec.Cmd
	pidFile string
	done    chan struct{}
	err     error // exit error; valid once done is closed

	stopOnce sync.Once
}

// Start starts a lab daemon.
func (l *Lab) Start(c Command) (*Process, error) {
	if err := os.MkdirAll(c.Dir, 0o755); err != nil {
		return nil, err
	}
	logFile, err := os.OpenFile(c.LogPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	defer logFile.Close()

	cmd := exec.Command(c.Bin, c.Args...)
	cmd.Dir = c.Dir
	cmd.Env = append(os.Environ(), c.Env...)
	cmd.Stdout, cmd.Stderr = logFile, logFile
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", c.Name, err)
	}
	p := &Process{
		Command: c,
		lab:     l,
		cmd:     cmd,
		pidFile: filepath.Join(l.pidDir, strconv.Itoa(cmd.Process.Pid)),
		done:    make(chan struct{}),
	}
	if err := os.WriteFile(p.pidFile, []byte(c.Name+"\n"), 0o644); err != nil {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		return nil, err
	}
	go func() {
		p.err = cmd.Wait()
		close(p.done)
	}()
	l.track(p)
	return p, nil
}

// Respawn starts the process again with the same command, after it ended (a test kills it to
// prove recovery). The new Process replaces this one.
func (p *Process) Respawn() (*Process, error) {
	if !p.Exited() {
		return nil, fmt.Errorf("%s is still running", p.Name)
	}
	_ = p.Stop() // releases its pid file
	return p.lab.Start(p.Command)
}

// Pid returns the process id, which is also its process group id.
func (p *Process) Pid() int { return p.cmd.Process.Pid }

// Exited reports whether the process has ended.
func (p *Process) Exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// Done is closed when the process has ended.
func (p *Process) Done() <-chan struct{} { return p.done }

// Stop sends SIGTERM to the process group, waits up to stopTimeout, then kills the group.
// It is idempotent and returns the process's exit error only if it had ended on its own.
func (p *Process) Stop() error { return p.stop(syscall.SIGTERM) }

// Kill kills the process group with SIGKILL, as a crash would.
func (p *Process) Kill() error { return p.stop(syscall.SIGKILL) }

func (p *Process) stop(sig syscall.Signal) error {
	var err error
	p.stopOnce.Do(func() {
		if p.Exited() {
			err = p.exitError()
		} else {
			_ = syscall.Kill(-p.Pid(), sig)
			select {
			case <-p.done:
			case <-time.After(stopTimeout):
				_ = syscall.Kill(-p.Pid(), syscall.SIGKILL)
				<-p.done
			}
		}
		// Children that outlived the leader share its process group.
		_ = syscall.Kill(-p.Pid(), syscall.SIGKILL)
		if rmErr := os.Remove(p.pidFile); rmErr != nil && !errors.Is(rmErr, os.ErrNotExist) && err == nil {
			err = rmErr
		}
	})
	return err
}

func (p *Process) exitError() error {
	if p.err == nil {
		return nil
	}
	return fmt.Errorf("%s exited: %w (log: %s)", p.Name, p.err, p.LogPath)
}

// pidsIn lists the pids recorded in a lab's pid directory.
func pidsIn(dir string) ([]int, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	var pids []int
	for _, e := range entries {
		if pid, err := strconv.Atoi(e.Name()); err == nil {
			pids = append(pids, pid)
		}
	}
	return pids, nil
}
