package cluster

import (
	"bufio"
	"fmt"
	"os"
	"sort"
	"strings"

	"golang.org/x/sys/unix"
)

// MountsBelow lists the mount points at or below dir, deepest first.
func MountsBelow(dir string) ([]string, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var mounts []string
	s := bufio.NewScanner(f)
	for s.Scan() {
		fields := strings.Fields(s.Text())
		if len(fields) < 5 {
			continue
		}
		mp := unescapeMountPath(fields[4])
		if mp == dir || strings.HasPrefix(mp, dir+"/") {
			mounts = append(mounts, mp)
		}
	}
	if err := s.Err(); err != nil {
		return nil, err
	}
	sort.Sort(sort.Reverse(sort.StringSlice(mounts)))
	return mounts, nil
}

// unescapeMountPath undoes the octal escapes (\040 for a space) of /proc/self/mountinfo.
func unescapeMountPath(p string) string {
	if !strings.Contains(p, `\`) {
		return p
	}
	var b strings.Builder
	for i := 0; i < len(p); i++ {
		if p[i] == '\\' && i+3 < len(p) {
			var c byte
			if _, err := fmt.Sscanf(p[i+1:i+4], "%03o", &c); err == nil {
				b.WriteByte(c)
				i += 3
				continue
			}
		}
		b.WriteByte(p[i])
	}
	return b.String()
}

// unmountBelow unmounts everything at or below dir, deepest first. A mount that is still busy
// is detached lazily, so that nothing stays visible in the mount table.
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
