package replication

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"golang.org/x/sys/unix"

	"pvbridge.io/mgmt-csi/internal/loop"
	"pvbridge.io/pkg/qsd"
)

// These tests run the data path for real, as root: qemu-storage-daemons on 127.0.0.1, loop
// devices over sparse files standing for two hosts' replicas, a FUSE export.

const mib = int64(1) << 20

// sandbox is a test's directory, short enough for the daemons' sockets, with a keys file.
type sandbox struct {
	dir  string
	keys string
}

func newSandbox(t testing.TB) *sandbox {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Fatal("these tests run qemu-storage-daemons over loop devices: they must run as root")
	}
	dir, err := os.MkdirTemp("", "repl-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	s := &sandbox{dir: dir, keys: filepath.Join(dir, "keys")}
	s.writeKeys(t, s.keys)
	return s
}

// writeKeys writes a keys file of PSKUser with a random key into dir.
func (s *sandbox) writeKeys(t testing.TB, dir string) {
	t.Helper()
	key := make([]byte, 32)
	_, _ = rand.Read(key)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "keys.psk"), []byte(PSKUser+":"+hex.EncodeToString(key)+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
}

// replica returns a loop device over a new sparse file of size: a host's replica.
func (s *sandbox) replica(t testing.TB, name string, size int64) string {
	t.Helper()
	file := filepath.Join(s.dir, name+".img")
	if err := os.WriteFile(file, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(file, size); err != nil {
		t.Fatal(err)
	}
	dev, err := loop.Attach(file)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := loop.Detach(context.Background(), dev); err != nil {
			t.Error(err)
		}
	})
	return dev
}

// server returns a replica server on a free port of 127.0.0.1, stopped at the test's end.
func (s *sandbox) server(t testing.TB, name string) *Server {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	_ = l.Close()
	srv := &Server{Dir: qsd.Dir(filepath.Join(s.dir, name)), Address: addr, KeysDir: s.keys}
	t.Cleanup(func() {
		// t.Context() is done when cleanups run.
		if err := srv.Stop(context.Background()); err != nil {
			t.Error(err)
		}
	})
	return srv
}

func (s *sandbox) targets(t testing.TB) *Targets {
	t.Helper()
	targets := &Targets{RunDir: filepath.Join(s.dir, "t"), KeysDir: s.keys}
	t.Cleanup(func() {
		entries, _ := os.ReadDir(targets.RunDir)
		for _, e := range entries {
			t.Errorf("target left behind: %s", e.Name())
			if err := targets.Close(context.Background(), e.Name()); err != nil {
				t.Error(err)
			}
		}
	})
	return targets
}

// watchedTargets returns targets whose watches run (until the test ends) and report each
// faulted replica on the channel; configure changes them before the watches start.
func (s *sandbox) watchedTargets(t *testing.T, configure ...func(*Targets)) (*Targets, chan string) {
	t.Helper()
	targets := s.targets(t)
	faulted := make(chan string, 4)
	targets.Faulted = func(_ context.Context, replica, _ string) error {
		faulted <- replica
		return nil
	}
	for _, c := range configure {
		c(targets)
	}
	go func() { _ = targets.Start(t.Context()) }()
	return targets, faulted
}

// trio is a watched target of volume "vol" over a local replica and a remote one (vol, exported
// by srvB), and a third replica, fresh, that srvC exports as "vol-c" for a rebuild.
type trio struct {
	local, remote, fresh string
	srvB, srvC           *Server
	targets              *Targets
	faulted              chan string
	dev                  string
}

func (s *sandbox) trio(t *testing.T, g Gomega) trio {
	t.Helper()
	tr := trio{local: s.replica(t, "a", 32*mib), remote: s.replica(t, "b", 32*mib), fresh: s.replica(t, "c", 32*mib)}
	tr.srvB, tr.srvC = s.server(t, "server-b"), s.server(t, "server-c")
	g.Expect(tr.srvB.Export(t.Context(), vol, tr.remote)).To(Succeed())
	g.Expect(tr.srvC.Export(t.Context(), "vol-c", tr.fresh)).To(Succeed())
	tr.targets, tr.faulted = s.watchedTargets(t)
	var err error
	tr.dev, err = tr.targets.Open(t.Context(), "vol", []Replica{{Name: vol, Address: tr.srvB.Address}, {Name: "vol-a", Device: tr.local}})
	g.Expect(err).NotTo(HaveOccurred())
	return tr
}

