package qemu

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net"
	"os"
	"strings"

	"golang.org/x/sys/unix"

	"pvbridge.io/vm-operator/internal/hypervisor"
)

// bridgePrefix is how Options.Network names a bridge: "bridge:<name>".
const bridgePrefix = "bridge:"

// bridgeOf is the bridge Options.Network names, "" for another network.
func bridgeOf(network string) string {
	name, ok := strings.CutPrefix(network, bridgePrefix)
	if !ok {
		return ""
	}
	return name
}

// tapName is the name of vm's tap device: "pvb" and 12 hex digits of the SHA-256 of its UID,
// within the kernel's 15 characters, the same at every start.
func tapName(vm hypervisor.VM) string {
	sum := sha256.Sum256([]byte(nicSeed(vm)))
	return "pvb" + hex.EncodeToString(sum[:6])
}

// openTap makes the tap device name, attached to bridge and up, and returns the file QEMU is
// handed (-netdev tap,fd=N). The tap is not persistent: it goes when its last holder closes it,
// QEMU's exit, so a VM leaves none behind however it ends. A tap of the name that another QEMU
// still holds (the VM runs) is EBUSY.
func openTap(name, bridge string) (*os.File, error) {
	tun, err := os.OpenFile("/dev/net/tun", os.O_RDWR, 0)
	if err != nil {
		return nil, fmt.Errorf("tap %s: %w", name, err)
	}
	ok := false
	defer func() {
		if !ok {
			_ = tun.Close()
		}
	}()
	ifr, err := unix.NewIfreq(name)
	if err != nil {
		return nil, fmt.Errorf("tap %s: %w", name, err)
	}
	ifr.SetUint16(unix.IFF_TAP | unix.IFF_NO_PI | unix.IFF_VNET_HDR)
	if err := unix.IoctlIfreq(int(tun.Fd()), unix.TUNSETIFF, ifr); err != nil {
		return nil, fmt.Errorf("make tap %s: %w", name, err)
	}
	link, err := net.InterfaceByName(name)
	if err != nil {
		return nil, fmt.Errorf("tap %s: %w", name, err)
	}
	s, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("tap %s: %w", name, err)
	}
	defer unix.Close(s)
	br, err := unix.NewIfreq(bridge)
	if err != nil {
		return nil, fmt.Errorf("bridge %s: %w", bridge, err)
	}
	br.SetUint32(uint32(link.Index)) //nolint:gosec // an interface index is positive and below 2^31
	if err := unix.IoctlIfreq(s, unix.SIOCBRADDIF, br); err != nil {
		return nil, fmt.Errorf("attach tap %s to bridge %s: %w", name, bridge, err)
	}
	if err := unix.IoctlIfreq(s, unix.SIOCGIFFLAGS, ifr); err != nil {
		return nil, fmt.Errorf("tap %s: %w", name, err)
	}
	ifr.SetUint16(ifr.Uint16() | unix.IFF_UP)
	if err := unix.IoctlIfreq(s, unix.SIOCSIFFLAGS, ifr); err != nil {
		return nil, fmt.Errorf("set tap %s up: %w", name, err)
	}
	ok = true
	return tun, nil
}
