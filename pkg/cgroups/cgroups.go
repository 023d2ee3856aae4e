// Package cgroups puts processes in cgroups of the host's cgroup filesystem, cgroup v1 (one
// hierarchy per controller, as on this project's lab machine) or v2 (unified): the host agent
// runs each QEMU in a cgroup of its own, outside its container's, so that the VM's memory is
// not charged to the agent and the container runtime, which kills every process of a
// container's cgroup when it stops it, does not kill the VM with it.
package cgroups

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// procs is the file of a cgroup that lists its processes, and moves one in when written.
const procs = "cgroup.procs"

// Hierarchies lists the cgroup hierarchies mounted at root: root itself when it is a cgroup v2
// mount, else each of its directories that is a v1 hierarchy (memory, pids, name=systemd, ...).
func Hierarchies(root string) ([]string, error) {
	if exists(filepath.Join(root, procs)) {
		return []string{root}, nil
	}
	entries, err := os.ReadDir(root)
	if err != nil {
		return nil, fmt.Errorf("cgroup filesystem %s: %w", root, err)
	}
	var hierarchies []string
	for _, e := range entries {
		dir := filepath.Join(root, e.Name())
		// Not a link: cpu and cpuacct are often links to the one hierarchy cpu,cpuacct.
		if e.IsDir() && exists(filepath.Join(dir, procs)) {
			hierarchies = append(hierarchies, dir)
		}
	}
	if len(hierarchies) == 0 {
		return nil, fmt.Errorf("no cgroup hierarchy at %s", root)
	}
	return hierarchies, nil
}

// Join moves process pid, all its threads, into the cgroup path (relative to each hierarchy,
// e.g. "pvbridge-vms/ns_vm") of every hierarchy at root, making the cgroup where it is missing.
// Joining the cgroup it is in is success.
func Join(root, path string, pid int) error {
	hierarchies, err := Hierarchies(root)
	if err != nil {
		return err
	}
	for _, h := range hierarchies {
		dir, err := makeCgroup(h, path)
		if err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(dir, procs), []byte(strconv.Itoa(pid)), 0); err != nil {
			return fmt.Errorf("move process %d into cgroup %s: %w", pid, dir, err)
		}
	}
	return nil
}

// Make makes the cgroup path (relative to each hierarchy) in every hierarchy at root where it
// is missing, as Join does.
func Make(root, path string) error {
	hierarchies, err := Hierarchies(root)
	if err != nil {
		return err
	}
	for _, h := range hierarchies {
		if _, err := makeCgroup(h, path); err != nil {
			return err
		}
	}
	return nil
}

// makeCgroup makes the cgroup path below hierarchy h, level by level, and returns its directory.
// A new v1 cpuset cgroup takes its parent's CPUs and memory nodes (it has none, and refuses
// processes, until set); a new v2 cgroup's parent passes its controllers down when it may.
func makeCgroup(h, path string) (string, error) {
	dir := h
	for _, name := range strings.Split(filepath.Clean(path), string(filepath.Separator)) {
		parent := dir
		dir = filepath.Join(dir, name)
		if err := os.Mkdir(dir, 0o755); errors.Is(err, os.ErrExist) {
			continue
		} else if err != nil {
			return "", fmt.Errorf("make cgroup %s: %w", dir, err)
		}
		for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
			if value, err := os.ReadFile(filepath.Join(parent, f)); err == nil {
				if err := os.WriteFile(filepath.Join(dir, f), value, 0); err != nil {
					return "", fmt.Errorf("cgroup %s: %s: %w", dir, f, err)
				}
			}
		}
		if controllers, err := os.ReadFile(filepath.Join(parent, "cgroup.controllers")); err == nil {
			// Best effort: a parent with processes of its own cannot pass controllers down,
			// and the cgroup then counts on the nearest ancestor that has them.
			_ = os.WriteFile(filepath.Join(parent, "cgroup.subtree_control"), []byte(enable(string(controllers))), 0)
		}
	}
	return dir, nil
}

