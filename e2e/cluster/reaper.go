package cluster

import (
	"fmt"
	"os"
	"os/exec"
	"syscall"
)

// reaperScript runs in its own session and waits for end-of-file on its standard input, a pipe
// whose only writer is the process that owns the lab. The kernel closes that pipe however the
// owner ends (Stop, panic, SIGKILL), and the script then kills every process group still
// recorded under pids/ and unmounts everything below the lab root, deepest first. After a clean
// Stop there is nothing left to do, so running it twice is harmless.
const reaperScript = `
root=$1
cat >/dev/null
for f in "$root"/pids/*; do
	[ -e "$f" ] || continue
	kill -KILL -- "-${f##*/}" 2>/dev/null
done
awk -v r="$root" '$5 == r || index($5, r "/") == 1 { print $5 }' /proc/self/mountinfo |
	sort -r | while read -r m; do umount -l "$m" 2>/dev/null; done
exit 0
`

type reaper struct {
	cmd  *exec.Cmd
	pipe *os.File // write end; closing it triggers the clean-up
}

func startReaper(root, logPath string) (*reaper, error) {
	r, w, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	defer r.Close()
	logFile, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		w.Close()
		return nil, err
	}
	defer logFile.Close()
	cmd := exec.Command("/bin/sh", "-c", reaperScript, "reaper", root)
	cmd.Stdin = r
	cmd.Stdout, cmd.Stderr = logFile, logFile
	// A session of its own: a Ctrl-C or a kill of the owner's process group does not reach it.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		w.Close()
		return nil, fmt.Errorf("start lab reaper: %w", err)
	}
	return &reaper{cmd: cmd, pipe: w}, nil
}

// finish triggers the reaper and waits until it has cleaned up.
func (r *reaper) finish() error {
	r.pipe.Close()
	return r.cmd.Wait()
}
