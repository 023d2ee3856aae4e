package images

import (
	"archive/tar"
	"crypto/md5"
	"encoding/hex"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	. "github.com/onsi/gomega"
)

func TestLayers(t *testing.T) {
	a := []Entry{File("/etc/b", 0o644, []byte("b")), Symlink("/bin", "usr/bin"), File("/etc/a", 0o600, []byte("a"))}
	reversed := []Entry{a[2], a[1], a[0]}
	for _, tc := range []struct {
		name    string
		entries []Entry
		want    func(g Gomega, l v1.Layer)
		err     string
	}{
		{name: "the order of entries does not matter", entries: reversed, want: func(g Gomega, l v1.Layer) {
			g.Expect(digest(g, l)).To(Equal(digest(g, must(Layer(a)))))
		}},
		{name: "contents matter", entries: []Entry{a[0], a[1], File("/etc/a", 0o600, []byte("A"))}, want: func(g Gomega, l v1.Layer) {
			g.Expect(digest(g, l)).NotTo(Equal(digest(g, must(Layer(a)))))
		}},
		{name: "parents are added, files are dated epoch and owned by root", entries: a, want: func(g Gomega, l v1.Layer) {
			hs := headers(g, l)
			g.Expect(hs).To(HaveKeyWithValue("etc/", HaveField("Mode", int64(0o755))))
			g.Expect(hs).To(HaveKeyWithValue("etc/a", And(HaveField("Mode", int64(0o600)), HaveField("Size", int64(1)))))
			g.Expect(hs).To(HaveKeyWithValue("bin", HaveField("Linkname", "usr/bin")))
			for _, h := range hs {
				g.Expect(h.ModTime.Unix()).To(BeZero())
				g.Expect(h.Uid).To(BeZero())
			}
		}},
		{name: "sticky directories stay sticky", entries: []Entry{Dir("/tmp", fs.ModeSticky|0o777)}, want: func(g Gomega, l v1.Layer) {
			g.Expect(headers(g, l)).To(HaveKeyWithValue("tmp/", HaveField("Mode", int64(0o1777))))
		}},
		{name: "a path given twice", entries: []Entry{a[0], a[0]}, err: "/etc/b: given twice"},
		{name: "a relative path", entries: []Entry{File("etc/a", 0o644, nil)}, err: "not a clean absolute path"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			l, err := Layer(tc.entries)
			if tc.err != "" {
				g.Expect(err).To(MatchError(ContainSubstring(tc.err)))
				return
			}
			g.Expect(err).NotTo(HaveOccurred())
			tc.want(g, l)
		})
	}
}

// TestProgramsOfThisMachine copies a real program of this machine (Debian's e2fsprogs, which
// `make deps` installs) with everything it loads.
func TestProgramsOfThisMachine(t *testing.T) {
	g := NewWithT(t)
	entries, pkgs, err := (&Host{}).Programs([]string{"mkfs.ext4", "fsck.xfs"})
	g.Expect(err).NotTo(HaveOccurred())
	byPath := map[string]Entry{}
	for _, e := range entries {
		byPath[e.Path] = e
	}
	g.Expect(byPath).To(HaveKeyWithValue("/usr/sbin/mkfs.ext4", HaveField("Link", "mke2fs")))
	g.Expect(byPath).To(HaveKeyWithValue("/usr/sbin/mke2fs", HaveField("Source", "/usr/sbin/mke2fs")))
	g.Expect(byPath).To(HaveKeyWithValue("/lib64", HaveField("Link", "usr/lib64")))
	g.Expect(byPath).To(HaveKey("/usr/lib64/ld-linux-x86-64.so.2"))
	g.Expect(byPath).To(HaveKey("/usr/lib/x86_64-linux-gnu/libext2fs.so.2"))
	g.Expect(byPath).To(HaveKey(HavePrefix("/usr/lib/x86_64-linux-gnu/libc.so.6")))
	g.Expect(byPath).To(HaveKeyWithValue("/usr/bin/sh", HaveField("Link", "dash")), "fsck.xfs is a shell script")
	g.Expect(byPath).To(HaveKey("/usr/bin/dash"))
	g.Expect(pkgs).To(ContainElements(HavePrefix("e2fsprogs="), HavePrefix("libext2fs2"), HavePrefix("libc6="), HavePrefix("dash=")))
}

func TestProgramsOnlyFromDebianPackages(t *testing.T) {
	for _, tc := range []struct {
		name    string
		program string
		prepare func(root string)
		err     string
	}{
		{name: "a file no package installed", program: "local-tool", prepare: func(root string) {
			write(t, filepath.Join(root, "usr/bin/local-tool"), "#!/bin/sh\n")
		}, err: "/usr/bin/local-tool belongs to no installed Debian package"},
		{name: "a file changed since its package installed it", program: "tool", prepare: func(root string) {
			installed(t, root, "tool", "/usr/bin/tool", "#!/bin/sh\necho debian\n")
			write(t, filepath.Join(root, "usr/bin/tool"), "#!/bin/sh\necho changed\n")
		}, err: "/usr/bin/tool differs from what Debian package tool installed"},
		{name: "a program that is not installed", program: "missing-tool", prepare: func(string) {}, err: "program missing-tool is not installed"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			root := t.TempDir()
			g.Expect(os.MkdirAll(filepath.Join(root, "var/lib/dpkg/info"), 0o755)).To(Succeed())
			tc.prepare(root)
			h := &Host{Root: root, DpkgDir: filepath.Join(root, "var/lib/dpkg")}
			_, _, err := h.Programs([]string{tc.program})
			g.Expect(err).To(MatchError(ContainSubstring(tc.err)))
		})
	}
}