// enable is the cgroup.subtree_control line that enables the controllers a cgroup counts a
// process's use with.
func enable(available string) string {
	var on []string
	for _, c := range strings.Fields(available) {
		if c == "cpu" || c == "memory" || c == "pids" || c == "io" {
			on = append(on, "+"+c)
		}
	}
	return strings.Join(on, " ")
}

// Pids lists the processes in the cgroup path of the hierarchies at root (they are the same in
// each hierarchy a process was joined to: the first that has the cgroup says); none when no
// hierarchy has it.
func Pids(root, path string) ([]int, error) {
	hierarchies, err := Hierarchies(root)
	if err != nil {
		return nil, err
	}
	for _, h := range hierarchies {
		if pids, err := readPids(filepath.Join(h, path)); err == nil || !errors.Is(err, os.ErrNotExist) {
			return pids, err
		}
	}
	return nil, nil
}

// readPids lists the processes of the cgroup dir.
func readPids(dir string) ([]int, error) {
	data, err := os.ReadFile(filepath.Join(dir, procs))
	if err != nil {
		return nil, err
	}
	var pids []int
	for _, f := range strings.Fields(string(data)) {
		pid, err := strconv.Atoi(f)
		if err != nil {
			return nil, fmt.Errorf("%s: %q: %w", filepath.Join(dir, procs), f, err)
		}
		pids = append(pids, pid)
	}
	return pids, nil
}

// Kill sends SIGKILL to every process in the cgroup path and in the cgroups below it, as a
// container runtime stopping a container does. It does not wait for them to end: Remove fails
// with EBUSY until they have.
func Kill(root, path string) error {
	hierarchies, err := Hierarchies(root)
	if err != nil {
		return err
	}
	// Every process is in every hierarchy (Join): one hierarchy lists them all.
	return filepath.WalkDir(filepath.Join(hierarchies[0], path), func(p string, e os.DirEntry, err error) error {
		if errors.Is(err, os.ErrNotExist) {
			return nil
		}
		if err != nil || !e.IsDir() {
			return err
		}
		pids, err := readPids(p)
		if errors.Is(err, os.ErrNotExist) {
			return nil // removed meanwhile
		} else if err != nil {
			return err
		}
		for _, pid := range pids {
			if err := syscall.Kill(pid, syscall.SIGKILL); err != nil && !errors.Is(err, syscall.ESRCH) {
				return fmt.Errorf("kill process %d of cgroup %s: %w", pid, p, err)
			}
		}
		return nil
	})
}

// Destroy kills every process of the cgroup path and of those below it, then removes them once
// those processes are gone: a process counts in its cgroup until its parent has reaped it. It
// tries until ctx ends, then returns the last error.
func Destroy(ctx context.Context, root, path string) error {
	if err := Kill(root, path); err != nil {
		return err
	}
	for {
		err := Remove(root, path)
		if err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return err
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// Remove removes the cgroup path, and the cgroups below it, from every hierarchy at root. A
// cgroup that does not exist is success; one that still has processes is an error (EBUSY).
func Remove(root, path string) error {
	hierarchies, err := Hierarchies(root)
	if err != nil {
		return err
	}
	var errs []error
	for _, h := range hierarchies {
		errs = append(errs, removeTree(filepath.Join(h, path)))
	}
	return errors.Join(errs...)
}

// removeTree removes the cgroup dir and its children, deepest first (a cgroup's own files are
// not files to remove: rmdir of the directory takes them).
func removeTree(dir string) error {
	entries, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	} else if err != nil {
		return err
	}
	for _, e := range entries {
		if e.IsDir() {
			if err := removeTree(filepath.Join(dir, e.Name())); err != nil {
				return err
			}
		}
	}
	if err := syscall.Rmdir(dir); err != nil && !errors.Is(err, syscall.ENOENT) {
		return fmt.Errorf("remove cgroup %s: %w", dir, err)
	}
	return nil
}

func exists(path string) bool {
	_, err := os.Stat(path)
	return err == nil
}