// vol is a replica's name as the controller makes them: longer than QEMU's node names.
const vol = "pvc-0b3f7c1e-2f7a-4d0c-9b1e-4c2e8f0a1d2c-r1"

func TestTargetWritesEveryReplicaAndOutlivesALostOne(t *testing.T) {
	g := NewWithT(t)
	s := newSandbox(t)
	local, remote := s.replica(t, "a", 64*mib), s.replica(t, "b", 64*mib)
	srv := s.server(t, "server-b")
	g.Expect(srv.Export(t.Context(), vol, remote)).To(Succeed())
	g.Expect(srv.Export(t.Context(), vol, remote)).To(Succeed(), "exporting again changes nothing")
	g.Expect(srv.Exports(t.Context())).To(Equal([]string{vol}))

	targets, faulted := s.watchedTargets(t)
	replicas := []Replica{{Name: vol, Address: srv.Address}, {Name: "vol-a", Device: local}}
	dev, err := targets.Open(t.Context(), "vol", replicas)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(targets.Open(t.Context(), "vol", replicas)).To(Equal(dev), "opening again finds the running target")
	g.Expect(targets.Device("vol")).To(Equal(dev))
	g.Expect(size(g, dev)).To(Equal(size(g, local)), "the volume has its replicas' size")

	first := writeSynced(g, dev, 4*mib, mib)
	g.Expect(read(g, local, 4*mib, mib)).To(Equal(first), "the local replica has the write")
	g.Expect(read(g, remote, 4*mib, mib)).To(Equal(first), "the remote replica has the write")

	// The remote host dies: its server goes as a crash would.
	g.Expect(qsd.Kill(t.Context(), srv.Dir)).To(Succeed())
	second := writeSynced(g, dev, 8*mib, mib)
	g.Expect(read(g, local, 8*mib, mib)).To(Equal(second), "the write is acknowledged from the surviving replica")
	g.Expect(read(g, remote, 8*mib, mib)).NotTo(Equal(second), "the lost replica missed it")
	g.Expect(read(g, dev, 4*mib, mib)).To(Equal(first), "reads go on from the local replica")
	g.Eventually(faulted).WithTimeout(time.Minute).Should(Receive(Equal(vol)), "the watch reports the replica faulted")

	// The server comes back with the replica: the target never writes to it again, so it
	// cannot serve a mix of old and new data.
	g.Expect(srv.Export(t.Context(), vol, remote)).To(Succeed())
	third := writeSynced(g, dev, 12*mib, mib)
	g.Expect(read(g, local, 12*mib, mib)).To(Equal(third))
	g.Consistently(func() []byte { return read(g, remote, 12*mib, mib) }).WithTimeout(3*time.Second).ShouldNot(Equal(third), "out of the quorum for good")

	g.Expect(targets.Close(t.Context(), "vol")).To(Succeed())
	g.Expect(targets.Device("vol")).To(BeEmpty())
	g.Expect(loop.Backing(dev)).NotTo(HaveSuffix("/vol/disk"), "its loop device is detached")
	g.Expect(targets.Close(t.Context(), "vol")).To(Succeed(), "closing again changes nothing")
}

