package qemu

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"

	"pvbridge.io/vm-operator/internal/hypervisor"
)

// Files of an image in the host's image store, <ImageDir>/<name>/ (hack/build-node-image.sh
// writes them). Only the disk is required; with a kernel the VM boots it directly, with the
// image's initrd and command line.
const (
	imageDisk    = "disk.qcow2"
	imageKernel  = "vmlinuz"
	imageInitrd  = "initrd.img"
	imageCmdline = "cmdline"
)

// imageNameRE is VirtualMachine spec.image's pattern: a name, never a path.
var imageNameRE = regexp.MustCompile(`^[a-z0-9]([-a-z0-9._]*[a-z0-9])?$`)

// boot is what a VM boots: a qcow2 image it gets an overlay of, and a kernel to boot directly.
// Any may be empty.
type boot struct {
	image, kernel, initrd, append string
}

// bootOf is what vm boots: the image of the host's store that it names, or the driver's
// options when it names none. An image that is not in the store (or a store this host does not
// have) is ErrImageNotFound; the VM is not started with anything else.
func (d *Driver) bootOf(vm hypervisor.VM) (boot, error) {
	o := d.opts
	if vm.Image == "" {
		return boot{image: o.Image, kernel: o.Kernel, initrd: o.Initrd, append: o.Append}, nil
	}
	name := vm.Namespace + "/" + vm.Name
	if !imageNameRE.MatchString(vm.Image) {
		return boot{}, fmt.Errorf("VM %s: image name %q is not a name of the image store", name, vm.Image)
	}
	if o.ImageDir == "" {
		return boot{}, fmt.Errorf("%w: VM %s boots image %s, and this host has no image store (--qemu-image-dir)", hypervisor.ErrImageNotFound, name, vm.Image)
	}
	dir := filepath.Join(o.ImageDir, vm.Image)
	file := func(f string) (string, error) {
		path := filepath.Join(dir, f)
		if _, err := os.Stat(path); err != nil {
			if errors.Is(err, os.ErrNotExist) {
				return "", nil
			}
			return "", fmt.Errorf("VM %s: image %s: %w", name, vm.Image, err)
		}
		return path, nil
	}
	var b boot
	var err error
	if b.image, err = file(imageDisk); err != nil {
		return boot{}, err
	} else if b.image == "" {
		return boot{}, fmt.Errorf("%w: VM %s boots image %s, and %s has no %s", hypervisor.ErrImageNotFound, name, vm.Image, o.ImageDir, filepath.Join(vm.Image, imageDisk))
	}
	if b.kernel, err = file(imageKernel); err != nil || b.kernel == "" {
		return b, err
	}
	if b.initrd, err = file(imageInitrd); err != nil {
		return boot{}, err
	}
	cmdline, err := os.ReadFile(filepath.Join(dir, imageCmdline))
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return boot{}, fmt.Errorf("VM %s: image %s: %w", name, vm.Image, err)
	}
	b.append = strings.TrimSpace(string(cmdline))
	return b, nil
}
