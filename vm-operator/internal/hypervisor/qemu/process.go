package qemu

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"time"

	"k8s.io/klog/v2"

	"pvbridge.io/pkg/netns"
	"pvbridge.io/vm-operator/internal/hypervisor"
)

// exitWait is how long start waits for a QEMU whose monitor closed at once to be reaped.
const exitWait = 5 * time.Second

// process is a QEMU this driver started; done is closed once it has been reaped.
type process struct {
	pid  int
	done chan struct{}
}

// start runs QEMU for vm and waits until its QMP answers.
//
// The driver binds the QMP socket itself and hands the listening descriptor to QEMU: a client
// can connect at once (the connection waits in the backlog until QEMU accepts it), so nothing
// polls for the socket to appear, and a crash before QEMU is ready shows as a reset connection.
func (d *Driver) start(ctx context.Context, v *vmState, vm hypervisor.VM) error {
	b, err := d.bootOf(vm)
	if err != nil {
		return err
	}
	if err := d.checkMemory(v, vm); err != nil {
		return err
	}
	if err := os.MkdirAll(v.dir, 0o750); err != nil {
		return fmt.Errorf("VM %s: %w", v.name, err)
	}
	if err := makeBootDisk(ctx, v, b.image); err != nil {
		return err
	}
	sock := v.path(qmpSocket)
	if err := os.Remove(sock); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("VM %s: remove stale QMP socket: %w", v.name, err)
	}
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		return fmt.Errorf("VM %s: listen on QMP socket: %w", v.name, err)
	}
	l.SetUnlinkOnClose(false) // the socket is QEMU's now
	lf, err := l.File()
	_ = l.Close()
	if err != nil {
		return fmt.Errorf("VM %s: QMP socket: %w", v.name, err)
	}
	defer lf.Close()
	if err := writeSeed(v.path(seedDir), vm.Bootstrap); err != nil {
		return fmt.Errorf("VM %s: bootstrap data: %w", v.name, err)
	}
	out, err := os.OpenFile(v.path(logFile), os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o640)
	if err != nil {
		return fmt.Errorf("VM %s: %w", v.name, err)
	}
	defer out.Close()

	// Not CommandContext: the VM outlives this call, and in its own session it outlives the
	// agent too.
	cmd := exec.Command(d.opts.Binary, d.args(v, vm, b, 3)...)
	cmd.ExtraFiles = []*os.File{lf} // descriptor 3
	cmd.Stdout, cmd.Stderr = out, out
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := netns.Run(d.opts.NetNS, func() error {
		if br := bridgeOf(d.opts.Network); br != "" {
			tap, err := openTap(tapName(vm), br)
			if err != nil {
				return err
			}
			defer tap.Close()                            // QEMU holds it
			cmd.ExtraFiles = append(cmd.ExtraFiles, tap) // descriptor 4
		}
		return cmd.Start()
	}); err != nil {
		return fmt.Errorf("VM %s: start QEMU: %w", v.name, err)
	}
	p := &process{pid: cmd.Process.Pid, done: make(chan struct{})}
	go func() {
		_ = cmd.Wait()
		close(p.done)
	}()
	v.monMu.Lock()
	v.proc = p
	v.monMu.Unlock()
	if err := d.joinCgroup(v, p.pid); err != nil {
		// Not a VM charged to the agent and killed with it.
		_ = syscall.Kill(p.pid, syscall.SIGKILL)
		<-p.done
		v.forget()
		return err
	}
	klog.FromContext(ctx).V(2).Info("Started QEMU", "vm", v.name, "pid", p.pid, "accel", d.opts.Accel, "cgroup", d.cgroupOf(v))

	dialCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		select {
		case <-p.done:
			cancel()
		case <-dialCtx.Done():
		}
	}()
	if _, err := v.monitor(dialCtx); err != nil {
		// A QEMU that refuses its command line closes the connection it accepted as it exits:
		// its reaping, just after, says why.
		exited := time.NewTimer(exitWait)
		defer exited.Stop()
		select {
		case <-p.done:
			v.forget()
			return fmt.Errorf("VM %s: QEMU exited at start: %s", v.name, tail(v.path(logFile), 2048))
		case <-exited.C:
		}
		// QEMU may still come up; the next PowerOn finds it running.
		return fmt.Errorf("VM %s: wait for QMP: %w", v.name, err)
	}
	return nil
}

