package cluster

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"golang.org/x/sys/unix"
)

// LoopsBelow lists the loop devices (/dev/loopN) whose backing file is at or below dir, then
// those whose backing file is on one of them (volumes a containerd node's mgmt-csi made on its
// PMEM filesystem: their path, as the container saw it, says nothing of dir). Outer devices
// come first.
func LoopsBelow(dir string) ([]string, error) {
	files, err := filepath.Glob("/sys/block/loop*/loop/backing_file")
	if err != nil {
		return nil, err
	}
	var loops, others []string
	devs := map[uint64]bool{} // of the loops below dir
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			continue // detached meanwhile
		}
		name := filepath.Base(filepath.Dir(filepath.Dir(f)))
		backing := strings.TrimSuffix(strings.TrimSuffix(string(data), "\n"), " (deleted)")
		if backing != dir && !strings.HasPrefix(backing, dir+"/") {
			// Only a device whose file this mount namespace does not have can be on one of
			// ours (a container's path); opening the others' would race their owners' detach.
			if _, err := os.Stat(backing); errors.Is(err, os.ErrNotExist) && !strings.HasSuffix(string(data), " (deleted)\n") {
				others = append(others, "/dev/"+name)
			}
			continue
		}
		loops = append(loops, "/dev/"+name)
		var st unix.Stat_t
		if unix.Stat("/dev/"+name, &st) == nil {
			devs[st.Rdev] = true
		}
	}
	if len(devs) == 0 {
		return loops, nil
	}
	for _, l := range others {
		if dev, ok := backingDevice(l); ok && devs[dev] {
			loops = append(loops, l)
		}
	}
	return loops, nil
}

// daemonRunDirs are where the hosts' qemu-storage-daemons keep their FUSE exports, one
// directory per disk, as a node's namespace has them: the local hypervisor's throttled disks
// and mgmt-csi's targets of replicated volumes.
var daemonRunDirs = []string{"/run/pvbridge/local/", "/run/pvbridge/mgmt-csi/t/"}

// daemonLoops lists the loop devices over the FUSE exports of the qemu-storage-daemons that
// the nodes of nodeDirs run: their backing file is <run dir><disk>/disk in a node's namespace,
// whose directory the lab has below the node's (a node's /run/pvbridge is a directory of the
// lab). They must be listed while the daemons run: a daemon gone, its export is unmounted and
// the loop device names no file.
func daemonLoops(nodeDirs ...string) []string {
	files, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
	var loops []string
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		for _, runDir := range daemonRunDirs {
			disk, ok := strings.CutPrefix(strings.TrimSpace(string(data)), runDir)
			if !ok || strings.Contains(filepath.Dir(disk), "/") {
				continue
			}
			if slices.ContainsFunc(nodeDirs, func(d string) bool { return isDir(filepath.Join(d, "root", runDir, filepath.Dir(disk))) }) {
				loops = append(loops, "/dev/"+filepath.Base(filepath.Dir(filepath.Dir(f))))
			}
		}
	}
	return loops
}

// nodeDirs lists the directories of the nodes (and VMs) of the lab at root: those with a root/.
func nodeDirs(root string) []string {
	var dirs []string
	for _, pattern := range []string{"/*", "/*/*", "/*/*/*"} {
		m, _ := filepath.Glob(root + pattern + "/root")
		for _, r := range m {
			dirs = append(dirs, filepath.Dir(r))
		}
	}
	return dirs
}

func isDir(path string) bool {
	info, err := os.Stat(path)
	return err == nil && info.IsDir()
}

// backingDevice returns the device of the filesystem that holds loop device l's backing file.
func backingDevice(l string) (uint64, bool) {
	f, err := os.Open(l)
	if err != nil {
		return 0, false
	}
	defer f.Close()
	info, err := unix.IoctlLoopGetStatus64(int(f.Fd()))
	if err != nil {
		return 0, false
	}
	return unix.Mkdev(unix.Major(info.Device), unix.Minor(info.Device)), true
}

// DetachLoopsBelow detaches every loop device backed by a file below dir. A device still in use
// (mounted) gets auto-clear instead, so it goes away with its last user.
func DetachLoopsBelow(dir string) error {
	loops, err := LoopsBelow(dir)
	if err != nil {
		return err
	}
	var errs []error
	for _, l := range slices.Backward(loops) { // inner devices first
		if err := detachLoop(l); err != nil {
			errs = append(errs, fmt.Errorf("detach %s: %w", l, err))
		}
	}
	return errors.Join(errs...)
}

func detachLoop(dev string) error {
	f, err := os.OpenFile(dev, os.O_RDONLY, 0)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	defer f.Close()
	err = unix.IoctlSetInt(int(f.Fd()), unix.LOOP_CLR_FD, 0)
	if errors.Is(err, unix.ENXIO) { // not attached any more
		return nil
	}
	return err
}
