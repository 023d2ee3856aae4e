package cluster

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// newTestLab starts a lab below a short temporary root and stops it when the test ends.
func newTestLab(t *testing.T) *Lab {
	t.Helper()
	bin, err := DefaultBinaries()
	if err != nil {
		t.Fatal(err)
	}
	root, err := NewRoot()
	if err != nil {
		t.Fatal(err)
	}
	lab, err := NewLab(root, bin)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := lab.Stop(); err != nil {
			t.Errorf("stop lab: %v", err)
		}
		if mounts, _ := MountsBelow(root); len(mounts) == 0 && !t.Failed() {
			_ = os.RemoveAll(root)
		}
	})
	return lab
}

func TestTwoControlPlanesBindVolumesAndRunNodes(t *testing.T) {
	g := NewWithT(t)
	ctx := t.Context()
	lab := newTestLab(t)

	start := time.Now()
	var (
		wg    sync.WaitGroup
		cps   [2]*ControlPlane
		nodes [2]*Node
		errs  [2]error
	)
	for i, name := range []string{"mgmt", "guest"} {
		wg.Go(func() {
			if cps[i], errs[i] = lab.StartControlPlane(ctx, name); errs[i] == nil {
				nodes[i], errs[i] = cps[i].AddNode(ctx, name+"-node-1", NodeOptions{Labels: map[string]string{"pvbridge.io/test": "true"}})
			}
		})
	}
	wg.Wait()
	g.Expect(errs[0]).NotTo(HaveOccurred())
	g.Expect(errs[1]).NotTo(HaveOccurred())
	fmt.Printf("BENCH lab_two_control_planes_and_nodes_ready %.2f s\n", time.Since(start).Seconds())

	for i, cp := range cps {
		node, err := cp.Client().CoreV1().Nodes().Get(ctx, nodes[i].Name, metav1.GetOptions{})
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(NodeReady(node)).To(BeTrue())
		g.Expect(node.Labels).To(HaveKeyWithValue("pvbridge.io/test", "true"))

		bound := time.Now()
		expectStaticVolumeBinds(ctx, g, cp)
		t.Logf("%s: static PV + PVC bound in %v", cp.Name, time.Since(bound).Round(time.Millisecond))
	}
	// The two clusters are separate: each sees only its own node.
	for i, cp := range cps {
		list, err := cp.Client().CoreV1().Nodes().List(ctx, metav1.ListOptions{})
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(list.Items).To(HaveLen(1))
		g.Expect(list.Items[0].Name).To(Equal(nodes[i].Name))
	}
}

// expectStaticVolumeBinds creates a static PV and a PVC that asks for it, and waits until
// kube-controller-manager binds them.
func expectStaticVolumeBinds(ctx context.Context, g *WithT, cp *ControlPlane) {
	c := cp.Client().CoreV1()
	size := resource.MustParse("1Gi")
	_, err := c.PersistentVolumes().Create(ctx, &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: "static-pv"},
		Spec: corev1.PersistentVolumeSpec{
			Capacity:    corev1.ResourceList{corev1.ResourceStorage: size},
			AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			PersistentVolumeSource: corev1.PersistentVolumeSource{
				CSI: &corev1.CSIPersistentVolumeSource{Driver: "test.csi.pvbridge.io", VolumeHandle: "vol-1"},
			},
		},
	}, metav1.CreateOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	empty := ""
	_, err = c.PersistentVolumeClaims("default").Create(ctx, &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: "static-pvc"},
		Spec: corev1.PersistentVolumeClaimSpec{
			StorageClassName: &empty,
			VolumeName:       "static-pv",
			AccessModes:      []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			Resources:        corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: size}},
		},
	}, metav1.CreateOptions{})
	g.Expect(err).NotTo(HaveOccurred())
	g.Eventually(func(g Gomega) {
		pvc, err := c.PersistentVolumeClaims("default").Get(ctx, "static-pvc", metav1.GetOptions{})
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(pvc.Status.Phase).To(Equal(corev1.ClaimBound))
		pv, err := c.PersistentVolumes().Get(ctx, "static-pv", metav1.GetOptions{})
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(pv.Status.Phase).To(Equal(corev1.VolumeBound))
	}).WithContext(ctx).WithTimeout(time.Minute).WithPolling(100 * time.Millisecond).Should(Succeed())
}

