#!/usr/bin/env bash
# Builds the node image of pvbridge's QEMU VirtualMachines (issue 49) into the image store STORE
# (the qemu driver's --qemu-image-dir), as the image node-<kubelet version> (node-v1.37.2): the
# name a cluster template's PVBridgeMachineTemplate gives from its Kubernetes version. From Debian
# packages and the pinned binaries of the tool cache, without a container engine, it writes
# STORE/node-<version>/:
#   disk.qcow2            the root filesystem (ext4, label "root", compressed): Debian bookworm
#                         with systemd, udev, cloud-init (NoCloud), the QEMU guest agent (which
#                         reports the VM's addresses), runc, the CNI plugins, and
#                         the tool cache's containerd, kubelet and kubeadm, enabled as units the
#                         way kubeadm expects them. A VM boots a copy-on-write overlay of it;
#   vmlinuz, initrd.img,  Debian's cloud kernel, its initramfs and its command line
#   cmdline               (root=LABEL=root, the console on the serial port), a direct boot;
#   manifest              what the image is: every Debian package with its version, and the
#                         SHA-256 of each binary from the tool cache.
# Reproducible: the same packages and binaries make the same bytes (every file dated
# SOURCE_DATE_EPOCH, the filesystem's UUID, hash seed and times fixed), so that an image is
# known by its manifest and its SHA-256.
# Usage: build-node-image.sh STORE
# Needs root, mmdebstrap, e2fsprogs and qemu-img (hack/install-deps.sh) and the tool cache
# ($PVBRIDGE_BIN, default ${XDG_CACHE_HOME:-~/.cache}/pvbridge/bin: `make tools`). Does
# nothing when the image is complete and was built by this script from the same binaries; the
# Debian packages are whatever the mirror serves that day (the manifest says which).
set -euo pipefail
store=${1:?usage: build-node-image.sh STORE}
bin=${PVBRIDGE_BIN:-${XDG_CACHE_HOME:-$HOME/.cache}/pvbridge/bin}
binaries="containerd containerd-shim-runc-v2 kubelet kubeadm"
name=node-$("$bin/kubelet" --version | awk '{print $2}')
out=$store/$name
mkdir -p "$out"
out=$(cd "$out" && pwd)
exec 9>"$out/.lock"
flock 9
inputs="script=$(sha256sum "$0" | cut -c1-16)"
for b in $binaries; do
	inputs+=" $b=$(sha256sum "$bin/$b" | cut -c1-16)"
done
if [ -s "$out/disk.qcow2" ] && [ -s "$out/vmlinuz" ] && [ -s "$out/initrd.img" ] && [ -s "$out/cmdline" ] && [ "$(cat "$out/inputs" 2>/dev/null)" = "$inputs" ]; then
	echo "build-node-image: $name is built"
	exit 0
fi
work=$(mktemp -d "$out/build.XXXXXX")
trap 'rm -rf "$work"' EXIT
tree=$work/tree
start=$(date +%s)
# 2026-01-01T00:00:00Z unless the caller says otherwise: every file's time, the filesystem's too.
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-1767225600}

# The root filesystem. cloud-init configures the NIC with ifupdown and DHCP (bookworm's
# cloud-init renders eni); the kernel's initramfs comes from initramfs-tools.
packages=(
	systemd-sysv udev dbus kmod linux-image-cloud-amd64 initramfs-tools
	cloud-init cloud-guest-utils ifupdown isc-dhcp-client qemu-guest-agent
	runc containernetworking-plugins iptables iproute2 conntrack ethtool socat
	ca-certificates e2fsprogs xfsprogs util-linux mount procps netbase
	keepalived
)
mmdebstrap --mode=root --variant=minbase --quiet \
	--include="$(IFS=,; echo "${packages[*]}")" \
	--dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
	--dpkgopt='path-exclude=/usr/share/locale/*' \
	bookworm "$tree" http://deb.debian.org/debian

# Python's byte code unchecked: with SOURCE_DATE_EPOCH set, Debian compiled it "checked" (each
# import reads and hashes its source, the reproducible default), which cloud-init's four
# processes pay for under TCG at every boot; unchecked byte code is as reproducible, and a
# package's upgrade compiles its own again.
chroot "$tree" python3 -m compileall -q -f --invalidation-mode unchecked-hash /usr/lib/python3/dist-packages /usr/lib/python3.11 >/dev/null

