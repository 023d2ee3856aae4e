package operator

import (
	"time"

	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"

	pmemv1alpha1 "pvbridge.io/pkg/apis/pmem/v1alpha1"
	vmv1alpha1 "pvbridge.io/pkg/apis/vm/v1alpha1"
)

func TestOptionsValidate(t *testing.T) {
	valid := func(role Role, change func(*Options)) Options {
		o := Options{Role: role, MetricsAddress: "0", HealthAddress: ":8081"}
		if role == RoleHostAgent {
			o.NodeName, o.Hypervisor, o.VMRoot = "host-a", "local", "/var/lib/pvbridge/vms"
			o.CSIEndpoint, o.StateDir = "unix:///csi/csi.sock", "/var/lib/pvbridge/host-agent"
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
		{name: "controller", opts: valid(RoleController, nil)},
		{name: "host agent", opts: valid(RoleHostAgent, nil)},
		{name: "infrastructure provider", opts: valid(RoleInfrastructureProvider, func(o *Options) { o.VolumeDetachTimeout = time.Minute })},
		{name: "infrastructure provider with node name", opts: valid(RoleInfrastructureProvider, func(o *Options) { o.NodeName = "host-a" }), wantErr: []string{"only used in the host-agent role"}},
		{name: "negative volume detach timeout", opts: valid(RoleInfrastructureProvider, func(o *Options) { o.VolumeDetachTimeout = -time.Second }), wantErr: []string{"volume detach timeout"}},
		{name: "controller elects a leader", opts: valid(RoleController, func(o *Options) { o.LeaderElect, o.LeaderElectionNamespace = true, "pvbridge-system" })},
		{name: "provider elects a leader", opts: valid(RoleInfrastructureProvider, func(o *Options) { o.LeaderElect = true })},
		{name: "host agent elects no leader", opts: valid(RoleHostAgent, func(o *Options) { o.LeaderElect = true }), wantErr: []string{"each host runs its own agent"}},
		{name: "provider watching one namespace and a filter", opts: valid(RoleInfrastructureProvider, func(o *Options) { o.WatchNamespace, o.WatchFilter = "tenant-a", "blue" })},
		{name: "provider watching a bad namespace", opts: valid(RoleInfrastructureProvider, func(o *Options) { o.WatchNamespace = "Tenant_A" }), wantErr: []string{"not a namespace"}},
		{name: "provider with a bad watch filter", opts: valid(RoleInfrastructureProvider, func(o *Options) { o.WatchFilter = "a b" }), wantErr: []string{"not a label value"}},
		{name: "controller with a watch filter", opts: valid(RoleController, func(o *Options) { o.WatchFilter = "blue" }), wantErr: []string{"only used in the infrastructure-provider role"}},
		{name: "metrics on a port", opts: valid(RoleController, func(o *Options) { o.MetricsAddress = "127.0.0.1:8080" })},
		{name: "health probes disabled", opts: valid(RoleController, func(o *Options) { o.HealthAddress = "0" })},
		{name: "no role", opts: valid("", nil), wantErr: []string{`role ""`}},
		{name: "unknown role", opts: valid("agent", nil), wantErr: []string{`role "agent"`}},
		{name: "host agent without node name", opts: valid(RoleHostAgent, func(o *Options) { o.NodeName = "" }), wantErr: []string{"node name is required"}},
		{name: "host agent with a bad node name", opts: valid(RoleHostAgent, func(o *Options) { o.NodeName = "Host_A" }), wantErr: []string{"not a node name"}},
		{name: "controller with node name", opts: valid(RoleController, func(o *Options) { o.NodeName = "host-a" }), wantErr: []string{"only used in the host-agent role"}},
		{name: "host agent with qemu", opts: valid(RoleHostAgent, func(o *Options) { o.Hypervisor, o.QEMU.RunDir = "qemu", "/run/pvbridge/qemu" })},
		{name: "unknown hypervisor", opts: valid(RoleHostAgent, func(o *Options) { o.Hypervisor = "xen" }), wantErr: []string{`hypervisor "xen"`}},
		{name: "relative VM root", opts: valid(RoleHostAgent, func(o *Options) { o.VMRoot = "vms" }), wantErr: []string{"absolute VM root"}},
		{name: "host agent without CSI endpoint", opts: valid(RoleHostAgent, func(o *Options) { o.CSIEndpoint = "" }), wantErr: []string{"CSI endpoint"}},
		{name: "relative state directory", opts: valid(RoleHostAgent, func(o *Options) { o.StateDir = "state" }), wantErr: []string{"state directory"}},
		{name: "host agent with a longest hold", opts: valid(RoleHostAgent, func(o *Options) { o.HoldMax = 3 * time.Second })},
		{name: "negative longest hold", opts: valid(RoleHostAgent, func(o *Options) { o.HoldMax = -time.Second }), wantErr: []string{"longest hold"}},
		{name: "metrics address without port", opts: valid(RoleController, func(o *Options) { o.MetricsAddress = "localhost" }), wantErr: []string{"metrics address"}},
		{name: "empty health address", opts: valid(RoleController, func(o *Options) { o.HealthAddress = "" }), wantErr: []string{"health address"}},
		{
			name:    "every problem is reported",
			opts:    Options{Role: RoleHostAgent, MetricsAddress: "x", HealthAddress: "y"},
			wantErr: []string{"hypervisor", "CSI endpoint", "state directory", "node name is required", "metrics address", "health address"},
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

func TestSchemeHoldsTheKindsTheOperatorUses(t *testing.T) {
	scheme, err := NewScheme()
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		obj  runtime.Object
		want schema.GroupVersionKind
	}{
		{obj: &vmv1alpha1.VirtualMachine{}, want: vmv1alpha1.GroupVersion.WithKind("VirtualMachine")},
		{obj: &pmemv1alpha1.PmemVolume{}, want: pmemv1alpha1.GroupVersion.WithKind("PmemVolume")},
		{obj: &corev1.PersistentVolumeClaim{}, want: corev1.SchemeGroupVersion.WithKind("PersistentVolumeClaim")},
		{obj: &storagev1.VolumeAttachment{}, want: storagev1.SchemeGroupVersion.WithKind("VolumeAttachment")},
	}
	for _, tt := range tests {
		t.Run(tt.want.Kind, func(t *testing.T) {
			g := NewWithT(t)
			gvks, _, err := scheme.ObjectKinds(tt.obj)
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(gvks).To(ConsistOf(tt.want))
		})
	}
}

// freeAddress returns a loopback address with a port that was free a moment ago.
func freeAddress(t *testing.T) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// kubeconfig writes a kubeconfig for an API server that does not exist: New never calls it, and
// the reconcilers' caches of a running manager only retry in the background.
func kubeconfig(t *testing.T) string {
	path := filepath.Join(t.TempDir(), "kubeconfig")
	const cfg = `apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:1"}}]
users: [{name: u, user: {token: t}}]
contexts: [{name: c, context: {cluster: c, user: u}}]
current-context: c
`
	if err := os.WriteFile(path, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

func TestRunServesHealthProbesUntilCancelled(t *testing.T) {
	tests := []struct {
		name string
		opts Options
	}{
		{name: "controller", opts: Options{Role: RoleController}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := NewWithT(t)
			opts := tt.opts
			opts.Kubeconfig = kubeconfig(t)
			opts.MetricsAddress = "0"
			opts.HealthAddress = freeAddress(t)
			op, err := New(opts)
			g.Expect(err).NotTo(HaveOccurred())

			ctx, cancel := context.WithCancel(t.Context())
			done := make(chan error, 1)
			go func() { done <- op.Run(ctx) }()

			for _, path := range []string{"/healthz", "/readyz"} {
				url := fmt.Sprintf("http://%s%s", opts.HealthAddress, path)
				g.Eventually(func() (int, error) {
					resp, err := http.Get(url)
					if err != nil {
						return 0, err
					}
					_ = resp.Body.Close()
					return resp.StatusCode, nil
				}).Should(Equal(http.StatusOK), path)
			}

			cancel()
			g.Eventually(done).Should(Receive(BeNil()))
		})
	}
}

func TestNewFailsOnAMissingKubeconfig(t *testing.T) {
	g := NewWithT(t)
	_, err := New(Options{Role: RoleController, MetricsAddress: "0", HealthAddress: "0", Kubeconfig: filepath.Join(t.TempDir(), "missing")})
	g.Expect(err).To(MatchError(ContainSubstring("load kubeconfig")))
}

func TestHostAgentSaysWhenItCannotReachTheAPIServer(t *testing.T) {
	g := NewWithT(t)
	_, err := New(Options{
		Role: RoleHostAgent, NodeName: "host-a", Kubeconfig: kubeconfig(t), MetricsAddress: "0", HealthAddress: "0",
		Hypervisor: "local", VMRoot: filepath.Join(t.TempDir(), "vms"), CSIEndpoint: "unix:///csi/csi.sock", StateDir: t.TempDir(),
	})
	g.Expect(err).To(MatchError(ContainSubstring("create manager")))
}
