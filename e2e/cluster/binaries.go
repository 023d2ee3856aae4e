package cluster

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"sync"

	"pvbridge.io/e2e/images"
)

// Binaries finds the executables a lab runs: the pinned third-party ones (Kubernetes, etcd, the
// CSI sidecars), built once by `make tools` into a cache outside the repository, and pvbridge's
// own, built from the repository on first use.
type Binaries struct {
	// Dir holds the third-party binaries ($PVBRIDGE_BIN, default
	// ${XDG_CACHE_HOME:-$HOME/.cache}/pvbridge/bin).
	Dir string
	// Repo is the root of the pvbridge repository ($PVBRIDGE_ROOT, default: found from this
	// source file).
	Repo string

	mu     sync.Mutex
	builds map[string]*build
}

type build struct {
	once sync.Once
	path string
	err  error
}

// DefaultBinaries returns the binaries of the environment.
func DefaultBinaries() (*Binaries, error) {
	dir := os.Getenv("PVBRIDGE_BIN")
	if dir == "" {
		cache := os.Getenv("XDG_CACHE_HOME")
		if cache == "" {
			home, err := os.UserHomeDir()
			if err != nil {
				return nil, err
			}
			cache = filepath.Join(home, ".cache")
		}
		dir = filepath.Join(cache, "pvbridge", "bin")
	}
	repo := os.Getenv("PVBRIDGE_ROOT")
	if repo == "" {
		_, file, _, ok := runtime.Caller(0)
		if !ok {
			return nil, fmt.Errorf("cannot find the repository: set PVBRIDGE_ROOT")
		}
		repo = filepath.Join(filepath.Dir(file), "..", "..")
	}
	repo, err := filepath.Abs(repo)
	if err != nil {
		return nil, err
	}
	if _, err := os.Stat(filepath.Join(repo, "go.work")); err != nil {
		return nil, fmt.Errorf("%s is not the pvbridge repository (no go.work): set PVBRIDGE_ROOT", repo)
	}
	return &Binaries{Dir: dir, Repo: repo}, nil
}

// Tool returns the path of a pinned third-party binary.
func (b *Binaries) Tool(name string) (string, error) {
	p := filepath.Join(b.Dir, name)
	if _, err := os.Stat(p); err != nil {
		return "", fmt.Errorf("%s is not built: run `make tools` (looked in %s)", name, b.Dir)
	}
	return p, nil
}

// Own builds one of pvbridge's commands (a package path relative to the repository, e.g.
// ./e2e/cmd/fakecri) into <repo>/bin, once per process, and returns its path. The Go build cache
// makes this cheap when nothing changed.
func (b *Binaries) Own(pkg string) (string, error) {
	b.mu.Lock()
	if b.builds == nil {
		b.builds = map[string]*build{}
	}
	bd, ok := b.builds[pkg]
	if !ok {
		bd = &build{}
		b.builds[pkg] = bd
	}
	b.mu.Unlock()

	bd.once.Do(func() {
		bd.path = filepath.Join(b.Repo, "bin", filepath.Base(pkg))
		// As the images have them: the lab runs and measures the binaries a user deploys.
		if out, err := images.GoBuild(b.Repo, bd.path, "", pkg).CombinedOutput(); err != nil {
			bd.err = fmt.Errorf("go build %s: %w\n%s", pkg, err, out)
		}
	})
	return bd.path, bd.err
}

// NodeImages builds the node image of QEMU VMs for the lab's kubelet (hack/build-node-image.sh,
// which does nothing when it is built) into the image store next to the binaries' directory,
// <cache>/node-images, and returns the store and the image's name (node-<kubelet version>).
func (b *Binaries) NodeImages(ctx context.Context) (store, image string, err error) {
	store = filepath.Join(filepath.Dir(b.Dir), "node-images")
	cmd := exec.CommandContext(ctx, filepath.Join(b.Repo, "hack", "build-node-image.sh"), store)
	cmd.Env = append(os.Environ(), "PVBRIDGE_BIN="+b.Dir)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return "", "", fmt.Errorf("build the node image: %w\n%s", err, out)
	}
	m := regexp.MustCompile(`build-node-image: (node-\S+?):? `).FindSubmatch(out)
	if m == nil {
		return "", "", fmt.Errorf("build the node image: no image named in %q", out)
	}
	return store, string(m[1]), nil
}
