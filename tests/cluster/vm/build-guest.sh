#!/usr/bin/env bash
# Build (or reuse) the cluster stage's VM node guest (issue 45): Debian's own 6.12 kernel
# (AppArmor enforcing, cgroup v2 only) and a Debian root packed as an uncompressed
# initramfs. The Kubernetes parts (kubelet, containerd, runc, CNI) are NOT in it: the node
# reads the stage's stack over 9p at the host's paths (tests/cluster/vm_node.py), so one
# guest serves every build of the stack. Cached outside the work tree, keyed by the kernel
# package's version and a hash of this script.
#
#   tests/cluster/vm/build-guest.sh     prints the cache directory holding
#                                       vmlinuz, rootfs.cpio, kernel-release
#
# Needs root, apt (with lists), debootstrap, cpio, dpkg-deb and kmod (depmod, modprobe).
set -euo pipefail

cache_root=${FDP_VM_NODE_CACHE:-/var/cache/fuse-device-plugin/vm-node}
suite=bookworm
# What a node image has for the kubelet and containerd to run: mount and nsenter
# (util-linux), ip, the AppArmor tools (apparmor_parser is the installer's, in its image;
# aa-status is the evidence), libseccomp for runc, iptables for the kubelet's probes.
base_packages=(apparmor kmod procps iproute2 util-linux mount libseccomp2 iptables
               ca-certificates)
# The modules a node needs that Debian builds as modules: FUSE, the overlay snapshotter,
# the NIC, 9p (the host's stack), the pods' bridge and veths, and the disk holding
# containerd's root with the images already in it (ext4 on virtio-blk).
modules=(fuse overlay virtio_net 9pnet_virtio 9p bridge veth virtio_blk ext4)

log() { printf '[vm-node guest] %s\n' "$*" >&2; }
apt_get() { apt-get -o DPkg::Lock::Timeout=900 -o APT::Sandbox::User=root "$@"; }

[ "$(id -u)" = 0 ] || { echo "build-guest.sh: needs root (debootstrap, device nodes)" >&2; exit 77; }

# Which kernel: the newest Linux 6.12 image Debian 12 ships (bookworm's LTS kernel line
# beside 6.1), as the unsigned package holding vmlinuz and the modules.
kernel_pkg() {
  apt-cache search --names-only '^linux-image-6\.12\.[0-9]+\+deb12-amd64-unsigned$' 2>/dev/null \
    | awk '{print $1}' | sort -V | while read -r pkg; do
      apt-cache policy "$pkg" | awk '/Candidate: [0-9]/ {found = 1} END {exit !found}' \
        && echo "$pkg"
    done | tail -n 1
}
kpkg=$(kernel_pkg)
if [ -z "$kpkg" ]; then
  log "apt lists have no Linux 6.12 image: apt-get update"
  apt_get update -qq >&2
  kpkg=$(kernel_pkg)
fi
[ -n "$kpkg" ] || { echo "build-guest.sh: no linux-image-6.12.*-amd64-unsigned in apt" >&2; exit 1; }
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
krel=${krel%-unsigned}
cp "$work/kernel/boot/vmlinuz-$krel" "$work/vmlinuz"

log "debootstrap $suite minbase (+ ${base_packages[*]})"
debootstrap --variant=minbase --cache-dir="$cache_root/debs" \
  --include="$(IFS=,; echo "${base_packages[*]}")" "$suite" "$root" >"$work/debootstrap.log" 2>&1 \
  || { tail -n 30 "$work/debootstrap.log" >&2; exit 1; }

log "modules for $krel: ${modules[*]} and what they depend on"
kmods="$work/kernel/lib/modules/$krel"
depmod -b "$work/kernel" "$krel"   # the package ships no modules.dep: its postinst makes it
for module in "${modules[@]}"; do
  modprobe -d "$work/kernel" -S "$krel" --show-depends "$module" | awk '$1 == "insmod" {print $2}'
done | sort -u | while read -r path; do
  rel=${path#"$work/kernel"}
  mkdir -p "$root$(dirname "$rel")"
  cp "$path" "$root$rel"
done
cp "$kmods"/modules.order "$kmods"/modules.builtin "$kmods"/modules.builtin.modinfo \
  "$root/lib/modules/$krel/"
depmod -b "$root" "$krel"

log "trim"
rm -rf "$root"/usr/share/{doc,man,info,locale,lintian} "$root"/var/cache/apt/* \
  "$root"/var/lib/apt/lists/* "$root"/var/cache/debconf/*-old
echo "$krel" > "$work/kernel-release"

log "pack rootfs.cpio"
(cd "$root" && find . -mindepth 1 -print0 | LC_ALL=C sort -z | cpio --null -o -H newc --quiet) > "$work/rootfs.cpio"
rm -rf "$root" "$work/kernel" "$work"/linux-image-*.deb
touch "$work/BUILT"
rm -rf "$dest"
mv "$work" "$dest"
find "$cache_root" -mindepth 1 -maxdepth 1 -type d ! -name debs ! -name disks ! -name "$key" \
  -exec rm -rf {} +
log "built $dest in $(( $(date +%s) - start ))s ($(du -sh "$dest/rootfs.cpio" | cut -f1) rootfs)"
echo "$dest"
