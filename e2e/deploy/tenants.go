package deploy

import (
	"context"
	"fmt"
	"os/exec"
	"path/filepath"

	"pvbridge.io/e2e/cluster"
)

// Tenants is guest-csi's tenants controller deployed into the management cluster, with the
// tenancy admission policy: per opted-in Cluster it makes the guest's identity, delivers and
// renews its credential, installs the guest side, writes the policy's parameters and cleans up
// after a deleted Cluster.
type Tenants struct {
	Controller *cluster.Process
}

// TenantsOptions configure the tenants controller.
type TenantsOptions struct {
	// TokenTTL is the life of each guest credential (--token-ttl); the apiserver's minimum is
	// 10 minutes. A new one is issued after two thirds of it.
	TokenTTL string
	// GuestImageRegistry moves every image of the guest install to this registry
	// (--guest-image-registry, a platform's mirror); empty: the images as shipped.
	GuestImageRegistry string
}

// StartTenants applies the admission policy of manifests/base/admission and starts the tenants
// controller.
func StartTenants(ctx context.Context, lab *cluster.Lab, m *Management, opts TenantsOptions) (*Tenants, error) {
	kubectl, err := lab.Binaries().Tool("kubectl")
	if err != nil {
		return nil, err
	}
	admission := filepath.Join(lab.Binaries().Repo, "manifests", "base", "admission")
	if out, err := exec.CommandContext(ctx, kubectl, "--kubeconfig="+m.CP.Kubeconfig, "apply", "--server-side", "-k", admission).CombinedOutput(); err != nil {
		return nil, fmt.Errorf("apply the admission policy: %w\n%s", err, out)
	}
	bin, err := lab.Binaries().Own("./guest-csi/cmd/guest-csi-tenants")
	if err != nil {
		return nil, err
	}
	ttl := opts.TokenTTL
	if ttl == "" {
		ttl = "24h"
	}
	p, err := lab.Start(cluster.Command{
		Name: m.CP.Name + "/guest-csi-tenants", Bin: bin, Dir: filepath.Join(m.CP.Dir, "guest-csi-tenants"),
		LogPath: filepath.Join(m.CP.Dir, "logs", "guest-csi-tenants.log"),
		Args: []string{
			"--kubeconfig=" + m.CP.Kubeconfig, "--mgmt-server=" + m.CP.Server,
			// The lab apiserver's self-signed serving certificate is its own CA.
			"--mgmt-ca-file=" + filepath.Join(m.CP.Dir, "certs", "apiserver.crt"),
			"--capacity-namespace=" + CSINamespace, "--token-ttl=" + ttl,
			"--leader-elect=false", "--health-probe-bind-address=0", "--metrics-bind-address=0",
			"--guest-image-registry=" + opts.GuestImageRegistry,
			"--v=4",
		},
		Restart: true,
	})
	if err != nil {
		return nil, err
	}
	return &Tenants{Controller: p}, nil
}
