#!/bin/bash
# Broker mode in the AppArmor kernel (issue 14), run by guest-tests.sh after the profile runs.
#
#   broker.sh                 start the broker (unconfined), run both cases, stop it
#   broker.sh ns CASE FILTER  (internal) in a new mount namespace: the shim over fusermount3,
#                             the broker's directory at /run/fuse-broker, then the caller
#   broker.sh caller CASE     (internal) the caller, as a broker-mode container runs it
#
# The caller is what a broker-mode pod is on an AppArmor node: root without CAP_SYS_ADMIN,
# under the runtime's default AppArmor profile (the control, ending in `deny mount,`), with
# no FUSE rule anywhere. Case "seccomp": also a seccomp filter refusing mount(2) with EPERM
# (the runtime's default seccomp profile): sshfs must mount through the broker, carry data
# and unmount. Case "noseccomp": no filter: AppArmor refuses mount(2) with EACCES before the
# capability check, libfuse gives up without running fusermount3, and the broker never
# hears of it. Case "nonroot": a restricted pod's caller, uid 1000 with no_new_privs under
# the same profile and filter: bindfs (libfuse 2) mounts its own directory through the
# broker as uid 1000 (the broker's helper takes its /dev/fuse fd across AppArmor's ptrace
# mediation) and carries data. Prints RESULT/MOUNTINFO/LOG lines with run=broker.
set -u
. /fdp/workloads.sh
run=broker
say() { echo "$1 run=$run ${*:2}"; }
BROKER_DIR=/run/fdp-broker
PROFILE=$(awk '$1 == "control" { print $2 }' /fdp/plan)
MOUNTS=/mnt/fuse/broker

nonroot() {  # nonroot: bindfs as uid 1000 over its own directory
  local mp=$MOUNTS/nonroot out
  say RESULT "check=nonroot-uid status=$(id -u)"
  if out=$(bindfs --no-allow-other /srv/bindfs-nonroot "$mp" 2>&1); then
    say RESULT "check=nonroot-mount status=ok"
    say MOUNTINFO "workload=nonroot $(mountinfo_line "$mp")"
    echo "written by uid 1000" > "$mp/from-nonroot.txt"
    say RESULT "check=nonroot-data status=$(cat /srv/bindfs-nonroot/from-nonroot.txt 2>&1 | tr ' ' '_')"
    if out=$(fusermount -u "$mp" 2>&1) && ! is_mounted "$mp"; then
      say RESULT "check=nonroot-unmount status=ok"
    else
      say RESULT "check=nonroot-unmount status=fail ${out//$'\n'/ }"
    fi
  else
    say RESULT "check=nonroot-mount status=refused ${out//$'\n'/ }"
  fi
}

caller() {  # caller CASE
  local case=$1 mp=$MOUNTS/$1 out
  say RESULT "check=$case-confined status=$(tr ' ' '_' < /proc/self/attr/current)"
  local caps
  caps=$(awk '/^CapEff:/ { print $2 }' /proc/self/status)
  if (( (16#$caps >> 21) & 1 )); then out=yes; else out=no; fi
  say RESULT "check=$case-sys-admin status=$out"
  say RESULT "check=$case-seccomp status=$(awk '/^Seccomp:/ { print $2 }' /proc/self/status)"
  if [ "$case" = nonroot ]; then nonroot; return; fi
  if out=$(sshfs root@127.0.0.1:/srv/sshfs "$mp" -o IdentityFile=/root/.ssh/id_ed25519 \
      -o StrictHostKeyChecking=no,UserKnownHostsFile=/dev/null,BatchMode=yes 2>&1); then
    say RESULT "check=$case-mount status=ok"
    say MOUNTINFO "workload=$case $(mountinfo_line "$mp")"
    say RESULT "check=$case-data status=$(data_check sshfs "$mp" "broker-$case")"
    if out=$(fusermount3 -u "$mp" 2>&1) && ! is_mounted "$mp"; then
      say RESULT "check=$case-unmount status=ok"
    else
      say RESULT "check=$case-unmount status=fail ${out//$'\n'/ }"
    fi
  else
    say RESULT "check=$case-mount status=refused ${out//$'\n'/ }"
  fi
}

in_namespace() {  # in_namespace CASE FILTER: binds as Allocate would make them, then confine
  local case=$1 filter=$2 user=()
  for target in /usr/bin/fusermount3 /usr/bin/fusermount; do
    mount --bind /fdp/native/fusermount3 "$target"
  done
  mount --bind "$BROKER_DIR" /run/fuse-broker
  [ "$case" = nonroot ] && user=(--reuid=1000 --regid=1000 --clear-groups --no-new-privs)
  # shellcheck disable=SC2086
  exec aa-exec -p "$PROFILE" -- setpriv --bounding-set -sys_admin --inh-caps -sys_admin \
    "${user[@]}" -- $filter /fdp/broker.sh caller "$case"
}

case ${1:-} in
  caller) caller "$2"; exit ;;
  ns) in_namespace "$2" "${3:-}"; exit ;;
esac

mkdir -p "$BROKER_DIR" /run/fuse-broker "$MOUNTS/seccomp" "$MOUNTS/noseccomp" \
  "$MOUNTS/nonroot" /srv/bindfs-nonroot
chown 1000:1000 "$MOUNTS/nonroot" /srv/bindfs-nonroot
chmod 0666 /dev/fuse  # as udev leaves it on a node (this guest runs no udev)
PYTHONPATH=/fdp/py python3 -m fuse_plugin broker --dir "$BROKER_DIR" \
  --shim /fdp/native/fusermount3 --state-dir /run/fdp-broker-state \
  --log-format json >/tmp/broker.log 2>&1 &
broker=$!
for _ in $(seq 600); do [ -S "$BROKER_DIR/broker.sock" ] && break; sleep 0.1; done
if [ -S "$BROKER_DIR/broker.sock" ]; then
  say RESULT "check=broker-started status=ok"
else
  say RESULT "check=broker-started status=fail"
fi
unshare --mount --propagation private /fdp/broker.sh ns seccomp /fdp/seccomp-eperm
unshare --mount --propagation private /fdp/broker.sh ns noseccomp
unshare --mount --propagation private /fdp/broker.sh ns nonroot /fdp/seccomp-eperm
kill -TERM "$broker"
wait "$broker"
say RESULT "check=broker-exit status=$?"
awk -v p="LOG run=$run broker: " 'NF { print p $0 }' /tmp/broker.log