// TestImagesAreReproducibleArchives builds an image twice and reads the archive back as
// `ctr images import` would: an OCI layout whose one manifest is named by its reference.
func TestImagesAreReproducibleArchives(t *testing.T) {
	g := NewWithT(t)
	spec := Spec{
		Ref: "example.org/tool:v1", Binary: "/usr/bin/true", User: Nonroot, Programs: []string{"blkid"},
		Labels: map[string]string{"org.opencontainers.image.version": "v1"},
	}
	img, err := Build(spec, &Host{})
	g.Expect(err).NotTo(HaveOccurred())
	again, err := Build(spec, &Host{})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(digest(g, again)).To(Equal(digest(g, img)))

	cf, err := img.ConfigFile()
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(cf.Config.Entrypoint).To(Equal([]string{"/usr/local/bin/true"}))
	g.Expect(cf.Config.User).To(Equal(Nonroot))
	g.Expect(cf.Config.Env).To(ContainElement(HavePrefix("PATH=/usr/local/sbin:")))
	g.Expect(cf.Config.Labels).To(HaveKeyWithValue("io.pvbridge.debian-packages", ContainSubstring("util-linux=")))
	g.Expect(cf.Created.Unix()).To(BeZero())
	files := map[string]*tar.Header{}
	rc := mutate.Extract(img)
	defer rc.Close()
	tr := tar.NewReader(rc)
	for h, err := tr.Next(); err != io.EOF; h, err = tr.Next() {
		g.Expect(err).NotTo(HaveOccurred())
		files[h.Name] = h
	}
	g.Expect(files).To(HaveKey("usr/local/bin/true"))
	g.Expect(files).To(HaveKey("usr/sbin/blkid"))
	g.Expect(files).To(HaveKeyWithValue("etc/passwd", HaveField("Mode", int64(0o644))))

	dir := t.TempDir()
	archive := filepath.Join(dir, "tool.tar")
	g.Expect(WriteArchive(archive, spec.Ref, img)).To(Succeed())
	first := sum(g, archive)
	g.Expect(WriteArchive(archive, spec.Ref, again)).To(Succeed())
	g.Expect(sum(g, archive)).To(Equal(first), "the same image gives the same archive")

	untarred := filepath.Join(dir, "layout")
	g.Expect(untar(archive, untarred)).To(Succeed())
	index, err := layout.ImageIndexFromPath(untarred)
	g.Expect(err).NotTo(HaveOccurred())
	m, err := index.IndexManifest()
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(m.Manifests).To(HaveExactElements(And(
		HaveField("Digest", digest(g, img)),
		HaveField("Annotations", HaveKeyWithValue("io.containerd.image.name", spec.Ref)),
	)))
}

func must(l v1.Layer, err error) v1.Layer {
	if err != nil {
		panic(err)
	}
	return l
}

func digest(g Gomega, o interface{ Digest() (v1.Hash, error) }) v1.Hash {
	d, err := o.Digest()
	g.Expect(err).NotTo(HaveOccurred())
	return d
}

func headers(g Gomega, l v1.Layer) map[string]*tar.Header {
	rc, err := l.Uncompressed()
	g.Expect(err).NotTo(HaveOccurred())
	defer rc.Close()
	hs := map[string]*tar.Header{}
	tr := tar.NewReader(rc)
	for h, err := tr.Next(); err != io.EOF; h, err = tr.Next() {
		g.Expect(err).NotTo(HaveOccurred())
		hs[h.Name] = h
	}
	return hs
}

func sum(g Gomega, file string) string {
	data, err := os.ReadFile(file)
	g.Expect(err).NotTo(HaveOccurred())
	s := md5.Sum(data)
	return hex.EncodeToString(s[:])
}

func write(t *testing.T, file, content string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(file), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(file, []byte(content), 0o755); err != nil {
		t.Fatal(err)
	}
}

// installed records in root's dpkg database that package pkg installed file with content.
func installed(t *testing.T, root, pkg, file, content string) {
	t.Helper()
	write(t, filepath.Join(root, file), content)
	s := md5.Sum([]byte(content))
	info := filepath.Join(root, "var/lib/dpkg/info", pkg)
	write(t, info+".list", file+"\n")
	write(t, info+".md5sums", hex.EncodeToString(s[:])+"  "+strings.TrimPrefix(file, "/")+"\n")
}

// TestBusyboxRunsDebiansShellAndDD checks the busybox images of the storage tests: sh is bash
// and dd is coreutils' (busybox's sh runs its own applets before PATH, its dd lacks
// oflag=nocache, and dash lacks the tests' `let`), every other applet links to busybox, and no
// path is in the image twice.
func TestBusyboxRunsDebiansShellAndDD(t *testing.T) {
	g := NewWithT(t)
	img, err := busybox("registry.k8s.io/e2e-test-images/busybox", "1.37.0-2")
	g.Expect(err).NotTo(HaveOccurred())
	programs, _, err := (&Host{}).Programs(img.Programs)
	g.Expect(err).NotTo(HaveOccurred())
	byPath := map[string]Entry{}
	for _, e := range append(programs, img.Extra...) {
		g.Expect(byPath).NotTo(HaveKey(e.Path), "twice in the image")
		byPath[e.Path] = e
	}
	g.Expect(byPath["/usr/bin/sh"].Link).To(Equal("/usr/bin/bash"))
	g.Expect(byPath["/usr/bin/bash"].Source).To(Equal("/usr/bin/bash"))
	g.Expect(byPath["/usr/bin/dd"].Source).To(Equal("/usr/bin/dd"))
	g.Expect(byPath["/usr/bin/cat"].Link).To(Equal("/usr/bin/busybox"))
}
