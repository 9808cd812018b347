#!/bin/bash
# Idempotent node setup for the real-kubelet e2e stage (issue 6).
#
#   tests/kubelet/setup.sh            # everything (packages, kubelet, images)
#   tests/kubelet/setup.sh packages [PKG...]  # only Debian packages (+ deb-src line)
#   tests/kubelet/setup.sh kubelet    # only the kubelet build (cached)
#   tests/kubelet/setup.sh images     # only pause + workload OCI images (cached)
#   tests/kubelet/setup.sh build ./cmd/kube-scheduler ...   # more binaries of the same tree
#
# The kubelet is built from Debian bookworm's `kubernetes` source package
# (1.20.2) in GOPATH mode with golang-1.19-go, CGO off, and cached outside the
# work tree under $FDP_CACHE/kubelet/<source version>/kubelet.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
FDP_CACHE="${FDP_CACHE:-/var/cache/fuse-device-plugin}"
KCACHE="$FDP_CACHE/kubelet"
APT=(apt-get -o DPkg::Lock::Timeout=900 -o Acquire::Retries=3)
export DEBIAN_FRONTEND=noninteractive

log() { echo "[setup $(date +%H:%M:%S)] $*" >&2; }

[ "$(id -u)" = 0 ] || { echo "setup.sh must run as root" >&2; exit 1; }


# Packages this stage needs (also listed in scripts/apt-packages.txt).
PKGS=(containerd runc golang-1.19-go dpkg-dev gcc libc6-dev fuse3 sshfs
      openssh-server openssh-client busybox-static util-linux)

ensure_deb_src() {
    # A deb-src line for bookworm so `apt-get source kubernetes` works.
    if grep -rqsE '^(deb-src|Types:.*deb-src)' /etc/apt/sources.list /etc/apt/sources.list.d/ \
        && apt-cache showsrc kubernetes >/dev/null 2>&1 \
        && [ -n "$(apt-cache showsrc kubernetes 2>/dev/null)" ]; then
        return 0
    fi
    log "adding deb-src line for bookworm"
    cat > /etc/apt/sources.list.d/fuse-device-plugin-src.sources <<'SRC'
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
    "${APT[@]}" update -q >&2
}

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
    ensure_deb_src
}

# Source version of Debian's kubernetes package, e.g. 1.20.2-1 (key of the cache).
src_version() {
    apt-cache showsrc kubernetes 2>/dev/null | awk '/^Version:/{print $2; exit}'
}

kubelet_dir() { echo "$KCACHE/$(src_version)"; }

# Unpack `apt-get source kubernetes` once into $KCACHE/<version>/src and link it into a
# GOPATH; prints the tree's path.
unpack_source() {
    local ver dir src
    ver="$(src_version)"
    [ -n "$ver" ] || { echo "no source package 'kubernetes' visible to apt (deb-src missing?)" >&2; exit 1; }
    dir="$KCACHE/$ver"
    mkdir -p "$dir"
    if [ ! -f "$dir/src/.unpacked" ]; then
        log "fetching source kubernetes=$ver"
        rm -rf "$dir/src" && mkdir -p "$dir/src"
        (cd "$dir/src" && "${APT[@]}" source -q "kubernetes=$ver" >&2)
        touch "$dir/src/.unpacked"
    fi
    src="$(find "$dir/src" -maxdepth 1 -mindepth 1 -type d -name 'kubernetes-*' | head -1)"
    [ -d "$src/vendor" ] || { echo "unpacked source $src has no vendor/" >&2; exit 1; }
    mkdir -p "$dir/gopath/src/k8s.io"
    ln -sfn "$src" "$dir/gopath/src/k8s.io/kubernetes"
    echo "$dir/gopath/src/k8s.io/kubernetes"
}

# Build Go packages of the tree (e.g. ./cmd/kubelet) into $KCACHE/<version>/<basename>,
# each only if not there yet. One Go build cache serves every binary of one call and is
# dropped afterwards (FDP_KEEP_GOCACHE=1 keeps it for a caller building more).
do_build() {
    local ver dir tree pkg name
    ver="$(src_version)"
    tree="$(unpack_source)"
    dir="$KCACHE/$ver"
    # Version stamp like hack/lib/version.sh would set, so `--version` is meaningful.
    # Debian's version is 1.20.5+really1.20.2-...: the code is upstream 1.20.2.
    local upstream="${ver%-*}" vpkg=k8s.io/kubernetes/vendor/k8s.io/component-base/version
    upstream="${upstream##*really}"; upstream="${upstream%%[-+~]*}"
    local ldflags="-s -w -X $vpkg.gitVersion=v$upstream -X $vpkg.gitMajor=${upstream%%.*}"
    ldflags+=" -X $vpkg.gitMinor=$(echo "$upstream" | cut -d. -f2) -X $vpkg.gitTreeState=archive"
    ldflags+=" -X $vpkg.buildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
    for pkg in "$@"; do
        name="$(basename "$pkg")"
        # Written under a temporary name and renamed: present means complete.
        if [ -x "$dir/$name" ]; then
            log "$name cached: $dir/$name"
            continue
        fi
        log "building $name (GOPATH mode, go 1.19, CGO off)"
        local t0=$SECONDS
        (
            cd "$tree"
            export PATH=/usr/lib/go-1.19/bin:$PATH GOPATH="$dir/gopath" GO111MODULE=off \
                   CGO_ENABLED=0 GOCACHE="$dir/gocache" GOFLAGS=
            go build -o "$dir/$name.tmp" -ldflags "$ldflags" "$pkg"
        ) >&2
        mv "$dir/$name.tmp" "$dir/$name"
        log "$name built in $((SECONDS - t0))s"
    done
    # The Go build cache is only needed for rebuilds; drop it to save disk.
    [ -n "${FDP_KEEP_GOCACHE:-}" ] || rm -rf "$dir/gocache"
}

do_kubelet() {
    do_build ./cmd/kubelet
    log "kubelet: $(kubelet_dir)/kubelet ($("$(kubelet_dir)/kubelet" --version))"
}

# FDP_SETUP_LOCKED=1: the caller (tests/cluster/setup.sh) already holds the lock.
if [ "${1:-all}" != path ] && [ "${1:-all}" != dir ] && [ -z "${FDP_SETUP_LOCKED:-}" ]; then
    # One setup at a time per cache (a test run and a developer may start it together).
    mkdir -p "$FDP_CACHE"
    exec 9>"$FDP_CACHE/setup.lock"
    flock 9
fi

case "${1:-all}" in
    packages) shift; do_packages "$@" ;;
    kubelet) do_packages; do_kubelet ;;
    images) do_packages; "$HERE/images.sh" "$(kubelet_dir)" ;;
    build) shift; do_packages; do_build "$@" ;;
    path) echo "$(kubelet_dir)/kubelet" ;;
    dir) kubelet_dir ;;
    all) do_packages; do_kubelet; "$HERE/images.sh" "$(kubelet_dir)" ;;
    *) echo "usage: $0 [all|packages|kubelet|images|path|dir|build PKG...]" >&2; exit 2 ;;
esac
