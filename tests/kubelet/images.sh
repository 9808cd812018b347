#!/bin/bash
# Build the e2e images as OCI tarballs from host files (no registry is reachable):
#   - pause: a static binary compiled from Kubernetes' build/pause/linux/pause.c (the
#     k8s.io/kubernetes module's copy, which tests/stack/build.sh keeps)
#   - workload: static busybox + sshfs, ssh, fusermount3 and the libraries they need
# Usage: images.sh PAUSE_C
# Writes $FDP_CACHE/images/{pause,workload}.tar and images.env (PAUSE_IMAGE=, WORKLOAD_IMAGE=).
# Cached: rebuilt only when an input changes (the tag is the layer digest).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
pause_c="$1"
FDP_CACHE="${FDP_CACHE:-/var/cache/fuse-device-plugin}"
OUT="$FDP_CACHE/images"
mkdir -p "$OUT"

[ -f "$pause_c" ] || { echo "missing $pause_c (run setup.sh kubelet first)" >&2; exit 1; }
if [ ! -x "$OUT/pause" ] || [ "$pause_c" -nt "$OUT/pause" ]; then
    gcc -Os -Wall -Werror -static -DVERSION="fdp-e2e-$(basename "$(dirname "$pause_c")")" -o "$OUT/pause.tmp" "$pause_c"
    strip "$OUT/pause.tmp"
    mv "$OUT/pause.tmp" "$OUT/pause"
fi

pause_ref="$(python3 "$HERE/mkimage.py" --name fdp-e2e/pause --out "$OUT/pause.tar" \
    --entrypoint /pause --file "$OUT/pause:/pause")"

workload_ref="$(python3 "$HERE/mkimage.py" --name fdp-e2e/workload --out "$OUT/workload.tar" \
    --entrypoint /bin/sh --busybox /bin/busybox \
    --binary /usr/bin/sshfs --binary /usr/bin/ssh --binary /usr/bin/fusermount3 \
    --text '/etc/passwd:root:x:0:0:root:/root:/bin/sh\n' \
    --text '/etc/group:root:x:0:\n' \
    --text '/etc/fuse.conf:user_allow_other\n' \
    --dir /data)"

cat > "$OUT/images.env" <<ENV
PAUSE_IMAGE=$pause_ref
PAUSE_TAR=$OUT/pause.tar
WORKLOAD_IMAGE=$workload_ref
WORKLOAD_TAR=$OUT/workload.tar
ENV
cat "$OUT/images.env"
