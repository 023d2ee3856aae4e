package cgroups

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	. "github.com/onsi/gomega"
)

func TestHierarchies(t *testing.T) {
	touch := func(t *testing.T, files ...string) string {
		root := t.TempDir()
		for _, f := range files {
			path := filepath.Join(root, f)
			if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(path, nil, 0o644); err != nil {
				t.Fatal(err)
			}
		}
		return root
	}
	tests := []struct {
		name    string
		files   []string
		want    []string // relative to root; "." is root
		wantErr string
	}{
		{name: "a v2 mount is one hierarchy", files: []string{"cgroup.procs", "cgroup.controllers", "system.slice/cgroup.procs"}, want: []string{"."}},
		{name: "v1 mounts are one hierarchy each", files: []string{"memory/cgroup.procs", "pids/cgroup.procs", "systemd/cgroup.procs", "README"}, want: []string{"memory", "pids", "systemd"}},
		{name: "no cgroup filesystem", files: []string{"memory/README"}, wantErr: "no cgroup hierarchy"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			root := touch(t, tt.files...)
			got, err := Hierarchies(root)
			if tt.wantErr != "" {
				g.Expect(err).To(MatchError(ContainSubstring(tt.wantErr)))
				return
			}
			g.Expect(err).NotTo(HaveOccurred())
			var want []string
			for _, w := range tt.want {
				want = append(want, filepath.Join(root, w))
			}
			g.Expect(got).To(Equal(want))
		})
	}
}

// On the machine's own cgroup filesystem: a process joined to a new cgroup is in it in every
// hierarchy (the v1 cpuset one included, which refuses processes until its CPUs are set), is
// listed there, keeps the cgroup from being removed, is killed with the cgroup's tree, and the
// cgroup goes once it has ended.
func TestJoinPidsKillRemove(t *testing.T) {
	g := NewWithT(t)
	if os.Geteuid() != 0 {
		t.Fatal("this test makes cgroups and must run as root")
	}
	const root = "/sys/fs/cgroup"
	parent := fmt.Sprintf("pvbridge-test-%d", os.Getpid())
	t.Cleanup(func() { _ = Remove(root, parent) })
	path := filepath.Join(parent, "vm")

	cmd := exec.Command("sleep", "600")
	g.Expect(cmd.Start()).To(Succeed())
	t.Cleanup(func() { _ = cmd.Process.Kill() })
	pid := cmd.Process.Pid
	g.Expect(Join(root, path, pid)).To(Succeed())
	g.Expect(Join(root, path, pid)).To(Succeed(), "joining the cgroup it is in")

	own, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	g.Expect(err).NotTo(HaveOccurred())
	hierarchies, err := Hierarchies(root)
	g.Expect(err).NotTo(HaveOccurred())
	lines := strings.Split(strings.TrimSpace(string(own)), "\n")
	g.Expect(lines).To(HaveLen(len(hierarchies)), "one line per hierarchy: %s", own)
	for _, line := range lines {
		g.Expect(line).To(HaveSuffix(":/"+path), "in every hierarchy")
	}
	g.Expect(Pids(root, path)).To(Equal([]int{pid}))
	g.Expect(Remove(root, parent)).To(MatchError(syscall.EBUSY), "a cgroup with a process stays")

	g.Expect(Kill(root, parent)).To(Succeed(), "kills what is below it too")
	g.Expect(cmd.Wait()).To(MatchError(ContainSubstring("killed")))
	g.Expect(Pids(root, path)).To(BeEmpty())
	g.Expect(Remove(root, parent)).To(Succeed())
	for _, h := range hierarchies {
		g.Expect(filepath.Join(h, parent)).NotTo(BeADirectory())
	}
	g.Expect(Remove(root, parent)).To(Succeed(), "removing what is gone")
	g.Expect(Pids(root, path)).To(BeEmpty())
}
