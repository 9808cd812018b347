#!/bin/bash
# Runs under the profile under test (started by aa-exec): the preset's real FUSE programs must
# mount here, and this same confined shell's children must be refused every other mount.
#
#   confined.sh RUN BASE FUSETARGET SUBTYPE WORKLOAD=MOUNTPOINT...
#
# FUSETARGET is where the raw FUSE probes mount (inside what the profile allows), SUBTYPE the
# fuse.SUBTYPE they use (the preset's own). Prints RESULT/MOUNTINFO/LOG lines; guest-tests.sh
# and the host-side test read them.
set -u
. /fdp/workloads.sh
run=$1 base=$2 fuse_target=$3 subtype=$4
shift 4
say() { echo "$1 run=$run ${*:2}"; }

say RESULT "check=confined status=$(tr ' ' '_' < /proc/self/attr/current)"

now() { cut -d" " -f1 /proc/uptime; }
probe() {  # probe CHECK SOURCE TARGET FSTYPE FLAGS DATA
  local out
  out=$(/fdp/mounttest "mt-$1" "${@:2}" 2>&1)
  say RESULT "check=$1 status=${out##*result=}"
}

# lxcfs's files over /proc as manifests/examples/lxcfs-daemonset.yaml binds them (the same
# list): in a child mount namespace, util-linux `mount --bind` of each over its /proc name,
# read back through /proc from guest-tests.sh's 1-CPU, 256 MiB cgroup, where only lxcfs's
# answers show the limits. Then binds the profile must still refuse: a served file over
# another /proc name (served or not), and a recursive bind.
LXCFS_PROC_FILES="cpuinfo diskstats loadavg meminfo stat swaps uptime"
over_proc() {  # runs in the child namespace
  echo $$ > /sys/fs/cgroup/fdp-lxcfs/cgroup.procs || say LOG "could not join fdp-lxcfs"
  local f out got kernel
  for f in $LXCFS_PROC_FILES; do
    if out=$(mount --bind "$LXCFS_MP/proc/$f" "/proc/$f" 2>&1); then out=ok; fi
    say RESULT "check=proc-bind:$f status=${out//$'\n'/ }"
  done
  say MOUNTINFO "workload=proc-meminfo $(mountinfo_line /proc/meminfo)"
  got=$(awk '/^MemTotal:/ { print $2 }' /proc/meminfo)
  kernel=$(awk '/^MemTotal:/ { print $2 }' "$KERNEL_PROC/meminfo")
  [ "$got" = 262144 ] && out=ok || out=fail
  say RESULT "check=proc-meminfo status=$out MemTotal=$got kB (the kernel's: $kernel kB)"
  got=$(grep -c ^processor /proc/cpuinfo)
  kernel=$(grep -c ^processor "$KERNEL_PROC/cpuinfo")
  [ "$got" = 1 ] && out=ok || out=fail
  say RESULT "check=proc-cpuinfo status=$out processors=$got (the kernel's: $kernel)"
  probe lxcfs-swap "$LXCFS_MP/proc/meminfo" /proc/cpuinfo - bind -
  probe lxcfs-other "$LXCFS_MP/proc/meminfo" /proc/version - bind -
  probe lxcfs-rbind "$LXCFS_MP/proc/meminfo" /proc/meminfo - bind,rec -
}
lxcfs_over_proc() {  # lxcfs_over_proc MOUNTPOINT
  # The kernel's own answers, copied before the binds hide them, for the log.
  KERNEL_PROC=$(mktemp -d)
  cp /proc/meminfo /proc/cpuinfo "$KERNEL_PROC/"
  export run LXCFS_MP=$1 LXCFS_PROC_FILES KERNEL_PROC
  export -f say probe over_proc mountinfo_line
  unshare --mount --propagation private /bin/bash -c over_proc
  say RESULT "check=proc-namespace status=exit=$?"
  rm -rf "$KERNEL_PROC"
}
for item in "$@"; do
  w=${item%%=*} mp=${item#*=} t0=$(now)
  mkdir -p "$mp"
  workload_cmd "$w" "$mp" "$run"
  "${CMD[@]}" >"/tmp/$run-$w.log" 2>&1 &
  pid=$!
  wait_mounted "$mp" "$pid" 90
  case $? in
    0)
      say RESULT "check=workload:$w status=mounted"
      say MOUNTINFO "workload=$w $(mountinfo_line "$mp")"
      say RESULT "check=data:$w status=$(data_check "$w" "$mp" "$run")"
      [ "$w" = lxcfs ] && lxcfs_over_proc "$mp"
      ;;
    1) say RESULT "check=workload:$w status=refused" ;;
    *) say RESULT "check=workload:$w status=timeout" ;;
  esac
  stop_job "$mp" "$pid"
  say TIMING "workload=$w from=$t0 to=$(now)"
  # The program's own words (e.g. "fuse: mount failed: Permission denied"), one line each.
  awk -v p="LOG run=$run workload=$w: " 'NF { print p $0 }' "/tmp/$run-$w.log" | tail -n 8
