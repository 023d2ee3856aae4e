package cluster

import (
	"context"
	"crypto/rand"
	"crypto/rsa"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"sync"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

// ControlPlane is one Kubernetes control plane: etcd, kube-apiserver, kube-controller-manager
// and kube-scheduler.
type ControlPlane struct {
	Name string
	// Dir holds the control plane's data, certificates, logs and nodes.
	Dir string
	// Server is the apiserver URL, https://127.0.0.1:<port>.
	Server string
	// Kubeconfig is the path of an admin (system:masters) kubeconfig.
	Kubeconfig string
	// ServiceIP is the address of the control plane's `kubernetes` Service (443), the first of
	// its service range 10.96.<n>.0/24 (n counts the lab's control planes). The pods of every
	// containerd node of the lab reach this apiserver there, whichever cluster they are in.
	ServiceIP string

	lab        *Lab
	token      string
	restConfig *rest.Config
	client     kubernetes.Interface

	mu         sync.Mutex
	etcd       *Process
	apiserver  *Process
	controller *Process
	scheduler  *Process
}

// StartControlPlane starts a control plane named name (a short DNS label), waits until its
// apiserver is ready, and installs pvbridge's CRDs and the snapshot CRDs.
func (l *Lab) StartControlPlane(ctx context.Context, name string) (*ControlPlane, error) {
	cp := &ControlPlane{Name: name, Dir: filepath.Join(l.Root, name), lab: l}
	cp.Kubeconfig = filepath.Join(cp.Dir, "admin.kubeconfig")
	for _, d := range []string{"pki", "certs", "logs"} {
		if err := os.MkdirAll(filepath.Join(cp.Dir, d), 0o755); err != nil {
			return nil, err
		}
	}
	if err := cp.writeCredentials(); err != nil {
		return nil, err
	}
	p, err := FreePorts(3)
	if err != nil {
		return nil, err
	}
	etcdClient, etcdPeer, apiPort := p[0], p[1], p[2]
	cp.Server = fmt.Sprintf("https://127.0.0.1:%d", apiPort)
	if err := cp.writeKubeconfig(); err != nil {
		return nil, err
	}
	serviceRange, err := l.addControlPlane(cp)
	if err != nil {
		return nil, err
	}

	etcdURL := fmt.Sprintf("http://127.0.0.1:%d", etcdClient)
	peerURL := fmt.Sprintf("http://127.0.0.1:%d", etcdPeer)
	if cp.etcd, err = cp.start("etcd",
		"--name="+name, "--data-dir="+filepath.Join(cp.Dir, "etcd"),
		"--listen-client-urls="+etcdURL, "--advertise-client-urls="+etcdURL,
		"--listen-peer-urls="+peerURL, "--initial-advertise-peer-urls="+peerURL,
		"--initial-cluster="+name+"="+peerURL,
		"--unsafe-no-fsync=true", // throwaway data; spares the disk
		"--log-level=warn",
	); err != nil {
		return nil, err
	}
	if cp.apiserver, err = cp.start("kube-apiserver",
		"--etcd-servers="+etcdURL,
		"--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
		fmt.Sprintf("--secure-port=%d", apiPort),
		"--cert-dir="+filepath.Join(cp.Dir, "certs"),
		"--service-cluster-ip-range="+serviceRange,
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file="+filepath.Join(cp.Dir, "pki", "sa.pub"),
		"--service-account-signing-key-file="+filepath.Join(cp.Dir, "pki", "sa.key"),
		"--token-auth-file="+filepath.Join(cp.Dir, "pki", "tokens.csv"),
		"--authorization-mode=RBAC",
		"--allow-privileged=true",                      // CSI node plugins are privileged; kubeadm clusters allow it too
		"--kubelet-preferred-address-types=InternalIP", // the lab's node names do not resolve
		// A loopback advertise address needs the endpoint reconciler off. The rest halves the
		// idle CPU of a lab apiserver (measured in shared/reference/lab-fit.md).
		"--endpoint-reconciler-type=none",
		fmt.Sprintf("--watch-cache=%t", cp.lab.WatchCache), "--enable-priority-and-fairness=false",
		"--profiling=false", "--etcd-count-metric-poll-period=0",
		// Pods' status.volumeHealth, which kubelets with the same gate write (CSI volume
		// health, alpha in v1.37): without it the apiserver drops the field.
		"--feature-gates=CSIVolumeHealth=true",
	); err != nil {
		return nil, err
	}
	if err := cp.waitReady(ctx); err != nil {
		return nil, err
	}
	if err := cp.StartControllerManager(); err != nil {
		return nil, err
	}
	if cp.scheduler, err = cp.start("kube-scheduler",
		"--kubeconfig="+cp.Kubeconfig, "--leader-elect=false", "--secure-port=0",
	); err != nil {
		return nil, err
	}
	if err := cp.installCRDs(ctx); err != nil {
		return nil, err
	}
	return cp, nil
}

func (cp *ControlPlane) start(bin string, args ...string) (*Process, error) {
	path, err := cp.lab.bin.Tool(bin)
	if err != nil {
		return nil, err
	}
	return cp.lab.Start(Command{Name: cp.Name + "/" + bin, Bin: path, Args: args, Dir: cp.Dir, LogPath: cp.logPath(bin)})
}

func (cp *ControlPlane) logPath(component string) string {
	return filepath.Join(cp.Dir, "logs", component+".log")
}

// StartControllerManager starts kube-controller-manager with the lab's flags and extra ones;
// with StopControllerManager it lets a test restart it.
func (cp *ControlPlane) StartControllerManager(extra ...string) error {
	cp.mu.Lock()
	defer cp.mu.Unlock()
	if cp.controller != nil && !cp.controller.Exited() {
		return fmt.Errorf("%s: kube-controller-manager is running", cp.Name)
	}
	p, err := cp.start("kube-controller-manager", append([]string{
		"--kubeconfig=" + cp.Kubeconfig, "--leader-elect=false",
		"--use-service-account-credentials=false",
		"--bind-address=127.0.0.1", "--secure-port=0",
		// The default controller set, as in any cluster (Deployments, StatefulSets, DaemonSets,
		// ...): service account token Secrets are signed with the apiserver's key, and every
		// namespace gets the apiserver's CA as kube-root-ca.crt, which a pod's token volume needs.
		"--service-account-private-key-file=" + filepath.Join(cp.Dir, "pki", "sa.key"),
		"--root-ca-file=" + filepath.Join(cp.Dir, "certs", "apiserver.crt"),
		"--pvclaimbinder-sync-period=1s", // static PVs bind in about a second, not 15
		// The PV binder writes twice per claim; at the default 20 QPS a burst of 100 new volumes
		// waits 15 s for it after provisioning is done (measured; see the README's figures).
		"--kube-api-qps=100", "--kube-api-burst=200",
		// The lab installs CRDs (VolumeSnapshots) as kcm starts: a quota made before the quota
		// controller discovered them is counted at its next full sync (default 5 minutes).
		"--resource-quota-sync-period=15s",
	}, extra...)...)
	if err != nil {
		return err
	}
	cp.controller = p
	return nil
}

// StopControllerManager stops kube-controller-manager.
func (cp *ControlPlane) StopControllerManager() error {
	cp.mu.Lock()
	defer cp.mu.Unlock()
	if cp.controller == nil {
		return nil
	}
	err := cp.controller.Stop()
	cp.controller = nil
	return err
}

// Stop stops the control plane's processes, for a cluster a test made and is done with (the
// lab's Stop stops the rest).
func (cp *ControlPlane) Stop() error {
	cp.mu.Lock()
	defer cp.mu.Unlock()
	var errs []error
	for _, p := range []*Process{cp.scheduler, cp.controller, cp.apiserver, cp.etcd} {
		if p != nil {
			errs = append(errs, p.Stop())
		}
	}
	cp.controller = nil
	return errors.Join(errs...)
}

// StopAPIServer stops kube-apiserver, as an outage would: every client of the control plane
// loses it until StartAPIServer. etcd keeps the state.
func (cp *ControlPlane) StopAPIServer() error {
	cp.mu.Lock()
	defer cp.mu.Unlock()
	return cp.apiserver.Stop()
}

// StartAPIServer starts the stopped kube-apiserver again, on the same address, and waits until
// it is ready. An apiserver that exits while starting is started again, up to three times, as
// its supervisor (kubelet for a static pod, systemd) would: on a loaded machine a starting
// apiserver exited on a post-start hook's timeout ("unable to perform initial IP and Port
// allocation check").
func (cp *ControlPlane) StartAPIServer(ctx context.Context) error {
	var err error
	for range 3 {
		cp.mu.Lock()
		p, respawnErr := cp.apiserver.Respawn()
		if respawnErr == nil {
			cp.apiserver = p
		}
		cp.mu.Unlock()
		if respawnErr != nil {
			return respawnErr
		}
		if err = cp.waitReady(ctx); err == nil || !p.Exited() {
			return err
		}
	}
	return err
}

// RESTConfig returns an admin client configuration.
func (cp *ControlPlane) RESTConfig() *rest.Config { return rest.CopyConfig(cp.restConfig) }

// Client returns an admin clientset.
func (cp *ControlPlane) Client() kubernetes.Interface { return cp.client }

// writeCredentials writes the service-account signing key pair and the static admin token.
func (cp *ControlPlane) writeCredentials() error {
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		return err
	}
	pub, err := x509.MarshalPKIXPublicKey(&key.PublicKey)
	if err != nil {
		return err
	}
	token := make([]byte, 16)
	if _, err := rand.Read(token); err != nil {
		return err
	}
	cp.token = hex.EncodeToString(token)
	files := map[string][]byte{
		"sa.key":     pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(key)}),
		"sa.pub":     pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: pub}),
		"tokens.csv": []byte(cp.token + ",admin,admin-uid,system:masters\n"),
	}
	for name, data := range files {
		if err := os.WriteFile(filepath.Join(cp.Dir, "pki", name), data, 0o600); err != nil {
			return err
		}
	}
	return nil
}

