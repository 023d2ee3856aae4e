package cluster

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"pvbridge.io/pkg/cgroups"
)

const (
	// stopTimeout is how long a process gets after SIGTERM before it is killed.
	stopTimeout = 10 * time.Second
	// restartDelay is how soon a process with Restart set is started again after it ended.
	restartDelay = 500 * time.Millisecond
)

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
	// Restart starts the process again whenever it ends until Stop, as kubelet restarts a
	// container (restartPolicy: Always). A CSI sidecar, for one, exits when its driver does.
	Restart bool
	// Cgroup, when set, runs the process in the lab's cgroup of that name (Lab.Cgroup), as a
	// container runs in its own: Kill then kills every process of the cgroup, as a container
	// runtime stopping the container does, whatever session or process group they are in.
	Cgroup string
}

// Process is a lab daemon running in its own process group, so that stopping it also stops
// whatever it started. The pid of each run is recorded under the lab's pids/ directory while it
// runs, which is what the reaper kills if the process that owns the lab dies without stopping
// it.
type Process struct {
	Command

	lab      *Lab
	restarts atomic.Int32

	mu       sync.Mutex
	cmd      *exec.Cmd     // the current run
	ran      chan struct{} // closed when the current run has ended
	err      error         // exit error of the last run
	stopping bool

	stop chan struct{} // closed by Stop
	done chan struct{} // closed when the process has ended for good
}

// Start starts a lab daemon.
func (l *Lab) Start(c Command) (*Process, error) {
	if err := os.MkdirAll(c.Dir, 0o755); err != nil {
		return nil, err
	}
	p := &Process{Command: c, lab: l, stop: make(chan struct{}), done: make(chan struct{})}
	if err := p.spawn(); err != nil {
		return nil, err
	}
	go p.supervise()
	l.track(p)
	return p, nil
}

// spawn starts one run of the command.
func (p *Process) spawn() error {
	logFile, err := os.OpenFile(p.LogPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer logFile.Close()
	cmd := exec.Command(p.Bin, p.Args...)
	cmd.Dir = p.Dir
	cmd.Env = append(os.Environ(), p.Env...)
	cmd.Stdout, cmd.Stderr = logFile, logFile
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start %s: %w", p.Name, err)
	}
	if p.Cgroup != "" {
		if err := cgroups.Join(cgroupRoot, p.lab.Cgroup(p.Cgroup), cmd.Process.Pid); err != nil {
			_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
			_ = cmd.Wait()
			return fmt.Errorf("start %s: %w", p.Name, err)
		}
	}
	pidFile := filepath.Join(p.lab.pidDir, strconv.Itoa(cmd.Process.Pid))
	if err := os.WriteFile(pidFile, []byte(p.Name+"\n"), 0o644); err != nil {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		_ = cmd.Wait()
		return err
	}
	ran := make(chan struct{})
	p.cmd, p.ran = cmd, ran
	go func() {
		err := cmd.Wait()
		// Children that outlived the leader share its process group.
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		_ = os.Remove(pidFile)
		p.mu.Lock()
		p.err = err
		p.mu.Unlock()
		close(ran)
	}()
	return nil
}

// supervise waits for each run to end and starts the next one while Restart is set and the
// process is not being stopped.
func (p *Process) supervise() {
	defer close(p.done)
	for {
		p.mu.Lock()
		ran := p.ran
		p.mu.Unlock()
		<-ran
		if !p.Restart {
			return
		}
		select {
		case <-p.stop:
			return
		case <-time.After(restartDelay):
		}
		p.mu.Lock()
		if p.stopping {
			p.mu.Unlock()
			return
		}
		err := p.spawn()
		if err != nil {
			p.err = err
		}
		p.mu.Unlock()
		if err != nil {
			return
		}
		p.restarts.Add(1)
	}
}

// CountInLog counts the occurrences of line in the log at path (a Process's LogPath), which its
// process appends to.
func CountInLog(path, line string) (int, error) {
	log, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	return strings.Count(string(log), line), nil
}

// Pid returns the process id of the current run, which is also its process group id.
func (p *Process) Pid() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.cmd.Process.Pid
}

// Restarts counts how often the process was started again.
func (p *Process) Restarts() int { return int(p.restarts.Load()) }

// Exited reports whether the process has ended for good.
func (p *Process) Exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// Done is closed when the process has ended for good.
func (p *Process) Done() <-chan struct{} { return p.done }

// Stop sends SIGTERM to the process group, waits up to stopTimeout, then kills the group, and
// restarts it no more. It is idempotent and returns the exit error of a process that had ended
// on its own.
func (p *Process) Stop() error { return p.end(syscall.SIGTERM) }

// Halt kills the process group at once with SIGKILL, as a machine's power loss would, and
// restarts it no more (Respawn starts it again). It is idempotent, as Stop.
func (p *Process) Halt() error { return p.end(syscall.SIGKILL) }

// end sends sig to the process group, waits up to stopTimeout, then kills the group, and
// restarts it no more.
func (p *Process) end(sig syscall.Signal) error {
	p.mu.Lock()
	if p.stopping {
		p.mu.Unlock()
		<-p.done
		return nil
	}
	p.stopping = true
	close(p.stop)
	cmd, ran := p.cmd, p.ran
	p.mu.Unlock()

	if p.Exited() {
		return p.exitError()
	}
	_ = syscall.Kill(-cmd.Process.Pid, sig)
	select {
	case <-ran:
	case <-time.After(stopTimeout):
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		<-ran
	}
	<-p.done
	return nil
}

// Kill kills the current run with SIGKILL, as a crash would (with Cgroup, every process of its
// cgroup, as a container runtime stopping its container would), and waits until it has ended.
// A process with Restart set is then started again, as kubelet restarts a crashed container.
func (p *Process) Kill() error {
	p.mu.Lock()
	cmd, ran := p.cmd, p.ran
	p.mu.Unlock()
	if p.Cgroup != "" {
		if err := cgroups.Kill(cgroupRoot, p.lab.Cgroup(p.Cgroup)); err != nil {
			return err
		}
	}
	if err := syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL); err != nil && err != syscall.ESRCH {
		return err
	}
	<-ran
	return nil
}

// Respawn starts a process without Restart again with the same command after it ended. The
// new Process replaces this one.
func (p *Process) Respawn() (*Process, error) {
	if !p.Exited() {
		return nil, fmt.Errorf("%s is still running", p.Name)
	}
	return p.lab.Start(p.Command)
}

func (p *Process) exitError() error {
	p.mu.Lock()
	defer p.mu.Unlock()
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

// Tail is the last n lines of a file (a log), or why it could not be read.
func Tail(file string, n int) string {
	data, err := os.ReadFile(file)
	if err != nil {
		return err.Error()
	}
	lines := strings.Split(string(data), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}
