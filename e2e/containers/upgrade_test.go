package containers_test

import (
	"context"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apiextensions "k8s.io/apiextensions-apiserver/pkg/client/clientset/clientset"
	"k8s.io/apimachinery/pkg/api/equality"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/apimachinery/pkg/watch"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pvbridge.io/e2e/cluster"
	"pvbridge.io/e2e/deploy"
	"pvbridge.io/e2e/images"
	vmv1 "pvbridge.io/pkg/apis/vm/v1alpha1"
)

// upgraded is what the shared lab's upgrade saw (upgradeWithAWriter): the lab installs the
// previous release, starts a guest pod that writes to a guest volume, and upgrades both clusters
// to this tree while it writes.
var upgraded struct {
	// ns is the guest namespace of the writer and its claim "data"; node the writer's node.
	ns, node string
	// synced is how many records the writer had synced when the upgrade was done.
	synced int
	// took is how long the upgrade took, both clusters.
	took time.Duration
	// before are the images of pvbridge's containers before the upgrade (pvbridgeImages).
	before map[string]string
	// faults are what the watches saw go wrong while the upgrade ran.
	faults []string
}

// TestUpgradeWithVolumesAttached: the lab was installed at the previous release and upgraded
// to this tree (helm upgrade of the management chart after its CRDs, the guest overlay applied
// again) while a guest pod wrote to a volume. No VM restarted, no volume detached, the writer
// never stopped; every workload runs this tree's images and the CRDs are this tree's. The old
// volume is still served: the new release detached it from the writer's VM (the writer was
// deleted after the upgrade), attaches it to another VM whose pod finds every record, and
// deletes it.
func TestUpgradeWithVolumesAttached(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	t.Logf("upgraded in %.0f s while the writer synced %d records", upgraded.took.Seconds(), upgraded.synced)
	g.Expect(upgraded.faults).To(BeEmpty(), "no VM restarted, no volume detached, no write stopped")

	tags, err := images.Tags(filepath.Join(lab.Binaries().Repo, images.TagsFile))
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(upgraded.before).NotTo(BeEmpty())
	for container, image := range upgraded.before {
		name, tag, _ := strings.Cut(image, ":")
		g.Expect(tag).To(Equal(in.Options.Previous.Version), "%s ran %s before the upgrade", container, name)
	}
	after, err := pvbridgeImages(ctx)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(after).To(HaveLen(len(upgraded.before)))
	for container, image := range after {
		name, tag, _ := strings.Cut(image, ":")
		g.Expect(tag).To(Equal(tags[name]), "%s runs %s after the upgrade", container, name)
	}
	crds, err := cluster.ReadCRDs(filepath.Join(lab.Binaries().Repo, "charts", "pvbridge-management", "crds"))
	g.Expect(err).NotTo(HaveOccurred())
	ac, err := apiextensions.NewForConfig(in.Mgmt.RESTConfig())
	g.Expect(err).NotTo(HaveOccurred())
	for _, want := range crds {
		got, err := ac.ApiextensionsV1().CustomResourceDefinitions().Get(ctx, want.Name, metav1.GetOptions{})
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(got.Spec.Versions).To(HaveLen(len(want.Spec.Versions)), want.Name)
		for i, v := range want.Spec.Versions {
			g.Expect(equality.Semantic.DeepEqual(got.Spec.Versions[i].Schema, v.Schema)).To(BeTrue(), "%s %s: the served schema is this tree's", want.Name, v.Name)
		}
	}

	gc := in.Guest.Client()
	ns := upgraded.ns
	expectRecords(g, runToCompletion(ctx, g, gc, ns, "reader", readerNode(), "cat /data/log"), upgraded.synced)

	pvc, err := gc.CoreV1().PersistentVolumeClaims(ns).Get(ctx, "data", metav1.GetOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(gc.CoreV1().PersistentVolumeClaims(ns).Delete(ctx, "data", metav1.DeleteOptions{})).To(Succeed())
	g.Eventually(func() bool {
		_, err := gc.CoreV1().PersistentVolumes().Get(ctx, pvc.Spec.VolumeName, metav1.GetOptions{})
		return err != nil && client.IgnoreNotFound(err) == nil
	}).WithContext(ctx).WithTimeout(3*time.Minute).Should(BeTrue(), "the volume made by the previous release is deleted by this one")
}

// upgradeWithAWriter starts a guest pod that appends synced records to a volume, upgrades the
// lab to this tree (deploy.Installed.Upgrade) while it writes, watching the guest's VMs, both
// clusters' VolumeAttachments and the writer, and records what it saw in upgraded.
func upgradeWithAWriter(ctx context.Context, lab *cluster.Lab) error {
	gc := in.Guest.Client()
	ns, err := deploy.CreateNamespace(ctx, gc, "upgrade")
	if err != nil {
		return err
	}
	upgraded.ns, upgraded.node = ns, "vm-1"
	if _, err := gc.CoreV1().PersistentVolumeClaims(ns).Create(ctx, deploy.PVC(ns, "data", "", "64Mi", false), metav1.CreateOptions{}); err != nil {
		return err
	}
	writer := deploy.Pod(ns, "writer", "data", upgraded.node, false)
	// Each record synced before the next; the first failed write ends the pod.
	writer.Spec.Containers[0].Command = []string{"sh", "-c",
		"i=0; while i=$((i+1)) && echo $i >> /data/log && sync /data/log; do sleep 0.05; done; echo write $i failed; exit 1"}
	writer.Spec.RestartPolicy = corev1.RestartPolicyNever
	if _, err := gc.CoreV1().Pods(ns).Create(ctx, writer, metav1.CreateOptions{}); err != nil {
		return err
	}
	if err := until(ctx, 3*time.Minute, "the writer writes", func() (bool, error) {
		n, err := records(ctx)
		return n >= 20, client.IgnoreNotFound(err)
	}); err != nil {
		return err
	}

	if upgraded.before, err = pvbridgeImages(ctx); err != nil {
		return err
	}
	watching, stop := context.WithCancel(ctx)
	faults, err := watchFaults(watching)
	if err != nil {
		stop()
		return err
	}
	start := time.Now()
	err = in.Upgrade(ctx, lab)
	upgraded.took = time.Since(start)
	if err != nil {
		stop()
		return err
	}
	if upgraded.synced, err = records(ctx); err != nil {
		stop()
		return err
	}
	// The writer goes on after the upgrade, through the new node plugins.
	err = until(ctx, time.Minute, "the writer writes after the upgrade", func() (bool, error) {
		n, err := records(ctx)
		return n > upgraded.synced, err
	})
	stop()
	upgraded.faults = faults.wait()
	if err != nil {
		return err
	}
	// Stopped, so that its volume takes none of vm-1's slots while the other tests run;
	// TestUpgradeWithVolumesAttached reads it.
	return gc.CoreV1().Pods(ns).Delete(ctx, "writer", metav1.DeleteOptions{})
}

// records counts the writer's records, read in its node's mount namespace from its mount.
func records(ctx context.Context) (int, error) {
	gc := in.Guest.Client()
	p, err := gc.CoreV1().Pods(upgraded.ns).Get(ctx, "writer", metav1.GetOptions{})
	if err != nil {
		return 0, err
	}
	pvc, err := gc.CoreV1().PersistentVolumeClaims(upgraded.ns).Get(ctx, "data", metav1.GetOptions{})
	if err != nil || pvc.Spec.VolumeName == "" || p.Status.Phase != corev1.PodRunning {
		return 0, err
	}
	n, err := syncedRecords(ctx, in.GuestNodes[upgraded.node], p.UID, pvc.Spec.VolumeName)
	if err != nil {
		return 0, nil // not yet published
	}
	return n, nil
}

// syncedRecords counts the lines of the log a writer appends to its volume pv at /data, read in
// the mount namespace of its node from the pod's mount.
func syncedRecords(ctx context.Context, node *cluster.Node, pod types.UID, pv string) (int, error) {
	log := filepath.Join("/var/lib/kubelet/pods", string(pod), "volumes/kubernetes.io~csi", pv, "mount/log")
	out, err := node.Command(ctx, "cat", log).Output()
	if err != nil {
		return 0, fmt.Errorf("%s: cat %s: %w", node.Name, log, err)
	}
	return strings.Count(string(out), "\n"), nil
}

// pvbridgeImages returns the images of pvbridge's own containers in both clusters, by cluster,
// pod and container (of pods not being deleted).
func pvbridgeImages(ctx context.Context) (map[string]string, error) {
	imgs := map[string]string{}
	for _, cp := range []*cluster.ControlPlane{in.Mgmt, in.Guest} {
		pods, err := cp.Client().CoreV1().Pods(deploy.InstallNamespace).List(ctx, metav1.ListOptions{})
		if err != nil {
			return nil, err
		}
		for _, p := range pods.Items {
			if p.DeletionTimestamp != nil {
				continue
			}
			for _, c := range p.Spec.Containers {
				if strings.HasPrefix(c.Image, "ghcr.io/pvbridge/") {
					imgs[cp.Name+"/"+p.Name+"/"+c.Name] = c.Image
				}
			}
		}
	}
	return imgs, nil
}

// until polls done every 200 ms until it is true, its error, or timeout, which it describes as
// what.
func until(ctx context.Context, timeout time.Duration, what string, done func() (bool, error)) error {
	if err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, timeout, true, func(context.Context) (bool, error) { return done() }); err != nil {
		return fmt.Errorf("%s: %w", what, err)
	}
	return nil
}

