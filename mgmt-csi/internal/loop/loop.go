// Package loop binds loop devices to files and unbinds them, with ioctls rather than losetup:
// LOOP_CONFIGURE (Linux 5.8) binds a free device in one call, and the kernel's answers tell an
// open device from a free one, which losetup's exit codes do not. The file back end of the PMEM
// agent keeps its volumes on loop devices; a replicated volume's target puts one over its FUSE
// export.
package loop

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// ErrInUse is the error of Detach while the device is mounted, held or open elsewhere.
var ErrInUse = errors.New("in use")

const (
	sysBlock    = "/sys/block"
	loopControl = "/dev/loop-control"
)

// Attachments maps every backing file to the loop devices bound to it, from
// /sys/block/loop*/loop/backing_file. The kernel writes the path as the process that bound
// the device opened it, so the file back end must see its directory under the same path in
// every incarnation of the agent (true of a hostPath volume mounted at a fixed path).
func Attachments() (map[string][]string, error) {
	entries, err := os.ReadDir(sysBlock)
	if err != nil {
		return nil, err
	}
	attached := map[string][]string{}
	for _, e := range entries {
		if !strings.HasPrefix(e.Name(), "loop") {
			continue
		}
		data, err := os.ReadFile(filepath.Join(sysBlock, e.Name(), "loop", "backing_file"))
		if errors.Is(err, fs.ErrNotExist) || errors.Is(err, unix.ENODEV) || errors.Is(err, unix.ENXIO) {
			// Not bound; or being unbound right now by another process of the host, whose
			// device answers ENODEV while the kernel tears it down (seen under load).
			continue
		}
		if err != nil {
			return nil, err
		}
		backing := strings.TrimSuffix(string(data), "\n")
		attached[backing] = append(attached[backing], "/dev/"+e.Name())
	}
	return attached, nil
}

// Backing returns the backing file of loop device dev (/dev/loopN), "" if it has none or
// cannot be read.
func Backing(dev string) string {
	data, err := os.ReadFile(filepath.Join(sysBlock, filepath.Base(dev), "loop", "backing_file"))
	if err != nil {
		return ""
	}
	return strings.TrimSuffix(string(data), "\n")
}

// Attach binds a free loop device to the file at path and returns the device.
func Attach(path string) (string, error) {
	ctl, err := os.OpenFile(loopControl, os.O_RDWR, 0)
	if err != nil {
		return "", err
	}
	defer ctl.Close()
	backing, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return "", err
	}
	defer backing.Close()

	cfg := unix.LoopConfig{Fd: uint32(backing.Fd())} //nolint:gosec // a file descriptor fits in uint32
	copy(cfg.Info.File_name[:len(cfg.Info.File_name)-1], path)
	// Another process may take the free device between LOOP_CTL_GET_FREE and LOOP_CONFIGURE;
	// the kernel then answers EBUSY and we ask for another one.
	for range 16 {
		n, err := unix.IoctlRetInt(int(ctl.Fd()), unix.LOOP_CTL_GET_FREE)
		if err != nil {
			return "", fmt.Errorf("find a free loop device: %w", err)
		}
		dev := "/dev/loop" + strconv.Itoa(n)
		if err := ensureDeviceNode(dev); err != nil {
			return "", err
		}
		err = configureLoop(dev, &cfg)
		if errors.Is(err, unix.EBUSY) {
			continue
		}
		if err != nil {
			return "", fmt.Errorf("bind %s to %s: %w", dev, path, err)
		}
		return dev, nil
	}
	return "", fmt.Errorf("bind a loop device to %s: every free device was taken by someone else", path)
}

