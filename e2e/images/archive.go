package images

import (
	"archive/tar"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/remote"
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

// Push pushes the image of an OCI archive that WriteArchive wrote to registry (host:port, plain
// HTTP) below the reference the archive names, which it returns: registry.k8s.io/pause:3.10.2
// goes to <registry>/registry.k8s.io/pause:3.10.2.
func Push(ctx context.Context, archive, registry string) (string, error) {
	dir, err := os.MkdirTemp(filepath.Dir(archive), ".push-")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(dir)
	if err := untar(archive, dir); err != nil {
		return "", fmt.Errorf("%s: %w", archive, err)
	}
	index, err := layout.ImageIndexFromPath(dir)
	if err != nil {
		return "", fmt.Errorf("%s: %w", archive, err)
	}
	m, err := index.IndexManifest()
	if err != nil {
		return "", fmt.Errorf("%s: %w", archive, err)
	}
	if len(m.Manifests) != 1 {
		return "", fmt.Errorf("%s: %d images, want 1", archive, len(m.Manifests))
	}
	ref := m.Manifests[0].Annotations["io.containerd.image.name"]
	img, err := index.Image(m.Manifests[0].Digest)
	if err != nil {
		return "", fmt.Errorf("%s: %w", archive, err)
	}
	tag, err := name.NewTag(registry+"/"+ref, name.Insecure)
	if err != nil {
		return "", fmt.Errorf("%s: %w", archive, err)
	}
	if err := remote.Write(tag, img, remote.WithContext(ctx)); err != nil {
		return "", fmt.Errorf("push %s: %w", tag, err)
	}
	return ref, nil
}

// untar extracts the files and directories of a tar file into dir, made if missing; a name
// that leads outside dir fails (os.Root).
func untar(file, dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	root, err := os.OpenRoot(dir)
	if err != nil {
		return err
	}
	defer root.Close()
	f, err := os.Open(file)
	if err != nil {
		return err
	}
	defer f.Close()
	tr := tar.NewReader(f)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		switch h.Typeflag {
		case tar.TypeDir:
			err = root.MkdirAll(h.Name, 0o755)
		case tar.TypeReg:
			err = writeFile(root, h.Name, tr)
		default:
			err = fmt.Errorf("%s: unexpected type %c", h.Name, h.Typeflag)
		}
		if err != nil {
			return err
		}
	}
}

func writeFile(root *os.Root, name string, r io.Reader) error {
	if err := root.MkdirAll(path.Dir(name), 0o755); err != nil {
		return err
	}
	f, err := root.Create(name)
	if err != nil {
		return err
	}
	_, err = io.Copy(f, r)
	return errors.Join(err, f.Close())
}