done

# Probes: one mount(2) each, from a child of this confined shell; the probe's comm is
# "mt-CHECK", which the kernel's audit line names. First the FUSE mount itself, without a
# program: fuse and fuse.SUBTYPE with the flags libfuse uses, and the same without nosuid or
# without nodev (to be refused: a suid or device file on a FUSE mount is a way out), and at a
# mountpoint outside the run's base (refused only by a profile narrowed to a glob).
fuse_data="fd=@,rootmode=40000,user_id=0,group_id=0"
d=/mnt/deny/$run
mkdir -p "$fuse_target" "$d"/{outside,tmpfs,proc,cgroup,cgroup2,bind,fuseblk}
probe fuse fdp "$fuse_target" fuse nosuid,nodev "$fuse_data"
probe fuse-sub fdp "$fuse_target" "$subtype" nosuid,nodev "$fuse_data"
probe fuse-suid fdp "$fuse_target" "$subtype" nodev "$fuse_data"
probe fuse-dev fdp "$fuse_target" "$subtype" nosuid "$fuse_data"
probe fuse-outside fdp "$d/outside" "$subtype" nosuid,nodev "$fuse_data"

# Then what no FUSE profile may allow, each with the FUSE flags so that only the type (or the
# bind/remount) differs. fuseblk's source must exist: AppArmor resolves a block device first.
probe tmpfs tmpfs "$d/tmpfs" tmpfs nosuid,nodev -
probe proc proc "$d/proc" proc nosuid,nodev -
probe cgroup cgroup "$d/cgroup" cgroup nosuid,nodev none,name=fdptest
probe cgroup2 cgroup2 "$d/cgroup2" cgroup2 nosuid,nodev -
probe bind /etc "$d/bind" - bind -
probe sysrw - /sys - remount -
probe sysrw-bind - /sys - remount,bind -
probe fuseblk /dev/fdpblk "$d/fuseblk" fuseblk nosuid,nodev "$fuse_data,blksize=4096"
# Nothing new on /proc either, where the lxcfs profile allows its own binds: a tmpfs over it, a
# bind of another file over /proc/meminfo, a bind over the /proc/sys directory.
printf 'MemTotal: 1 kB\n' > "$d/meminfo"
probe proc-tmpfs tmpfs /proc tmpfs nosuid,nodev -
probe proc-bind "$d/meminfo" /proc/meminfo - bind -
probe proc-sysbind "$d/bind" /proc/sys - bind -
# A new mount without flags where the lxcfs profile allows only a bind: AppArmor 3.0's parser
# turns `mount options=(rw,bind) / -> /run/lxcfs/root/` into that bind AND any mount of any
# type with no flags (a fresh, unmasked procfs here). Its rules must not say "rw".
mkdir -p /run/lxcfs/root
probe noflags-proc / /run/lxcfs/root proc - -
