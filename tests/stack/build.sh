#!/bin/bash
# Build the node and control plane that the kubelet and cluster stages run, from the Go
# module proxy (no git clone, no download outside the package registries), pinned in
# tests/stack/versions.env:
#
#   Kubernetes (kubelet, kube-apiserver, kube-controller-manager, kube-scheduler),
#   etcd, containerd + containerd-shim-runc-v2 + ctr, runc (cgo, libseccomp), the CNI plugins
#   bridge, host-local and loopback, and the pause image's pause.c; with
#   FUSE_E2E_RUNTIME=crio also CRI-O (crio, cgo with libseccomp) and its pinns (C, from
#   the same module's source; conmon is Debian's).
#
#   tests/stack/build.sh          build what is missing (idempotent, quick when cached)
#   tests/stack/build.sh dir      print the directory holding bin/ (nothing is built)
#
# Output: $FDP_CACHE/stack/<hash of versions.env and this script>/bin/. The Go module and
# build caches live in $FDP_CACHE/go and are shared by every binary (kube-apiserver, the
# controller manager and the scheduler reuse most of what the kubelet compiled).
#
# k8s.io/kubernetes cannot be `go install`ed: its go.mod replaces every staging module
# (k8s.io/api, client-go, kubelet, ...) with ./staging/src/..., which a dependency's go.mod
# cannot do. A wrapper module requires k8s.io/kubernetes and replaces each staging module
# with its published v0.<minor>.<patch>; the list is read from Kubernetes' own go.mod, and
# the wrapper carries the same `go` and `godebug` lines (godebug applies only in a main
# module).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
FDP_CACHE="${FDP_CACHE:-/var/cache/fuse-device-plugin}"
# shellcheck source=versions.env
. "$HERE/versions.env"
KEY="$( (cat "$HERE/versions.env" "$HERE/build.sh" "$HERE/etcd/main.go") | sha256sum | cut -c1-12)"
OUT="$FDP_CACHE/stack/$KEY"
BIN="$OUT/bin"

log() { echo "[stack $(date +%H:%M:%S)] $*" >&2; }

if [ "${1:-build}" = dir ]; then echo "$OUT"; exit 0; fi
[ "${1:-build}" = build ] || { echo "usage: $0 [build|dir]" >&2; exit 2; }

command -v go >/dev/null || { echo "stack: no 'go' on PATH (Go $GO_MIN or newer is needed)" >&2; exit 1; }
export GOMODCACHE="$FDP_CACHE/go/mod" GOCACHE="$FDP_CACHE/go/build" GOFLAGS=-mod=mod \
       GOTOOLCHAIN=local GOWORK=off GO111MODULE=on
mkdir -p "$BIN" "$OUT/src"

# wrapper NAME: a module directory $OUT/src/NAME with go.mod from stdin.
wrapper() {
    local dir="$OUT/src/$1"
    mkdir -p "$dir"
    cat > "$dir/go.mod.new"
    if ! cmp -s "$dir/go.mod.new" "$dir/go.mod.in"; then
        cp "$dir/go.mod.new" "$dir/go.mod.in"
        cp "$dir/go.mod.new" "$dir/go.mod"
        rm -f "$dir/go.sum"
    fi
    rm -f "$dir/go.mod.new"
    echo "$dir"
}

# build NAME DIR PKG [go build args...]: DIR's module builds PKG into bin/NAME, once.
build() {
    local name="$1" dir="$2" pkg="$3" t0=$SECONDS
    shift 3
    [ -x "$BIN/$name" ] && return 0
    log "building $name ($pkg)"
    (cd "$dir" && go build -trimpath -o "$BIN/$name.tmp" "$@" "$pkg") >&2
    mv "$BIN/$name.tmp" "$BIN/$name"
    log "$name built in $((SECONDS - t0)) s"
}

kubernetes() {
    local gomod dir minor vpkg=k8s.io/component-base/version ldflags
    gomod="$(cd "$OUT/src" && go mod download -json "k8s.io/kubernetes@$KUBERNETES" | python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')"
    minor="${KUBERNETES#v1.}"
    dir="$(
        {
            echo "module fdp.local/kubernetes"
            grep -E '^(go|godebug) ' "$gomod"
            echo "require k8s.io/kubernetes $KUBERNETES"
            # k8s.io/<m> => ./staging/src/k8s.io/<m>  becomes  k8s.io/<m> => k8s.io/<m> v0.<minor>
            sed -nE 's#^[[:space:]]*(k8s\.io/[^ ]+) => \./staging/src/k8s\.io/[^ ]+$#replace \1 => \1 v0.'"$minor"'#p' "$gomod"
        } | wrapper kubernetes
    )"
    [ "$(grep -c '^replace ' "$dir/go.mod")" -ge 30 ] \
        || { echo "stack: fewer staging modules than expected in $gomod" >&2; exit 1; }
    ldflags="-s -w -X $vpkg.gitVersion=$KUBERNETES -X $vpkg.gitMajor=1"
    ldflags+=" -X $vpkg.gitMinor=${minor%%.*} -X $vpkg.gitTreeState=archive"
    for cmd in kubelet kube-apiserver kube-controller-manager kube-scheduler; do
        CGO_ENABLED=0 build "$cmd" "$dir" "k8s.io/kubernetes/cmd/$cmd" -ldflags "$ldflags"
    done
    # The pause container's source, for tests/kubelet/images.sh.
    if [ ! -f "$OUT/pause.c" ]; then
        cp "$GOMODCACHE/k8s.io/kubernetes@$KUBERNETES/build/pause/linux/pause.c" "$OUT/pause.c"
    fi
}

