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

base_image() {
    local k ref rootfs
    k="$(echo "debootstrap --variant=minbase --include=$INCLUDE $SUITE $MIRROR" | key)"
    ref="localhost/fdp-cluster/debian-base:$k"
    if ! have_image "$ref"; then
        rootfs="$OUT/rootfs.tmp"
        rm -rf "$rootfs"
        log "debootstrap $SUITE (minbase + $INCLUDE)"
        local t0=$SECONDS
        debootstrap --variant=minbase --include="$INCLUDE" "$SUITE" "$rootfs" "$MIRROR" >&2
        # Debian marks its Python externally managed (PEP 668); the official python image
        # does not, and the Dockerfile's `pip install` relies on that.
        rm -f "$rootfs"/usr/lib/python3*/EXTERNALLY-MANAGED
        rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/archives/*.deb
        tar -C "$rootfs" -c . | "${PODMAN[@]}" import --change 'CMD ["python3"]' - "$ref" >&2
        rm -rf "$rootfs"
        log "base $ref in $((SECONDS - t0))s"
    fi
    # manifests/examples/Dockerfile starts FROM debian:bookworm-slim.
    "${PODMAN[@]}" tag "$ref" docker.io/library/debian:bookworm-slim
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

mkdir -p "$OUT"
base="$(base_image)"
bkey="${base##*:}"

plugin="$(build fuse-device-plugin \
    "$(inputs_key "$bkey" Dockerfile pyproject.toml README.md fuse_plugin)" "$REPO" \
    --build-arg "PYTHON_IMAGE=$base" -f "$REPO/Dockerfile")"
env_lines=("PLUGIN_IMAGE=$plugin")
refs=("$plugin")
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
printf '%s\n' "${env_lines[@]}" > "$OUT/images.env.tmp"
mv "$OUT/images.env.tmp" "$OUT/images.env"
cat "$OUT/images.env"
