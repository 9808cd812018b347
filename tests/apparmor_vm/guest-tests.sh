#!/bin/bash
# The guest's test harness (unconfined, started by /init): start the servers, load the profiles,
# record each FUSE program's mount(2) call with strace, then run every planned profile through
# confined.sh under aa-exec, and finally print the kernel's AppArmor audit lines.
#
# /fdp/plan holds one run a line:  RUN PROFILE BASE FUSETARGET SUBTYPE WORKLOAD=MOUNTPOINT...
# (the arguments of confined.sh after the profile).
# Output lines start with FDPT, RESULT, MOUNTINFO, STRACE, LOG or AUDIT; the host side parses them.
set -u
. /fdp/workloads.sh
say() { echo "FDPT $*"; }
t0=$(cut -d' ' -f1 /proc/uptime)
step() { say "step=$1 uptime=$(cut -d' ' -f1 /proc/uptime)"; }

say "boot kernel=$(uname -r) root=$(awk '$5 == "/" { r = $9 } END { print r }' /proc/self/mountinfo) lsm=$(cat /sys/kernel/security/lsm) apparmor=$(cat /sys/module/apparmor/parameters/enabled) uptime=$t0"
dmesg | grep -E 'Unpacking initramfs|Freeing initrd|Run /init' | sed 's/^/FDPT kmsg: /'
# Audit records reach the kernel log through printk_ratelimit(): lift it so no DENIED line is lost.
echo 0 > /proc/sys/kernel/printk_ratelimit
mknod /dev/fdpblk b 7 0   # a block device path for the fuseblk probe (loop0's numbers)
modprobe fuse && say "fuse=loaded dev=$(stat -c %t:%T /dev/fuse)" || say "fuse=FAILED"
ip link set lo up

step servers
mkdir -p /run/sshd /srv/sshfs /srv/bindfs /srv/ovl/lower
echo lower > /srv/ovl/lower/lower.txt
/usr/sbin/sshd -o ListenAddress=127.0.0.1 && say "sshd=started" || say "sshd=FAILED"
# moto takes a while to start under emulation: the profiles load meanwhile.
PYTHONPATH=/opt/moto python3 -m moto.server -H 127.0.0.1 -p 5000 >/tmp/moto.log 2>&1 &
echo fdptest:fdptestsecret > /etc/passwd-s3fs
chmod 600 /etc/passwd-s3fs

step profiles
# One parser run compiles them all, two at a time (the guest has two CPUs).
if ! out=$(apparmor_parser -r -j 2 /fdp/profiles/* 2>&1); then
  echo "$out" | sed 's/^/LOG apparmor_parser: /'
fi
for f in /fdp/profiles/*; do
  if grep -q "^${f##*/} (enforce)$" /sys/kernel/security/apparmor/profiles; then
    say "profile-load file=${f##*/} status=ok"
  else
    say "profile-load file=${f##*/} status=FAILED"
  fi
done
sed 's/^/FDPT loaded: /' /sys/kernel/security/apparmor/profiles

if python3 /fdp/s3check.py wait-bucket fdp-bucket 240; then
  say "moto=started bucket=fdp-bucket"
else
  say "moto=FAILED"; awk 'NF { print "LOG moto: " $0 }' /tmp/moto.log | tail -n 20
fi

# Each program's own mount(2) call, unconfined, exactly as it makes it.
step record
for w in $(awk '{ for (i = 6; i <= NF; i++) { sub(/=.*/, "", $i); print $i } }' /fdp/plan | sort -u); do
  mp=/mnt/record/$w
  mkdir -p "$mp"
  workload_cmd "$w" "$mp" record
  strace -f --seccomp-bpf -qq -e signal=none -s 200 -o "/tmp/strace-$w.log" \
    -e trace=mount,umount2,pivot_root,unshare,setns,fsopen,fsconfig,fsmount,move_mount,open_tree,mount_setattr \
    "${CMD[@]}" >"/tmp/record-$w.log" 2>&1 &
  pid=$!
  if wait_mounted "$mp" "$pid" 90; then
    say "record workload=$w status=mounted"
    echo "MOUNTINFO run=record workload=$w $(mountinfo_line "$mp")"
  else
    say "record workload=$w status=FAILED"
    awk -v p="LOG record $w: " 'NF { print p $0 }' "/tmp/record-$w.log" | tail -n 8
  fi
  stop_job "$mp" "$pid"
  sed "s/^/STRACE prog=$w /" "/tmp/strace-$w.log"
done

# lxcfs answers with the reader's cgroup limits, the kernel does not: a cgroup with one CPU and
# 256 MiB tells lxcfs's /proc/cpuinfo and /proc/meminfo apart from the kernel's (confined.sh
# binds them over /proc from inside it).
cg=/sys/fs/cgroup/fdp-lxcfs
if echo "+cpuset +memory" > /sys/fs/cgroup/cgroup.subtree_control && mkdir -p "$cg" \
    && echo 0 > "$cg/cpuset.cpus" && echo 256M > "$cg/memory.max"; then
  say "cgroup=$cg cpuset.cpus=$(cat "$cg/cpuset.cpus") memory.max=$(cat "$cg/memory.max")"
else
  say "cgroup=FAILED"
fi

# Inside a container /sys is read-only; make it so here, so that "remount /sys rw" means it.
mount -o remount,ro /sys && say "sys=ro"

step confined
while read -r run profile base args; do
  [ -n "$run" ] || continue
  say "run=$run profile=$profile base=$base args=$args uptime=$(cut -d" " -f1 /proc/uptime)"
  # shellcheck disable=SC2086
  aa-exec -p "$profile" -- /fdp/confined.sh "$run" "$base" $args
  say "run=$run exit=$?"
  awk '$5 ~ "^/(mnt/fuse|var/lib/lxcfs)" { print $5 }' /proc/self/mountinfo | xargs -r -n1 umount -l
done < /fdp/plan

# Broker mode: a caller under the runtime-default control profile, no CAP_SYS_ADMIN.
step broker
/fdp/broker.sh

# The audit queue is drained asynchronously: one last denial, then wait for it in the log, so
# every earlier line is there too.
step audit
sentinel_profile=$(awk 'NR == 1 { print $2 }' /fdp/plan)
mkdir -p /mnt/sentinel
aa-exec -p "$sentinel_profile" -- /fdp/mounttest mt-sentinel tmpfs /mnt/sentinel tmpfs - - >/dev/null
for _ in $(seq 100); do dmesg | grep -q 'comm="mt-sentinel"' && break; sleep 0.1; done
dmesg | grep -E 'apparmor="(DENIED|AUDIT|ALLOWED)"' | sed 's/^/AUDIT /'
step end
say done