for b in $binaries; do
	install -m 0755 "$bin/$b" "$tree/usr/local/bin/$b"
done
# containerd: systemd's cgroup driver, as kubelet's (the guest runs cgroup v2 under systemd), and
# registry hosts (mirrors, credentials) from /etc/containerd/certs.d, where containerd's
# documentation has them and a cluster template's files can put them.
mkdir -p "$tree/etc/containerd"
cat >"$tree/etc/containerd/config.toml" <<'EOF'
version = 3
[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
  SystemdCgroup = true
[plugins.'io.containerd.cri.v1.runtime'.cni]
  bin_dirs = ['/usr/lib/cni']
[plugins.'io.containerd.cri.v1.images'.registry]
  config_path = '/etc/containerd/certs.d'
EOF
cat >"$tree/etc/systemd/system/containerd.service" <<'EOF'
[Unit]
Description=containerd container runtime
After=network.target local-fs.target

[Service]
ExecStartPre=-/sbin/modprobe overlay
ExecStart=/usr/local/bin/containerd
Type=notify
Delegate=yes
KillMode=process
Restart=always
RestartSec=5
LimitNPROC=infinity
LimitCORE=infinity
TasksMax=infinity
OOMScoreAdjust=-999

[Install]
WantedBy=multi-user.target
EOF
# kubelet as kubeadm's packages install it, but not started until `kubeadm join` has written
# its config (which then restarts it): the packages' kubelet fails and restarts every 10 s until
# then, seconds of an emulated CPU each time under TCG.
cat >"$tree/etc/systemd/system/kubelet.service" <<'EOF'
[Unit]
Description=kubelet: The Kubernetes Node Agent
ConditionPathExists=/var/lib/kubelet/config.yaml
Wants=network-online.target containerd.service
After=network-online.target containerd.service

[Service]
ExecStart=/usr/local/bin/kubelet
Restart=always
StartLimitInterval=0
RestartSec=10

[Install]
WantedBy=multi-user.target
EOF
mkdir -p "$tree/etc/systemd/system/kubelet.service.d"
cat >"$tree/etc/systemd/system/kubelet.service.d/10-kubeadm.conf" <<'EOF'
[Service]
Environment="KUBELET_KUBECONFIG_ARGS=--bootstrap-kubeconfig=/etc/kubernetes/bootstrap-kubelet.conf --kubeconfig=/etc/kubernetes/kubelet.conf"
Environment="KUBELET_CONFIG_ARGS=--config=/var/lib/kubelet/config.yaml"
EnvironmentFile=-/var/lib/kubelet/kubeadm-flags.env
EnvironmentFile=-/etc/default/kubelet
ExecStart=
ExecStart=/usr/local/bin/kubelet $KUBELET_KUBECONFIG_ARGS $KUBELET_CONFIG_ARGS $KUBELET_KUBEADM_ARGS $KUBELET_EXTRA_ARGS
EOF
for unit in containerd kubelet; do
	ln -sf "/etc/systemd/system/$unit.service" "$tree/etc/systemd/system/multi-user.target.wants/$unit.service"
done
# keepalived holds an HA control plane's endpoint (cluster-template-ha.yaml), which starts it
# once its configuration is written; not at boot, where it would find none.
rm -f "$tree/etc/systemd/system/multi-user.target.wants/keepalived.service"
printf 'overlay\nbr_netfilter\n' >"$tree/etc/modules-load.d/kubernetes.conf"
printf 'net.ipv4.ip_forward = 1\nnet.bridge.bridge-nf-call-iptables = 1\n' >"$tree/etc/sysctl.d/90-kubernetes.conf"
# cloud-init reads only the NoCloud seed (the qemu driver's CIDATA disk): no metadata service
# is probed for minutes.
# Its hostname resolves (/etc/hosts, kubeadm's preflight looks it up), and no locale is generated
# (seconds of a first boot under TCG, for a node that needs none).
# Its modules are those of what Cluster API's kubeadm bootstrap writes (bootcmd, write_files,
# disk_setup, fs_setup, mounts, users, ntp, runcmd) and the first boot's own (hostname, host
# keys, the root's growth): Debian's list adds grub, apt, snap, byobu and the rest, whose loading
# and running cost an emulated CPU seconds at every first boot (grub-dpkg alone 5 s).
cat >"$tree/etc/cloud/cloud.cfg.d/90-pvbridge.cfg" <<'EOF'
datasource_list: [ NoCloud, None ]
manage_etc_hosts: true
locale: false
cloud_init_modules: [migrator, seed_random, bootcmd, write-files, growpart, resizefs, disk_setup, mounts, set_hostname, update_hostname, update_etc_hosts, ca-certs, users-groups, ssh]
cloud_config_modules: [ntp, runcmd]
cloud_final_modules: [write-files-deferred, scripts-vendor, scripts-per-once, scripts-per-boot, scripts-per-instance, scripts-user, final-message, power-state-change]
EOF
printf 'LABEL=root / ext4 defaults,discard 0 1\n' >"$tree/etc/fstab"
# Each VM is a new machine: its own machine ID, host keys, hostname and resolver (the last two
# mmdebstrap copied from this host) at first boot. The resolver's file is there, empty, until
# DHCP names a server: the kubelet gives every pod's sandbox the node's, and fails without one.
: >"$tree/etc/machine-id"
rm -f "$tree"/etc/ssh/ssh_host_* "$tree/etc/hostname"
: >"$tree/etc/resolv.conf"

cp "$(ls "$tree"/boot/vmlinuz-* | head -1)" "$work/vmlinuz"
cp "$(ls "$tree"/boot/initrd.img-* | head -1)" "$work/initrd.img"
{
	chroot "$tree" dpkg-query -W -f '${Package} ${Version}\n'
	for b in $binaries; do
		echo "$b $(sha256sum "$bin/$b" | cut -d' ' -f1)"
	done
} >"$work/manifest"
rm -rf "$tree/boot"/vmlinuz-* "$tree/boot"/initrd.img-* "$tree/var/cache/apt"/*.bin "$tree/var/lib/apt/lists"/*_*
# Reproducible bytes: every file dated SOURCE_DATE_EPOCH (what this script wrote is newer), a
# fixed UUID and directory hash seed, mke2fs's own clock fixed; mke2fs copies each inode's
# ctime from the tree, which only debugfs can set.
find "$tree" -newermt "@$SOURCE_DATE_EPOCH" -print0 | xargs -0r touch --no-dereference --date="@$SOURCE_DATE_EPOCH"
uuid=6e6f6465-7076-6272-6964-676500000001
E2FSPROGS_FAKE_TIME=$SOURCE_DATE_EPOCH mkfs.ext4 -q -L root -U "$uuid" -E hash_seed="$uuid" -d "$tree" "$work/root.img" 2G
stamp=$(date -u -d "@$SOURCE_DATE_EPOCH" +%Y%m%d%H%M%S)
(cd "$tree" && find . -mindepth 1 -printf '%P\n') | awk -v t="$stamp" '
	{ gsub(/"/, "\\\""); for (f = 0; f < 3; f++) printf "sif \"/%s\" %s %s\n", $0, (f == 0 ? "ctime" : f == 1 ? "atime" : "crtime"), t }
	END { printf "sif / ctime %s\nsif / atime %s\nsif / crtime %s\n", t, t, t }' >"$work/times"
E2FSPROGS_FAKE_TIME=$SOURCE_DATE_EPOCH debugfs -w -f "$work/times" "$work/root.img" >/dev/null 2>"$work/debugfs.log" ||
	{ cat "$work/debugfs.log" >&2; exit 1; }
qemu-img convert -c -O qcow2 "$work/root.img" "$work/disk.qcow2"
echo "root=LABEL=root ro console=ttyS0 net.ifnames=0" >"$work/cmdline"
mv "$work/vmlinuz" "$work/initrd.img" "$work/cmdline" "$work/manifest" "$work/disk.qcow2" "$out/"
echo "$inputs" >"$out/inputs"
echo "build-node-image: $name: $(wc -l <"$out/manifest") packages and binaries, $(du -m "$out/disk.qcow2" | cut -f1) MiB compressed, in $(($(date +%s) - start)) s"
