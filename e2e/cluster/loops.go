package cluster

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
)

// LoopsBelow lists the loop devices (/dev/loopN) whose backing file is at or below dir.
func LoopsBelow(dir string) ([]string, error) {
	files, err := filepath.Glob("/sys/block/loop*/loop/backing_file")
	if err != nil {
		return nil, err
	}
	var loops []string
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			continue // detached meanwhile
		}
		backing := strings.TrimSuffix(strings.TrimSuffix(string(data), "\n"), " (deleted)")
		if backing == dir || strings.HasPrefix(backing, dir+"/") {
			loops = append(loops, "/dev/"+filepath.Base(filepath.Dir(filepath.Dir(f))))
		}
	}
	return loops, nil
}

// detachLoopsBelow detaches every loop device backed by a file below dir. A device still in use
// (mounted) gets auto-clear instead, so it goes away with its last user.
func detachLoopsBelow(dir string) error {
	loops, err := LoopsBelow(dir)
	if err != nil {
		return err
	}
	var errs []error
	for _, l := range loops {
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
