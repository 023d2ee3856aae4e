package driver

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"

	"pvbridge.io/pkg/mounter"
)

// disks finds the disks attached to this VM in its device tree: <root>/sys/block/<name>/serial
// names the serial of disk <name>, whose node is <root>/dev/<name>, and udev links
// <root>/dev/disk/by-id/virtio-<serial> to it. The root is "/" in a real guest and a directory
// that the local hypervisor fills in the lab. disks keeps no state: a disk hot-plugged or
// removed is seen at the next lookup.
type disks struct {
	root string
}

// bySerial returns the device node of the disk with serial, or an error wrapping
// mounter.ErrNotFound while no such disk is attached (yet). sysfs is read first, because it
// lists a disk as soon as the kernel knows it, before udev has made the link.
func (d disks) bySerial(serial string) (string, error) {
	names, err := d.names()
	if err != nil {
		return "", err
	}
	for _, name := range names {
		b, err := os.ReadFile(filepath.Join(d.root, "sys", "block", name, "serial"))
		if err != nil || strings.TrimSpace(string(b)) != serial {
			continue // most disks (loop, nvme, ...) have no serial file
		}
		node := filepath.Join(d.root, "dev", name)
		if _, err := blockNumber(node); err == nil {
			return node, nil
		} else if !errors.Is(err, mounter.ErrNotFound) {
			return "", err
		}
	}
	link := filepath.Join(d.root, "dev", "disk", "by-id", "virtio-"+serial)
	if _, err := blockNumber(link); err != nil {
		if errors.Is(err, mounter.ErrNotFound) {
			return "", fmt.Errorf("%w: no disk with serial %s is attached (yet) under %s", mounter.ErrNotFound, serial, d.root)
		}
		return "", err
	}
	return link, nil
}

// byNumber returns the device node of the disk with device number dev, "" if none is
// attached.
func (d disks) byNumber(dev uint64) (string, error) {
	names, err := d.names()
	if err != nil {
		return "", err
	}
	for _, name := range names {
		node := filepath.Join(d.root, "dev", name)
		if n, err := blockNumber(node); err == nil && n == dev {
			return node, nil
		}
	}
	return "", nil
}

// names lists the disks in <root>/sys/block.
func (d disks) names() ([]string, error) {
	entries, err := os.ReadDir(filepath.Join(d.root, "sys", "block"))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("list disks: %w", err)
	}
	names := make([]string, 0, len(entries))
	for _, e := range entries {
		names = append(names, e.Name())
	}
	return names, nil
}

// blockNumber returns the device number of the block device at path, following symbolic
// links; an error wrapping mounter.ErrNotFound if nothing is there.
func blockNumber(path string) (uint64, error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return 0, fmt.Errorf("%w: %s", mounter.ErrNotFound, path)
		}
		return 0, fmt.Errorf("stat %s: %w", path, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFBLK {
		return 0, fmt.Errorf("%s is not a block device", path)
	}
	return st.Rdev, nil
}
