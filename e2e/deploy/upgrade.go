package deploy

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"

	"golang.org/x/sys/unix"

	"pvbridge.io/e2e/cluster"
	"pvbridge.io/e2e/images"
)

// The release the upgrade test upgrades from (docs/upgrade.md): until v0.1.0 is tagged, the first
// commit `make release` could release, built as previousVersion. Each release moves them to the
// release before it.
const (
	previousCommit  = "1c4dbb3d463215729281996b84e92aaf6a0bcfeb"
	previousVersion = "v0.1.0-alpha.0"
)

// previousLacks are the lab's flags (labArgs) the previous release does not know: its node
// agents start no daemons of replicated volumes.
var previousLacks = []string{"--daemon-cgroup-parent"}

// Release is a tree of pvbridge other than the lab's, the commit Commit, built as Version (its
// binaries' version, its images' tag).
type Release struct {
	Root, Commit, Version string
}

// PreviousRelease writes the previous release's tree, from the lab's git repository (or its
// origin's), below the lab's root.
func PreviousRelease(ctx context.Context, lab *cluster.Lab) (*Release, error) {
	dir := filepath.Join(lab.Root, "release-"+previousVersion)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	// A shallow clone lacks the commit: it is fetched from the clone's origin.
	cmd := exec.CommandContext(ctx, "bash", "-o", "pipefail", "-ec", `
		git -C "$1" cat-file -e "$2^{commit}" 2>/dev/null || git -C "$1" fetch --quiet origin "$2"
		git -C "$1" archive --format=tar "$2" | tar -x -C "$3"`,
		"-", lab.Binaries().Repo, previousCommit, dir)
	if out, err := cmd.CombinedOutput(); err != nil {
		return nil, fmt.Errorf("the previous release, commit %s: %w\n%s", previousCommit, err, out)
	}
	return &Release{Root: dir, Commit: previousCommit, Version: previousVersion}, nil
}

// images returns the archives of r's images, built once per machine (a release's tree does not
// change) into <cache>/releases/<version>-<commit>, next to the tools' directory.
// Labs of one machine that build it at once take turns (a lock file beside it): the second
// finds the first's build.
func (r *Release) images(lab *cluster.Lab) ([]string, error) {
	dir := filepath.Join(filepath.Dir(lab.Binaries().Dir), "releases", r.Version+"-"+r.Commit)
	if err := os.MkdirAll(filepath.Dir(dir), 0o755); err != nil {
		return nil, err
	}
	lock, err := os.OpenFile(dir+".lock", os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, err
	}
	defer lock.Close() // and so unlocked
	if err := unix.Flock(int(lock.Fd()), unix.LOCK_EX); err != nil {
		return nil, fmt.Errorf("lock %s: %w", lock.Name(), err)
	}
	list := filepath.Join(dir, "archives") // written last: the build is whole
	if data, err := os.ReadFile(list); err == nil {
		return strings.Fields(string(data)), nil
	}
	if err := os.RemoveAll(dir); err != nil {
		return nil, err
	}
	files, err := images.BuildRelease(r.Root, r.Version, dir)
	if err != nil {
		return nil, fmt.Errorf("release %s: %w", r.Version, err)
	}
	return files, os.WriteFile(list, []byte(strings.Join(files, "\n")+"\n"), 0o644)
}

// Upgrade moves an install of the previous release (InstalledOptions.Previous) to the lab's
// tree as docs/upgrade.md says: the management cluster first, its CRDs applied with kubectl
// (helm installs a chart's crds/ but never upgrades them) and then helm upgrade with the values
// of the install; then the guest, its overlay applied again. It returns once every workload of
// both clusters has rolled out and is ready.
func (in *Installed) Upgrade(ctx context.Context, lab *cluster.Lab) error {
	if in.installed == nil {
		return errors.New("upgrade: no previous release is installed")
	}
	in.installed = nil
	chart := filepath.Join(lab.Binaries().Repo, "charts", "pvbridge-management")
	kubectl, err := lab.Binaries().Tool("kubectl")
	if err != nil {
		return err
	}
	out, err := exec.CommandContext(ctx, kubectl, "--kubeconfig", in.Mgmt.Kubeconfig, "apply", "--server-side", "--force-conflicts",
		"-f", filepath.Join(chart, "crds")).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s: apply the chart's CRDs: %w\n%s", in.Mgmt.Name, err, out)
	}
	values, err := in.helmValues(lab)
	if err != nil {
		return err
	}
	if _, err := in.Helm(ctx, lab, "upgrade", "pvbridge", chart, "--namespace", InstallNamespace, "--values", values); err != nil {
		return err
	}
	if err := WaitWorkloadsReady(ctx, in.Mgmt.Client(), InstallNamespace); err != nil {
		return err
	}
	return in.apply(ctx, lab, in.Guest, "guest", in.guestKustomization())
}

// clusterctlRepository adds r's infrastructure provider to the clusterctl repository repo
// (hack/release.sh clusterctl) as r's own release wrote it: its manifests/clusterctl, with its
// image tagged r.Version.
func (r *Release) clusterctlRepository(repo string) error {
	dir := filepath.Join(repo, "infrastructure-pvbridge", r.Version)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	var refs []string
	for _, name := range ownImageNames() {
		refs = append(refs, regexp.QuoteMeta(name))
	}
	ref := regexp.MustCompile(`(` + strings.Join(refs, "|") + `):[^\s"]+`)
	for _, file := range []string{"infrastructure-components.yaml", "metadata.yaml"} {
		data, err := os.ReadFile(filepath.Join(r.Root, "manifests", "clusterctl", file))
		if err != nil {
			return err
		}
		data = ref.ReplaceAll(data, []byte("${1}:"+r.Version))
		if err := os.WriteFile(filepath.Join(dir, file), data, 0o644); err != nil {
			return err
		}
	}
	return nil
}
