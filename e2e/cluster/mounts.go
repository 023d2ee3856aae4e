package cluster

import (
	"errors"
	"fmt"
	"strings"

	"golang.org/x/sys/unix"

	"pvbridge.io/pkg/mounter"
)

// MountsBelow lists the mount points at or below dir, latest mounted first: the order to
// unmount them in.
func MountsBelow(dir string) ([]string, error) { return mounter.MountPointsBelow(dir) }

// unmountBelow unmounts everything at or below dir, latest mounted first. A mount that is still
// busy is detached lazily, so that nothing stays visible in the mount table.
func unmountBelow(dir string) error {
	mounts, err := MountsBelow(dir)
	if err != nil {
		return err
	}
	var errs []string
	for _, m := range mounts {
		if err := unix.Unmount(m, 0); err != nil && err != unix.EINVAL && err != unix.ENOENT {
			if err := unix.Unmount(m, unix.MNT_DETACH); err != nil && err != unix.EINVAL {
				errs = append(errs, fmt.Sprintf("%s: %v", m, err))
			}
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("unmount below %s: %s", dir, strings.Join(errs, "; "))
	}
	return nil
}

// ClearBelow leaves nothing mounted at or below the directories dirs and no loop device on their
// files, as a reboot leaves a machine's tree. Loop devices hold files of filesystems that are
// themselves mounted from loop devices (the PMEM emulation), and filesystems are mounted from
// loop devices: detach, unmount, and detach what the unmounts released.
func ClearBelow(dirs ...string) error {
	var errs []error
	for _, step := range []func(string) error{DetachLoopsBelow, unmountBelow, DetachLoopsBelow} {
		for _, d := range dirs {
			errs = append(errs, step(d))
		}
	}
	return errors.Join(errs...)
}