// args is QEMU's command line for vm booting b, with its QMP listening socket at descriptor
// qmpFD and, on a bridge, its tap at the next one.
func (d *Driver) args(v *vmState, vm hypervisor.VM, b boot, qmpFD int) []string {
	o := d.opts
	cpu := "max"
	if o.Accel == "kvm" {
		cpu = "host"
	}
	args := []string{
		"-name", "guest=" + vm.Namespace + "/" + vm.Name,
		"-machine", "q35",
		"-accel", o.Accel,
		"-cpu", cpu,
		"-smp", strconv.Itoa(cmp.Or(vm.CPUs, o.CPUs)),
		"-m", strconv.Itoa(cmp.Or(vm.MemoryMiB, o.MemoryMiB)) + "M",
		"-nodefaults", "-no-user-config",
		"-display", "none",
		"-pidfile", v.path(pidFile),
		"-chardev", fmt.Sprintf("socket,id=qmp,fd=%d,server=on,wait=off", qmpFD),
		"-mon", "chardev=qmp,mode=control",
		"-chardev", fmt.Sprintf("socket,id=serial0,path=%s,server=on,wait=off,logfile=%s",
			v.path(serialSocket), v.path(serialLog)),
		"-serial", "chardev:serial0",
		// Native PCIe hot-plug: unplug completes without a guest, and does not get lost when
		// requested while a guest boots (ACPI hot-plug, q35's default, has both problems).
		"-global", "ICH9-LPC.acpi-pci-hotplug-with-bridge-support=off",
	}
	if uuidRE.MatchString(vm.UID) {
		// The guest reads it as its SMBIOS system UUID.
		args = append(args, "-uuid", vm.UID)
	}
	// pcie.0 does not take hot-plugged devices: one root port per disk, eight per slot.
	ports := o.HotplugPorts
	if vm.Slots > 0 {
		ports = min(vm.Slots, hypervisor.MaxSlots)
	}
	for i := range ports {
		dev := fmt.Sprintf("pcie-root-port,id=%s,bus=pcie.0,chassis=%d,slot=%d,addr=0x%x.%d",
			portID(i), i+1, i+1, 2+i/8, i%8)
		if i%8 == 0 {
			dev += ",multifunction=on"
		}
		args = append(args, "-device", dev)
	}
	if b.kernel != "" {
		args = append(args, "-kernel", b.kernel)
		if b.initrd != "" {
			args = append(args, "-initrd", b.initrd)
		}
		if b.append != "" {
			args = append(args, "-append", b.append)
		}
	}
	if b.image != "" {
		disk := fmt.Sprintf("virtio-blk-pci,drive=%s,id=%s,bus=pcie.0", bootID, bootID)
		if b.kernel == "" {
			disk += ",bootindex=0" // the firmware boots it; a direct kernel boot has that index
		}
		args = append(args,
			"-blockdev", fmt.Sprintf("driver=qcow2,node-name=%s,file.driver=file,file.filename=%s", bootID, v.path(bootDisk)),
			"-device", disk)
	}
	switch {
	case o.Network == "user":
		args = append(args, "-netdev", "user,id="+nicID)
	case bridgeOf(o.Network) != "":
		args = append(args, "-netdev", fmt.Sprintf("tap,id=%s,fd=%d", nicID, qmpFD+1))
	}
	if o.Network != "" {
		// No option ROM (iPXE's efi-virtio.rom, another package): VMs boot their disk or kernel,
		// never the network, and QEMU refuses to start without a ROM it is told to load.
		args = append(args, "-device", fmt.Sprintf("virtio-net-pci,netdev=%s,id=%s,bus=pcie.0,mac=%s,romfile=", nicID, nicID, macFor(vm)))
	}
	// The guest agent's channel (qemu-guest-agent in the guest): the guest's addresses.
	args = append(args,
		"-device", "virtio-serial-pci,id=pvb-vser,bus=pcie.0",
		"-chardev", fmt.Sprintf("socket,id=qga0,path=%s,server=on,wait=off", v.path(guestAgentSocket)),
		"-device", "virtserialport,bus=pvb-vser.0,chardev=qga0,name=org.qemu.guest_agent.0")
	if vm.Bootstrap != nil {
		args = append(args,
			"-blockdev", fmt.Sprintf("driver=vvfat,node-name=%s,dir=%s,label=CIDATA,read-only=on", seedID, v.path(seedDir)),
			"-device", fmt.Sprintf("virtio-blk-pci,drive=%s,id=%s,bus=pcie.0", seedID, seedID))
	}
	return append(args, o.ExtraArgs...)
}

