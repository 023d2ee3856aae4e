package suite_test

import (
	"context"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"

	snapshotv1 "github.com/kubernetes-csi/external-snapshotter/client/v8/apis/volumesnapshot/v1"
	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/yaml"

	"pvbridge.io/e2e/cluster"
	pmemv1 "pvbridge.io/pkg/apis/pmem/v1alpha1"
	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
)

// storageState is everything a volume leaves behind somewhere, one line per thing: management
// PVCs, PVs, VolumeAttachments, VolumeSnapshots, PmemVolumes, PmemSnapshots, PmemReplicas, VM volume entries
// (spec and status), each guest's PVs, VolumeAttachments and VolumeSnapshotContents, the loop
// devices and mounts below the lab, and each host's free PMEM.
func storageState(ctx context.Context) ([]string, error) {
	var lines []string
	add := func(format string, args ...any) { lines = append(lines, fmt.Sprintf(format, args...)) }
	// each lists l in c and adds a line per object: what, then its namespace/name.
	each := func(c client.Client, what string, l client.ObjectList) error {
		if err := c.List(ctx, l); err != nil {
			return err
		}
		return meta.EachListItem(l, func(o runtime.Object) error {
			add("%s %s", what, client.ObjectKeyFromObject(o.(client.Object)))
			return nil
		})
	}
	for what, l := range map[string]client.ObjectList{
		"mgmt PVC": &corev1.PersistentVolumeClaimList{}, "mgmt PV": &corev1.PersistentVolumeList{},
		"mgmt VolumeAttachment": &storagev1.VolumeAttachmentList{}, "mgmt VolumeSnapshot": &snapshotv1.VolumeSnapshotList{},
		"PmemVolume": &pmemv1.PmemVolumeList{}, "PmemSnapshot": &pmemv1.PmemSnapshotList{},
		"PmemReplica": &pmemv1.PmemReplicaList{},
	} {
		if err := each(mc, what, l); err != nil {
			return nil, err
		}
	}
	for _, g := range []*guestCluster{alpha, beta} {
		for what, l := range map[string]client.ObjectList{
			"PV": &corev1.PersistentVolumeList{}, "VolumeAttachment": &storagev1.VolumeAttachmentList{},
			"VolumeSnapshotContent": &snapshotv1.VolumeSnapshotContentList{},
		} {
			if err := each(g.c, "guest "+g.Options.Name+" "+what, l); err != nil {
				return nil, err
			}
		}
	}
	pmemNodes := &pmemv1.PmemNodeList{}
	vms := &vmv1.VirtualMachineList{}
	for _, l := range []client.ObjectList{pmemNodes, vms} {
		if err := mc.List(ctx, l); err != nil {
			return nil, err
		}
	}
	for _, o := range pmemNodes.Items {
		add("PMEM free on %s: %v", o.Name, o.Status.Free)
	}
	for _, vm := range vms.Items {
		for _, v := range vm.Spec.Volumes {
			add("VM %s/%s spec volume %s", vm.Namespace, vm.Name, v.Name)
		}
		for _, v := range vm.Status.Volumes {
			add("VM %s/%s status volume %s", vm.Namespace, vm.Name, v.Name)
		}
	}
	loops, err := cluster.LoopsBelow(lab.Root)
	if err != nil {
		return nil, err
	}
	for _, l := range loops {
		// By its file, not its number: a host replaced (Host loss) mounts its new PMEM region
		// from another loop device.
		backing, err := os.ReadFile(filepath.Join("/sys/block", filepath.Base(l), "loop", "backing_file"))
		if err != nil {
			continue // detached meanwhile
		}
		add("loop device of %s", strings.TrimSpace(string(backing)))
	}
	mounts, err := cluster.MountsBelow(lab.Root)
	if err != nil {
		return nil, err
	}
	for _, m := range mounts {
		// The tmpfs of a pod's token, Secret and ConfigMap volumes are kubelet's own, and come
		// and go with the installed system's pods (fake containers here) on their own time.
		if !kubeletTmpfs.MatchString(m) {
			add("mount %s", m)
		}
	}
	slices.Sort(lines)
	return lines, nil
}

