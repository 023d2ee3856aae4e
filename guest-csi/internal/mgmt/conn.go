package mgmt

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/klog/v2"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
)

// ErrNotConnected is returned while no session with the management cluster is up: before the
// first credential has been read and the cache filled.
var ErrNotConnected = errors.New("not connected to the management cluster yet")

// Options configure a Conn.
type Options struct {
	Credentials Credentials
	Scheme      *runtime.Scheme
	// CacheOptions returns the cache options for the namespace of the credential: which
	// objects are cached, with which selectors. The cache fails reads of anything else.
	CacheOptions func(namespace string) cache.Options
	// OnSession is called with the cache of every new session before the session serves: it
	// starts the informers the cache holds and registers event handlers on them.
	OnSession func(ctx context.Context, c cache.Cache) error
	// Poll is how often the credential files are read to see whether they changed.
	Poll time.Duration
	// SyncTimeout bounds how long a new session may take to fill its cache.
	SyncTimeout time.Duration
	// QPS and Burst limit the requests to the management apiserver.
	QPS   float32
	Burst int
}

// Conn is the connection to the management cluster. It reads the credential every Poll and,
// when it changed (rotated token, new CA, new kubeconfig), starts a new session with it: a
// client and a cache. The new session replaces the old one only once its cache is filled, so
// that readers never see an empty cache; a credential that does not work is logged and the
// old session keeps serving until the next change. No restart is needed.
//
// Conn is the driver's client: Get and List read the current session's cache, Create, Patch
// and Delete write through its client, Live reads the apiserver.
type Conn struct {
	opts Options

	mu      sync.RWMutex
	current *session
}

type session struct {
	cred   *credential
	cache  cache.Cache
	client client.Client
	stop   context.CancelFunc
	done   chan struct{}
}

// New returns a Conn that connects once Run runs.
func New(opts Options) (*Conn, error) {
	if err := opts.Credentials.Validate(); err != nil {
		return nil, err
	}
	if opts.Poll <= 0 {
		return nil, fmt.Errorf("credential poll interval %v is not positive", opts.Poll)
	}
	if opts.SyncTimeout <= 0 {
		opts.SyncTimeout = time.Minute
	}
	return &Conn{opts: opts}, nil
}

// Run connects, and reconnects whenever the credential changes, until ctx ends.
func (c *Conn) Run(ctx context.Context) error {
	defer func() {
		c.mu.Lock()
		s := c.current
		c.current = nil
		c.mu.Unlock()
		if s != nil {
			s.close()
		}
	}()
	ticker := time.NewTicker(c.opts.Poll)
	defer ticker.Stop()
	var lastErr string
	for {
		if err := c.refresh(ctx); err != nil && ctx.Err() == nil && err.Error() != lastErr {
			// Logged once per distinct problem: it is retried every Poll.
			klog.FromContext(ctx).Error(err, "Cannot connect to the management cluster with the current credential; retrying")
			lastErr = err.Error()
		} else if err == nil {
			lastErr = ""
		}
		select {
		case <-ctx.Done():
			return nil
		case <-ticker.C:
		}
	}
}

// refresh starts a session with the credential as it is now if it differs from the current
// session's.
func (c *Conn) refresh(ctx context.Context) error {
	cred, err := c.opts.Credentials.load()
	if err != nil {
		return err
	}
	c.mu.RLock()
	old := c.current
	c.mu.RUnlock()
	if old != nil && old.cred.fingerprint == cred.fingerprint {
		return nil
	}
	s, err := c.start(ctx, cred)
	if err != nil {
		return err
	}
	c.mu.Lock()
	c.current = s
	c.mu.Unlock()
	logger := klog.FromContext(ctx)
	if old == nil {
		logger.Info("Connected to the management cluster", "server", cred.config.Host, "namespace", cred.namespace)
		return nil
	}
	logger.Info("The management credential changed; switched to a new session", "server", cred.config.Host, "namespace", cred.namespace)
	old.close()
	return nil
}