func (cp *ControlPlane) writeKubeconfig() error {
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters[cp.Name] = &clientcmdapi.Cluster{Server: cp.Server, InsecureSkipTLSVerify: true}
	cfg.AuthInfos["admin"] = &clientcmdapi.AuthInfo{Token: cp.token}
	cfg.Contexts[cp.Name] = &clientcmdapi.Context{Cluster: cp.Name, AuthInfo: "admin"}
	cfg.CurrentContext = cp.Name
	if err := clientcmd.WriteToFile(*cfg, cp.Kubeconfig); err != nil {
		return err
	}
	rc, err := clientcmd.BuildConfigFromFlags("", cp.Kubeconfig)
	if err != nil {
		return err
	}
	rc.QPS, rc.Burst = 100, 200
	cp.restConfig = rc
	cp.client, err = kubernetes.NewForConfig(rc)
	return err
}

// waitReady waits until /readyz answers ok, failing early if etcd or the apiserver exits.
func (cp *ControlPlane) waitReady(ctx context.Context) error {
	hc := &http.Client{
		Timeout:   2 * time.Second,
		Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}, //nolint:gosec // the lab's self-signed apiserver
	}
	// On a loaded 2-core machine (CI runs the lab suites side by side) a restarted apiserver
	// took 31 s to serve and its /readyz then took more than the client's 2 s for another 30 s.
	ctx, cancel := context.WithTimeout(ctx, StartTimeout)
	defer cancel()
	err := wait.PollUntilContextCancel(ctx, 100*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		for _, p := range []*Process{cp.etcd, cp.apiserver} {
			if p.Exited() {
				return false, fmt.Errorf("%s exited; see %s", p.Name, p.LogPath)
			}
		}
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, cp.Server+"/readyz", nil)
		if err != nil {
			return false, err
		}
		req.Header.Set("Authorization", "Bearer "+cp.token)
		resp, err := hc.Do(req)
		if err != nil {
			return false, nil
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK, nil
	})
	if err != nil {
		return fmt.Errorf("%s: apiserver not ready: %w (log: %s)", cp.Name, err, cp.apiserver.LogPath)
	}
	return nil
}

// ControlPlaneOf returns a control plane the lab did not start (a guest's that kubeadm made in
// lab VMs), reached with the admin kubeconfig at path: a client of it, not its processes.
func (l *Lab) ControlPlaneOf(name, dir, kubeconfig string) (*ControlPlane, error) {
	rc, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return nil, err
	}
	c, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return nil, err
	}
	return &ControlPlane{Name: name, Dir: dir, Server: rc.Host, Kubeconfig: kubeconfig, lab: l, restConfig: rc, client: c}, nil
}