var kubeletTmpfs = regexp.MustCompile(`/volumes/kubernetes\.io~(projected|secret|configmap)/`)

// Every spec must leave the system as it found it. The check is registered first, so it runs
// after every cleanup the spec registered.
var _ = BeforeEach(func(ctx SpecContext) {
	before, err := storageState(ctx)
	Expect(err).NotTo(HaveOccurred())
	DeferCleanup(func(ctx SpecContext) {
		Eventually(storageState).WithContext(ctx).WithTimeout(timeout).Should(Equal(before), "left behind or removed by the spec")
	}, NodeTimeout(timeout+30e9))
}, OncePerOrdered)

// suiteFailed keeps the lab for a look when any spec failed.
var suiteFailed bool

// On failure, dump what an engineer would look at first.
var _ = ReportAfterEach(func(report SpecReport) {
	if !report.Failed() || lab == nil {
		return
	}
	suiteFailed = true
	dir := os.Getenv("PVBRIDGE_ARTIFACTS")
	if dir == "" {
		dir = filepath.Join(os.TempDir(), "pvbridge-artifacts")
	}
	dir = filepath.Join(dir, regexp.MustCompile(`[^A-Za-z0-9_.-]+`).ReplaceAllString(report.FullText(), "_"))
	if err := dumpArtifacts(context.Background(), dir); err != nil {
		fmt.Fprintf(GinkgoWriter, "dump artefacts: %v\n", err)
	}
	fmt.Fprintf(GinkgoWriter, "artefacts of the failed spec in %s; the lab (all logs) stays in %s\n", dir, lab.Root)
})

// dumpArtifacts writes every storage object of both clusters as YAML, with their events, and
// the last 256 KiB of every log of the lab.
func dumpArtifacts(ctx context.Context, dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	clients := map[string]client.Client{"mgmt": mc}
	for _, g := range []*guestCluster{alpha, beta} {
		if g != nil {
			clients["guest-"+g.Options.Name] = g.c
		}
	}
	for name, c := range clients {
		for kind, l := range map[string]client.ObjectList{
			"pvcs": &corev1.PersistentVolumeClaimList{}, "pvs": &corev1.PersistentVolumeList{},
			"volumeattachments": &storagev1.VolumeAttachmentList{}, "pods": &corev1.PodList{},
			"events": &corev1.EventList{}, "nodes": &corev1.NodeList{},
			"volumesnapshots": &snapshotv1.VolumeSnapshotList{}, "volumesnapshotcontents": &snapshotv1.VolumeSnapshotContentList{},
			"virtualmachines": &vmv1.VirtualMachineList{}, "pmemvolumes": &pmemv1.PmemVolumeList{}, "pmemnodes": &pmemv1.PmemNodeList{},
			"pmemreplicas": &pmemv1.PmemReplicaList{},
		} {
			if err := c.List(ctx, l); err != nil {
				continue // the kind is not served in this cluster, or the apiserver is down
			}
			out, err := yaml.Marshal(l)
			if err != nil {
				return err
			}
			if err := os.WriteFile(filepath.Join(dir, name+"-"+kind+".yaml"), out, 0o644); err != nil {
				return err
			}
		}
	}
	return filepath.WalkDir(lab.Root, func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || !strings.HasSuffix(path, ".log") {
			return nil //nolint:nilerr // a directory that vanished has no logs to keep
		}
		rel, _ := filepath.Rel(lab.Root, path)
		return tail(path, filepath.Join(dir, "logs", rel), 256<<10)
	})
}

// tail copies the last n bytes of file from to to.
func tail(from, to string, n int64) error {
	in, err := os.Open(from)
	if err != nil {
		return err
	}
	defer in.Close()
	if st, err := in.Stat(); err == nil && st.Size() > n {
		if _, err := in.Seek(-n, io.SeekEnd); err != nil {
			return err
		}
	}
	if err := os.MkdirAll(filepath.Dir(to), 0o755); err != nil {
		return err
	}
	out, err := os.Create(to)
	if err != nil {
		return err
	}
	defer out.Close()
	_, err = io.Copy(out, in)
	return err
}
