package local

import (
	"errors"
	"fmt"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
	"k8s.io/apimachinery/pkg/util/validation"

	"pvbridge.io/vm-operator/internal/hypervisor"
)

// errInvalid marks the errors of arguments that no retry can fix.
var errInvalid = errors.New("invalid argument")

// validateVM checks that the VM's namespace is a DNS label and its name a DNS subdomain, as the
// API server requires: neither can then contain a path separator or be "." or "..", so the VM
// directory is always a directory two levels below the root.
func validateVM(vm hypervisor.VM) error {
	if errs := validation.IsDNS1123Label(vm.Namespace); len(errs) > 0 {
		return fmt.Errorf("%w: VM namespace %q: %s", errInvalid, vm.Namespace, strings.Join(errs, "; "))
	}
	if errs := validation.IsDNS1123Subdomain(vm.Name); len(errs) > 0 {
		return fmt.Errorf("%w: VM name %q: %s", errInvalid, vm.Name, strings.Join(errs, "; "))
	}
	return nil
}

// validateSerial checks that serial has 1 to MaxSerialLength characters of [A-Za-z0-9_-]: it
// names files (virtio-<serial>), and QEMU would truncate a longer one.
func validateSerial(serial string) error {
	if serial == "" || len(serial) > hypervisor.MaxSerialLength {
		return fmt.Errorf("%w: serial %q must have 1 to %d characters", errInvalid, serial, hypervisor.MaxSerialLength)
	}
	for _, c := range []byte(serial) {
		if !isSerialChar(c) {
			return fmt.Errorf("%w: serial %q may only contain letters, digits, '_' and '-'", errInvalid, serial)
		}
	}
	return nil
}

func isSerialChar(c byte) bool {
	return 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '_' || c == '-'
}

// blockDevice returns the device number of the block device at the absolute path device,
// following symbolic links.
func blockDevice(device string) (uint64, error) {
	if !filepath.IsAbs(device) {
		return 0, fmt.Errorf("%w: device %q is not an absolute path", errInvalid, device)
	}
	var st unix.Stat_t
	if err := unix.Stat(device, &st); err != nil {
		return 0, fmt.Errorf("%w: device %s: %w", errInvalid, device, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFBLK {
		return 0, fmt.Errorf("%w: %s is not a block device", errInvalid, device)
	}
	return st.Rdev, nil
}