// A replica server that stops answering but keeps its connections (here a stopped process,
// whose kernel still acknowledges): the writer stalls until the guard cuts the connection,
// then the replica is faulted as a dead one and the writes go on.
func TestTargetCutsOffAReplicaThatStopsAnswering(t *testing.T) {
	g := NewWithT(t)
	s := newSandbox(t)
	local, remote := s.replica(t, "a", 32*mib), s.replica(t, "b", 32*mib)
	srv := s.server(t, "server-b")
	g.Expect(srv.Export(t.Context(), vol, remote)).To(Succeed())
	targets, faulted := s.watchedTargets(t, func(t *Targets) { t.StallBound = 2 * time.Second })
	dev, err := targets.Open(t.Context(), "vol", []Replica{{Name: vol, Address: srv.Address}, {Name: "vol-a", Device: local}})
	g.Expect(err).NotTo(HaveOccurred())
	first := writeSynced(g, dev, 0, mib)
	g.Expect(read(g, remote, 0, mib)).To(Equal(first))

	pid, err := qsd.Pid(srv.Dir)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(unix.Kill(pid, unix.SIGSTOP)).To(Succeed())
	t.Cleanup(func() { _ = unix.Kill(pid, unix.SIGCONT) }) // before the server stops
	written := make(chan []byte, 1)
	go func() { written <- writeSynced(g, dev, mib, mib) }()
	var second []byte
	g.Eventually(written).WithTimeout(time.Minute).Should(Receive(&second), "the guard ends the stall")
	g.Expect(read(g, local, mib, mib)).To(Equal(second))
	g.Eventually(faulted).WithTimeout(time.Minute).Should(Receive(Equal(vol)), "the silent replica is faulted")
	third := writeSynced(g, dev, 2*mib, mib)
	g.Expect(read(g, local, 2*mib, mib)).To(Equal(third), "writes go on without it")

	g.Expect(unix.Kill(pid, unix.SIGCONT)).To(Succeed())
	g.Expect(targets.Close(t.Context(), "vol")).To(Succeed())
}

// A rebuild brings a degraded volume back to two replicas while a writer goes on: the new
// replica ends byte-identical to the surviving one, gets every later write, and is watched as
// the others are.
func TestTargetRebuildsAReplicaUnderAWriter(t *testing.T) {
	g := NewWithT(t)
	s := newSandbox(t)
	tr := s.trio(t, g)
	writeSynced(g, tr.dev, 0, 8*mib)
	g.Expect(qsd.Kill(t.Context(), tr.srvB.Dir)).To(Succeed())
	writeSynced(g, tr.dev, 8*mib, mib)
	g.Eventually(tr.faulted).WithTimeout(time.Minute).Should(Receive(Equal(vol)))

	// A writer goes on through the rebuild: synced writes of 64 KiB all over the volume.
	stop := writeUnder(tr.dev, func(i int64) int64 { return (i * 7919 * 64 << 10) % (32 * mib) })
	c := Replica{Name: "vol-c", Address: tr.srvC.Address}
	g.Expect(tr.targets.Rebuild(t.Context(), "vol", c)).To(Succeed())
	g.Expect(stop()).To(Succeed(), "the writer saw no error")
	g.Expect(read(g, tr.fresh, 0, 32*mib)).To(Equal(read(g, tr.local, 0, 32*mib)), "the rebuilt replica is the volume")
	g.Expect(tr.targets.Rebuild(t.Context(), "vol", c)).To(Succeed(), "rebuilding again: done already")
	after := writeSynced(g, tr.dev, 20*mib, mib)
	g.Expect(read(g, tr.fresh, 20*mib, mib)).To(Equal(after), "the rebuilt replica gets every write")

	// It is a replica as the others: its server dies, it is faulted.
	g.Expect(qsd.Kill(t.Context(), tr.srvC.Dir)).To(Succeed())
	writeSynced(g, tr.dev, 24*mib, mib)
	g.Eventually(tr.faulted).WithTimeout(time.Minute).Should(Receive(Equal("vol-c")))
	g.Expect(tr.targets.Close(t.Context(), "vol")).To(Succeed())
}

