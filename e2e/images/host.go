package images

import (
	"bufio"
	"crypto/md5" //nolint:gosec // dpkg's md5sums: an integrity check against Debian's record, not security
	"debug/elf"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"maps"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"slices"
	"strings"
)

// libDirs is where the dynamic loader of a Debian amd64 system finds libraries (ld.so.conf).
var libDirs = []string{"/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu", "/usr/lib64", "/lib64", "/usr/lib", "/lib"}

// programPath is the PATH programs are looked up in, here and in the images.
const programPath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// Host copies programs of this machine into images, with the shared libraries and the dynamic
// loader they need. Every regular file must come from an installed Debian package and be
// unchanged since (its md5sum is the one dpkg recorded): an image carries Debian's files, not
// whatever this machine has.
type Host struct {
	// Root is where the machine's files are ("" is /), for tests.
	Root string
	// DpkgDir is dpkg's database (default /var/lib/dpkg).
	DpkgDir string

	owners map[string]string // path -> package (with :arch when dpkg names it so)
}

// Programs returns the layer entries of programs (names looked up in PATH, or absolute paths of
// files or of directories whose every file is taken, such as a program's data or modules),
// the root symlinks of a merged /usr (/bin -> usr/bin, ...) as the machine has them, and the
// Debian packages the files come from, as sorted "name=version".
func (h *Host) Programs(programs []string) ([]Entry, []string, error) {
	if err := h.loadOwners(); err != nil {
		return nil, nil, err
	}
	c := &closure{h: h, entries: map[string]Entry{}, packages: map[string]bool{}}
	for _, top := range []string{"/bin", "/sbin", "/lib", "/lib64"} {
		if target, err := os.Readlink(h.abs(top)); err == nil {
			c.entries[top] = Symlink(top, target)
		}
	}
	for _, p := range programs {
		if !path.IsAbs(p) {
			found, err := h.lookPath(p)
			if err != nil {
				return nil, nil, err
			}
			p = found
		}
		if err := c.addTree(p); err != nil {
			return nil, nil, fmt.Errorf("program %s: %w", p, err)
		}
	}
	pkgs, err := h.versions(slices.Sorted(maps.Keys(c.packages)))
	if err != nil {
		return nil, nil, err
	}
	entries := slices.Collect(maps.Values(c.entries))
	slices.SortFunc(entries, func(a, b Entry) int { return strings.Compare(a.Path, b.Path) })
	return entries, pkgs, nil
}

func (h *Host) abs(p string) string { return filepath.Join(h.root(), p) }

func (h *Host) root() string {
	if h.Root == "" {
		return "/"
	}
	return h.Root
}

func (h *Host) dpkgDir() string {
	if h.DpkgDir == "" {
		return "/var/lib/dpkg"
	}
	return h.DpkgDir
}

func (h *Host) lookPath(name string) (string, error) {
	for _, dir := range filepath.SplitList(programPath) {
		p := path.Join(dir, name)
		if fi, err := os.Stat(h.abs(p)); err == nil && fi.Mode().IsRegular() && fi.Mode()&0o111 != 0 {
			return p, nil
		}
	}
	return "", fmt.Errorf("program %s is not installed (PATH %s); `make deps` installs it", name, programPath)
}

// closure collects a program's files, following symlinks and ELF dependencies.
type closure struct {
	h        *Host
	entries  map[string]Entry
	packages map[string]bool
}

// addTree adds p, or every file below p when it is a directory.
func (c *closure) addTree(p string) error {
	fi, err := os.Stat(c.h.abs(p))
	if err != nil {
		return err
	}
	if !fi.IsDir() {
		return c.add(p)
	}
	dir, err := c.realDir(p)
	if err != nil {
		return err
	}
	return filepath.WalkDir(c.h.abs(dir), func(f string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		rel, err := filepath.Rel(c.h.root(), f)
		if err != nil {
			return err
		}
		return c.add(path.Join("/", filepath.ToSlash(rel)))
	})
}

// add adds the file at p (a path in the machine's namespace) and everything it needs.
func (c *closure) add(p string) error {
	// Directories on the way may be symlinks (/lib64 -> usr/lib64): the file is stored at its
	// directory's real path, which the root symlinks make reachable by the other name too.
	dir, err := c.realDir(path.Dir(p))
	if err != nil {
		return err
	}
	p = path.Join(dir, path.Base(p))
	if _, ok := c.entries[p]; ok {
		return nil
	}
	fi, err := os.Lstat(c.h.abs(p))
	if err != nil {
		return err
	}
	switch {
	case fi.Mode()&fs.ModeSymlink != 0:
		target, err := os.Readlink(c.h.abs(p))
		if err != nil {
			return err
		}
		c.entries[p] = Symlink(p, target)
		if !path.IsAbs(target) {
			target = path.Join(dir, target)
		}
		return c.add(target)
	case !fi.Mode().IsRegular():
		return fmt.Errorf("%s is not a regular file", p)
	}
	pkg, err := c.h.verify(p)
	if err != nil {
		return err
	}
	c.packages[pkg] = true
	c.entries[p] = Entry{Path: p, Mode: fi.Mode().Perm(), Source: c.h.abs(p)}
	needs, err := c.h.elfNeeds(p)
	if err != nil {
		return err
	}
	interpreter, err := c.h.scriptInterpreter(p)
	if err != nil {
		return err
	}
	if interpreter != "" {
		needs = append(needs, interpreter)
	}
	for _, n := range needs {
		if err := c.add(n); err != nil {
			return fmt.Errorf("%s needs %s: %w", p, n, err)
		}
	}
	return nil
}

