package mounter

import (
	"os"
	"path/filepath"
	"testing"

	. "github.com/onsi/gomega"
	"golang.org/x/sys/unix"
)

func TestMountPointsBelowListsLatestFirstAndUnescapes(t *testing.T) {
	g := NewWithT(t)
	dir := filepath.Join(t.TempDir(), "a dir")
	inner := filepath.Join(dir, "inner")
	g.Expect(os.MkdirAll(dir, 0o755)).To(Succeed())
	for _, p := range []string{dir, dir} { // two mounts stacked on dir
		g.Expect(unix.Mount("tmpfs", p, "tmpfs", 0, "size=1m")).To(Succeed())
	}
	g.Expect(os.Mkdir(inner, 0o755)).To(Succeed())
	g.Expect(unix.Mount("tmpfs", inner, "tmpfs", 0, "size=1m")).To(Succeed())
	t.Cleanup(func() {
		_ = unix.Unmount(inner, 0)
		_ = unix.Unmount(dir, 0)
		_ = unix.Unmount(dir, 0)
	})

	got, err := MountPointsBelow(dir)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(got).To(Equal([]string{inner, dir, dir}))
	g.Expect(MountPointsBelow(filepath.Join(t.TempDir(), "nothing"))).To(BeEmpty())
}

func TestUnescapeMountPath(t *testing.T) {
	NewWithT(t).Expect(UnescapeMountPath(`/a\040b/c\134d`)).To(Equal(`/a b/c\d`))
}

func TestFilesystemType(t *testing.T) {
	g := NewWithT(t)
	dir := filepath.Join(t.TempDir(), "a dir")
	g.Expect(os.MkdirAll(dir, 0o755)).To(Succeed())
	g.Expect(FilesystemType(dir)).To(BeEmpty(), "nothing is mounted there")
	g.Expect(unix.Mount("tmpfs", dir, "tmpfs", 0, "size=1m")).To(Succeed())
	t.Cleanup(func() { _ = unix.Unmount(dir, 0) })
	g.Expect(FilesystemType(dir)).To(Equal("tmpfs"))
}
