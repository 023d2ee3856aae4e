package cluster

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"

	"pvbridge.io/e2e/images"
)

// Registry is the lab's image registry: the distribution registry (hack/build-tools.sh
// registry) as a process of the lab, its storage below the lab's root. It listens on
// 127.0.0.1 only, as the apiservers do: a registry anyone may push to is not offered to the
// machine's network. The lab's VMs reach it through their link to the machine (a DNAT rule
// of the VM's link, see VM.startNetwork), pull the images pushed by their own names through
// their containerd's registry mirrors, and pull what a user pushed to Address by that address,
// as kind's local registry is used (`docker push localhost:5001/app`, `image:
// localhost:5001/app`).
type Registry struct {
	// Address is host:port on the machine, plain HTTP: where a user pushes.
	Address string
	// Port is Address's port, which the VMs reach at their link's address on the machine.
	Port int

	mu    sync.Mutex
	hosts []string // the registries whose images were pushed (registry.k8s.io, docker.io, ...)
}

// StartRegistry starts the lab's registry and returns once it serves.
func (l *Lab) StartRegistry(ctx context.Context) (*Registry, error) {
	bin, err := l.bin.Tool("registry")
	if err != nil {
		return nil, err
	}
	ports, err := FreePorts(1)
	if err != nil {
		return nil, err
	}
	r := &Registry{Address: fmt.Sprintf("127.0.0.1:%d", ports[0]), Port: ports[0]}
	dir := filepath.Join(l.Root, "registry")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	config := filepath.Join(dir, "config.yml")
	if err := os.WriteFile(config, []byte(fmt.Sprintf(`version: 0.1
log: {level: info}
storage:
  filesystem: {rootdirectory: %q}
  delete: {enabled: true}
http:
  addr: %s
`, filepath.Join(dir, "data"), r.Address)), 0o644); err != nil {
		return nil, err
	}
	p, err := l.Start(Command{
		Name: "registry", Bin: bin, Args: []string{"serve", config},
		// It exports traces to an OTLP collector on localhost unless told not to.
		Env: []string{"OTEL_TRACES_EXPORTER=none"},
		Dir: dir, LogPath: filepath.Join(dir, "registry.log"), Restart: true,
	})
	if err != nil {
		return nil, err
	}
	if err := WaitHTTPReady(ctx, time.Minute, "http://"+r.Address+"/v2/"); err != nil {
		return nil, fmt.Errorf("registry: %w (log: %s)", err, p.LogPath)
	}
	return r, nil
}

// WaitHTTPReady waits, at most timeout for each, until every URL answers 200.
func WaitHTTPReady(ctx context.Context, timeout time.Duration, urls ...string) error {
	for _, u := range urls {
		err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, timeout, true, func(ctx context.Context) (bool, error) {
			req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
			if err != nil {
				return false, err
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				return false, nil
			}
			resp.Body.Close()
			return resp.StatusCode == http.StatusOK, nil
		})
		if err != nil {
			return fmt.Errorf("%s not ready: %w", u, err)
		}
	}
	return nil
}

// Push pushes the images of OCI archives (images.WriteArchive) below their own names:
// registry.k8s.io/pause:3.10.2 is <Address>/registry.k8s.io/pause:3.10.2, which a VM pulls as
// registry.k8s.io/pause:3.10.2.
func (r *Registry) Push(ctx context.Context, archives ...string) error {
	for _, a := range archives {
		ref, err := images.Push(ctx, a, r.Address)
		if err != nil {
			return err
		}
		host, _, _ := strings.Cut(ref, "/")
		r.mu.Lock()
		if !slices.Contains(r.hosts, host) {
			r.hosts = append(r.hosts, host)
		}
		r.mu.Unlock()
	}
	return nil
}

// mirrors returns the containerd hosts.toml files (registry host → content) of a machine that
// reaches the registry at address (host:port): each registry whose images were pushed is
// mirrored by the lab's registry below its name (override_path: containerd would otherwise ask
// for the repository without the registry's name, and docker.io/library/pause would be
// registry.k8s.io/pause's neighbour), and the lab's registry's own address is that address,
// over plain HTTP. What the lab's registry lacks is asked of the registry itself, which the lab
// does not reach.
func (r *Registry) mirrors(address string) map[string]string {
	r.mu.Lock()
	defer r.mu.Unlock()
	files := map[string]string{r.Address: fmt.Sprintf("server = %q\n", "http://"+address)}
	for _, host := range r.hosts {
		files[host] = fmt.Sprintf("[host.%q]\n  capabilities = [\"pull\", \"resolve\"]\n  override_path = true\n", "http://"+address+"/v2/"+host)
	}
	return files
}