// makeBootDisk makes the VM's overlay of image unless it has one: a new VM's first power-on.
// The image is its backing file, read only; the overlay is written aside and renamed in, so
// that an interrupted call leaves no half-made disk to boot from.
func makeBootDisk(ctx context.Context, v *vmState, image string) error {
	if image == "" {
		return nil
	}
	disk := v.path(bootDisk)
	if _, err := os.Stat(disk); err == nil || !errors.Is(err, os.ErrNotExist) {
		return err
	}
	tmp := disk + ".new"
	out, err := exec.CommandContext(ctx, "qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", image, tmp).CombinedOutput()
	if err != nil {
		return fmt.Errorf("VM %s: make its boot disk over %s: %w: %s", v.name, image, err, bytes.TrimSpace(out))
	}
	return os.Rename(tmp, disk)
}

// macFor is the MAC address of vm's NIC: QEMU's locally administered prefix 52:54:00 and three
// bytes of the SHA-256 of its UID (of its name, when it has none), the same at every start.
func macFor(vm hypervisor.VM) string {
	sum := sha256.Sum256([]byte(nicSeed(vm)))
	return fmt.Sprintf("52:54:00:%02x:%02x:%02x", sum[0], sum[1], sum[2])
}

// nicSeed is what the names of vm's NIC derive from: its UID, or its name when it has none.
func nicSeed(vm hypervisor.VM) string { return cmp.Or(vm.UID, vm.Namespace+"/"+vm.Name) }

// checkMemory refuses to start vm when the host has less memory available (MemAvailable) than
// the VM boots with: a VM is never started smaller than it asks, and one that would make the
// host swap or kill is not started at all. QEMU allocates the guest's memory as the guest
// touches it, so the check is of the VM's whole size against what is free now.
func (d *Driver) checkMemory(v *vmState, vm hypervisor.VM) error {
	need := cmp.Or(vm.MemoryMiB, d.opts.MemoryMiB)
	data, err := os.ReadFile(d.meminfo)
	if err != nil {
		return fmt.Errorf("VM %s: read the host's available memory: %w", v.name, err)
	}
	for line := range strings.Lines(string(data)) {
		f := strings.Fields(line)
		if len(f) == 3 && f[0] == "MemAvailable:" && f[2] == "kB" {
			kib, err := strconv.ParseInt(f[1], 10, 64)
			if err != nil {
				return fmt.Errorf("VM %s: %s: %q: %w", v.name, d.meminfo, line, err)
			}
			if avail := int(kib >> 10); avail < need {
				return fmt.Errorf("%w: VM %s boots with %d MiB, the host has %d MiB available", hypervisor.ErrInsufficientMemory, v.name, need, avail)
			}
			return nil
		}
	}
	return fmt.Errorf("VM %s: no MemAvailable in %s", v.name, d.meminfo)
}

// writeSeed makes dir the NoCloud seed of b (readable by the agent's user only: it holds
// secrets), or removes it when the VM starts without bootstrap data.
func writeSeed(dir string, b *hypervisor.Bootstrap) error {
	if err := os.RemoveAll(dir); err != nil {
		return err
	}
	if b == nil {
		return nil
	}
	if err := os.Mkdir(dir, 0o700); err != nil {
		return err
	}
	for name, data := range map[string][]byte{"user-data": b.UserData, "meta-data": b.MetaData} {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o600); err != nil {
			return err
		}
	}
	return nil
}

var uuidRE = regexp.MustCompile(`^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$`)

// portID is the QOM id of the i-th hot-plug port; its bus has the same name.
func portID(i int) string { return fmt.Sprintf("pvb-port%d", i) }

