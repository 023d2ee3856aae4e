#!/usr/bin/env bash
# Builds a minimal Linux guest for QEMU tests from Debian packages into OUTDIR:
#   vmlinux       the kernel of linux-image-amd64 as a raw ELF, booted through PVH (about 2.5 s
#                 to init under TCG, against 5.5 s for the compressed bzImage);
#   initramfs.gz  busybox-static, the kernel modules named (with what they depend on), the host
#                 programs named (with their libraries), and an /init that loads the modules,
#                 prints GUEST-READY, then runs /run.sh if an appended archive brought one
#                 (printing GUEST-DONE rc=<exit code> and powering off), else serves a shell on
#                 ttyS0.
# Usage: build-guest.sh OUTDIR [MODULE,...] [PROGRAM,...]
#   default modules: virtio_pci,virtio_blk,virtio_net; programs (found on this host's PATH): none.
# Nothing is installed: the kernel and busybox packages are downloaded and unpacked. Needs apt
# (lists updated if the package is not found), dpkg-deb, xz, gzip and ldd. Does nothing if OUTDIR
# is complete and was built from the same modules and programs; concurrent runs wait for each
# other. About 10 s and a 70 MB download the first
# time.
set -euo pipefail

out=${1:?usage: build-guest.sh OUTDIR [MODULE,...] [PROGRAM,...]}
modules=${2:-virtio_pci,virtio_blk,virtio_net}
programs=${3:-}
mkdir -p "$out"
out=$(cd "$out" && pwd)
exec 9>"$out/.lock"
flock 9
inputs="modules=$modules programs=$programs script=$(sha256sum "$0" | cut -c1-16)"
if [ -s "$out/vmlinux" ] && [ -s "$out/initramfs.gz" ] && [ "$(cat "$out/inputs" 2>/dev/null)" = "$inputs" ]; then
	exit 0
fi

work=$(mktemp -d "$out/build.XXXXXX")
trap 'rm -rf "$work"' EXIT
cd "$work"

kernel_pkg() { apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ { print $2; exit }'; }
pkg=$(kernel_pkg)
if [ -z "$pkg" ] || ! apt-get download -q "$pkg" busybox-static >/dev/null 2>&1; then
	apt-get update -qq
	pkg=$(kernel_pkg)
	apt-get download -q "$pkg" busybox-static >/dev/null
fi
kver=${pkg#linux-image-}
echo "build-guest: $pkg"

dpkg-deb -x linux-image-*.deb kpkg
dpkg-deb -x busybox-static_*.deb bb
bb=$PWD/bb/bin/busybox
# The package has no modules.dep: its postinst would run depmod.
"$bb" depmod -b "$PWD/kpkg" "$kver"

# The modules of the wanted ones and of everything they depend on, as paths below
# lib/modules/$kver. A wanted module built into the kernel needs nothing.
moddir=kpkg/lib/modules/$kver
closure() {
	awk -v want="$*" -v builtin="$moddir/modules.builtin" '
		BEGIN {
			while ((getline b < builtin) > 0) { sub(/.*\//, "", b); sub(/\.ko$/, "", b); gsub(/-/, "_", b); built[b] = 1 }
			n = split(want, w, " "); for (i = 1; i <= n; i++) if (!(w[i] in built)) todo[w[i]] = 1
		}
		{
			sub(/:$/, "", $1); name = $1; sub(/.*\//, "", name); sub(/\.ko(\.xz)?$/, "", name)
			gsub(/-/, "_", name); path[name] = $1; line[name] = $0
		}
		END {
			changed = 1
			while (changed) {
				changed = 0
				for (m in todo) {
					if (!(m in path)) { print "no module " m > "/dev/stderr"; exit 1 }
					k = split(line[m], f, " ")
					for (i = 2; i <= k; i++) {
						d = f[i]; sub(/.*\//, "", d); sub(/\.ko(\.xz)?$/, "", d); gsub(/-/, "_", d)
						if (!(d in todo)) { todo[d] = 1; changed = 1 }
					}
				}
			}
			for (m in todo) print path[m]
		}' "$moddir/modules.dep"
}

root=$PWD/root
mkdir -p "$root"/{bin,sbin,proc,sys,dev,tmp,run,etc} "$root/lib/modules/$kver"
for ko in $(closure ${modules//,/ }); do
	mkdir -p "$root/lib/modules/$kver/$(dirname "$ko")"
	cp "$moddir/$ko" "$root/lib/modules/$kver/$ko"
done
"$bb" depmod -b "$root" "$kver"
cp "$bb" "$root/bin/busybox"
for applet in sh mount umount cat echo ls sleep setsid cut modprobe mkdir poweroff sync dd rm; do
	ln -s busybox "$root/bin/$applet"
done
ln -s ../bin/busybox "$root/sbin/modprobe"

# Host programs, with the shared libraries and the loader they need, at the same paths. A
# program that is a symlink (lvcreate -> lvm) stays one.
copy() {
	[ -e "$root$1" ] && return
	mkdir -p "$root$(dirname "$1")"
	cp -L "$1" "$root$1"
}
for p in ${programs//,/ }; do
	path=$(command -v "$p") || { echo "build-guest: program $p not found on this host" >&2; exit 1; }
	real=$(readlink -f "$path")
	copy "$real"
	if [ "$real" != "$path" ]; then
		mkdir -p "$root$(dirname "$path")"
		ln -sf "$real" "$root$path"
	fi
	for lib in $(ldd "$real" 2>/dev/null | awk '/=> \// { print $3 } /^[ \t]*\// { print $1 }'); do
		copy "$lib"
	done
done
cat >"$root/init" <<EOF
#!/bin/sh
export PATH=/bin:/sbin:/usr/bin:/usr/sbin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mount -t tmpfs run /run
# Loaded before any hot-plug, so that hot-plugged devices bind without udev.
for m in ${modules//,/ }; do modprobe \$m || echo "modprobe \$m failed"; done
echo 1 >/proc/sys/kernel/printk
echo "GUEST-READY uptime=\$(cut -d' ' -f1 /proc/uptime)"
if [ -x /run.sh ]; then
	/run.sh </dev/ttyS0 >/dev/ttyS0 2>&1
	echo "GUEST-DONE rc=\$?" >/dev/ttyS0
	sync
	poweroff -f
fi
while true; do setsid sh -c 'exec sh </dev/ttyS0 >/dev/ttyS0 2>&1'; done
EOF
chmod 755 "$root/init"
(cd "$root" && find . -print0 | "$bb" cpio -o -H newc -0 2>/dev/null) | gzip -1 >initramfs.gz

# vmlinuz is a bzImage around an XZ stream; unpack the raw ELF for PVH boot. busybox unxz
# cannot (the BCJ filter), xz can; it complains about the trailing data, hence --single-stream.
vmlinuz=kpkg/boot/vmlinuz-$kver
off=$(LC_ALL=C grep -obUaP '\xfd7zXZ\x00' "$vmlinuz" | head -1 | cut -d: -f1)
{ tail -c +$((off + 1)) "$vmlinuz" || true; } | xz -dc --single-stream >vmlinux

mv initramfs.gz "$out/initramfs.gz"
mv vmlinux "$out/vmlinux"
echo "$kver" >"$out/kernel-version"
echo "$inputs" >"$out/inputs"