func configureLoop(dev string, cfg *unix.LoopConfig) error {
	f, err := os.OpenFile(dev, os.O_RDWR, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	return unix.IoctlLoopConfigure(int(f.Fd()), cfg)
}

// ensureDeviceNode makes the node of a loop device the kernel has just added when /dev is not
// devtmpfs (a container's private /dev).
func ensureDeviceNode(dev string) error {
	if _, err := os.Stat(dev); !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	data, err := os.ReadFile(filepath.Join(sysBlock, filepath.Base(dev), "dev"))
	if err != nil {
		return err
	}
	var major, minor uint32
	if _, err := fmt.Sscanf(strings.TrimSpace(string(data)), "%d:%d", &major, &minor); err != nil {
		return fmt.Errorf("parse device number of %s: %w", dev, err)
	}
	err = unix.Mknod(dev, unix.S_IFBLK|0o600, int(unix.Mkdev(major, minor))) //nolint:gosec // dev_t of 32-bit numbers
	if err != nil && !errors.Is(err, fs.ErrExist) {
		return fmt.Errorf("make %s: %w", dev, err)
	}
	return nil
}

// Detach unbinds a loop device. ErrInUse while it is mounted, held by another device or
// open elsewhere: the device then stays bound as it was. A short-lived opener (udev probing a
// new device) is waited out for about a second.
func Detach(ctx context.Context, dev string) error {
	for attempt := 0; ; attempt++ {
		detached, err := tryDetach(dev)
		if err != nil || detached {
			if err == nil {
				err = waitUnbound(ctx, dev)
			}
			return err
		}
		if attempt == 10 {
			return fmt.Errorf("%w: %s is open", ErrInUse, dev)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%w: %s is open", ErrInUse, dev)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

func tryDetach(dev string) (bool, error) {
	// An exclusive open fails while a filesystem or a device mapper target holds the device.
	f, err := os.OpenFile(dev, os.O_RDONLY|unix.O_EXCL, 0)
	switch {
	case errors.Is(err, unix.EBUSY):
		return false, fmt.Errorf("%w: %s is mounted or held by another device", ErrInUse, dev)
	case errors.Is(err, fs.ErrNotExist), errors.Is(err, unix.ENXIO):
		return true, nil
	case err != nil:
		return false, err
	}
	detached, err := clearFd(f)
	if closeErr := f.Close(); err == nil {
		err = closeErr
	}
	if err != nil {
		return false, fmt.Errorf("unbind %s: %w", dev, err)
	}
	return detached, nil
}

// clearFd asks the kernel to unbind the loop device open as f. When another process has it
// open too, the kernel only marks it to be unbound on its last close (autoclear); clearFd
// then takes the mark back and reports false, so the volume stays usable.
func clearFd(f *os.File) (bool, error) {
	fd := int(f.Fd())
	if err := unix.IoctlSetInt(fd, unix.LOOP_CLR_FD, 0); err != nil {
		if errors.Is(err, unix.ENXIO) {
			return true, nil // not bound
		}
		return false, err
	}
	info, err := unix.IoctlLoopGetStatus64(fd)
	if errors.Is(err, unix.ENXIO) {
		return true, nil // unbound, or being unbound on our close
	}
	if err != nil {
		return false, err
	}
	if info.Flags&unix.LO_FLAGS_AUTOCLEAR != 0 {
		info.Flags &^= unix.LO_FLAGS_AUTOCLEAR
		if err := unix.IoctlLoopSetStatus64(fd, info); err != nil {
			return false, fmt.Errorf("keep device bound: %w", err)
		}
	}
	return false, nil
}

// waitUnbound waits until the kernel has finished unbinding dev, which it does on the last
// close.
func waitUnbound(ctx context.Context, dev string) error {
	backingFile := filepath.Join(sysBlock, filepath.Base(dev), "loop", "backing_file")
	for {
		if _, err := os.Stat(backingFile); errors.Is(err, fs.ErrNotExist) {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("wait for %s to be unbound: %w", dev, ctx.Err())
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// Resize makes a loop device take the new size of its backing file.
func Resize(dev string) error {
	f, err := os.Open(dev)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := unix.IoctlSetInt(int(f.Fd()), unix.LOOP_SET_CAPACITY, 0); err != nil {
		return fmt.Errorf("resize %s: %w", dev, err)
	}
	return nil
}

// Flush writes what the page cache of dev holds to its backing store, so that a copy
// of the backing file sees every write made through the device.
func Flush(dev string) error {
	f, err := os.Open(dev)
	if err != nil {
		return err
	}
	defer f.Close()
	return f.Sync()
}
