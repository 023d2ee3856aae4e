package driver

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	. "github.com/onsi/gomega"
	"google.golang.org/grpc"
	"k8s.io/klog/v2"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"pvbridge.io/mgmt-csi/internal/pmem"
	"pvbridge.io/mgmt-csi/internal/pmem/fake"
	pmemv1 "pvbridge.io/pkg/apis/pmem/v1alpha1"
	"pvbridge.io/pkg/csinode/csinodetest"
	"pvbridge.io/pkg/qsd"
)

func TestOptionsValidate(t *testing.T) {
	valid := func(mode Mode, change func(*Options)) Options {
		o := Options{Endpoint: "unix:///csi/csi.sock", Mode: mode, Version: "v0.1.0"}
		if mode == ModeNode {
			o.PmemMode, o.Pmem.File.Dir = pmemv1.ModeFile, "/pmem"
		}
		if mode == ModeNode {
			o.NodeID = "host-a"
		}
		if change != nil {
			change(&o)
		}
		return o
	}
	tests := []struct {
		name    string
		opts    Options
		wantErr []string
	}{
		{name: "controller", opts: valid(ModeController, nil)},
		{name: "node", opts: valid(ModeNode, nil)},
		{name: "node registering with kubelet", opts: valid(ModeNode, func(o *Options) { o.KubeletRegistrationDir = "/var/lib/kubelet/plugins_registry" })},
		{name: "endpoint as a path", opts: valid(ModeController, func(o *Options) { o.Endpoint = "/csi/csi.sock" })},
		{name: "tcp endpoint", opts: valid(ModeController, func(o *Options) { o.Endpoint = "tcp://127.0.0.1:9000" }), wantErr: []string{"endpoint"}},
		{name: "no mode", opts: valid("", nil), wantErr: []string{`mode ""`}},
		{name: "unknown mode", opts: valid("all", nil), wantErr: []string{`mode "all"`}},
		{name: "node without node ID", opts: valid(ModeNode, func(o *Options) { o.NodeID = "" }), wantErr: []string{"node ID is required"}},
		{name: "node ID that is not a node name", opts: valid(ModeNode, func(o *Options) { o.NodeID = "Node_1" }), wantErr: []string{"not a node name"}},
		{name: "relative registration directory", opts: valid(ModeNode, func(o *Options) { o.KubeletRegistrationDir = "plugins_registry" }), wantErr: []string{"not absolute"}},
		{name: "controllers elect a leader", opts: valid(ModeController, func(o *Options) { o.LeaderElection, o.LeaderElectionNamespace = true, "pvbridge-system" })},
		{name: "node agents elect no leader", opts: valid(ModeNode, func(o *Options) { o.LeaderElection = true }), wantErr: []string{"every node runs its own agent"}},
		{name: "controller with node ID", opts: valid(ModeController, func(o *Options) { o.NodeID = "n" }), wantErr: []string{"only used in node mode"}},
		{name: "controller registering with kubelet", opts: valid(ModeController, func(o *Options) { o.KubeletRegistrationDir = "/r" }), wantErr: []string{"only done in node mode"}},
		{name: "no version", opts: valid(ModeController, func(o *Options) { o.Version = "" }), wantErr: []string{"version"}},
		{name: "node with a volume limit", opts: valid(ModeNode, func(o *Options) { o.MaxVolumesPerNode = 8 })},
		{name: "negative volume limit", opts: valid(ModeNode, func(o *Options) { o.MaxVolumesPerNode = -1 }), wantErr: []string{"is negative"}},
		{name: "controller with a volume limit", opts: valid(ModeController, func(o *Options) { o.MaxVolumesPerNode = 8 }), wantErr: []string{"max volumes per node is only used in node mode"}},
		{name: "controller with a PMEM back end", opts: valid(ModeController, func(o *Options) { o.PmemMode = pmemv1.ModeFile }), wantErr: []string{"only used in node mode"}},
		{name: "node without a PMEM back end", opts: valid(ModeNode, func(o *Options) { o.PmemMode = "" }), wantErr: []string{`PMEM mode ""`}},
		{name: "file back end without a directory", opts: valid(ModeNode, func(o *Options) { o.Pmem.File.Dir = "" }), wantErr: []string{"needs a directory"}},
		{name: "lvm back end without volume groups", opts: valid(ModeNode, func(o *Options) { o.PmemMode = pmemv1.ModeLVM }), wantErr: []string{"needs volume groups"}},
		{name: "node with replication", opts: valid(ModeNode, func(o *Options) {
			o.Replication = ReplicationOptions{Address: "10.0.0.1:10809", KeysDir: "/keys", RunDir: "/run/pvbridge/mgmt-csi", Daemons: qsd.Placement{NetNS: "/proc/1/ns/net", CgroupParent: "pvbridge-mgmt-csi"}}
		})},
		{name: "daemons' cgroup outside the root", opts: valid(ModeNode, func(o *Options) {
			o.Replication = ReplicationOptions{KeysDir: "/keys", RunDir: "/run/m", Daemons: qsd.Placement{CgroupParent: "/pvbridge"}}
		}), wantErr: []string{"relative to the cgroup root"}},
		{name: "negative API QPS", opts: valid(ModeController, func(o *Options) { o.KubeAPIQPS = -1 }), wantErr: []string{"must not be negative"}},
		{
			name:    "every problem is reported",
			opts:    Options{Endpoint: "csi.sock", Mode: ModeNode},
			wantErr: []string{"endpoint", "node ID is required", "PMEM mode", "version"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			err := tt.opts.Validate()
			if len(tt.wantErr) == 0 {
				g.Expect(err).NotTo(HaveOccurred())
				return
			}
			g.Expect(err).To(HaveOccurred())
			g.Expect(strings.Split(err.Error(), "\n")).To(HaveLen(len(tt.wantErr)))
			for _, want := range tt.wantErr {
				g.Expect(err.Error()).To(ContainSubstring(want))
			}
		})
	}
}

