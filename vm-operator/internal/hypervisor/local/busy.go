package local

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"

	"pvbridge.io/vm-operator/internal/hypervisor"
)

// mountInfo is the mount table the busy check reads: that of the agent's mount namespace,
// which in the lab is also the guests'. Mounts in other namespaces still show as an
// exclusive claim on the device.
const mountInfo = "/proc/self/mountinfo"

// users describes what still holds the device the guest sees of rec (guestDev); none when it
// is free to go.
func (d *Driver) users(r *os.Root, rec record) ([]string, error) {
	if rec.guestDev() == 0 {
		return nil, nil // a throttled disk whose loop device was never recorded: no node either
	}
	mounts, binds, err := mountsOf(r, rec)
	if err != nil {
		return nil, err
	}
	var users []string
	for _, m := range mounts {
		users = append(users, "mounted at "+m)
	}
	for _, m := range binds {
		users = append(users, "its device node is bind-mounted at "+m)
	}
	holders, err := d.holders(rec)
	if err != nil {
		return nil, err
	}
	for _, h := range holders {
		users = append(users, "held by "+h)
	}
	if len(users) == 0 && claimed(r, rec) {
		users = append(users, "claimed exclusively (mounted in another mount namespace?)")
	}
	return users, nil
}

// mountsOf lists the mount points of the guest's device of rec, and those of bind mounts of the
// VM's node of it (a raw block volume published in the guest), which show with the number of
// the filesystem that holds the node, not of the device.
func mountsOf(r *os.Root, rec record) (mounts, binds []string, err error) {
	data, err := os.ReadFile(mountInfo)
	if err != nil {
		return nil, nil, fmt.Errorf("read the mount table: %w", err)
	}
	table, err := parseMountInfo(data)
	if err != nil {
		return nil, nil, err
	}
	var vmfs uint64
	if fi, err := r.Stat(devDir); err == nil {
		if st, ok := fi.Sys().(*syscall.Stat_t); ok {
			vmfs = st.Dev
		}
	}
	for _, m := range table {
		switch {
		case m.dev == rec.guestDev():
			mounts = append(mounts, m.mountPoint)
		case vmfs != 0 && m.dev == vmfs && isDeviceFile(m.mountPoint, rec.guestDev()):
			binds = append(binds, m.mountPoint)
		}
	}
	return mounts, binds, nil
}

// holders lists the devices stacked on the guest's device of rec.
func (d *Driver) holders(rec record) ([]string, error) {
	entries, err := os.ReadDir(filepath.Join(d.sysfs, "dev", "block", rec.guestNumber(), "holders"))
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("list holders of device %s: %w", rec.guestNumber(), err)
	}
	names := make([]string, len(entries))
	for i, e := range entries {
		names[i] = e.Name()
	}
	return names, nil
}

// pullDisk takes the disk of rec from a VM that is being forced off: the guest's mounts of it
// are detached lazily, the deepest first, and the disk is unplugged.
func (d *Driver) pullDisk(ctx context.Context, r *os.Root, vm hypervisor.VM, rec record) error {
	holders, err := d.holders(rec)
	if err != nil {
		return err
	}
	if len(holders) > 0 {
		return fmt.Errorf("%w: held by %s", hypervisor.ErrBusy, strings.Join(holders, ", "))
	}
	mounts, binds, err := mountsOf(r, rec)
	if err != nil {
		return err
	}
	all := slices.Concat(mounts, binds)
	slices.SortFunc(all, func(a, b string) int { return len(b) - len(a) })
	for _, m := range all {
		if err := unix.Unmount(m, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
			return fmt.Errorf("unmount %s: %w", m, err)
		}
	}
	return d.unplug(ctx, r, vm, rec)
}

// isDeviceFile reports whether path is a block device node with number dev.
func isDeviceFile(path string, dev uint64) bool {
	var st unix.Stat_t
	return unix.Stat(path, &st) == nil && st.Mode&unix.S_IFMT == unix.S_IFBLK && st.Rdev == dev
}

// claimed reports whether the guest's device of rec is claimed exclusively, by a mount or a
// stacked device the other checks cannot see: the kernel then refuses an exclusive open with
// EBUSY.
// Any other outcome (no node left, a filesystem mounted nodev) counts as not claimed, the
// other checks having found nothing.
func claimed(r *os.Root, rec record) bool {
	fi, err := r.Lstat(rec.node())
	if err != nil || !isBlockDevice(fi, rec.guestDev()) {
		return false
	}
	f, err := r.OpenFile(rec.node(), os.O_RDONLY|unix.O_EXCL|unix.O_NONBLOCK, 0)
	if err != nil {
		return errors.Is(err, unix.EBUSY)
	}
	_ = f.Close()
	return false
}

// mount is what the busy check needs of a line of mountinfo.
type mount struct {
	// dev is the number of the mounted filesystem's device.
	dev uint64
	// mountPoint is where it is mounted.
	mountPoint string
}

// parseMountInfo parses the third and fifth fields of each line of a mountinfo file (see
// proc_pid_mountinfo(5)): "major:minor" and the mount point.
func parseMountInfo(data []byte) ([]mount, error) {
	var mounts []mount
	for line := range bytes.Lines(data) {
		line = bytes.TrimSuffix(line, []byte("\n"))
		if len(line) == 0 {
			continue
		}
		// Fields are separated by single spaces; spaces in paths are escaped.
		fields := strings.Split(string(line), " ")
		if len(fields) < 5 {
			return nil, fmt.Errorf("parse the mount table: short line %q", line)
		}
		major, minor, ok := strings.Cut(fields[2], ":")
		if !ok {
			return nil, fmt.Errorf("parse the mount table: no major:minor in %q", line)
		}
		ma, err := strconv.ParseUint(major, 10, 32)
		if err != nil {
			return nil, fmt.Errorf("parse the mount table: %q: %w", line, err)
		}
		mi, err := strconv.ParseUint(minor, 10, 32)
		if err != nil {
			return nil, fmt.Errorf("parse the mount table: %q: %w", line, err)
		}
		mounts = append(mounts, mount{dev: unix.Mkdev(uint32(ma), uint32(mi)), mountPoint: unescapeOctal(fields[4])})
	}
	return mounts, nil
}

// unescapeOctal undoes the kernel's escaping of space, tab, newline and backslash as \ooo in
// the paths of mountinfo.
func unescapeOctal(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) && isOctal(s[i+1], '3') && isOctal(s[i+2], '7') && isOctal(s[i+3], '7') {
			b.WriteByte((s[i+1]-'0')<<6 | (s[i+2]-'0')<<3 | (s[i+3] - '0'))
			i += 3
			continue
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// isOctal reports whether c is an octal digit no greater than limit.
func isOctal(c, limit byte) bool { return '0' <= c && c <= limit }
