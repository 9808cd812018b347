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
probe() {  # probe CHECK SOURCE TARGET FSTYPE FLAGS DATA
  local out
  out=$(/fdp/mounttest "mt-$1" "${@:2}" 2>&1)
  say RESULT "check=$1 status=${out##*result=}"
}
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
