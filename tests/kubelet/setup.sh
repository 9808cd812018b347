#!/bin/bash
# Idempotent node setup for the real-kubelet e2e stage (issue 6).
#
#   tests/kubelet/setup.sh            # everything (packages, kubelet, images)
#   tests/kubelet/setup.sh packages   # only Debian packages (+ deb-src line)
#   tests/kubelet/setup.sh kubelet    # only the kubelet build (cached)
#   tests/kubelet/setup.sh images     # only pause + workload OCI images (cached)
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

do_packages() {
    local missing=()
    for p in "${PKGS[@]}"; do
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

do_kubelet() {
    local ver dir src gopath
    ver="$(src_version)"
    [ -n "$ver" ] || { echo "no source package 'kubernetes' visible to apt (deb-src missing?)" >&2; exit 1; }
    dir="$KCACHE/$ver"
    if [ -x "$dir/kubelet" ] && "$dir/kubelet" --version >/dev/null 2>&1; then
        log "kubelet cached: $dir/kubelet ($("$dir/kubelet" --version))"
        return 0
    fi
    mkdir -p "$dir"
    if [ ! -f "$dir/src/.unpacked" ]; then
        log "fetching source kubernetes=$ver"
        rm -rf "$dir/src" && mkdir -p "$dir/src"
        (cd "$dir/src" && "${APT[@]}" source -q "kubernetes=$ver" >&2)
        touch "$dir/src/.unpacked"
    fi
    src="$(find "$dir/src" -maxdepth 1 -mindepth 1 -type d -name 'kubernetes-*' | head -1)"
    [ -d "$src/vendor" ] || { echo "unpacked source $src has no vendor/" >&2; exit 1; }
    gopath="$dir/gopath"
    mkdir -p "$gopath/src/k8s.io"
    ln -sfn "$src" "$gopath/src/k8s.io/kubernetes"
    log "building kubelet (GOPATH mode, go 1.19, CGO off) — several minutes"
    local t0=$SECONDS
    # Version stamp like hack/lib/version.sh would set, so `kubelet --version` is meaningful.
    # Debian's version is 1.20.5+really1.20.2-...: the code is upstream 1.20.2.
    local upstream="${ver%-*}" pkg=k8s.io/kubernetes/vendor/k8s.io/component-base/version
    upstream="${upstream##*really}"; upstream="${upstream%%[-+~]*}"
    local ldflags="-s -w -X $pkg.gitVersion=v$upstream -X $pkg.gitMajor=${upstream%%.*}"
    ldflags+=" -X $pkg.gitMinor=$(echo "$upstream" | cut -d. -f2) -X $pkg.gitTreeState=archive"
    ldflags+=" -X $pkg.buildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
    (
        cd "$gopath/src/k8s.io/kubernetes"
        export PATH=/usr/lib/go-1.19/bin:$PATH GOPATH="$gopath" GO111MODULE=off CGO_ENABLED=0 \
               GOCACHE="$dir/gocache" GOFLAGS=
        go build -o "$dir/kubelet.tmp" -ldflags "$ldflags" ./cmd/kubelet
    ) >&2
    mv "$dir/kubelet.tmp" "$dir/kubelet"
    log "kubelet built in $((SECONDS - t0))s: $("$dir/kubelet" --version)"
    # The Go build cache is only needed for rebuilds; drop it to save disk.
    rm -rf "$dir/gocache"
}

if [ "${1:-all}" != path ]; then
    # One setup at a time per cache (a test run and a developer may start it together).
    mkdir -p "$FDP_CACHE"
    exec 9>"$FDP_CACHE/setup.lock"
    flock 9
fi

case "${1:-all}" in
    packages) do_packages ;;
    kubelet) do_packages; do_kubelet ;;
    images) do_packages; "$HERE/images.sh" "$(kubelet_dir)" ;;
    path) echo "$(kubelet_dir)/kubelet" ;;
    all) do_packages; do_kubelet; "$HERE/images.sh" "$(kubelet_dir)" ;;
    *) echo "usage: $0 [all|packages|kubelet|images|path]" >&2; exit 2 ;;
esac
