#!/usr/bin/env bash
# The qemu driver's test guest: hack/build-guest.sh with its default modules (virtio_pci,
# virtio_blk, virtio_net) and no extra programs.
exec "$(dirname "$0")/../../../../../hack/build-guest.sh" "$1"
