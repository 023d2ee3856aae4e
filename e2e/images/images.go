package images

import (
	"fmt"
	"io/fs"
	"maps"
	"path"
	"strings"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// Nonroot is the user of images whose every role runs unprivileged (distroless' nonroot).
const Nonroot = "65532:65532"

// Spec describes one image: a binary of this machine as its entrypoint, on the programs it runs.
type Spec struct {
	// Ref is the image's name and tag, e.g. ghcr.io/pvbridge/guest-csi:v0.1.0.
	Ref string
	// Binary is the entrypoint's file on this machine; it goes to /usr/local/bin/<base name>.
	// Without one the image has no entrypoint, only Cmd.
	Binary string
	// Cmd is the image's default command (the arguments of the entrypoint, if any).
	Cmd []string
	// Extra are more entries of the programs' layer (symlinks to a program, say).
	Extra []Entry
	// User runs the entrypoint: "0" where a role needs root (node plugins), else Nonroot.
	User string
	// Programs are the programs (with their libraries) the binary runs, from Debian packages.
	Programs []string
	// Labels are OCI annotations of the image config (title, source, version, revision, ...).
	Labels map[string]string
}

// Build builds the image of s: a base layer (users, /tmp), the programs' layer and the binary's
// layer. The Debian packages the programs come from are listed in the label
// io.pvbridge.debian-packages.
func Build(s Spec, h *Host) (v1.Image, error) {
	layers := []v1.Layer{}
	base, err := Layer([]Entry{
		File("/etc/passwd", 0o644, []byte("root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n")),
		File("/etc/group", 0o644, []byte("root:x:0:\nnonroot:x:65532:\n")),
		Dir("/tmp", fs.ModeSticky|0o777),
		Dir("/home/nonroot", 0o755),
	})
	if err != nil {
		return nil, err
	}
	layers = append(layers, base)
	labels := maps.Clone(s.Labels)
	if labels == nil {
		labels = map[string]string{}
	}
	if len(s.Programs) > 0 {
		entries, pkgs, err := h.Programs(s.Programs)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", s.Ref, err)
		}
		l, err := Layer(append(entries, s.Extra...))
		if err != nil {
			return nil, err
		}
		layers = append(layers, l)
		labels["io.pvbridge.debian-packages"] = strings.Join(pkgs, " ")
	}
	var entrypoint []string
	if s.Binary != "" {
		entrypoint = []string{path.Join("/usr/local/bin", path.Base(s.Binary))}
		bin, err := Layer([]Entry{{Path: entrypoint[0], Mode: 0o755, Source: s.Binary}})
		if err != nil {
			return nil, err
		}
		layers = append(layers, bin)
	}

	img, err := mutate.AppendLayers(mutate.MediaType(empty.Image, types.OCIManifestSchema1), layers...)
	if err != nil {
		return nil, err
	}
	img = mutate.ConfigMediaType(img, types.OCIConfigJSON)
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, err
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = "linux", "amd64"
	cf.Created = v1.Time{Time: epoch}
	cf.Config = v1.Config{
		Entrypoint: entrypoint,
		Cmd:        s.Cmd,
		User:       s.User,
		WorkingDir: "/",
		Env:        []string{"PATH=" + programPath},
		Labels:     labels,
	}
	return mutate.ConfigFile(img, cf)
}