// waitStopped waits until the QEMU behind mon has exited, and kills it (pid, if known) when it
// has not within StopTimeout.
func (d *Driver) waitStopped(ctx context.Context, v *vmState, mon *Monitor, pid int) error {
	v.monMu.Lock()
	proc := v.proc
	v.monMu.Unlock()
	if proc != nil {
		pid = proc.pid
	}
	exited := func(ctx context.Context) error {
		select {
		case <-mon.Done(): // QEMU closes QMP as it exits
		case <-ctx.Done():
			return ctx.Err()
		}
		if proc != nil {
			select {
			case <-proc.done:
				return nil
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		// Not our child (we restarted since we started it): poll the pid, which no event
		// reports on.
		for pid > 0 && !processGone(pid) {
			select {
			case <-time.After(20 * time.Millisecond):
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		return nil
	}

	wctx, cancel := context.WithTimeout(ctx, d.opts.StopTimeout)
	err := exited(wctx)
	cancel()
	if err == nil {
		return nil
	}
	if pid <= 0 || !isQEMUOf(pid, v) {
		return fmt.Errorf("QEMU has not exited: %w", err)
	}
	klog.FromContext(ctx).Info("Killing QEMU that did not exit", "vm", v.name, "pid", pid)
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil && !errors.Is(err, syscall.ESRCH) {
		return fmt.Errorf("kill QEMU %d: %w", pid, err)
	}
	// A killed process is gone at once; allow for reaping even if ctx has ended.
	kctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	if err := exited(kctx); err != nil {
		return fmt.Errorf("QEMU %d has not exited after SIGKILL: %w", pid, err)
	}
	return nil
}

// readPid reads QEMU's pid file; 0 if there is none.
func readPid(path string) int {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		return 0
	}
	return pid
}

// processGone reports whether pid has exited (a zombie counts as exited).
func processGone(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return true
	}
	// The state follows the command name, which is in parentheses and may contain anything.
	i := bytes.LastIndexByte(b, ')')
	fields := strings.Fields(string(b[i+1:]))
	return len(fields) == 0 || fields[0] == "Z" || fields[0] == "X"
}

// isQEMUOf reports whether pid is the QEMU of v (its command line names v's pid file), so that
// a reused pid is never killed.
func isQEMUOf(pid int, v *vmState) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	if err != nil {
		return false
	}
	for arg := range bytes.SplitSeq(b, []byte{0}) {
		if string(arg) == v.path(pidFile) {
			return true
		}
	}
	return false
}

// isNotServing reports whether a dial error means that no process listens on the socket.
func isNotServing(err error) bool {
	return errors.Is(err, os.ErrNotExist) || errors.Is(err, syscall.ECONNREFUSED)
}

// detectAccel picks kvm if the CPU has hardware virtualization and /dev/kvm exists, else tcg.
func detectAccel() string {
	f, err := os.Open("/proc/cpuinfo")
	if err != nil {
		return "tcg"
	}
	defer f.Close()
	if !hasVirtualizationFlag(f) {
		return "tcg"
	}
	if _, err := os.Stat("/dev/kvm"); err != nil {
		return "tcg"
	}
	return "kvm"
}

// hasVirtualizationFlag reports whether a /proc/cpuinfo lists vmx (Intel VT-x) or svm (AMD-V).
func hasVirtualizationFlag(cpuinfo io.Reader) bool {
	s := bufio.NewScanner(cpuinfo)
	for s.Scan() {
		key, value, ok := strings.Cut(s.Text(), ":")
		if !ok || strings.TrimSpace(key) != "flags" {
			continue
		}
		for _, flag := range strings.Fields(value) {
			if flag == "vmx" || flag == "svm" {
				return true
			}
		}
	}
	return false
}

// tail returns the last n bytes of a file, for error messages.
func tail(path string, n int64) string {
	f, err := os.Open(path)
	if err != nil {
		return err.Error()
	}
	defer f.Close()
	if st, err := f.Stat(); err == nil && st.Size() > n {
		_, _ = f.Seek(-n, io.SeekEnd)
	}
	b, _ := io.ReadAll(f)
	return strings.TrimSpace(string(b))
}
