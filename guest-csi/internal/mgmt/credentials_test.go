package mgmt

import (
	"os"
	"path/filepath"
	"testing"

	. "github.com/onsi/gomega"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

func TestCredentialsValidate(t *testing.T) {
	for _, tc := range []struct {
		name    string
		c       Credentials
		wantErr string
	}{
		{"kubeconfig", Credentials{Kubeconfig: "/etc/mgmt/kubeconfig"}, ""},
		{"token directory", Credentials{Dir: "/var/run/mgmt", Server: "https://mgmt:6443"}, ""},
		{"nothing", Credentials{}, "is required"},
		{"both", Credentials{Kubeconfig: "/k", Dir: "/d", Server: "https://s"}, "not both"},
		{"directory without server", Credentials{Dir: "/d"}, "apiserver's URL"},
		{"kubeconfig with server", Credentials{Kubeconfig: "/k", Server: "https://s"}, "comes from the kubeconfig"},
		{"relative path", Credentials{Kubeconfig: "k"}, "not an absolute path"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			err := tc.c.Validate()
			if tc.wantErr == "" {
				g.Expect(err).NotTo(HaveOccurred())
			} else {
				g.Expect(err).To(MatchError(ContainSubstring(tc.wantErr)))
			}
		})
	}
}

func writeKubeconfig(t *testing.T, path, token, namespace string) {
	t.Helper()
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["mgmt"] = &clientcmdapi.Cluster{Server: "https://127.0.0.1:6443", CertificateAuthorityData: []byte("ca")}
	cfg.AuthInfos["guest"] = &clientcmdapi.AuthInfo{Token: token}
	cfg.Contexts["guest"] = &clientcmdapi.Context{Cluster: "mgmt", AuthInfo: "guest", Namespace: namespace}
	cfg.CurrentContext = "guest"
	if err := clientcmd.WriteToFile(*cfg, path); err != nil {
		t.Fatal(err)
	}
}

// The fingerprint changes with every part of the credential and only then: a rotation starts a
// new session, rereading the same files does not.
func TestLoadKubeconfig(t *testing.T) {
	g := NewWithT(t)
	path := filepath.Join(t.TempDir(), "kubeconfig")
	c := Credentials{Kubeconfig: path}
	_, err := c.load()
	g.Expect(err).To(MatchError(ContainSubstring("no such file")))

	writeKubeconfig(t, path, "token-1", "tenant-a")
	first, err := c.load()
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(first.namespace).To(Equal("tenant-a"))
	g.Expect(first.config.BearerToken).To(Equal("token-1"))
	again, err := c.load()
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(again.fingerprint).To(Equal(first.fingerprint))

	writeKubeconfig(t, path, "token-2", "tenant-a")
	rotated, err := c.load()
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(rotated.fingerprint).NotTo(Equal(first.fingerprint))

	writeKubeconfig(t, path, "token-2", "")
	_, err = c.load()
	g.Expect(err).To(MatchError(ContainSubstring("names no namespace")))
	c.Namespace = "tenant-b"
	overridden, err := c.load()
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(overridden.namespace).To(Equal("tenant-b"))
}

func TestLoadTokenDirectory(t *testing.T) {
	g := NewWithT(t)
	dir := t.TempDir()
	c := Credentials{Dir: dir, Server: "https://mgmt:6443"}
	write := func(name, content string) {
		g.Expect(os.WriteFile(filepath.Join(dir, name), []byte(content), 0o600)).To(Succeed())
	}
	write(TokenFile, "token-1\n")
	_, err := c.load()
	g.Expect(err).To(MatchError(ContainSubstring(CAFile)))
	write(CAFile, "ca")
	write(NamespaceFile, "tenant-a\n")
	first, err := c.load()
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(first.namespace).To(Equal("tenant-a"))
	g.Expect(first.config.BearerToken).To(Equal("token-1"))
	g.Expect(first.config.Host).To(Equal("https://mgmt:6443"))

	write(TokenFile, "token-2\n")
	rotated, err := c.load()
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(rotated.fingerprint).NotTo(Equal(first.fingerprint))
}
