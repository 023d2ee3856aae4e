#!/usr/bin/env bash
# Builds the minimal Linux guest of the qemu driver's tests from Debian packages into OUTDIR:
#   vmlinux       the kernel of linux-image-amd64 as a raw ELF, booted through PVH (about 2.5 s
#                 to init under TCG, against 5.5 s for the compressed bzImage);
#   initramfs.gz  busybox-static, the virtio_pci and virtio_blk modules, and an /init that loads
#                 them, prints GUEST-READY and serves a shell on ttyS0.
# Nothing is installed: the packages are downloaded and unpacked. Needs apt (lists updated if the
# package is not found), dpkg-deb, xz and gzip. Does nothing if OUTDIR is complete; concurrent
# runs wait for each other. About 10 s and a 70 MB download the first time.
set -euo pipefail

out=${1:?usage: build-guest.sh OUTDIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
exec 9>"$out/.lock"
flock 9
if [ -s "$out/vmlinux" ] && [ -s "$out/initramfs.gz" ]; then
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
# lib/modules/$kver.
moddir=kpkg/lib/modules/$kver
closure() {
	awk -v want="$*" '
		BEGIN { n = split(want, w, " "); for (i = 1; i <= n; i++) todo[w[i]] = 1 }
		{
			sub(/:$/, "", $1); name = $1; sub(/.*\//, "", name); sub(/\.ko$/, "", name)
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
						d = f[i]; sub(/.*\//, "", d); sub(/\.ko$/, "", d); gsub(/-/, "_", d)
						if (!(d in todo)) { todo[d] = 1; changed = 1 }
					}
				}
			}
			for (m in todo) print path[m]
		}' "$moddir/modules.dep"
}

root=$PWD/root
mkdir -p "$root"/{bin,sbin,proc,sys,dev,tmp} "$root/lib/modules/$kver"
for ko in $(closure virtio_pci virtio_blk); do
	mkdir -p "$root/lib/modules/$kver/$(dirname "$ko")"
	cp "$moddir/$ko" "$root/lib/modules/$kver/$ko"
done
"$bb" depmod -b "$root" "$kver"
cp "$bb" "$root/bin/busybox"
for applet in sh mount cat echo ls sleep setsid cut modprobe; do
	ln -s busybox "$root/bin/$applet"
done
ln -s ../bin/busybox "$root/sbin/modprobe"
cat >"$root/init" <<'EOF'
#!/bin/sh
export PATH=/bin:/sbin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
# Loaded before any hot-plug, so that hot-plugged devices bind without udev.
for m in virtio_pci virtio_blk; do modprobe $m || echo "modprobe $m failed"; done
echo 1 >/proc/sys/kernel/printk
echo "GUEST-READY uptime=$(cut -d' ' -f1 /proc/uptime)"
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
