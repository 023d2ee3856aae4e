package cluster

import (
	"context"
	"crypto/sha256"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"

	"pvbridge.io/e2e/images"
)

// What Cluster API's kubeadm bootstrap provider gives a lab VM (VMOptions.UserData), and the
// images kubeadm runs in it.

// KubeadmInitUserData is a cloud-config as Cluster API's kubeadm bootstrap provider writes it
// for the first control plane machine: the node's name from the meta-data (Jinja), kubeadm's
// preflight check that cannot hold in a lab VM ignored by name (docs/design.md), the lab's etcd
// without fsync (throwaway data, as the management etcd's), generous timeouts for a loaded 2-core machine.
func KubeadmInitUserData(version, etcdTag string) string {
	return fmt.Sprintf(`## template: jinja
#cloud-config
write_files:
- path: /run/kubeadm/kubeadm.yaml
  owner: root:root
  permissions: '0640'
  content: |
    apiVersion: kubeadm.k8s.io/v1beta4
    kind: InitConfiguration
`+kubeadmNodeRegistration+`    bootstrapTokens:
    - token: %[3]s
    timeouts:
      controlPlaneComponentHealthCheck: 10m0s
      kubeletHealthCheck: 10m0s
      kubernetesAPICall: 5m0s
    ---
    apiVersion: kubeadm.k8s.io/v1beta4
    kind: ClusterConfiguration
    kubernetesVersion: %[1]s
    etcd: {local: {imageTag: %[2]s, extraArgs: [{name: unsafe-no-fsync, value: "true"}]}}
    networking: {serviceSubnet: 10.112.0.0/16}
- path: /run/cluster-api/placeholder
  owner: root:root
  permissions: '0640'
  content: "This placeholder file is used to create the /run/cluster-api sub directory"
runcmd:
- 'kubeadm init --config /run/kubeadm/kubeadm.yaml && echo success > /run/cluster-api/bootstrap-success.complete'
`, version, etcdTag, BootstrapToken)
}

// kubeadmNodeRegistration is the node registration of both, as Cluster API's templates have it:
// the node's name and provider ID from the meta-data, the preflight check that cannot hold in a
// lab VM ignored by name (docs/design.md).
const kubeadmNodeRegistration = `    nodeRegistration:
      name: '{{ ds.meta_data.local_hostname }}'
      criSocket: unix:///run/containerd/containerd.sock
      kubeletExtraArgs:
      - name: provider-id
        value: '{{ ds.meta_data.provider_id }}'
      ignorePreflightErrors: [SystemVerification]
`

// BootstrapToken is the token with which the control plane's kubeadm init lets workers join.
const BootstrapToken = "pvbvm0.0123456789abcdef"

// KubeadmJoinUserData is a cloud-config as Cluster API's kubeadm bootstrap provider writes it for a
// worker machine: kubeadm join of endpoint with the bootstrap token, trusting the CA of hash.
func KubeadmJoinUserData(endpoint, caHash string) string {
	return fmt.Sprintf(`## template: jinja
#cloud-config
write_files:
- path: /run/kubeadm/kubeadm-join-config.yaml
  owner: root:root
  permissions: '0640'
  content: |
    apiVersion: kubeadm.k8s.io/v1beta4
    kind: JoinConfiguration
    discovery:
      bootstrapToken:
        apiServerEndpoint: %s
        token: %s
        caCertHashes: [%s]
`+kubeadmNodeRegistration+`    timeouts:
      kubeletHealthCheck: 10m0s
      kubernetesAPICall: 5m0s
      tlsBootstrap: 10m0s
runcmd:
- kubeadm join --config /run/kubeadm/kubeadm-join-config.yaml && echo success > /run/cluster-api/bootstrap-success.complete
`, endpoint, BootstrapToken, caHash)
}

// CACertHash is kubeadm's hash of a CA certificate: sha256 of its public key info.
func CACertHash(path string) (string, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return "", err
	}
	block, _ := pem.Decode(data)
	if block == nil {
		return "", fmt.Errorf("%s: no PEM block", path)
	}
	cert, err := x509.ParseCertificate(block.Bytes)
	if err != nil {
		return "", err
	}
	return fmt.Sprintf("sha256:%x", sha256.Sum256(cert.RawSubjectPublicKeyInfo)), nil
}

// KubeadmImageArchives builds the lab's images and those kubeadm runs (images.KubeadmImages)
// for the pinned kubeadm, etcd and CoreDNS, and returns them with kubeadm's version and etcd's
// tag.
func KubeadmImageArchives(ctx context.Context, lab *Lab) (archives []string, version, etcdTag string, err error) {
	kubeadm, err := lab.Binaries().Tool("kubeadm")
	if err != nil {
		return nil, "", "", err
	}
	out, err := exec.CommandContext(ctx, kubeadm, "version", "-o", "short").Output()
	if err != nil {
		return nil, "", "", err
	}
	version = strings.TrimSpace(string(out))
	if etcdTag, err = imageTag(ctx, lab, "etcd", `etcd Version: (\d+\.\d+\.\d+)`, "%s-0"); err != nil {
		return nil, "", "", err
	}
	corednsTag, err := imageTag(ctx, lab, "coredns", `CoreDNS-(\d+\.\d+\.\d+)`, "v%s")
	if err != nil {
		return nil, "", "", err
	}
	imgs, err := images.LabImages()
	if err != nil {
		return nil, "", "", err
	}
	imgs = append(imgs, images.KubeadmImages(version, etcdTag, corednsTag)...)
	built, err := images.BuildAll(images.Options{Root: lab.Binaries().Repo, Bin: lab.Binaries().Dir, Out: filepath.Join(lab.Root, "images")}, imgs)
	if err != nil {
		return nil, "", "", err
	}
	for _, b := range built {
		archives = append(archives, b.File)
	}
	return archives, version, etcdTag, nil
}

// imageTag is the tag registry.k8s.io gives the image of a pinned tool, from the version the
// tool prints (-version): etcd's 3.7.2-0, CoreDNS' v1.14.6. version matches it, format makes
// the tag of it.
func imageTag(ctx context.Context, lab *Lab, tool, version, format string) (string, error) {
	bin, err := lab.Binaries().Tool(tool)
	if err != nil {
		return "", err
	}
	out, err := exec.CommandContext(ctx, bin, "-version").Output()
	if err != nil {
		return "", fmt.Errorf("%s -version: %w", tool, err)
	}
	m := regexp.MustCompile(version).FindSubmatch(out)
	if m == nil {
		return "", fmt.Errorf("%s -version: %q", tool, out)
	}
	return fmt.Sprintf(format, m[1]), nil
}
