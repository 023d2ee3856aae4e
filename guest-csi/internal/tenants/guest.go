package tenants

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/controller-runtime/pkg/client"
)

const (
	// kubeconfigSecretKey is the key of the kubeconfig in Cluster API's <cluster>-kubeconfig
	// Secret.
	kubeconfigSecretKey = "value"
	// guestTimeout bounds every request to a guest apiserver, so that an unreachable guest holds
	// a worker for seconds, not minutes.
	guestTimeout = 15 * time.Second
)

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

// For returns a client of the guest cluster of Cluster cluster, made from the kubeconfig Secret
// read with c. It returns errNoKubeconfig while the Secret does not exist.
func (g *GuestClients) For(ctx context.Context, c client.Reader, cluster types.NamespacedName) (client.Client, error) {
	secret := &corev1.Secret{}
	key := client.ObjectKey{Namespace: cluster.Namespace, Name: kubeconfigSecretName(cluster.Name)}
	if err := c.Get(ctx, key, secret); err != nil {
		if apierrors.IsNotFound(err) {
			return nil, errNoKubeconfig
		}
		return nil, fmt.Errorf("read Secret %s: %w", key, err)
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if cached, ok := g.clients[cluster]; ok && cached.secretVersion == secret.ResourceVersion {
		return cached.client, nil
	}
	data := secret.Data[kubeconfigSecretKey]
	if len(data) == 0 {
		return nil, fmt.Errorf("Secret %s has no %q key", key, kubeconfigSecretKey) //nolint:staticcheck // Secret is a kind
	}
	rc, err := clientcmd.RESTConfigFromKubeConfig(data)
	if err != nil {
		return nil, fmt.Errorf("kubeconfig in Secret %s: %w", key, err)
	}
	rc.Timeout = guestTimeout
	cl, err := client.New(rc, client.Options{Scheme: g.scheme})
	if err != nil {
		return nil, fmt.Errorf("client of the guest cluster from Secret %s: %w", key, err)
	}
	g.clients[cluster] = guestClient{secretVersion: secret.ResourceVersion, client: cl}
	return cl, nil
}

// Forget drops the client of a Cluster that is gone.
func (g *GuestClients) Forget(cluster types.NamespacedName) {
	g.mu.Lock()
	defer g.mu.Unlock()
	delete(g.clients, cluster)
}