func (c *closure) realDir(dir string) (string, error) {
	resolved, err := filepath.EvalSymlinks(c.h.abs(dir))
	if err != nil {
		return "", err
	}
	rel, err := filepath.Rel(c.h.root(), resolved)
	if err != nil || strings.HasPrefix(rel, "..") {
		return "", fmt.Errorf("%s leads outside %s", dir, c.h.root())
	}
	return path.Join("/", filepath.ToSlash(rel)), nil
}

// elfNeeds returns the dynamic loader and the libraries an ELF file needs, as paths; nothing for
// a file that is not ELF (a script), is static, or is for another machine (firmware).
func (h *Host) elfNeeds(p string) ([]string, error) {
	f, err := elf.Open(h.abs(p))
	if err != nil {
		var fe *elf.FormatError
		if errors.As(err, &fe) {
			return nil, nil
		}
		return nil, err
	}
	defer f.Close()
	if f.Machine != elf.EM_X86_64 {
		return nil, nil
	}
	var needs []string
	for _, prog := range f.Progs {
		if prog.Type == elf.PT_INTERP {
			b := make([]byte, prog.Filesz)
			if _, err := prog.ReadAt(b, 0); err != nil {
				return nil, err
			}
			needs = append(needs, strings.TrimRight(string(b), "\x00"))
		}
	}
	libs, err := f.ImportedLibraries()
	if err != nil {
		return nil, err
	}
	for _, lib := range libs {
		found := ""
		for _, d := range libDirs {
			if _, err := os.Stat(h.abs(path.Join(d, lib))); err == nil {
				found = path.Join(d, lib)
				break
			}
		}
		if found == "" {
			return nil, fmt.Errorf("%s needs %s, found in none of %v", p, lib, libDirs)
		}
		needs = append(needs, found)
	}
	return needs, nil
}

// scriptInterpreter returns the interpreter a script names on its #! line (fsck.xfs is a shell
// script), or "" for a file that is not a script.
func (h *Host) scriptInterpreter(p string) (string, error) {
	f, err := os.Open(h.abs(p))
	if err != nil {
		return "", err
	}
	defer f.Close()
	line, err := bufio.NewReader(f).ReadString('\n')
	if err != nil && !errors.Is(err, io.EOF) {
		return "", err
	}
	rest, ok := strings.CutPrefix(line, "#!")
	if !ok {
		return "", nil
	}
	fields := strings.Fields(rest)
	if len(fields) == 0 || !path.IsAbs(fields[0]) {
		return "", fmt.Errorf("%s: a #! line without an absolute interpreter", p)
	}
	return fields[0], nil
}

// loadOwners reads which package installed each path (dpkg's info/*.list).
func (h *Host) loadOwners() error {
	if h.owners != nil {
		return nil
	}
	lists, err := filepath.Glob(filepath.Join(h.dpkgDir(), "info", "*.list"))
	if err != nil {
		return err
	}
	h.owners = map[string]string{}
	for _, l := range lists {
		pkg := strings.TrimSuffix(filepath.Base(l), ".list")
		if err := eachLine(l, func(line string) { h.owners[line] = pkg }); err != nil {
			return err
		}
	}
	return nil
}

// verify returns the package that installed p, failing unless p is byte-identical to what it
// installed. With a merged /usr, dpkg may know /usr/sbin/x as /sbin/x.
func (h *Host) verify(p string) (string, error) {
	name, pkg := "", ""
	for _, alias := range aliases(p) {
		if pkg = h.owners[alias]; pkg != "" {
			name = alias
			break
		}
	}
	if pkg == "" {
		return "", fmt.Errorf("%s belongs to no installed Debian package", p)
	}
	want := ""
	err := eachLine(filepath.Join(h.dpkgDir(), "info", pkg+".md5sums"), func(line string) {
		if sum, file, ok := strings.Cut(line, "  "); ok && "/"+file == name {
			want = sum
		}
	})
	if err != nil {
		return "", err
	}
	got, err := md5sum(h.abs(p))
	if err != nil {
		return "", err
	}
	if want != got {
		return "", fmt.Errorf("%s differs from what Debian package %s installed (md5 %s, dpkg recorded %q)", p, pkg, got, want)
	}
	name, _, _ = strings.Cut(pkg, ":")
	return name, nil
}

// aliases returns the names a file has with a merged /usr: /usr/sbin/x is also /sbin/x.
func aliases(p string) []string {
	out := []string{p}
	for _, d := range []string{"/usr/bin/", "/usr/sbin/", "/usr/lib/", "/usr/lib64/"} {
		if rest, ok := strings.CutPrefix(p, d); ok {
			out = append(out, "/"+strings.TrimPrefix(d, "/usr/")+rest)
		}
	}
	return out
}

// versions returns "name=version" of installed packages.
func (h *Host) versions(pkgs []string) ([]string, error) {
	if len(pkgs) == 0 {
		return nil, nil
	}
	args := append([]string{"--admindir=" + h.dpkgDir(), "-W", "-f=${Package}=${Version}\n"}, pkgs...)
	out, err := exec.Command("dpkg-query", args...).Output()
	if err != nil {
		return nil, fmt.Errorf("dpkg-query %v: %w", pkgs, err)
	}
	return slices.Sorted(slices.Values(strings.Fields(string(out)))), nil
}

func md5sum(file string) (string, error) {
	f, err := os.Open(file)
	if err != nil {
		return "", err
	}
	defer f.Close()
	h := md5.New() //nolint:gosec // what dpkg records; an integrity check, not security
	if _, err := io.Copy(h, f); err != nil {
		return "", err
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

func eachLine(file string, fn func(string)) error {
	f, err := os.Open(file)
	if err != nil {
		return err
	}
	defer f.Close()
	s := bufio.NewScanner(f)
	for s.Scan() {
		fn(s.Text())
	}
	return s.Err()
}
