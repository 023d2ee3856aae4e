package tenants

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clusterv1 "sigs.k8s.io/cluster-api/api/core/v1beta2"
	"sigs.k8s.io/controller-runtime/pkg/client"
)

const (
	// kubeconfigSecretKey is the key of the kubeconfig in Cluster API's <cluster>-kubeconfig
	// Secret.
	kubeconfigSecretKey = "value"
	// guestTimeout bounds every request to a guest apiserver, so that an unreachable guest holds
	// a worker for seconds, not minutes.
	guestTimeout = 15 * time.Second
	// guestQPS and guestBurst limit the requests to each guest apiserver. A pass of the guest
	// install writes a few dozen objects, which client-go's default (5/s after a burst of 10)
	// spread over seconds.
	guestQPS, guestBurst = 20, 50
	// maxGuestResponse bounds the body of every response of a guest apiserver: the controller
	// reads single objects and short lists there (its install, a ServiceAccount, a Secret), and
	// a hostile guest's endless or enormous answer must not hold its memory or a worker.
	maxGuestResponse = 4 << 20
	// guestWorkers is how many Clusters each controller that talks to guests serves at once: a
	// guest that answers slowly (up to guestTimeout a request) holds one of them, not the
	// others' credential renewals and installs.
	guestWorkers = 4
)

// errGuestResponseTooLarge is returned when a guest apiserver's response exceeds
// maxGuestResponse.
var errGuestResponseTooLarge = fmt.Errorf("the guest apiserver's response is larger than %d bytes", maxGuestResponse)

// limitResponses bounds the body of each response that rt returns to limit bytes: reading past
// it fails with errGuestResponseTooLarge.
func limitResponses(rt http.RoundTripper, limit int64) http.RoundTripper {
	return roundTripperFunc(func(req *http.Request) (*http.Response, error) {
		resp, err := rt.RoundTrip(req)
		if err != nil {
			return nil, err
		}
		resp.Body = &limitedBody{ReadCloser: resp.Body, left: limit}
		return resp, nil
	})
}

type roundTripperFunc func(*http.Request) (*http.Response, error)

func (f roundTripperFunc) RoundTrip(req *http.Request) (*http.Response, error) { return f(req) }

// limitedBody reads at most left more bytes of a body.
type limitedBody struct {
	io.ReadCloser
	left int64
}

func (b *limitedBody) Read(p []byte) (int, error) {
	if b.left <= 0 {
		// One byte more tells a body of exactly the limit from a longer one.
		var one [1]byte
		if n, _ := b.ReadCloser.Read(one[:]); n > 0 {
			return 0, errGuestResponseTooLarge
		}
		return 0, io.EOF
	}
	if int64(len(p)) > b.left {
		p = p[:b.left]
	}
	n, err := b.ReadCloser.Read(p)
	b.left -= int64(n)
	return n, err
}

// errNoKubeconfig is returned while Cluster API has not written the Cluster's kubeconfig Secret.
var errNoKubeconfig = errors.New("no kubeconfig Secret yet")

// kubeconfigSecretName is Cluster API's name of the Secret with a cluster's admin kubeconfig.
func kubeconfigSecretName(cluster string) string { return cluster + "-kubeconfig" }

// GuestClients connects to guest clusters through their Cluster API kubeconfig Secrets and
// keeps one client per Cluster for as long as the Secret does not change.
type GuestClients struct {
	scheme *runtime.Scheme

	mu      sync.Mutex
	clients map[types.NamespacedName]guestClient // by Cluster
}

type guestClient struct {
	secretVersion string // resourceVersion of the kubeconfig Secret the client was made from
	client        client.Client
}

// NewGuestClients returns an empty cache of guest clients with scheme's types.
func NewGuestClients(scheme *runtime.Scheme) *GuestClients {
	return &GuestClients{scheme: scheme, clients: map[types.NamespacedName]guestClient{}}
}