// readerNode is a VM on the writer's host other than the writer's (the volume is local to the host).
func readerNode() string {
	for vm, host := range in.Options.Guest.VMs {
		if vm != upgraded.node && host == in.Options.Guest.VMs[upgraded.node] {
			return vm
		}
	}
	return ""
}

// faultLog collects what watches describe as faults.
type faultLog struct {
	mu     sync.Mutex
	faults []string
	done   sync.WaitGroup
}

func (f *faultLog) add(format string, args ...any) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.faults = append(f.faults, fmt.Sprintf(format, args...))
}

// wait waits for the watches to end (their context done) and returns the faults.
func (f *faultLog) wait() []string {
	f.done.Wait()
	return f.faults
}

// watch describes every event of w with fault until ctx ends; a watch that ends before is a
// fault itself (what it did not see is not known).
func (f *faultLog) watch(ctx context.Context, what string, w watch.Interface, fault func(watch.Event) string) {
	f.done.Go(func() {
		defer w.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case e, ok := <-w.ResultChan():
				if !ok {
					if ctx.Err() == nil {
						f.add("the watch of %s ended", what)
					}
					return
				}
				if e.Type == watch.Error {
					f.add("%s: watch error %v", what, e.Object)
				} else if s := fault(e); s != "" {
					f.add("%s: %s", what, s)
				}
			}
		}
	})
}

