#!/bin/bash
# The images the cluster stage runs, built with Debian's podman (no registry is reachable,
# so no base image is pulled):
#   - a Debian base: debootstrap --variant=minbase with python3, pip and venv, standing in
#     for python:3.11-slim and debian:bookworm-slim;
#   - the plugin image: the repository's Dockerfile, unchanged, with only its documented
#     PYTHON_IMAGE build argument pointing at that base;
#   - the example tool images: manifests/examples/Dockerfile and broker mode's non-root
#     sshfs image, manifests/broker/examples/Dockerfile, unchanged (their
#     `FROM debian:bookworm-slim` finds the base under that name in our private storage);
#   - the servers the examples talk to (sshd, moto): tests/cluster/servers.Dockerfile.
# Each is tagged with a hash of its inputs and kept in a private podman storage under
# $FDP_CACHE/cluster/podman, so nothing is rebuilt until an input changes. All of them go
# into one docker archive (shared layers once) for `ctr images import`; images.env names it.
#
#   images.sh            # the cluster stage's images (above)
#   images.sh multiarch  # the plugin image for linux/amd64 and linux/arm64 and one manifest
#                        # list of both (multiarch.env names them); arm64's base is
#                        # debootstrapped and its Dockerfile steps run under qemu-user
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
FDP_CACHE="${FDP_CACHE:-/var/cache/fuse-device-plugin}"
OUT="$FDP_CACHE/cluster/images"
MIRROR="${FDP_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
SUITE=bookworm
INCLUDE=python3,python3-pip,python3-venv,ca-certificates
# The machine's CA bundle, bind-mounted into every build step (pip reaches PyPI through
# whatever TLS the machine trusts) and never copied into an image.
CA=/etc/ssl/certs/ca-certificates.crt
PODMAN=(podman --root "$FDP_CACHE/cluster/podman" --runroot /run/fuse-device-plugin-cluster/podman
        --storage-driver overlay --cgroup-manager cgroupfs --events-backend file)

log() { echo "[images $(date +%H:%M:%S)] $*" >&2; }
key() { sha256sum | cut -c1-12; }

# Hash of files (paths relative to the repo) and extra words: the tag of an image.
inputs_key() {
    local words="$1"; shift
    { echo "$words"; (cd "$REPO" && find "$@" -type f ! -path '*/__pycache__/*' ! -name '*.pyc' \
        | LC_ALL=C sort | xargs sha256sum); } | key
}

have_image() { "${PODMAN[@]}" image exists "$1"; }

# The architecture podman and Debian call this machine's.
NATIVE="$(dpkg --print-architecture)"

# emulate ARCH: let this kernel run ARCH's programs through Debian's qemu-user-static.
# Without systemd nothing registers them at boot, so this does what systemd-binfmt would:
# binfmt_misc mounted, and qemu's own binfmt.d line written to it (flag F: the kernel opens
# the interpreter now, so it works inside containers and chroots, which lack it).
emulate() {
    local arch="$1" name conf dir=/proc/sys/fs/binfmt_misc
    [ "$arch" = "$NATIVE" ] && return 0
    case "$arch" in arm64) name=qemu-aarch64 ;; amd64) name=qemu-x86_64 ;; *) name="qemu-$arch" ;; esac
    conf="/usr/lib/binfmt.d/$name.conf"
    [ -f "$conf" ] || { log "$conf not found: apt-get install qemu-user-static"; exit 1; }
    mountpoint -q "$dir" || mount -t binfmt_misc binfmt_misc "$dir"
    if [ ! -e "$dir/$name" ]; then
        log "registering $name with binfmt_misc"
        cat "$conf" > "$dir/register"
    fi
    [ "$(head -n1 "$dir/$name")" = enabled ] || { log "$dir/$name is disabled"; exit 1; }
    # Registered by someone else without F, the interpreter is looked up inside each
    # container's root at exec, where it is not.
    grep -q '^flags: .*F' "$dir/$name" || {
        log "$dir/$name lacks the F flag (containers cannot find its interpreter):" \
            "echo -1 > $dir/$name, then run this again"; exit 1; }
}

