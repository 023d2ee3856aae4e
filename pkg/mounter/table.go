package mounter

import (
	"slices"
	"strings"

	"k8s.io/mount-utils"
)

// MountInfo is the mount table of this process's mount namespace.
const MountInfo = "/proc/self/mountinfo"

// unescape undoes the octal escapes the kernel writes for these characters in the paths of the
// mount table.
var unescape = strings.NewReplacer(`\040`, " ", `\011`, "\t", `\012`, "\n", `\134`, `\`)

// UnescapeMountPath returns a path of the mount table as the path it names.
func UnescapeMountPath(p string) string { return unescape.Replace(p) }

// MountPointsBelow lists the mount points at or below dir, latest mounted first (a mount
// stacked on a path, or made inside another, comes before it: the order to unmount them in).
// A path with several mounts stacked on it is listed once per mount.
func MountPointsBelow(dir string) ([]string, error) {
	mps, err := mount.ParseMountInfo(MountInfo)
	if err != nil {
		return nil, err
	}
	var out []string
	for _, mp := range slices.Backward(mps) {
		if p := UnescapeMountPath(mp.MountPoint); p == dir || strings.HasPrefix(p, dir+"/") {
			out = append(out, p)
		}
	}
	return out, nil
}

// FilesystemType returns the type of the filesystem mounted last at path, "" if nothing is
// mounted there.
func FilesystemType(path string) (string, error) {
	mps, err := mount.ParseMountInfo(MountInfo)
	if err != nil {
		return "", err
	}
	for _, mp := range slices.Backward(mps) {
		if UnescapeMountPath(mp.MountPoint) == path {
			return mp.FsType, nil
		}
	}
	return "", nil
}