// watchFaults watches, until ctx ends, what an upgrade must leave alone: the guest's VMs (each
// Running, its uniqueID and its attached volumes as they are now), both clusters'
// VolumeAttachments that are attached now, and the writer (running, never restarted).
func watchFaults(ctx context.Context) (*faultLog, error) {
	f := &faultLog{}
	scheme, err := deploy.MgmtScheme()
	if err != nil {
		return nil, err
	}
	mc, err := client.NewWithWatch(in.Mgmt.RESTConfig(), client.Options{Scheme: scheme})
	if err != nil {
		return nil, err
	}
	vms := &vmv1.VirtualMachineList{}
	if err := mc.List(ctx, vms, client.InNamespace(in.Options.Guest.Namespace)); err != nil {
		return nil, err
	}
	type vmState struct {
		uid     string
		volumes []string
	}
	was := map[string]vmState{}
	for _, vm := range vms.Items {
		s := vmState{uid: vm.Status.UniqueID}
		for _, v := range vm.Status.Volumes {
			if v.Attached {
				s.volumes = append(s.volumes, v.Name)
			}
		}
		was[vm.Name] = s
	}
	w, err := mc.Watch(ctx, &vmv1.VirtualMachineList{}, client.InNamespace(in.Options.Guest.Namespace))
	if err != nil {
		return nil, err
	}
	f.watch(ctx, "VirtualMachines", w, func(e watch.Event) string {
		vm, ok := e.Object.(*vmv1.VirtualMachine)
		if !ok {
			return fmt.Sprintf("a %T", e.Object)
		}
		s := was[vm.Name]
		switch {
		case e.Type == watch.Deleted:
			return vm.Name + " deleted"
		case vm.Status.Phase != vmv1.PhaseRunning:
			return fmt.Sprintf("%s is %s", vm.Name, vm.Status.Phase)
		case vm.Status.UniqueID != s.uid:
			return fmt.Sprintf("%s restarted: uniqueID %s, was %s", vm.Name, vm.Status.UniqueID, s.uid)
		}
		for _, name := range s.volumes {
			if !slices.ContainsFunc(vm.Status.Volumes, func(v vmv1.VirtualMachineVolumeStatus) bool { return v.Name == name && v.Attached }) {
				return fmt.Sprintf("%s: volume %s detached", vm.Name, name)
			}
		}
		return ""
	})

	for _, cp := range []*cluster.ControlPlane{in.Mgmt, in.Guest} {
		if err := watchAttachments(ctx, f, cp); err != nil {
			return nil, err
		}
	}

	gc := in.Guest.Client()
	pw, err := gc.CoreV1().Pods(upgraded.ns).Watch(ctx, metav1.ListOptions{FieldSelector: fields.OneTermEqualSelector("metadata.name", "writer").String()})
	if err != nil {
		return nil, err
	}
	f.watch(ctx, "the writer", pw, func(e watch.Event) string {
		p, ok := e.Object.(*corev1.Pod)
		switch {
		case !ok:
			return fmt.Sprintf("a %T", e.Object)
		case e.Type == watch.Deleted:
			return "deleted"
		case p.Status.Phase != corev1.PodRunning:
			return fmt.Sprintf("%s: %s", p.Status.Phase, p.Status.Message)
		}
		for _, cs := range p.Status.ContainerStatuses {
			if cs.RestartCount > 0 || cs.State.Running == nil {
				return fmt.Sprintf("container %s: %d restarts, %+v", cs.Name, cs.RestartCount, cs.State)
			}
		}
		return ""
	})
	return f, nil
}

