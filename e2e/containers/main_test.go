// Package containers_test proves pvbridge as an admin installs it, with the images `make images`
// builds, on lab clusters whose nodes run real containers (containerd and runc): the management
// side from its Helm chart (helm install; e2e/capi and make run apply its overlay), the guest
// side from its overlay (kubectl apply -k). Every test shares one such lab (deploy.Install): two
// management hosts, and guest cluster alpha with vm-1 and vm-3 on host-a and vm-2 on host-b,
// installed at the previous release and upgraded to this tree while a guest pod writes
// (upgrade_test.go).
package containers_test

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"k8s.io/klog/v2"
	logf "sigs.k8s.io/controller-runtime/pkg/log"

	"pvbridge.io/e2e/cluster"
	"pvbridge.io/e2e/deploy"
	"pvbridge.io/e2e/images"
	"pvbridge.io/e2e/polling"
)

var (
	// lab and in are the shared lab and what is installed in it.
	lab *cluster.Lab
	in  *deploy.Installed
	// e2eTest is Kubernetes' e2e.test at the pinned version (hack/build-tools.sh).
	e2eTest string
)

func TestMain(m *testing.M) {
	polling.Set()
	flag.Parse()
	logf.SetLogger(klog.Background()) // deploy's controller-runtime clients log through klog
	os.Exit(run(m))
}

func run(m *testing.M) int {
	root, err := cluster.NewRoot()
	if err == nil {
		err = install(context.Background(), root)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "install the lab:", err)
	}
	code := 1
	if err == nil {
		code = m.Run()
	}
	if lab != nil {
		if err := lab.Stop(); err != nil {
			fmt.Fprintln(os.Stderr, "stop the lab:", err)
			code = 1
		}
	}
	if code == 0 {
		_ = os.RemoveAll(root)
	} else {
		fmt.Fprintln(os.Stderr, "lab kept in", root)
	}
	return code
}

// install starts the shared lab in root, with the images Kubernetes' storage tests run
// imported into every node besides pvbridge's.
func install(ctx context.Context, root string) error {
	bin, err := cluster.DefaultBinaries()
	if err != nil {
		return err
	}
	if e2eTest, err = bin.Tool("e2e.test"); err != nil {
		return err
	}
	list, err := exec.CommandContext(ctx, e2eTest, "--list-images").Output()
	if err != nil {
		return fmt.Errorf("e2e.test --list-images: %w", err)
	}
	testImages, err := images.ConformanceImages(strings.Fields(string(list)))
	if err != nil {
		return err
	}
	built, err := images.BuildAll(images.Options{Root: bin.Repo, Bin: bin.Dir, Out: filepath.Join(root, "test-images")}, testImages)
	if err != nil {
		return err
	}
	var archives []string
	for _, b := range built {
		archives = append(archives, b.File)
	}
	if lab, err = cluster.NewLab(root, bin); err != nil {
		return err
	}
	// The lab starts at the previous release (its CRDs too) and is upgraded to this tree.
	previous, err := deploy.PreviousRelease(ctx, lab)
	if err != nil {
		return err
	}
	lab.CRDs = previous.Root
	in, err = deploy.Install(ctx, lab, deploy.InstalledOptions{
		Hosts: []string{"host-a", "host-b"}, PmemSize: 64 << 30, Images: archives, Helm: true, Previous: previous,
		Guest: deploy.GuestOptions{Name: "alpha", Namespace: "tenant-a", VMs: map[string]string{"vm-1": "host-a", "vm-2": "host-b", "vm-3": "host-a"}},
	})
	if err != nil {
		return err
	}
	return upgradeWithAWriter(ctx, lab)
}