// start makes a session with cred and waits until its cache is filled.
func (c *Conn) start(ctx context.Context, cred *credential) (*session, error) {
	cfg := *cred.config
	cfg.QPS, cfg.Burst = c.opts.QPS, c.opts.Burst
	cfg.UserAgent = "guest-csi"
	opts := c.opts.CacheOptions(cred.namespace)
	opts.Scheme = c.opts.Scheme
	opts.ReaderFailOnMissingInformer = true
	ca, err := cache.New(&cfg, opts)
	if err != nil {
		return nil, fmt.Errorf("management cache: %w", err)
	}
	cl, err := client.New(&cfg, client.Options{Scheme: c.opts.Scheme})
	if err != nil {
		return nil, fmt.Errorf("management client: %w", err)
	}
	sctx, stop := context.WithCancel(ctx)
	s := &session{cred: cred, cache: ca, client: cl, stop: stop, done: make(chan struct{})}
	if err := c.opts.OnSession(sctx, ca); err != nil {
		stop()
		return nil, err
	}
	go func() {
		defer close(s.done)
		if err := ca.Start(sctx); err != nil {
			klog.FromContext(ctx).Error(err, "Management cache stopped")
		}
	}()
	syncCtx, cancel := context.WithTimeout(sctx, c.opts.SyncTimeout)
	defer cancel()
	if !ca.WaitForCacheSync(syncCtx) {
		s.close()
		return nil, fmt.Errorf("the management cache of namespace %s did not fill within %v: is the credential valid and allowed to watch there?", cred.namespace, c.opts.SyncTimeout)
	}
	return s, nil
}

func (s *session) close() {
	s.stop()
	<-s.done
}

func (c *Conn) session() (*session, error) {
	c.mu.RLock()
	defer c.mu.RUnlock()
	if c.current == nil {
		return nil, ErrNotConnected
	}
	return c.current, nil
}

// Namespace is the guest's namespace in the management cluster, "" while not connected.
func (c *Conn) Namespace() string {
	s, err := c.session()
	if err != nil {
		return ""
	}
	return s.cred.namespace
}

// Get reads obj from the cache.
func (c *Conn) Get(ctx context.Context, key client.ObjectKey, obj client.Object, opts ...client.GetOption) error {
	s, err := c.session()
	if err != nil {
		return err
	}
	return s.cache.Get(ctx, key, obj, opts...)
}

// List lists from the cache.
func (c *Conn) List(ctx context.Context, list client.ObjectList, opts ...client.ListOption) error {
	s, err := c.session()
	if err != nil {
		return err
	}
	return s.cache.List(ctx, list, opts...)
}

// Create creates obj in the management cluster.
func (c *Conn) Create(ctx context.Context, obj client.Object, opts ...client.CreateOption) error {
	s, err := c.session()
	if err != nil {
		return err
	}
	return s.client.Create(ctx, obj, opts...)
}

// Patch patches obj in the management cluster.
func (c *Conn) Patch(ctx context.Context, obj client.Object, patch client.Patch, opts ...client.PatchOption) error {
	s, err := c.session()
	if err != nil {
		return err
	}
	return s.client.Patch(ctx, obj, patch, opts...)
}

// Delete deletes obj from the management cluster.
func (c *Conn) Delete(ctx context.Context, obj client.Object, opts ...client.DeleteOption) error {
	s, err := c.session()
	if err != nil {
		return err
	}
	return s.client.Delete(ctx, obj, opts...)
}

// Live reads the management apiserver itself, for what the cache does not hold (a volume
// shared with the cluster, Events, capacity) and for fresh reads after a conflict.
func (c *Conn) Live() client.Reader { return liveReader{c} }

type liveReader struct{ c *Conn }

func (l liveReader) Get(ctx context.Context, key client.ObjectKey, obj client.Object, opts ...client.GetOption) error {
	s, err := l.c.session()
	if err != nil {
		return err
	}
	return s.client.Get(ctx, key, obj, opts...)
}

func (l liveReader) List(ctx context.Context, list client.ObjectList, opts ...client.ListOption) error {
	s, err := l.c.session()
	if err != nil {
		return err
	}
	return s.client.List(ctx, list, opts...)
}
