package cluster

import (
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
