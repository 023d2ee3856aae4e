package images

import (
	"archive/tar"
	"io/fs"
	"os"
	"path/filepath"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
)

// WriteArchive writes img as an OCI archive (a tar of an OCI image layout) named ref: both
// `io.containerd.image.name` (ctr images import) and `org.opencontainers.image.ref.name`
// (docker and podman load, skopeo) carry the full reference. The archive is reproducible.
func WriteArchive(file, ref string, img v1.Image) error {
	dir, err := os.MkdirTemp(filepath.Dir(file), ".layout-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	p, err := layout.Write(dir, empty.Index)
	if err != nil {
		return err
	}
	if err := p.AppendImage(img, layout.WithAnnotations(map[string]string{
		"io.containerd.image.name":          ref,
		"org.opencontainers.image.ref.name": ref,
	})); err != nil {
		return err
	}
	tmp := file + ".tmp"
	if err := tarDir(tmp, dir); err != nil {
		_ = os.Remove(tmp)
		return err
	}
	return os.Rename(tmp, file)
}

// tarDir writes the files below dir into the tar file, in lexical order, dated epoch.
func tarDir(file, dir string) error {
	out, err := os.Create(file)
	if err != nil {
		return err
	}
	tw := tar.NewWriter(out)
	err = filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || p == dir {
			return err
		}
		rel, err := filepath.Rel(dir, p)
		if err != nil {
			return err
		}
		h := &tar.Header{Name: filepath.ToSlash(rel), ModTime: epoch, Mode: 0o644, Typeflag: tar.TypeReg, Format: tar.FormatPAX}
		if d.IsDir() {
			h.Name, h.Mode, h.Typeflag = h.Name+"/", 0o755, tar.TypeDir
			return tw.WriteHeader(h)
		}
		data, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		h.Size = int64(len(data))
		if err := tw.WriteHeader(h); err != nil {
			return err
		}
		_, err = tw.Write(data)
		return err
	})
	if err == nil {
		err = tw.Close()
	}
	if cerr := out.Close(); err == nil {
		err = cerr
	}
	return err
}
