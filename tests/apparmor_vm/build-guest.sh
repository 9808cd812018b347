#!/usr/bin/env bash
# Build (or reuse) the AppArmor test guest: Debian's own kernel plus a whole Debian root packed
# as an uncompressed initramfs. Everything goes to a cache OUTSIDE the work tree, keyed by the
# kernel package version and a hash of this script, so an unchanged guest is never rebuilt.
#
#   tests/apparmor_vm/build-guest.sh        prints the cache directory holding
#                                           vmlinuz, rootfs.cpio, kernel-release
#
# Needs root, apt (with lists), debootstrap, cpio, dpkg-deb, ssh-keygen and pip ($PYTHON, by
# default python3). The guest's root comes from debootstrap's default mirror; nothing here
# names one. Test scripts, /init and profiles are NOT in this image: run_vm.py packs them per run.
set -euo pipefail

cache_root=${FDP_VM_CACHE:-/var/cache/fuse-device-plugin/apparmor-vm}
suite=bookworm
# moto's S3 server runs inside the guest on 127.0.0.1 (s3fs's backend). moto[server] would add
# every other AWS service's dependencies (~180 MB more: cfn-lint, sympy, networkx); the server
# itself needs only moto's S3 extra plus flask and flask-cors.
moto_reqs=("moto[s3]==5.2.5" "flask>=3,<4" "flask-cors>=5")
guest_python=3.11   # bookworm's python3
# debootstrap's own resolver picks the real package for a virtual name (s3fs's "fuse" becomes
# fuse 2, which fuse3 and sshfs break), so it installs only the base; apt in the chroot adds
# the FUSE programs and servers.
base_packages=(apparmor kmod procps iproute2 util-linux strace python3)
packages=(fuse3 s3fs sshfs lxcfs bindfs fuse-overlayfs openssh-server openssh-client)

log() { printf '[build-guest] %s\n' "$*" >&2; }
apt_get() { apt-get -o DPkg::Lock::Timeout=900 -o APT::Sandbox::User=root "$@"; }

[ "$(id -u)" = 0 ] || { echo "build-guest.sh: needs root (debootstrap, device nodes)" >&2; exit 77; }

# Which kernel: the one linux-image-amd64 depends on.
kernel_pkg() { apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/{print $2; exit}'; }
kpkg=$(kernel_pkg)
if [ -z "$kpkg" ]; then
  log "apt lists have no linux-image-amd64: apt-get update"
  apt_get update -qq >&2
  kpkg=$(kernel_pkg)
fi
[ -n "$kpkg" ] || { echo "build-guest.sh: cannot resolve linux-image-amd64's kernel package" >&2; exit 1; }
kver=$(apt-cache policy "$kpkg" | awk '/Candidate:/{print $2}')
script_hash=$(sha256sum < "${BASH_SOURCE[0]}" | cut -c1-12)
key="${kpkg#linux-image-}_${kver}_${script_hash}"
dest="$cache_root/$key"

mkdir -p "$cache_root"
exec 9>"$cache_root/.lock"
flock 9   # one builder at a time; a second caller waits and then finds the result

if [ -f "$dest/BUILT" ]; then
  log "cached: $dest"
  echo "$dest"
  exit 0
fi

start=$(date +%s)
work="$cache_root/$key.tmp"
rm -rf "$work"
mkdir -p "$work" "$cache_root/debs"
root="$work/root"

log "kernel $kpkg $kver"
(cd "$work" && apt_get download -q "$kpkg=$kver" >&2)
dpkg-deb -x "$work"/linux-image-*.deb "$work/kernel"
krel=${kpkg#linux-image-}
cp "$work/kernel/boot/vmlinuz-$krel" "$work/vmlinuz"

log "debootstrap $suite minbase (+ ${base_packages[*]})"
debootstrap --variant=minbase --cache-dir="$cache_root/debs" \
  --include="$(IFS=,; echo "${base_packages[*]}")" "$suite" "$root" >"$work/debootstrap.log" 2>&1 \
  || { tail -n 30 "$work/debootstrap.log" >&2; exit 1; }

log "apt-get install in the guest root: ${packages[*]}"
mount -t proc proc "$root/proc"
trap 'umount "$root/proc" 2>/dev/null || true' EXIT
printf '#!/bin/sh\nexit 101\n' > "$root/usr/sbin/policy-rc.d"   # start no services in the chroot
chmod +x "$root/usr/sbin/policy-rc.d"
cp /etc/resolv.conf "$root/etc/resolv.conf"
{ chroot "$root" apt-get -q update && DEBIAN_FRONTEND=noninteractive chroot "$root" \
    apt-get -q -y --no-install-recommends install "${packages[@]}"; } >"$work/apt.log" 2>&1 \
  || { tail -n 30 "$work/apt.log" >&2; exit 1; }
rm -f "$root/usr/sbin/policy-rc.d" "$root/etc/resolv.conf"
umount "$root/proc"
trap - EXIT

log "fuse.ko and overlay.ko for $krel"
kmods="$work/kernel/lib/modules/$krel"
mkdir -p "$root/lib/modules/$krel/kernel/fs"
cp -a "$kmods/kernel/fs/fuse" "$kmods/kernel/fs/overlayfs" "$root/lib/modules/$krel/kernel/fs/"
cp "$kmods"/modules.order "$kmods"/modules.builtin "$kmods"/modules.builtin.modinfo "$root/lib/modules/$krel/"
depmod -b "$root" "$krel"

log "moto into /opt/moto"
"${PYTHON:-python3}" -m pip install --quiet --disable-pip-version-check --no-warn-conflicts \
  --target "$root/opt/moto" --python-version "$guest_python" --implementation cp \
  --platform manylinux2014_x86_64 --only-binary=:all: "${moto_reqs[@]}" >&2
rm -rf "$root/opt/moto/bin"   # console scripts point at the host's python; use python3 -m

log "ssh keys (root logs in to its own sshd on 127.0.0.1)"
mkdir -p "$root/root/.ssh"
chmod 700 "$root/root/.ssh"
ssh-keygen -q -t ed25519 -N '' -C fdp-guest -f "$root/root/.ssh/id_ed25519"
cp "$root/root/.ssh/id_ed25519.pub" "$root/root/.ssh/authorized_keys"
ls "$root"/etc/ssh/ssh_host_*_key >/dev/null   # openssh-server's postinst made the host keys

log "trim"
rm -rf "$root"/usr/share/{doc,man,info,locale,lintian} "$root"/var/cache/apt/* \
  "$root"/var/lib/apt/lists/* "$root"/var/cache/debconf/*-old
echo "$krel" > "$work/kernel-release"
echo fdp-guest > "$root/etc/hostname"

log "pack rootfs.cpio"
(cd "$root" && find . -mindepth 1 -print0 | LC_ALL=C sort -z | cpio --null -o -H newc --quiet) > "$work/rootfs.cpio"
rm -rf "$root" "$work/kernel" "$work"/linux-image-*.deb
touch "$work/BUILT"
rm -rf "$dest"
mv "$work" "$dest"
# Older builds (another kernel or another version of this script) are dead weight.
find "$cache_root" -mindepth 1 -maxdepth 1 -type d ! -name debs ! -name "$key" -exec rm -rf {} +
log "built $dest in $(( $(date +%s) - start ))s ($(du -sh "$dest/rootfs.cpio" | cut -f1) rootfs)"
echo "$dest"
