package cluster

import (
	"strings"
	"testing"

	. "github.com/onsi/gomega"
)

func TestParseCloudConfig(t *testing.T) {
	meta := []byte("instance-id: abc\nlocal-hostname: cp-0\nprovider-id: pvbridge://tenant-a/cp-0\n")
	for _, tc := range []struct {
		name     string
		userData string
		check    func(g Gomega, c *CloudConfig)
		err      string
	}{{
		name: "Cluster API's kubeadm user data, with the meta-data's values",
		userData: "## template: jinja\n#cloud-config\nwrite_files:\n- path: /run/kubeadm/kubeadm.yaml\n  owner: root:root\n  permissions: '0640'\n" +
			"  content: |\n    name: '{{ ds.meta_data.local_hostname }}'\n    id: '{{ ds.meta_data.provider_id }}'\n" +
			"- path: /etc/kubernetes/pki/ca.key\n  encoding: base64\n  content: c2VjcmV0\n" +
			"runcmd:\n- 'kubeadm init --config /run/kubeadm/kubeadm.yaml && echo success > /run/cluster-api/bootstrap-success.complete'\n- [touch, /run/x]\n" +
			"ntp: {enabled: true}\nusers: []\n",
		check: func(g Gomega, c *CloudConfig) {
			g.Expect(c.WriteFiles).To(HaveLen(2))
			g.Expect(c.WriteFiles[0].Content).To(Equal("name: 'cp-0'\nid: 'pvbridge://tenant-a/cp-0'\n"))
			g.Expect(c.WriteFiles[0].Mode()).To(Equal(uint32(0o640)))
			g.Expect(c.WriteFiles[1].Data()).To(Equal([]byte("secret")))
			g.Expect(c.WriteFiles[1].Mode()).To(Equal(uint32(0o644)))
			g.Expect(c.RunCmd).To(HaveLen(2))
			g.Expect(c.RunCmd[0].Args()).To(Equal([]string{"/bin/sh", "-c", "kubeadm init --config /run/kubeadm/kubeadm.yaml && echo success > /run/cluster-api/bootstrap-success.complete"}))
			g.Expect(c.RunCmd[1].Args()).To(Equal([]string{"touch", "/run/x"}))
			g.Expect(c.Unsupported).To(Equal([]string{"ntp", "users"}))
		},
	}, {
		name:     "without Jinja, braces are kept",
		userData: "#cloud-config\nbootcmd:\n- echo '{{ x }}'\n",
		check: func(g Gomega, c *CloudConfig) {
			g.Expect(c.BootCmd[0].Args()).To(Equal([]string{"/bin/sh", "-c", "echo '{{ x }}'"}))
		},
	}, {
		name:     "a script is not a cloud-config",
		userData: "#!/bin/sh\necho hi\n",
		err:      `user data is not a cloud-config (first line "#!/bin/sh")`,
	}, {
		name:     "meta-data the VM does not have",
		userData: "## template: jinja\n#cloud-config\nruncmd:\n- echo {{ ds.meta_data.region }}\n",
		err:      "user data uses meta-data the VM does not have: region",
	}, {
		name:     "other Jinja",
		userData: "## template: jinja\n#cloud-config\nruncmd:\n- echo {{ v1.local_hostname }}\n",
		err:      "user data has Jinja other than {{ ds.meta_data.<key> }}",
	}, {
		name:     "relative path",
		userData: "#cloud-config\nwrite_files:\n- path: etc/x\n  content: x\n",
		err:      `write_files: path "etc/x" is not absolute`,
	}, {
		name:     "bad permissions",
		userData: "#cloud-config\nwrite_files:\n- path: /etc/x\n  permissions: rw\n",
		err:      `write_files /etc/x: permissions "rw" are not octal`,
	}, {
		name:     "unknown encoding",
		userData: "#cloud-config\nwrite_files:\n- path: /etc/x\n  encoding: zstd\n",
		err:      `write_files /etc/x: unknown encoding "zstd"`,
	}} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			c, err := ParseCloudConfig([]byte(tc.userData), meta)
			if tc.err != "" {
				g.Expect(err).To(MatchError(tc.err))
				return
			}
			g.Expect(err).NotTo(HaveOccurred())
			tc.check(g, c)
		})
	}
}

func TestCloudConfigControlPlane(t *testing.T) {
	file := func(content string) string {
		return "#cloud-config\nwrite_files:\n- path: /run/kubeadm/kubeadm.yaml\n  content: |\n    " + strings.ReplaceAll(content, "\n", "\n    ") + "\n"
	}
	for _, tc := range []struct {
		name, userData, endpoint string
		first                    bool
	}{
		{"kubeadm init's", file("apiVersion: kubeadm.k8s.io/v1beta4\nkind: InitConfiguration\n---\nkind: ClusterConfiguration\ncontrolPlaneEndpoint: 10.251.3.1:6443"), "10.251.3.1", true},
		{"a control plane's kubeadm join", file("kind: JoinConfiguration\ncontrolPlane:\n  localAPIEndpoint: {}\ndiscovery:\n  bootstrapToken:\n    apiServerEndpoint: 10.251.3.1:6443"), "10.251.3.1", false},
		{"a worker's kubeadm join", file("kind: JoinConfiguration\ndiscovery:\n  bootstrapToken:\n    apiServerEndpoint: 10.251.3.1:6443"), "", false},
		{"no kubeadm", "#cloud-config\nruncmd:\n- echo hi\n", "", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			c, err := ParseCloudConfig([]byte(tc.userData), nil)
			g.Expect(err).NotTo(HaveOccurred())
			endpoint, first := c.ControlPlane()
			g.Expect(endpoint).To(Equal(tc.endpoint))
			g.Expect(first).To(Equal(tc.first))
			g.Expect(c.KeepsEndpoint()).To(BeFalse())
		})
	}
}

// A control plane machine's data of the HA flavor, whose keepalived holds the endpoint.
func TestCloudConfigKeepsEndpoint(t *testing.T) {
	g := NewWithT(t)
	c, err := ParseCloudConfig([]byte("#cloud-config\nwrite_files:\n- path: /etc/keepalived/keepalived.conf\n  content: vrrp_instance control_plane {}\n"), nil)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(c.KeepsEndpoint()).To(BeTrue())
}
