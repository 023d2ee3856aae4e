// Command fakecri serves the CRI runtime and image services of k8s.io/cri-client's fake runtime
// on a unix socket, so that a real kubelet runs pods without a container engine: pods "run"
// without processes while the kubelet's volume manager makes real CSI calls.
//
// The fake keeps no container log path. The kubelet then removes `Glob(LogPath + "*")` when it
// deletes a container, which with an empty path matches every file in the kubelet's working
// directory. fakecri therefore records the log path the kubelet asked for, as a real runtime does,
// and gives images a size, without which the kubelet does not start their containers.
package main

import (
	"context"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"

	"google.golang.org/grpc"
	kubeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
	"k8s.io/cri-client/pkg/fake"
)

type runtime struct {
	*fake.RemoteRuntime
}

// CreateContainer creates the fake container and records the log path of its config.
func (r *runtime) CreateContainer(ctx context.Context, req *kubeapi.CreateContainerRequest) (*kubeapi.CreateContainerResponse, error) {
	resp, err := r.RemoteRuntime.CreateContainer(ctx, req)
	if err != nil {
		return nil, err
	}
	logDir, logPath := req.GetSandboxConfig().GetLogDirectory(), req.GetConfig().GetLogPath()
	if logDir == "" || logPath == "" {
		return nil, fmt.Errorf("container %s: the kubelet gave no log path", resp.GetContainerId())
	}
	rs := r.RuntimeService
	rs.Lock()
	defer rs.Unlock()
	if c, ok := rs.Containers[resp.GetContainerId()]; ok {
		c.LogPath = filepath.Join(logDir, logPath)
	}
	return resp, nil
}

func main() {
	socket := flag.String("socket", "", "path of the unix socket to serve the CRI runtime and image services on (required)")
	flag.Parse()
	if err := run(*socket); err != nil {
		fmt.Fprintln(os.Stderr, "fakecri:", err)
		os.Exit(1)
	}
}

func run(socket string) error {
	if socket == "" {
		return fmt.Errorf("--socket is required")
	}
	if err := os.Remove(socket); err != nil && !os.IsNotExist(err) {
		return fmt.Errorf("remove stale socket: %w", err)
	}
	l, err := net.Listen("unix", socket)
	if err != nil {
		return err
	}
	r := &runtime{RemoteRuntime: fake.NewFakeRemoteRuntime()}
	// The kubelet refuses to start a container whose image has no size ("ImageInspectError").
	r.ImageService.FakeImageSize = 1 << 20
	r.RuntimeService.FakeStatus = &kubeapi.RuntimeStatus{Conditions: []*kubeapi.RuntimeCondition{
		{Type: kubeapi.RuntimeReady, Status: true},
		{Type: kubeapi.NetworkReady, Status: true},
	}}
	srv := grpc.NewServer()
	kubeapi.RegisterRuntimeServiceServer(srv, r)
	kubeapi.RegisterImageServiceServer(srv, r)

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	go func() {
		<-ctx.Done()
		srv.Stop()
	}()
	return srv.Serve(l)
}