func TestParseLoopCounters(t *testing.T) {
	for _, tc := range []struct {
		name, stat string
		want       loopCounters
		wantErr    bool
	}{
		{"kernel 5.5 and later", "  10 0 80 3  20 0 160 9  2  12 12  1 0 8 0  4 1", loopCounters{done: 35, inFlight: 2}, false},
		{"kernel 4.18", "10 0 80 3 20 0 160 9 0 12 12 1 0 8 0", loopCounters{done: 31}, false},
		{"before 4.18", "10 0 80 3 20 0 160 9 1 12 12", loopCounters{done: 30, inFlight: 1}, false},
		{"too short", "10 0 80", loopCounters{}, true},
		{"not a number", "x 0 80 3 20 0 160 9 1 12 12", loopCounters{}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := NewWithT(t)
			got, err := parseLoopCounters(tc.stat)
			if tc.wantErr {
				g.Expect(err).To(HaveOccurred())
				return
			}
			g.Expect(err).NotTo(HaveOccurred())
			g.Expect(got).To(Equal(tc.want))
		})
	}
}

func TestTargetOfRemoteReplicasOnly(t *testing.T) {
	g := NewWithT(t)
	s := newSandbox(t)
	b, c := s.replica(t, "b", 32*mib), s.replica(t, "c", 32*mib)
	srvB, srvC := s.server(t, "server-b"), s.server(t, "server-c")
	g.Expect(srvB.Export(t.Context(), vol, b)).To(Succeed())
	g.Expect(srvC.Export(t.Context(), "vol-c", c)).To(Succeed())

	targets := s.targets(t)
	dev, err := targets.Open(t.Context(), "vol", []Replica{{Name: vol, Address: srvB.Address}, {Name: "vol-c", Address: srvC.Address}})
	g.Expect(err).NotTo(HaveOccurred())
	data := writeSynced(g, dev, 0, mib)
	g.Expect(read(g, b, 0, mib)).To(Equal(data))
	g.Expect(read(g, c, 0, mib)).To(Equal(data))
	g.Expect(targets.Close(t.Context(), "vol")).To(Succeed())

	// Ending an export drops its clients and closes the device; it is idempotent.
	g.Expect(srvB.Unexport(t.Context(), vol)).To(Succeed())
	g.Expect(srvB.Unexport(t.Context(), vol)).To(Succeed())
	g.Expect(srvB.Exports(t.Context())).To(BeEmpty())
	g.Expect(srvB.Export(t.Context(), vol, b)).To(Succeed(), "a replica can be exported again")
}

func TestServerServesOnlyClientsWithTheKey(t *testing.T) {
	g := NewWithT(t)
	s := newSandbox(t)
	dev := s.replica(t, "b", 16*mib) // before the server, which is stopped first
	srv := s.server(t, "server")
	g.Expect(srv.Export(t.Context(), vol, dev)).To(Succeed())
	other := filepath.Join(s.dir, "other-keys")
	s.writeKeys(t, other)

	info := func(tlsDir string) error {
		host, port, _ := net.SplitHostPort(srv.Address)
		opts := "driver=nbd,server.type=inet,server.host=" + host + ",server.port=" + port + ",export=" + vol
		args := []string{"info", "--image-opts"}
		if tlsDir != "" {
			args = append(args, "--object", "tls-creds-psk,id=tls,endpoint=client,username="+PSKUser+",dir="+tlsDir)
			opts += ",tls-creds=tls"
		}
		if out, err := exec.Command("qemu-img", append(args, opts)...).CombinedOutput(); err != nil {
			return fmt.Errorf("%w: %s", err, out)
		}
		return nil
	}
	g.Expect(info(s.keys)).To(Succeed(), "a client with the key reads the export")
	g.Expect(info("")).NotTo(Succeed(), "a client without TLS is refused")
	g.Expect(info(other)).NotTo(Succeed(), "a client with another key is refused")
}

