// Package images builds pvbridge's container images without a container engine and without
// pulling anything: each image is a few reproducible layers (files of this machine's Debian
// packages, a Go binary) on no base image, written as an OCI archive that `ctr images import`,
// `docker load`, `podman load` or `skopeo copy oci-archive:` take.
package images

import (
	"archive/tar"
	"bytes"
	"fmt"
	"io"
	"io/fs"
	"maps"
	"os"
	"path"
	"slices"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// epoch is the time of every file and of the image: the same inputs give the same digest.
var epoch = time.Unix(0, 0).UTC()

// Entry is one file, directory or symlink of a layer.
type Entry struct {
	// Path in the image, absolute.
	Path string
	// Mode is the permission bits (and fs.ModeDir or fs.ModeSymlink).
	Mode fs.FileMode
	// Source is the file on this machine a regular file is copied from.
	Source string
	// Data is a regular file's content when Source is empty.
	Data []byte
	// Link is a symlink's target.
	Link string
}

// Dir returns a directory entry.
func Dir(p string, mode fs.FileMode) Entry { return Entry{Path: p, Mode: fs.ModeDir | mode} }

// Symlink returns a symlink entry.
func Symlink(p, target string) Entry {
	return Entry{Path: p, Mode: fs.ModeSymlink | 0o777, Link: target}
}

// File returns a regular file entry with the given content.
func File(p string, mode fs.FileMode, data []byte) Entry {
	return Entry{Path: p, Mode: mode, Data: data}
}

// Layer returns an uncompressed-tar-in-gzip OCI layer of entries: sorted by path, owned by
// root, dated epoch, with each missing parent directory added (0755). Two calls with the
// same entries and file contents give the same digest.
func Layer(entries []Entry) (v1.Layer, error) {
	byPath := map[string]Entry{}
	for _, e := range entries {
		if !path.IsAbs(e.Path) || path.Clean(e.Path) != e.Path || e.Path == "/" {
			return nil, fmt.Errorf("layer entry %q: not a clean absolute path", e.Path)
		}
		if _, ok := byPath[e.Path]; ok {
			return nil, fmt.Errorf("layer entry %s: given twice", e.Path)
		}
		byPath[e.Path] = e
	}
	for _, e := range entries {
		for d := path.Dir(e.Path); d != "/"; d = path.Dir(d) {
			if _, ok := byPath[d]; !ok {
				byPath[d] = Dir(d, 0o755)
			}
		}
	}
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, p := range slices.Sorted(maps.Keys(byPath)) {
		if err := writeEntry(tw, byPath[p]); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	data := buf.Bytes()
	return tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(data)), nil
	}, tarball.WithMediaType(types.OCILayer))
}

func writeEntry(tw *tar.Writer, e Entry) error {
	h := &tar.Header{
		Name:    strings.TrimPrefix(e.Path, "/"),
		Mode:    int64(e.Mode.Perm()),
		ModTime: epoch, Format: tar.FormatPAX,
	}
	if e.Mode&fs.ModeSticky != 0 { // /tmp
		h.Mode |= 0o1000
	}
	data := e.Data
	switch {
	case e.Mode.IsDir():
		h.Typeflag, h.Name = tar.TypeDir, h.Name+"/"
	case e.Mode&fs.ModeSymlink != 0:
		h.Typeflag, h.Linkname = tar.TypeSymlink, e.Link
	default:
		if e.Source != "" {
			var err error
			if data, err = os.ReadFile(e.Source); err != nil {
				return err
			}
		}
		h.Typeflag, h.Size = tar.TypeReg, int64(len(data))
	}
	if err := tw.WriteHeader(h); err != nil {
		return err
	}
	_, err := tw.Write(data)
	return err
}