// For returns a client of the guest cluster of cluster, made from the kubeconfig Secret read
// with c. It returns errNoKubeconfig while the Secret does not exist, and refuses a Secret that
// is not Cluster API's (see checkKubeconfigSecret).
func (g *GuestClients) For(ctx context.Context, c client.Reader, cluster *clusterv1.Cluster) (client.Client, error) {
	secret := &corev1.Secret{}
	key := client.ObjectKey{Namespace: cluster.Namespace, Name: kubeconfigSecretName(cluster.Name)}
	if err := c.Get(ctx, key, secret); err != nil {
		if apierrors.IsNotFound(err) {
			return nil, errNoKubeconfig
		}
		return nil, fmt.Errorf("read Secret %s: %w", key, err)
	}
	if err := checkKubeconfigSecret(secret, cluster); err != nil {
		return nil, fmt.Errorf("Secret %s: %w", key, err) //nolint:staticcheck // Secret is a kind
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	name := client.ObjectKeyFromObject(cluster)
	if cached, ok := g.clients[name]; ok && cached.secretVersion == secret.ResourceVersion {
		return cached.client, nil
	}
	rc, err := inlineRESTConfig(secret.Data[kubeconfigSecretKey])
	if err != nil {
		return nil, fmt.Errorf("kubeconfig in Secret %s: %w", key, err)
	}
	rc.Timeout, rc.QPS, rc.Burst = guestTimeout, guestQPS, guestBurst
	rc.Wrap(func(rt http.RoundTripper) http.RoundTripper { return limitResponses(rt, maxGuestResponse) })
	cl, err := client.New(rc, client.Options{Scheme: g.scheme})
	if err != nil {
		return nil, fmt.Errorf("client of the guest cluster from Secret %s: %w", key, err)
	}
	g.clients[name] = guestClient{secretVersion: secret.ResourceVersion, client: cl}
	return cl, nil
}

// checkKubeconfigSecret accepts only Cluster API's kubeconfig Secret of cluster: of Cluster
// API's Secret type, and owned by the Cluster or by its control plane (Cluster API's cluster
// controller, or the control plane provider, writes it). The controller reads Secrets of every
// namespace; a Secret that someone with write access to a namespace made up is not a way to
// steer it.
func checkKubeconfigSecret(secret *corev1.Secret, cluster *clusterv1.Cluster) error {
	if secret.Type != clusterv1.ClusterSecretType {
		return fmt.Errorf("type %q is not Cluster API's %q", secret.Type, clusterv1.ClusterSecretType)
	}
	cp := cluster.Spec.ControlPlaneRef
	for _, ref := range secret.OwnerReferences {
		group, _, _ := strings.Cut(ref.APIVersion, "/")
		switch {
		case ref.Kind == "Cluster" && group == clusterv1.GroupVersion.Group && ref.UID == cluster.UID:
			return nil
		case cp.Kind != "" && ref.Kind == cp.Kind && group == cp.APIGroup && ref.Name == cp.Name:
			return nil
		}
	}
	return fmt.Errorf("it is owned neither by Cluster %s (uid %s) nor by its control plane", cluster.Name, cluster.UID)
}

// inlineRESTConfig is the client configuration of a kubeconfig that carries its credentials and
// CA inline. A reference to a file (tokenFile, client certificate or key, CA) or a program
// (exec, auth provider) is refused: the controller would read its own files or run a program
// that whoever wrote the kubeconfig chose.
func inlineRESTConfig(data []byte) (*rest.Config, error) {
	if len(data) == 0 {
		return nil, fmt.Errorf("no %q key", kubeconfigSecretKey)
	}
	cfg, err := clientcmd.Load(data)
	if err != nil {
		return nil, err
	}
	var refs []string
	for name, c := range cfg.Clusters {
		if c.CertificateAuthority != "" {
			refs = append(refs, "cluster "+name+": certificate-authority")
		}
	}
	for name, a := range cfg.AuthInfos {
		for field, set := range map[string]bool{
			"tokenFile": a.TokenFile != "", "client-certificate": a.ClientCertificate != "", "client-key": a.ClientKey != "",
			"exec": a.Exec != nil, "auth-provider": a.AuthProvider != nil,
		} {
			if set {
				refs = append(refs, "user "+name+": "+field)
			}
		}
	}
	if len(refs) > 0 {
		slices.Sort(refs)
		return nil, fmt.Errorf("only inline credentials are accepted, not %s", strings.Join(refs, ", "))
	}
	return clientcmd.NewDefaultClientConfig(*cfg, nil).ClientConfig()
}

// Forget drops the client of a Cluster that is gone.
func (g *GuestClients) Forget(cluster types.NamespacedName) {
	g.mu.Lock()
	defer g.mu.Unlock()
	delete(g.clients, cluster)
}