etcd() {
    local dir
    dir="$(printf 'module fdp.local/etcd\ngo %s\nrequire go.etcd.io/etcd/server/v3 %s\n' "$GO_MIN" "$ETCD" | wrapper etcd)"
    cp "$HERE/etcd/main.go" "$dir/main.go"
    CGO_ENABLED=0 build etcd "$dir" . -ldflags "-s -w"
}

containerd() {
    local dir m=github.com/containerd/containerd/v2
    dir="$(printf 'module fdp.local/containerd\ngo %s\nrequire %s %s\n' "$GO_MIN" "$m" "$CONTAINERD" | wrapper containerd)"
    CGO_ENABLED=0 build containerd "$dir" "$m/cmd/containerd" \
        -ldflags "-s -w -X $m/version.Version=$CONTAINERD -X $m/version.Revision=module"
    CGO_ENABLED=0 build containerd-shim-runc-v2 "$dir" "$m/cmd/containerd-shim-runc-v2" \
        -ldflags "-s -w -X $m/version.Version=$CONTAINERD"
    CGO_ENABLED=0 build ctr "$dir" "$m/cmd/ctr" -ldflags "-s -w -X $m/version.Version=$CONTAINERD"
}

runc() {
    local dir m=github.com/opencontainers/runc
    dir="$(printf 'module fdp.local/runc\ngo %s\nrequire %s %s\n' "$GO_MIN" "$m" "$RUNC" | wrapper runc)"
    # cgo (libcontainer's nsexec) and libseccomp (Debian's libseccomp-dev), as runc's Makefile.
    CGO_ENABLED=1 build runc "$dir" "$m" -tags seccomp \
        -ldflags "-s -w -X main.version=${RUNC#v} -X main.gitCommit=module"
}

cni() {
    local dir m=github.com/containernetworking/plugins p
    dir="$(printf 'module fdp.local/cni\ngo %s\nrequire %s %s\n' "$GO_MIN" "$m" "$CNI_PLUGINS" | wrapper cni)"
    mkdir -p "$BIN/cni"
    for p in main/bridge ipam/host-local main/loopback; do
        CGO_ENABLED=0 build "cni/$(basename "$p")" "$dir" "$m/plugins/$p" \
            -ldflags "-s -w -X github.com/containernetworking/plugins/pkg/utils/buildversion.BuildVersion=$CNI_PLUGINS"
    done
}

crio() {
    local dir m=github.com/cri-o/cri-o src
    dir="$(printf 'module fdp.local/crio\ngo %s\nrequire %s %s\n' "$GO_MIN" "$m" "$CRIO" | wrapper crio)"
    # The tags CRI-O's Makefile picks on a machine like this one (hack/*_tag.sh): seccomp
    # (libseccomp-dev), the pure-Go OpenPGP, no btrfs, no ostree; no AppArmor or SELinux
    # (the kernel has neither). cgo for libseccomp, as runc.
    CGO_ENABLED=1 build crio "$dir" "$m/cmd/crio" \
        -tags "containers_image_ostree_stub exclude_graphdriver_btrfs containers_image_openpgp seccomp" \
        -ldflags "-s -w -X $m/internal/version.buildCommit=module"
    # pinns (pins a pod's namespaces to files) is C in the module's pinns/, built as its
    # Makefile does: static, -std=c99 -Os.
    if [ ! -x "$BIN/pinns" ]; then
        src="$(cd "$dir" && go mod download -json "$m@$CRIO" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')/pinns/src"
        log "building pinns ($src)"
        gcc -std=c99 -Os -Wall -Wextra -static -o "$BIN/pinns.tmp" "$src"/*.c
        strip -s "$BIN/pinns.tmp"
        mv "$BIN/pinns.tmp" "$BIN/pinns"
    fi
}

t0=$SECONDS
kubernetes
etcd
containerd
runc
cni
case "${FUSE_E2E_RUNTIME:-containerd}" in
    containerd) ;;
    crio) crio ;;
    *) echo "stack: FUSE_E2E_RUNTIME must be containerd or crio, not '$FUSE_E2E_RUNTIME'" >&2; exit 2 ;;
esac
log "ready in $((SECONDS - t0)) s: $BIN ($(cd "$BIN" && ls | paste -sd' ' -))"
