// Package mgmt is guest-csi's connection to the management cluster: a credential that is
// reloaded when it rotates, and the client and cache made with it.
package mgmt

import (
	"crypto/sha256"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
)

// Files of a credential directory, as a projected ServiceAccount token volume lays them out.
const (
	TokenFile     = "token"
	CAFile        = "ca.crt"
	NamespaceFile = "namespace"
)

// Credentials say where the management credential is. Exactly one of Kubeconfig and Dir is set.
type Credentials struct {
	// Kubeconfig is a kubeconfig file, such as the one Cluster API's kubeconfig Secret holds.
	// Its current context's namespace is the guest's namespace unless Namespace is set.
	Kubeconfig string
	// Dir holds a token, the CA bundle and the namespace (TokenFile, CAFile, NamespaceFile),
	// for the apiserver at Server.
	Dir    string
	Server string
	// Namespace overrides the namespace of the credential.
	Namespace string
}

// Validate reports every problem with the credential options.
func (c Credentials) Validate() error {
	var errs []error
	switch {
	case c.Kubeconfig == "" && c.Dir == "":
		errs = append(errs, errors.New("a management kubeconfig or credential directory is required"))
	case c.Kubeconfig != "" && c.Dir != "":
		errs = append(errs, errors.New("give either a management kubeconfig or a credential directory, not both"))
	case c.Dir != "" && c.Server == "":
		errs = append(errs, errors.New("a credential directory needs the management apiserver's URL"))
	case c.Kubeconfig != "" && c.Server != "":
		errs = append(errs, errors.New("the management apiserver's URL comes from the kubeconfig"))
	}
	for _, p := range []string{c.Kubeconfig, c.Dir} {
		if p != "" && !filepath.IsAbs(p) {
			errs = append(errs, fmt.Errorf("%q is not an absolute path", p))
		}
	}
	return errors.Join(errs...)
}

// credential is one version of the credential: where to connect, as whom, in which namespace.
type credential struct {
	config    *rest.Config
	namespace string
	// fingerprint changes whenever anything of the above does.
	fingerprint [sha256.Size]byte
}

// load reads the credential as it is now. Every file the credential names is read here, so
// that the fingerprint covers them all and the client never reads a file later.
func (c Credentials) load() (*credential, error) {
	var cfg *rest.Config
	namespace := c.Namespace
	if c.Kubeconfig != "" {
		loader := &clientcmd.ClientConfigLoadingRules{ExplicitPath: c.Kubeconfig}
		kc := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(loader, &clientcmd.ConfigOverrides{})
		var err error
		if cfg, err = kc.ClientConfig(); err != nil {
			return nil, fmt.Errorf("management kubeconfig %s: %w", c.Kubeconfig, err)
		}
		if namespace == "" {
			raw, err := kc.RawConfig()
			if err != nil {
				return nil, fmt.Errorf("management kubeconfig %s: %w", c.Kubeconfig, err)
			}
			if ctx := raw.Contexts[raw.CurrentContext]; ctx != nil {
				namespace = ctx.Namespace
			}
			if namespace == "" {
				return nil, fmt.Errorf("management kubeconfig %s names no namespace in its current context, and none is configured", c.Kubeconfig)
			}
		}
	} else {
		read := func(name string) (string, error) {
			b, err := os.ReadFile(filepath.Join(c.Dir, name))
			if err != nil {
				return "", fmt.Errorf("management credential: %w", err)
			}
			return strings.TrimSpace(string(b)), nil
		}
		token, err := read(TokenFile)
		if err != nil {
			return nil, err
		}
		ca, err := read(CAFile)
		if err != nil {
			return nil, err
		}
		if namespace == "" {
			if namespace, err = read(NamespaceFile); err != nil {
				return nil, err
			}
		}
		cfg = &rest.Config{Host: c.Server, BearerToken: token, TLSClientConfig: rest.TLSClientConfig{CAData: []byte(ca)}}
	}
	if err := rest.LoadTLSFiles(cfg); err != nil {
		return nil, fmt.Errorf("management credential: %w", err)
	}
	if cfg.BearerTokenFile != "" {
		b, err := os.ReadFile(cfg.BearerTokenFile)
		if err != nil {
			return nil, fmt.Errorf("management credential: %w", err)
		}
		cfg.BearerToken, cfg.BearerTokenFile = strings.TrimSpace(string(b)), ""
	}
	if namespace == "" {
		return nil, errors.New("management credential: the namespace is empty")
	}

	h := sha256.New()
	for _, part := range [][]byte{
		[]byte(cfg.Host), []byte(cfg.BearerToken), []byte(cfg.Username), []byte(cfg.Password),
		cfg.CAData, cfg.CertData, cfg.KeyData, []byte(cfg.ServerName), []byte(namespace),
	} {
		fmt.Fprintf(h, "%d:", len(part))
		h.Write(part)
	}
	cred := &credential{config: cfg, namespace: namespace}
	h.Sum(cred.fingerprint[:0])
	return cred, nil
}
