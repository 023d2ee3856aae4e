package images

import (
	"fmt"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"slices"
	"strings"

	v1 "github.com/google/go-containerregistry/pkg/v1"
)

// Options say where BuildAll finds its inputs and puts the archives.
type Options struct {
	// Root is pvbridge's repository.
	Root string
	// Bin holds the pinned third-party binaries (hack/build-tools.sh).
	Bin string
	// Out receives one OCI archive per image, <base name>-<tag>.tar.
	Out string
	// Tags are the manifests' tags (Tags), for images without a Tag of their own.
	Tags map[string]string
	// Version, when set, replaces the tree's version (Version): the version stamped into
	// pvbridge's binaries and the tag of pvbridge's images, for a tree built as another release.
	Version string
}

// Built is an image BuildAll wrote.
type Built struct {
	Ref    string
	Digest v1.Hash
	File   string
}

// BuildAll builds imgs: pvbridge's binaries from the repository, then each image, written as
// an OCI archive to o.Out.
func BuildAll(o Options, imgs []Image) ([]Built, error) {
	if err := os.MkdirAll(o.Out, 0o755); err != nil {
		return nil, err
	}
	bins, err := os.MkdirTemp("", "pvbridge-images-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(bins)
	version := o.Version
	if version != "" && !versionRE.MatchString(version) {
		return nil, fmt.Errorf("version %q is not a version vX.Y.Z", version)
	}
	if version == "" {
		if version, err = Version(o.Root); err != nil {
			return nil, err
		}
	}
	if err := buildBinaries(o.Root, bins, version, imgs); err != nil {
		return nil, err
	}
	revision := "unknown"
	if rev, err := exec.Command("git", "-C", o.Root, "rev-parse", "HEAD").Output(); err == nil {
		revision = strings.TrimSpace(string(rev))
	}
	h := &Host{}
	var built []Built
	for _, i := range imgs {
		tag := i.Tag
		if i.Package != "" && o.Version != "" {
			tag = o.Version
		}
		if tag == "" {
			if tag = o.Tags[i.Name]; tag == "" {
				return nil, fmt.Errorf("image %s has no tag in manifests/components/images", i.Name)
			}
		}
		labels := map[string]string{
			"org.opencontainers.image.title":   path.Base(i.Name),
			"org.opencontainers.image.version": tag,
			"org.opencontainers.image.source":  i.Source,
		}
		binary := ""
		switch {
		case i.Tool != "":
			binary = filepath.Join(o.Bin, i.Tool)
			if _, err := os.Stat(binary); err != nil {
				return nil, fmt.Errorf("%s: %w (make tools builds it)", i.Name, err)
			}
		case i.Package != "":
			binary = filepath.Join(bins, path.Base(i.Package))
			labels["org.opencontainers.image.revision"] = revision
			labels["org.opencontainers.image.licenses"] = "Apache-2.0"
		}
		ref := i.Name + ":" + tag
		img, err := Build(Spec{Ref: ref, Binary: binary, Cmd: i.Cmd, User: i.User, Programs: i.Programs, Extra: i.Extra, Labels: labels}, h)
		if err != nil {
			return nil, err
		}
		file := filepath.Join(o.Out, path.Base(i.Name)+"-"+tag+".tar")
		if err := WriteArchive(file, ref, img); err != nil {
			return nil, fmt.Errorf("%s: %w", ref, err)
		}
		digest, err := img.Digest()
		if err != nil {
			return nil, err
		}
		built = append(built, Built{Ref: ref, Digest: digest, File: file})
	}
	return built, nil
}

// buildBinaries builds the pvbridge binaries of imgs into dir (GoBuild).
func buildBinaries(root, dir, version string, imgs []Image) error {
	var pkgs []string
	for _, i := range imgs {
		if i.Package != "" {
			pkgs = append(pkgs, i.Package)
		}
	}
	if len(pkgs) == 0 {
		return nil
	}
	cmd := GoBuild(root, dir+"/", version, pkgs...)
	cmd.Env = append(cmd.Env, "GOOS=linux", "GOARCH=amd64")
	cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("%s: %w", strings.Join(cmd.Args, " "), err)
	}
	return nil
}

// BuildForLab builds every image the manifests name and the lab's own (pause, busybox), tagged
// as the manifests set them, into out, and returns the archives: what a lab's containerd
// nodes import. root is pvbridge's repository, bin the pinned tool binaries.
func BuildForLab(root, bin, out string) ([]string, error) {
	tags, err := Tags(filepath.Join(root, TagsFile))
	if err != nil {
		return nil, err
	}
	lab, err := LabImages()
	if err != nil {
		return nil, err
	}
	return archives(BuildAll(Options{Root: root, Bin: bin, Out: out, Tags: tags}, append(lab, Catalogue...)))
}

// BuildRelease builds pvbridge's own images of the tree at root as release version (the
// version stamped into its binaries, the images' tag) into out, and returns the archives: a
// lab's previous release, which an upgrade test installs first.
func BuildRelease(root, version, out string) ([]string, error) {
	own := slices.DeleteFunc(slices.Clone(Catalogue), func(i Image) bool { return i.Package == "" })
	return archives(BuildAll(Options{Root: root, Out: out, Version: version}, own))
}

// archives returns the files of built.
func archives(built []Built, err error) ([]string, error) {
	if err != nil {
		return nil, err
	}
	files := make([]string, len(built))
	for i, b := range built {
		files[i] = b.File
	}
	return files, nil
}

// GoBuild returns the command that builds pvbridge's packages pkgs (relative to root) into out
// as the images ship them: static, stripped, without paths or build IDs of this machine, so that
// the same sources give the same bytes, and, unless version is empty, with version as each
// command's version (its main.version).
func GoBuild(root, out, version string, pkgs ...string) *exec.Cmd {
	ldflags := "-s -w -buildid="
	if version != "" {
		ldflags += " -X main.version=" + version
	}
	cmd := exec.Command("go", append([]string{"build", "-trimpath", "-buildvcs=false", "-ldflags=" + ldflags, "-o", out}, pkgs...)...)
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	return cmd
}