# base_image ARCH: the Debian base for ARCH, made once; prints its ref.
base_image() {
    local arch="$1" k ref rootfs words
    words="debootstrap --variant=minbase --include=$INCLUDE $SUITE $MIRROR"
    # This machine's base keeps the key it always had (its cache stays warm).
    [ "$arch" = "$NATIVE" ] || words="$words --arch $arch"
    k="$(echo "$words" | key)"
    ref="localhost/fdp-cluster/debian-base:$k"
    if ! have_image "$ref"; then
        emulate "$arch"
        rootfs="$(mktemp -d "$OUT/rootfs-$arch.XXXXXX")"
        log "debootstrap $SUITE for $arch (minbase + $INCLUDE)"
        local t0=$SECONDS
        debootstrap --arch "$arch" --variant=minbase --include="$INCLUDE" "$SUITE" "$rootfs" \
            "$MIRROR" >&2
        # Debian marks its Python externally managed (PEP 668); the official python image
        # does not, and the Dockerfile's `pip install` relies on that.
        rm -f "$rootfs"/usr/lib/python3*/EXTERNALLY-MANAGED
        rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/archives/*.deb
        tar -C "$rootfs" -c . | "${PODMAN[@]}" import --arch "$arch" --os linux \
            --change 'CMD ["python3"]' - "$ref" >&2
        rm -rf "$rootfs"
        log "base $ref ($arch) in $((SECONDS - t0))s"
    fi
    echo "$ref"
}

# build NAME TAG CONTEXT [podman build args...]: build unless cached; prints the ref.
build() {
    local name="$1" tag="$2" context="$3"; shift 3
    local ref="localhost/$name:$tag"
    if ! have_image "$ref"; then
        log "building $ref"
        local t0=$SECONDS
        "${PODMAN[@]}" build --network host --pull=never --volume "$CA:$CA:ro" \
            -t "$ref" "$@" "$context" >&2
        log "built $ref in $((SECONDS - t0))s"
    fi
    echo "$ref"
}

# plugin_image ARCH: the plugin image from the Dockerfile, unchanged, for ARCH on its base.
plugin_image() {
    local arch="$1" base bkey
    base="$(base_image "$arch")"
    bkey="${base##*:}"
    emulate "$arch"
    build fuse-device-plugin "$(inputs_key "$bkey" Dockerfile pyproject.toml README.md fuse_plugin)" \
        "$REPO" --platform "linux/$arch" --build-arg "PYTHON_IMAGE=$base" -f "$REPO/Dockerfile"
}

# previous_image BASE: the previous release's plugin image, built by its own Dockerfile
# from its source as released (tests/cluster/charts/*-src.tar.gz), for the Helm upgrade
# from that release; prints its ref.
previous_image() {
    local base="$1" src dir
    src="$(ls "$HERE"/charts/fuse-device-plugin-*-src.tar.gz)"
    dir="$OUT/previous-src"
    rm -rf "$dir"
    mkdir -p "$dir"
    tar -xzf "$src" -C "$dir" --strip-components=1
    build fuse-device-plugin "previous-$(key < "$src")-${base##*:}" "$dir" \
        --build-arg "PYTHON_IMAGE=$base" -f "$dir/Dockerfile"
}

# The cluster stage's images, all for this machine.
cluster_images() {
    local base bkey plugin previous ref servers tar
    base="$(base_image "$NATIVE")"
    bkey="${base##*:}"
    # manifests/examples/Dockerfile starts FROM debian:bookworm-slim.
    "${PODMAN[@]}" tag "$base" docker.io/library/debian:bookworm-slim
    plugin="$(plugin_image "$NATIVE")"
    previous="$(previous_image "$base")"
    env_lines=("PLUGIN_IMAGE=$plugin" "PREVIOUS_PLUGIN_IMAGE=$previous")
    refs=("$plugin" "$previous")
    for pkg in s3fs sshfs lxcfs; do
        ref="$(build "fuse-example-$pkg" \
            "$(inputs_key "$bkey $pkg" manifests/examples/Dockerfile)" "$REPO/manifests/examples" \
            --build-arg "PACKAGE=$pkg")"
        env_lines+=("EXAMPLE_${pkg^^}_IMAGE=$ref")
        refs+=("$ref")
    done
    # Broker mode's restricted examples run as uid 1000: their image, from the Dockerfile
    # beside them (FROM debian:bookworm-slim too), unchanged.
    ref="$(build fuse-example-sshfs-nonroot \
        "$(inputs_key "$bkey" manifests/broker/examples/Dockerfile)" "$REPO/manifests/broker/examples")"
    env_lines+=("EXAMPLE_SSHFS_NONROOT_IMAGE=$ref")
    refs+=("$ref")
    # The rootless-build example's image (buildah + fuse-overlayfs), its Dockerfile unchanged.
    ref="$(build fuse-example-buildah \
        "$(inputs_key "$bkey" manifests/broker/examples/buildah.Dockerfile)" \
        "$REPO/manifests/broker/examples" -f "$REPO/manifests/broker/examples/buildah.Dockerfile")"
    env_lines+=("EXAMPLE_BUILDAH_IMAGE=$ref")
    refs+=("$ref")
    # The rootless-build preset's image (buildah, podman, runc, busybox-static), unchanged.
    ref="$(build fuse-example-rootless-build \
        "$(inputs_key "$bkey" manifests/examples/rootless-build/Dockerfile)" \
        "$REPO/manifests/examples/rootless-build")"
    env_lines+=("EXAMPLE_ROOTLESS_BUILD_IMAGE=$ref")
    refs+=("$ref")
    servers="$(build fdp-cluster-servers \
        "$(inputs_key "$bkey" tests/cluster/servers.Dockerfile)" "$HERE" \
        --build-arg "BASE=$base" -f "$HERE/servers.Dockerfile")"
    env_lines+=("SERVERS_IMAGE=$servers")
    refs+=("$servers")

    tar="$OUT/images-$(printf '%s\n' "${refs[@]}" | key).tar"
    if [ ! -s "$tar" ]; then
        rm -f "$OUT"/images-*.tar
        "${PODMAN[@]}" save --multi-image-archive --format docker-archive -o "$tar.tmp" "${refs[@]}" >&2
        mv "$tar.tmp" "$tar"
    fi
    env_lines+=("IMAGES_TAR=$tar")
    write_env images.env
}

# The plugin image for both platforms and the manifest list an admin would push: the one
# name a node of either architecture pulls, each getting its own.
multiarch_images() {
    local amd64 arm64 list
    amd64="$(plugin_image amd64)"
    arm64="$(plugin_image arm64)"
    list="localhost/fuse-device-plugin-multiarch:$(printf '%s\n' "$amd64" "$arm64" | key)"
    # Made anew each time (a second): an earlier run stopped between its steps leaves no
    # list with one platform behind.
    "${PODMAN[@]}" manifest rm "$list" >/dev/null 2>&1 || true
    "${PODMAN[@]}" manifest create "$list" >&2
    "${PODMAN[@]}" manifest add "$list" "containers-storage:$amd64" >&2
    "${PODMAN[@]}" manifest add "$list" "containers-storage:$arm64" >&2
    env_lines=("PLUGIN_IMAGE_AMD64=$amd64" "PLUGIN_IMAGE_ARM64=$arm64" "PLUGIN_MANIFEST=$list")
    write_env multiarch.env
}

# write_env NAME: env_lines into $OUT/NAME whole (never half-written), and printed.
write_env() {
    printf '%s\n' "${env_lines[@]}" > "$OUT/$1.tmp"
    mv "$OUT/$1.tmp" "$OUT/$1"
    cat "$OUT/$1"
}

mkdir -p "$OUT"
case "${1:-cluster}" in
    cluster) cluster_images ;;
    multiarch) multiarch_images ;;
    *) echo "usage: $0 [cluster|multiarch]" >&2; exit 2 ;;
esac