// writeUnder starts a writer of synced 64 KiB writes of random data to dev, the i-th at
// offset at(i), until stop, which returns the writer's first error.
func writeUnder(dev string, at func(i int64) int64) (stop func() error) {
	quit, stopped := make(chan struct{}), make(chan error, 1)
	go func() {
		f, err := os.OpenFile(dev, os.O_RDWR|os.O_SYNC, 0)
		if err != nil {
			stopped <- err
			return
		}
		defer f.Close()
		buf := make([]byte, 64<<10)
		for i := int64(0); ; i++ {
			select {
			case <-quit:
				stopped <- nil
				return
			default:
			}
			_, _ = rand.Read(buf)
			if _, err := f.WriteAt(buf, at(i)); err != nil {
				stopped <- err
				return
			}
		}
	}()
	return func() error {
		close(quit)
		return <-stopped
	}
}

// writeSynced writes size random bytes at off through dev, fsyncs and returns them.
func writeSynced(g Gomega, dev string, off, size int64) []byte {
	data := make([]byte, size)
	_, _ = rand.Read(data)
	f, err := os.OpenFile(dev, os.O_RDWR, 0)
	g.Expect(err).NotTo(HaveOccurred())
	defer f.Close()
	_, err = f.WriteAt(data, off)
	g.Expect(err).NotTo(HaveOccurred())
	g.Expect(f.Sync()).To(Succeed())
	return data
}

// read reads size bytes at off from dev, past its page cache.
func read(g Gomega, dev string, off, size int64) []byte {
	f, err := os.Open(dev)
	g.Expect(err).NotTo(HaveOccurred())
	defer f.Close()
	g.Expect(unix.IoctlSetInt(int(f.Fd()), unix.BLKFLSBUF, 0)).To(Succeed())
	data := make([]byte, size)
	_, err = f.ReadAt(data, off)
	g.Expect(err).NotTo(HaveOccurred())
	return bytes.Clone(data)
}

// size returns the size of dev in bytes.
func size(g Gomega, dev string) int64 {
	f, err := os.Open(dev)
	g.Expect(err).NotTo(HaveOccurred())
	defer f.Close()
	n, err := f.Seek(0, io.SeekEnd)
	g.Expect(err).NotTo(HaveOccurred())
	return n
}

// A drain retires replicas once another took their place, under a writer: the local one (which
// served the reads) and a remote one, whose server then drops its export. The writer sees no
// error, no replica is faulted, and the volume goes on from the rebuilt one alone.
func TestTargetRetiresReplicasUnderAWriter(t *testing.T) {
	g := NewWithT(t)
	s := newSandbox(t)
	tr := s.trio(t, g)
	first := writeSynced(g, tr.dev, 0, 8*mib)
	g.Expect(tr.targets.Rebuild(t.Context(), "vol", Replica{Name: "vol-c", Address: tr.srvC.Address})).To(Succeed())

	stop := writeUnder(tr.dev, func(i int64) int64 { return 16*mib + (i%64)*(64<<10) })
	g.Expect(tr.targets.Retire(t.Context(), "vol", "vol-a")).To(Succeed())
	g.Expect(tr.targets.Retire(t.Context(), "vol", "vol-a")).To(Succeed(), "retiring again: out already")
	g.Expect(tr.targets.Retire(t.Context(), "vol", vol)).To(Succeed())
	g.Expect(tr.srvB.Unexport(t.Context(), vol)).To(Succeed())
	g.Expect(stop()).To(Succeed(), "the writer saw no error")

	second := writeSynced(g, tr.dev, 8*mib, mib)
	g.Expect(read(g, tr.fresh, 8*mib, mib)).To(Equal(second), "the rebuilt replica has the writes")
	g.Expect(read(g, tr.local, 8*mib, mib)).NotTo(Equal(second), "the retired tr.local replica has them no more")
	g.Expect(read(g, tr.remote, 8*mib, mib)).NotTo(Equal(second), "nor the retired tr.remote one")
	g.Expect(read(g, tr.dev, 0, 8*mib)).To(Equal(first), "reads come from the replica that is left")
	g.Consistently(tr.faulted).WithTimeout(3*time.Second).ShouldNot(Receive(), "a retired replica is no fault")
	g.Expect(tr.targets.Close(t.Context(), "vol")).To(Succeed())
	g.Expect(tr.targets.Retire(t.Context(), "vol", "vol-c")).To(MatchError(ErrNotServed))
}