// watchAttachments watches the VolumeAttachments of cp that are attached now: each stays, attached.
func watchAttachments(ctx context.Context, f *faultLog, cp *cluster.ControlPlane) error {
	c := cp.Client()
	list, err := c.StorageV1().VolumeAttachments().List(ctx, metav1.ListOptions{})
	if err != nil {
		return err
	}
	attached := map[string]bool{}
	for _, va := range list.Items {
		attached[va.Name] = va.Status.Attached
	}
	w, err := c.StorageV1().VolumeAttachments().Watch(ctx, metav1.ListOptions{ResourceVersion: list.ResourceVersion})
	if err != nil {
		return err
	}
	f.watch(ctx, cp.Name+"'s VolumeAttachments", w, func(e watch.Event) string {
		va, ok := e.Object.(*storagev1.VolumeAttachment)
		switch {
		case !ok:
			return fmt.Sprintf("a %T", e.Object)
		case !attached[va.Name]:
			return ""
		case e.Type == watch.Deleted:
			return va.Name + " deleted"
		case !va.Status.Attached:
			return va.Name + " detached"
		}
		return ""
	})
	return nil
}

// TestHelmTestOfTheUpgradedRelease: `helm test` of the management chart, as its NOTES say to run
// it after an install or upgrade, makes a volume on a host, writes it and reads it back, and
// leaves nothing behind.
func TestHelmTestOfTheUpgradedRelease(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	out, err := in.Helm(ctx, lab, "test", "pvbridge", "--namespace", deploy.InstallNamespace, "--logs", "--timeout", "3m")
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(string(out)).To(ContainSubstring("Phase:          Succeeded"))
	g.Expect(string(out)).To(ContainSubstring("a volume of class pmem was made, mounted, written and read"))
	mc := in.Mgmt.Client()
	g.Eventually(func(g Gomega) {
		pvcs, err := mc.CoreV1().PersistentVolumeClaims(deploy.InstallNamespace).List(ctx, metav1.ListOptions{})
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(pvcs.Items).To(BeEmpty())
		pods, err := mc.CoreV1().Pods(deploy.InstallNamespace).List(ctx, metav1.ListOptions{})
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(pods.Items).NotTo(ContainElement(HaveField("Name", "pvbridge-test")))
	}).WithContext(ctx).WithTimeout(time.Minute).Should(Succeed(), "the test's claim and pod are gone")
}