// A node agent whose keys directory has no keys file (the shipped DaemonSet's optional Secret
// not created) takes no part in replicated volumes, and says so.
func TestReplicationWithoutKeys(t *testing.T) {
	g := NewWithT(t)
	dir := t.TempDir()
	o := ReplicationOptions{Address: "10.0.0.1:10809", KeysDir: dir, RunDir: "/run/m"}
	g.Expect(o.withKeys(klog.Background())).To(Equal(ReplicationOptions{RunDir: "/run/m"}))
	g.Expect(os.WriteFile(filepath.Join(dir, KeysFile), []byte("pvbridge:00\n"), 0o600)).To(Succeed())
	g.Expect(o.withKeys(klog.Background())).To(Equal(o))
	g.Expect(ReplicationOptions{}.withKeys(klog.Background())).To(Equal(ReplicationOptions{}))
}

func TestRunServesIdentityAndRegistersWithKubelet(t *testing.T) {
	tests := []struct {
		name         string
		mode         Mode
		nodeID       string
		register     bool
		wantRegistry bool
	}{
		{name: "controller", mode: ModeController},
		{name: "node without registration", mode: ModeNode, nodeID: "host-a"},
		{name: "node registering with kubelet", mode: ModeNode, nodeID: "host-a", register: true, wantRegistry: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			dir := csinodetest.SocketDir(t)
			opts := Options{Endpoint: "unix://" + filepath.Join(dir, "csi.sock"), Mode: tt.mode, NodeID: tt.nodeID, Version: "v1.2.3", Kubeconfig: kubeconfig}
			if tt.mode == ModeNode {
				opts.PmemMode, opts.Pmem.File.Dir = pmemv1.ModeFile, dir
			}
			registry := filepath.Join(dir, "registry")
			if tt.register {
				opts.KubeletRegistrationDir = registry
			}
			d, err := New(opts)
			g.Expect(err).NotTo(HaveOccurred())
			d.backend = fake.New(fake.Options{})

			ctx, cancel := context.WithCancel(t.Context())
			done := make(chan error, 1)
			go func() { done <- d.Run(ctx) }()

			// Run fails fast or serves: wait for either, never forever.
			waitCtx, stopWaiting := context.WithTimeout(t.Context(), time.Minute)
			defer stopWaiting()
			go func() {
				select {
				case err := <-done:
					t.Errorf("Run ended: %v", err)
					stopWaiting()
				case <-waitCtx.Done():
				}
			}()
			info, err := csi.NewIdentityClient(csinodetest.Dial(t, filepath.Join(dir, "csi.sock"))).
				GetPluginInfo(waitCtx, &csi.GetPluginInfoRequest{}, grpc.WaitForReady(true))
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(info.GetName()).To(Equal("pmem.csi.pvbridge.io"))
			g.Expect(info.GetVendorVersion()).To(Equal("v1.2.3"))

			regSock := filepath.Join(registry, "pmem.csi.pvbridge.io-reg.sock")
			if tt.wantRegistry {
				reg, err := registerapi.NewRegistrationClient(csinodetest.Dial(t, regSock)).
					GetInfo(waitCtx, &registerapi.InfoRequest{}, grpc.WaitForReady(true))
				g.Expect(err).NotTo(HaveOccurred())
				g.Expect(reg.Endpoint).To(Equal(filepath.Join(dir, "csi.sock")))
			} else {
				g.Expect(regSock).NotTo(BeAnExistingFile())
			}

			stopWaiting() // before cancel: the watcher must not take Run's result
			cancel()
			g.Eventually(done).Should(Receive(BeNil()))
			g.Expect(filepath.Join(dir, "csi.sock")).NotTo(BeAnExistingFile())
			g.Expect(regSock).NotTo(BeAnExistingFile())
		})
	}
}

func TestRunFailsWhenRegistrationSocketCannotBeCreated(t *testing.T) {
	g := NewWithT(t)
	dir := csinodetest.SocketDir(t)
	notADir := filepath.Join(dir, "file")
	g.Expect(os.WriteFile(notADir, nil, 0o600)).To(Succeed())
	d, err := New(Options{Endpoint: filepath.Join(dir, "csi.sock"), Mode: ModeNode, NodeID: "host-a", KubeletRegistrationDir: notADir,
		Version: "v1", Kubeconfig: kubeconfig, PmemMode: pmemv1.ModeFile, Pmem: pmem.Options{File: pmem.FileOptions{Dir: dir}}})
	g.Expect(err).NotTo(HaveOccurred())
	d.backend = fake.New(fake.Options{})

	g.Expect(d.Run(t.Context())).To(HaveOccurred())
	g.Expect(filepath.Join(dir, "csi.sock")).NotTo(BeAnExistingFile(), "the CSI socket is closed again")
}