// TestKilledOwnerLeavesNothingBehind kills -9 a process that runs a lab and checks that the
// reaper removes every process, mount, container and pod network the lab had. The lab's
// containerd node holds no mount of another lab that runs beside it (here, a tmpfs under a lab
// root of this process's).
func TestKilledOwnerLeavesNothingBehind(t *testing.T) {
	g := NewWithT(t)
	root, err := NewRoot()
	g.Expect(err).NotTo(HaveOccurred())
	t.Cleanup(func() { _ = os.RemoveAll(root) })
	other, err := NewRoot()
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(unix.Mount("tmpfs", other, "tmpfs", 0, "size=1m")).To(Succeed())
	t.Cleanup(func() { _ = unix.Unmount(other, unix.MNT_DETACH); _ = os.RemoveAll(other) })

	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	child := exec.CommandContext(ctx, os.Args[0], "-test.run=^$")
	child.Env = append(os.Environ(), childLabEnv+"="+root)
	child.Stderr = os.Stderr
	out, err := child.StdoutPipe()
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(child.Start()).To(Succeed())
	// On a failure before the kill below, the child's lab must end too (its reaper runs).
	t.Cleanup(func() { _ = child.Process.Kill(); _ = child.Wait() })
	ready := make(chan bool, 1)
	go func() {
		s := bufio.NewScanner(out)
		for s.Scan() {
			if s.Text() == "READY" {
				ready <- true
				return
			}
		}
		ready <- false
	}()
	g.Expect(<-ready).To(BeTrue(), "child lab did not start")

	pids, err := pidsIn(filepath.Join(root, "pids"))
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(pids).To(HaveLen(9), "etcd, apiserver, controller-manager, scheduler, fakecri, kubelet, and a containerd node's namespace, containerd, kubelet")
	g.Expect(MountsBelow(root)).NotTo(BeEmpty(), "the kubelet bind-mounts its root dir")
	own, err := os.Readlink("/proc/self/ns/mnt")
	g.Expect(err).NotTo(HaveOccurred())
	nodes := 0
	for _, pid := range pids {
		if ns, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/mnt", pid)); err != nil || ns == own {
			continue
		}
		nodes++
		info, err := os.ReadFile(fmt.Sprintf("/proc/%d/mountinfo", pid))
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(string(info)).To(ContainSubstring(" "+root+"/"), "the node has its own lab's mounts")
		g.Expect(string(info)).NotTo(ContainSubstring(" "+other+" "), "the node of the lab holds the other lab's mount")
	}
	g.Expect(nodes).To(BeNumerically(">", 0), "the containerd node's processes are in a mount namespace of their own")
	bridge := readFirst(t, filepath.Join(root, "bridges"))
	g.Expect(exec.Command("pgrep", "-f", "sleep 3601").Run()).To(Succeed(), "the containerd node's pod runs")
	cgroups := containerCgroups(root)
	g.Expect(cgroups).NotTo(BeEmpty(), "the pod's containers have cgroups")

	g.Expect(child.Process.Kill()).To(Succeed())
	_ = child.Wait()

	g.Eventually(func(g Gomega) {
		for _, pid := range pids {
			g.Expect(processAlive(pid)).To(BeFalse(), "pid %d", pid)
		}
		g.Expect(MountsBelow(root)).To(BeEmpty())
		g.Expect(exec.Command("pgrep", "-f", "sleep 3601").Run()).To(HaveOccurred(), "the pod's container is left")
		g.Expect(exec.Command("ip", "link", "show", bridge).Run()).To(HaveOccurred(), "bridge %s is left", bridge)
		nat, err := exec.Command("iptables-save", "-t", "nat").Output()
		g.Expect(err).NotTo(HaveOccurred())
		g.Expect(string(nat)).NotTo(ContainSubstring(root))
		for _, c := range cgroups {
			g.Expect(c).NotTo(BeADirectory(), "the cgroup of a container is left")
		}
	}).WithTimeout(time.Minute).WithPolling(100 * time.Millisecond).Should(Succeed())
}

// containerCgroups lists the cgroups of the containerd nodes' containers below root, in every
// hierarchy.
func containerCgroups(root string) []string {
	var cgroups []string
	tasks, _ := filepath.Glob(filepath.Join(root, "*", "nodes", "*", "root", "run", "containerd", "io.containerd.runtime.v2.task", "k8s.io", "*"))
	for _, t := range tasks {
		for _, pattern := range []string{"/sys/fs/cgroup/k8s.io/", "/sys/fs/cgroup/*/k8s.io/"} {
			found, _ := filepath.Glob(pattern + filepath.Base(t))
			cgroups = append(cgroups, found...)
		}
	}
	return cgroups
}

// processAlive reports whether pid exists and is not a zombie waiting to be reaped.
func processAlive(pid int) bool {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	// The state follows the command name in parentheses, which may contain spaces.
	s := string(data)
	fields := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
	return len(fields) > 0 && fields[0] != "Z"
}

// TestLoopsBelowFindsLoopsOnLoops makes a loop device of a file below a root, a filesystem on
// it, and, in a mount namespace of its own (as a containerd node's mgmt-csi does), a loop device
// of a file on that filesystem, whose path means nothing here: both are the root's, and the
// inner one is detached first, which lets the outer one go.
func TestLoopsBelowFindsLoopsOnLoops(t *testing.T) {
	g := NewWithT(t)
	root := t.TempDir()
	outerFile, mnt := filepath.Join(root, "pmem.img"), t.TempDir() // mounted only in the namespace
	g.Expect(os.WriteFile(outerFile, nil, 0o600)).To(Succeed())
	g.Expect(os.Truncate(outerFile, 64<<20)).To(Succeed())
	run := func(args ...string) string {
		out, err := exec.Command(args[0], args[1:]...).CombinedOutput()
		g.Expect(err).NotTo(HaveOccurred(), "%v: %s", args, out)
		return strings.TrimSpace(string(out))
	}
	outer := run("losetup", "--find", "--show", outerFile)
	t.Cleanup(func() { _ = exec.Command("losetup", "-d", outer).Run() })
	run("mkfs.ext4", "-q", outer)
	inner := run("unshare", "--mount", "--propagation", "private", "sh", "-ec",
		fmt.Sprintf("mount %s %s; truncate -s 8M %[2]s/volume.img; losetup --find --show %[2]s/volume.img", outer, mnt))
	t.Cleanup(func() { _ = exec.Command("losetup", "-d", inner).Run() })

	g.Expect(LoopsBelow(root)).To(Equal([]string{outer, inner}))
	g.Expect(LoopsBelow(t.TempDir())).To(BeEmpty(), "another root opens no device")
	g.Expect(DetachLoopsBelow(root)).To(Succeed())
	g.Eventually(func() ([]string, error) { return LoopsBelow(root) }).Should(BeEmpty())
}
