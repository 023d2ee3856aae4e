package cluster

import (
	"fmt"
	"os"
	"os/exec"
	"sync"
	"syscall"
)

// reaperScript runs in its own session and waits for end-of-file on its standard input, a pipe
// whose only writer is the process that owns the lab. The kernel closes that pipe however the
// owner ends (Stop, panic, SIGKILL), and the script then kills every process group still
// recorded under pids/, removes the cgroups of its containerd nodes' containers, unmounts
// everything below the lab root (deepest first), detaches the loop devices of files below it
// (and of files on those), and removes the pod networks of its containerd nodes (bridges
// recorded under bridges/, their subnet locks, the DNAT rules marked with the root). Stop runs
// it last; what Stop already cleaned up it finds gone, so running it twice is harmless. It needs
// bash: dash's kill cannot signal a process group.
const reaperScript = `
root=$1
cat >/dev/null
for f in "$root"/pids/*; do
	[ -e "$f" ] || continue
	kill -KILL -- "-${f##*/}" 2>/dev/null
done
# The cgroups runc made for the containers of the containerd nodes and VMs, /k8s.io/<id> in each hierarchy
# (named by the tasks' state directories): the containers die with their node's namespace and
# nobody deletes them, and every kubelet's cAdvisor on the machine that watches "/" would read
# them every 10 s. A cgroup can go once the kernel has ended its processes: up to 10 s.
cgroups=""
for t in "$root"/*/nodes/*/root/run/containerd/io.containerd.runtime.v2.task/k8s.io/* "$root"/vms/*/root/run/containerd/io.containerd.runtime.v2.task/k8s.io/*; do
	[ -e "$t" ] || continue
	for c in /sys/fs/cgroup/k8s.io/"${t##*/}" /sys/fs/cgroup/*/k8s.io/"${t##*/}"; do
		[ -d "$c" ] && cgroups="$cgroups $c"
	done
done
for i in $(seq 100); do
	left=""
	for c in $cgroups; do
		rmdir "$c" 2>/dev/null || { [ -d "$c" ] && left="$left $c"; }
	done
	cgroups=$left
	[ -z "$cgroups" ] && break
	sleep 0.1
done
# The lab's own cgroups (Lab.Cgroup), pvbridge-lab/<the root's name> in each hierarchy: what is
# left in them (a QEMU, in a session of its own) is killed, then they go, deepest first.
for c in /sys/fs/cgroup/pvbridge-lab/"${root##*/}" /sys/fs/cgroup/*/pvbridge-lab/"${root##*/}"; do
	[ -d "$c" ] && find "$c" -name cgroup.procs -exec cat {} + | xargs -r kill -KILL 2>/dev/null
done
for i in $(seq 100); do
	left=""
	for c in /sys/fs/cgroup/pvbridge-lab/"${root##*/}" /sys/fs/cgroup/*/pvbridge-lab/"${root##*/}"; do
		[ -d "$c" ] || continue
		find "$c" -depth -type d -exec rmdir {} + 2>/dev/null || left=1
	done
	[ -z "$left" ] && break
	sleep 0.1
done
# Loop devices whose backing file is on a loop device below the root (a containerd node's
# volumes on its PMEM filesystem, with the container's path) go first: they keep that
# filesystem busy. Only devices whose file this namespace does not have are looked at: opening
# other devices would race their owners' detach.
detach_inner() {
	outer=" "
	for f in /sys/block/loop*/loop/backing_file; do
		[ -e "$f" ] || continue
		b=$(cat "$f" 2>/dev/null) || continue
		case "$b" in "$root"/*) d=${f#/sys/block/}; outer="$outer$(cat "/sys/block/${d%%/*}/dev") " ;; esac
	done
	[ "$outer" = " " ] && return
	for f in /sys/block/loop*/loop/backing_file; do
		[ -e "$f" ] || continue
		b=$(cat "$f" 2>/dev/null) || continue
		case "$b" in "$root"/* | *" (deleted)") continue ;; esac
		[ -e "$b" ] && continue
		d=${f#/sys/block/}
		d=/dev/${d%%/*}
		dev=$(losetup --noheadings --output BACK-MAJ:MIN "$d" 2>/dev/null | tr -d ' ')
		case "$outer" in *" $dev "*) losetup -d "$d" 2>/dev/null ;; esac
	done
}
detach() {
	for f in /sys/block/loop*/loop/backing_file; do
		[ -e "$f" ] || continue
		b=$(cat "$f" 2>/dev/null) || continue
		case "$b" in "$root"/*) d=${f#/sys/block/}; losetup -d "/dev/${d%%/*}" 2>/dev/null ;; esac
	done
}
detach_inner
detach
awk -v r="$root" '$5 == r || index($5, r "/") == 1 { print $5 }' /proc/self/mountinfo |
	sort -r | while read -r m; do umount -l "$m" 2>/dev/null; done
detach
for f in "$root"/bridges/*; do
	[ -e "$f" ] || continue
	ip link del "${f##*/}" 2>/dev/null
	rm -f "$(cat "$f")"
done
if command -v iptables-save >/dev/null; then
	iptables-save -t nat | grep -F -- "--comment \"pvbridge-lab $root\"" | sed 's/^-A /-D /' |
		while read -r rule; do eval iptables -t nat "$rule"; done
fi
exit 0
`

type reaper struct {
	cmd  *exec.Cmd
	pipe *os.File // write end; closing it triggers the clean-up
}

// liveReapers keeps every running reaper reachable: were a Lab dropped without Stop, the
// finalizer of its pipe would close it and clean the lab up under a process still using it.
var liveReapers sync.Map

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
	cmd := exec.Command("/bin/bash", "-c", reaperScript, "reaper", root)
	cmd.Stdin = r
	cmd.Stdout, cmd.Stderr = logFile, logFile
	// A session of its own: a Ctrl-C or a kill of the owner's process group does not reach it.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		w.Close()
		return nil, fmt.Errorf("start lab reaper: %w", err)
	}
	rp := &reaper{cmd: cmd, pipe: w}
	liveReapers.Store(rp, struct{}{})
	return rp, nil
}

// finish triggers the reaper and waits until it has cleaned up.
func (r *reaper) finish() error {
	defer liveReapers.Delete(r)
	r.pipe.Close()
	return r.cmd.Wait()
}
