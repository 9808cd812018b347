#!/bin/bash
# Idempotent node set-up for the real-kubelet stage (and, through tests/cluster/setup.sh,
# the cluster stage).
#
#   tests/kubelet/setup.sh            # everything (packages, the stack, images)
#   tests/kubelet/setup.sh packages [PKG...]  # only Debian packages (+ the caller's)
#   tests/kubelet/setup.sh kubelet    # only the stack build (tests/stack/build.sh, cached)
#   tests/kubelet/setup.sh images     # only the pause + workload OCI images (cached)
#   tests/kubelet/setup.sh path       # print the kubelet's path (nothing is built)
#   tests/kubelet/setup.sh dir        # print the stack's bin/ (nothing is built)
#
# The kubelet, containerd, runc and the rest come from tests/stack/build.sh: Kubernetes
# 1.37 and containerd 2 built from the Go module proxy, cached under $FDP_CACHE/stack.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
STACK="$HERE/../stack/build.sh"
FDP_CACHE="${FDP_CACHE:-/var/cache/fuse-device-plugin}"
export FDP_CACHE
APT=(apt-get -o DPkg::Lock::Timeout=900 -o Acquire::Retries=3)
export DEBIAN_FRONTEND=noninteractive

log() { echo "[setup $(date +%H:%M:%S)] $*" >&2; }

# Packages this stage needs (also listed in scripts/apt-packages.txt): the C toolchain and
# libseccomp's headers for runc and the pause binary, and what the workload image copies.
PKGS=(gcc libc6-dev libseccomp-dev binutils fuse3 sshfs openssh-server openssh-client
      busybox-static util-linux)

# do_packages [EXTRA...]: this stage's packages and the caller's extra ones.
do_packages() {
    local missing=()
    for p in "${PKGS[@]}" "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        log "installing: ${missing[*]}"
        "${APT[@]}" update -q >&2
        "${APT[@]}" install -y -q --no-install-recommends "${missing[@]}" >&2
    fi
}

stack_dir() { "$STACK" dir; }

do_kubelet() {
    "$STACK" build
    log "kubelet: $(stack_dir)/bin/kubelet ($("$(stack_dir)/bin/kubelet" --version))"
}

do_images() { "$HERE/images.sh" "$(stack_dir)/pause.c"; }

if [ "${1:-all}" != path ] && [ "${1:-all}" != dir ] && [ -z "${FDP_SETUP_LOCKED:-}" ]; then
    # One set-up at a time per cache (a test run and a developer may start it together).
    [ "$(id -u)" = 0 ] || { echo "setup.sh must run as root" >&2; exit 1; }
    mkdir -p "$FDP_CACHE"
    exec 9>"$FDP_CACHE/setup.lock"
    flock 9
fi

case "${1:-all}" in
    packages) shift; do_packages "$@" ;;
    kubelet) do_packages; do_kubelet ;;
    images) do_packages; do_images ;;
    path) echo "$(stack_dir)/bin/kubelet" ;;
    dir) echo "$(stack_dir)/bin" ;;
    all) do_packages; do_kubelet; do_images ;;
    *) echo "usage: $0 [all|packages|kubelet|images|path|dir]" >&2; exit 2 ;;
esac
