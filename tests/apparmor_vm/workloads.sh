# Sourced by guest-tests.sh and confined.sh: the real FUSE programs, their servers, their checks.
# Every program runs in the foreground (-f) as a background job, so a failed mount shows up as
# the job's exit and the same command line serves both the strace recording and the confined run.

# workload_cmd NAME MOUNTPOINT TAG -> sets CMD (array): the command that mounts NAME at MOUNTPOINT.
workload_cmd() {
  local w=$1 mp=$2 tag=$3
  case $w in
    s3fs) CMD=(s3fs fdp-bucket "$mp" -f -o "url=http://127.0.0.1:5000,use_path_request_style,passwd_file=/etc/passwd-s3fs") ;;
    sshfs) CMD=(sshfs root@127.0.0.1:/srv/sshfs "$mp" -f -o "IdentityFile=/root/.ssh/id_ed25519,StrictHostKeyChecking=no,UserKnownHostsFile=/dev/null,BatchMode=yes") ;;
    bindfs) CMD=(bindfs -f /srv/bindfs "$mp") ;;
    fuse-overlayfs | fuse-overlayfs-nosuid)
      # fuse-overlayfs asks for suid by default; "-o nosuid" gives nosuid,nodev,noatime.
      local extra=""
      [ "$w" = fuse-overlayfs-nosuid ] && extra="nosuid,"
      mkdir -p "/srv/ovl/upper-$w-$tag" "/srv/ovl/work-$w-$tag"
      CMD=(fuse-overlayfs -f -o "${extra}lowerdir=/srv/ovl/lower,upperdir=/srv/ovl/upper-$w-$tag,workdir=/srv/ovl/work-$w-$tag" "$mp") ;;
    lxcfs) CMD=(lxcfs "$mp") ;;   # lxcfs stays in the foreground by default
    *) echo "unknown workload $w" >&2; return 2 ;;
  esac
}

is_mounted() { awk -v mp="$1" '$5 == mp { found = 1 } END { exit !found }' /proc/self/mountinfo; }
mountinfo_line() { awk -v mp="$1" '$5 == mp' /proc/self/mountinfo | tail -n 1; }

# wait_mounted MOUNTPOINT PID SECONDS: until mounted (0), the job died (1) or time ran out (2).
wait_mounted() {
  local mp=$1 pid=$2 tries=$(( $3 * 10 ))
  while [ "$tries" -gt 0 ]; do
    is_mounted "$mp" && return 0
    kill -0 "$pid" 2>/dev/null || { is_mounted "$mp" && return 0; return 1; }
    sleep 0.1
    tries=$(( tries - 1 ))
  done
  return 2
}

# stop_job MOUNTPOINT PID: unmount (the FUSE program then exits), reap it, kill it if it lingers.
stop_job() {
  local mp=$1 pid=$2 tries=100
  is_mounted "$mp" && umount "$mp" 2>/dev/null || umount -l "$mp" 2>/dev/null || true
  while kill -0 "$pid" 2>/dev/null && [ "$tries" -gt 0 ]; do sleep 0.1; tries=$(( tries - 1 )); done
  kill -9 "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
}

# data_check NAME MOUNTPOINT TAG: write through the mount, read it back on the server side.
# Prints "ok <what>" or "fail <why>"; lxcfs serves read-only files, so it is read instead.
data_check() {
  local w=$1 mp=$2 tag=$3 file="fdp-$3.txt" want="written through $1 by $3" got
  case $w in
    lxcfs)
      got=$(head -c 200 "$mp/proc/meminfo" 2>&1 | head -n 1)
      case $got in MemTotal:*) echo "ok read $mp/proc/meminfo: $got" ;; *) echo "fail read $mp/proc/meminfo: $got" ;; esac
      return ;;
  esac
  printf '%s' "$want" > "$mp/$file" 2>/tmp/write.err || { echo "fail write: $(cat /tmp/write.err)"; return; }
  case $w in
    s3fs) got=$(python3 /fdp/s3check.py get fdp-bucket "$file" 2>&1) ;;
    sshfs) got=$(cat "/srv/sshfs/$file" 2>&1) ;;
    bindfs) got=$(cat "/srv/bindfs/$file" 2>&1) ;;
    fuse-overlayfs*) got=$(cat "/srv/ovl/upper-$w-$tag/$file" 2>&1) ;;
  esac
  if [ "$got" = "$want" ]; then echo "ok server side has $file: $got"; else echo "fail server side: $got"; fi
}
