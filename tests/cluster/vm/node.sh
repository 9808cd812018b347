#!/bin/sh
# The VM node's parts (tests/cluster/vm_node.py), run by its init once the shares are
# mounted: containerd (its root, on the node's disk, holds the images already), then the
# kubelet. The host reads what it writes into the node's directory: facts (kernel,
# cgroup, AppArmor), each part's log, the images, and the kernel's list of loaded
# AppArmor profiles, every 2 s (what aa-status reads), for as long as the node runs.
set -u
set -a
. "$(dirname "$0")/node.env"
set +a
mkdir -p /run/fdp-vm /var/lib/fdp-vm /var/lib/kubelet /var/log/pods /var/log/containers
{
  echo "kernel=$(uname -r)"
  echo "cgroup=$(stat -fc %T /sys/fs/cgroup)"
  echo "apparmor=$(cat /sys/module/apparmor/parameters/enabled)"
  echo "mode=$(cat /sys/module/apparmor/parameters/mode 2>/dev/null)"
  echo "booted_s=$(cut -d' ' -f1 /proc/uptime)"
} > "$NODE_DIR/facts.tmp" && mv "$NODE_DIR/facts.tmp" "$NODE_DIR/facts"
PATH="$BINS:$PATH" "$BINS/containerd" --config "$NODE_DIR/containerd.toml" \
  > "$NODE_DIR/containerd.log" 2>&1 &
tries=0
until "$BINS/ctr" --address "$CONTAINERD_SOCK" version >/dev/null 2>&1; do
  tries=$((tries + 1))
  [ "$tries" -lt 1500 ] || { echo "containerd did not serve within 300 s"; exit 1; }
  sleep 0.2
done
echo "containerd_s=$(cut -d' ' -f1 /proc/uptime)" >> "$NODE_DIR/facts"
"$BINS/ctr" --address "$CONTAINERD_SOCK" -n k8s.io images ls -q > "$NODE_DIR/images"
sh "$NODE_DIR/kubelet.sh" > "$NODE_DIR/kubelet.log" 2>&1 &
while :; do
  cat /sys/kernel/security/apparmor/profiles > "$NODE_DIR/.apparmor-profiles" 2>&1
  mv "$NODE_DIR/.apparmor-profiles" "$NODE_DIR/apparmor-profiles"
  sleep 2
done
