#!/usr/bin/env bash
# Installs the system packages pvbridge's lab and tests use, if they are missing.
# Debian packages only; runs as root (the lab needs root for mounts and loop devices anyway).
set -euo pipefail

# command (or absolute path) -> Debian package
declare -A need=(
	[mkfs.ext4]=e2fsprogs
	[mkfs.xfs]=xfsprogs
	[losetup]=util-linux
	[findmnt]=util-linux
	[jq]=jq
	# mgmt-csi's lvm and ndctl PMEM modes; `make images` copies them into the mgmt-csi image.
	[lvm]=lvm2
	[ndctl]=ndctl
	# The lab's containerd nodes: the OCI runtime, the CNI plugins, the DNAT to the apiservers,
	# and the busybox of the lab's test image.
	[runc]=runc
	[/usr/lib/cni/bridge]=containernetworking-plugins
	[iptables]=iptables
	[busybox]=busybox-static
	# vm-operator's qemu hypervisor driver and its tests (software emulation, no KVM needed).
	[qemu-system-x86_64]=qemu-system-x86
	# the local hypervisor's throttled disks and mgmt-csi's replicated volumes (replica servers,
	# targets).
	[qemu-storage-daemon]=qemu-system-common
	# the qemu driver's boot disk overlays; the node image's build (hack/build-node-image.sh).
	[qemu-img]=qemu-utils
	# the guest agent of the node image, which the qemu driver's test runs on the host.
	[qemu-ga]=qemu-guest-agent
	[mmdebstrap]=mmdebstrap
	# unpacks the test guest's kernel to a raw vmlinux for a fast PVH boot.
	[xz]=xz-utils
	# the lab VMs of an HA guest's control plane hold its endpoint with it (cluster-template-ha.yaml).
	[keepalived]=keepalived
)
missing=()
for cmd in "${!need[@]}"; do
	command -v "$cmd" >/dev/null 2>&1 || missing+=("${need[$cmd]}")
done
if [ ${#missing[@]} -eq 0 ]; then
	exit 0
fi
mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u)
echo "installing: ${missing[*]}"
if [ "$(id -u)" -ne 0 ]; then
	echo "install-deps: need root to install ${missing[*]}" >&2
	exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
