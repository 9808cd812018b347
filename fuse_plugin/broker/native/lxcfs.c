/*
 * fuse-broker-lxcfs: binds the node's lxcfs files over one container's own /proc and
 * /sys files, and nothing else.
 *
 *     fuse-broker-lxcfs MARK_DEV MARK_ROOT LXCFS_MNTNS_FD TARGET_MNTNS_FD
 *
 * The broker (fuse_plugin/broker/lxcfs.py) runs one per consumer it binds or heals, and
 * never waits for it: it watches its pidfd and kills it at a deadline. The fds are
 * inherited: the mount namespace lxcfs serves in (its DaemonSet's container, which
 * announced itself on the broker's lxcfs socket) and the consumer's mount namespace
 * (taken from the process the kernel named on the broker socket, or recorded then).
 *
 * Nothing comes from the consumer: the files are the fixed list below, the source is
 * LXCFS_DIR in lxcfs's namespace, the target the same names under the consumer's
 * namespace root. In the consumer's namespace it
 *   1. checks Allocate's bind at /run/fuse-broker is the broker's (MARK_DEV MARK_ROOT,
 *      as policy.allocated does): a container without broker mode gets nothing;
 *   2. for each file, removes the lxcfs binds already on it (a dead lxcfs's, which read
 *      "Transport endpoint is not connected"), and only those;
 *   3. checks what is left at the file is the namespace's own procfs (sysfs) mount at
 *      /proc (/sys), not shared with a peer (a bind would propagate), reached without a
 *      symlink, and moves a fresh clone of lxcfs's file there (read-only, nosuid,
 *      nodev, noexec).
 * One line on stdout: "ok", "refused REASON" (exit 2) or "failed REASON" (exit 1).
 *
 * Static (musl): it runs with the broker's privileges and loads nothing.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Where lxcfs is mounted in its own container (manifests/broker/lxcfs-daemonset.yaml,
 * fuse_plugin/broker/lxcfs.py's MOUNTPOINT: a unit test keeps them equal). */
#define LXCFS_DIR "/var/lib/lxcfs"
#define LXCFS_TYPE "fuse.lxcfs"
#define MAX_STALE 64
/* The files, as lxcfs.py's FILES (a unit test keeps them equal): directory, name, the
 * type of the namespace's mount the directory must be on, and that mount's point. */
static const struct target {
	const char *dir, *name, *fstype, *on;
} TARGETS[] = {
	{ "/proc", "cpuinfo", "proc", "/proc" },
	{ "/proc", "meminfo", "proc", "/proc" },
	{ "/proc", "stat", "proc", "/proc" },
	{ "/proc", "uptime", "proc", "/proc" },
	{ "/proc", "diskstats", "proc", "/proc" },
	{ "/proc", "swaps", "proc", "/proc" },
	{ "/proc", "loadavg", "proc", "/proc" },
	{ "/sys/devices/system/cpu", "online", "sysfs", "/sys" },
};
#define COUNT (sizeof(TARGETS) / sizeof(TARGETS[0]))

#define SYS_open_tree_ 428
#define SYS_mount_setattr_ 442
#define OPEN_TREE_CLONE 1
#define OPEN_TREE_CLOEXEC O_CLOEXEC

struct mount_attr_ {
	uint64_t attr_set, attr_clr, propagation, userns_fd;
};

/* One line: the word (ok, refused or failed) and why; the exit status says the same. */
_Noreturn static void finish(const char *word, const char *format, ...)
{
	va_list args;

	printf("%s ", word);
	va_start(args, format);
	vprintf(format, args);
	va_end(args);
	putchar('\n');
	fflush(stdout);
	_exit(strcmp(word, "ok") == 0 ? 0 : strcmp(word, "refused") == 0 ? 2 : 1);
}

#define refused(...) finish("refused", __VA_ARGS__)
#define failed(what) finish("failed", "%s: %s", what, strerror(errno))

#include "mounts.h"

/* Step 1, in lxcfs's namespace: a detached, read-only clone of each of its files. */
static void clone_sources(int proc, int trees[COUNT])
{
	struct table t = { 0 };
	struct mount_attr_ attr = { MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV |
				    MOUNT_ATTR_NOEXEC, 0, 0, 0 };
	const struct mount *m;
	char path[256];

	read_table(proc, &t);
	m = find_point(&t, LXCFS_DIR);
	if (!m || strcmp(m->fstype, LXCFS_TYPE) != 0)
		refused("lxcfs is not mounted at %s in its container (found %s)", LXCFS_DIR,
			m ? m->fstype : "nothing");
	for (size_t i = 0; i < COUNT; i++) {
		snprintf(path, sizeof(path), "%s%s/%s", LXCFS_DIR, TARGETS[i].dir, TARGETS[i].name);
		trees[i] = (int)syscall(SYS_open_tree_, AT_FDCWD, path,
					OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC);
		if (trees[i] == -1)
			finish("failed", "lxcfs's %s: %s", path, strerror(errno));
		if (syscall(SYS_mount_setattr_, trees[i], "", AT_EMPTY_PATH, &attr,
			    sizeof(attr)) == -1)
			failed("mount_setattr");
	}
}

/* Step 2: the lxcfs binds already on the file, top first, and nothing under another;
 * each reached from its directory's fd, never by a path. */
static void remove_stale(int proc, struct table *t, int dir, const struct target *to,
			 const char *path)
{
	for (int n = 0;; n++) {
		const struct mount *m;
		int fd;

		read_table(proc, t);
		m = find_point(t, path);
		if (!m || strcmp(m->fstype, LXCFS_TYPE) != 0)
			return;
		if (n == MAX_STALE)
			refused("more than %d lxcfs mounts are stacked on %s", MAX_STALE, path);
		fd = open_one(dir, to->name);
		if (fd == -1)
			failed("open a stale lxcfs bind");
		if (mount_id_of(fd) != m->id)
			refused("%s changed while the stale lxcfs binds were removed", path);
		if (detach(proc, fd) == -1)
			failed("umount a stale lxcfs bind");
		close(fd);
	}
}

/* Steps 2 and 3 for one file, binding nothing: its directory, reached by the shared walk
 * (never into a FUSE mount: a tenant's daemon could hold this process in the kernel),
 * is on the namespace's own procfs (sysfs) mount, and nothing the broker did not make
 * covers the file. Returns the directory's fd, where the clone goes. */
static int prepare(int proc, const struct target *to)
{
	struct table t = { 0 };
	char path[256];
	const struct mount *base, *dir, *top;
	int fd;

	snprintf(path, sizeof(path), "%s/%s", to->dir, to->name);
	read_table(proc, &t);
	base = find_point(&t, to->on);
	if (!base || strcmp(base->fstype, to->fstype) != 0)
		refused("the container's %s is not a %s mount", to->on, to->fstype);
	fd = walk_beneath(&t, to->dir, 1);
	if (fd == -1)
		refused("%s cannot be reached in the container without a symlink: %s", to->dir,
			strerror(errno));
	check_walkable(&t, fd, to->dir);
	remove_stale(proc, &t, fd, to, path);
	base = find_point(&t, to->on);
	dir = find_id(&t, mount_id_of(fd));
	if (!base || !dir || dir->id != base->id)
		refused("%s is not on the container's %s mount at %s", to->dir, to->fstype, to->on);
	top = find_point(&t, path);
	if (top)
		refused("%s is covered by a %s mount the broker did not make", path, top->fstype);
	if (dir->shared)
		refused("the container's %s mount is shared with a peer group: a bind on it "
			"would propagate", to->on);
	free(t.text);
	free(t.mounts);
	return fd;
}

/* Step 3's binds, all or none: every file was prepared first, and a bind that fails
 * takes the ones before it away again (a refusal at the eighth file leaves no seven
 * behind, unrecorded). */
static void bind_all(int proc, const int dirs[COUNT], const int trees[COUNT])
{
	for (size_t i = 0; i < COUNT; i++) {
		if (syscall(SYS_move_mount_, trees[i], "", dirs[i], TARGETS[i].name,
			    MOVE_MOUNT_F_EMPTY_PATH) == 0)
			continue;
		int err = errno;
		for (size_t j = 0; j < i; j++)
			detach(proc, trees[j]);
		finish("failed", "bind lxcfs over %s/%s: %s", TARGETS[i].dir, TARGETS[i].name,
		       strerror(err));
	}
}

static int fd_arg(const char *text)
{
	char *end;
	long fd = strtol(text, &end, 10);

	if (!*text || *end || fd < 3 || fd > 65535)
		finish("failed", "bad fd argument '%.20s'", text);
	return (int)fd;
}

int main(int argc, char *argv[])
{
	int trees[COUNT], dirs[COUNT], proc, source, target;
	struct table t = { 0 };
	const struct mount *mark;
	const char *uncharged = join_cgroups(); /* first: all that follows is the caller's */

	if (uncharged)
		refused("%s; the broker runs no tool outside its caller's cgroups", uncharged);
	if (argc != 5)
		finish("failed", "%s", "usage: fuse-broker-lxcfs MARK_DEV MARK_ROOT "
		       "LXCFS_MNTNS_FD TARGET_MNTNS_FD (the broker runs it)");
	source = fd_arg(argv[3]);
	target = fd_arg(argv[4]);
	proc = open("/proc", O_PATH | O_DIRECTORY | O_CLOEXEC);
	if (proc == -1)
		failed("open /proc");
	if (setns(source, CLONE_NEWNS) == -1)
		failed("enter lxcfs's mount namespace");
	clone_sources(proc, trees);
	if (setns(target, CLONE_NEWNS) == -1)
		failed("enter the container's mount namespace");
	read_table(proc, &t);
	mark = find_point(&t, BROKER_DIR);
	if (!mark || strcmp(mark->dev, argv[1]) != 0 || strcmp(mark->root, argv[2]) != 0)
		refused("%s", "this container was not given broker mode by the device plugin (no "
			"/run/fuse-broker bind of the broker's directory in its mount namespace); "
			"request github.com/fuse in its own resources");
	for (size_t i = 0; i < COUNT; i++)
		dirs[i] = prepare(proc, &TARGETS[i]);
	bind_all(proc, dirs, trees);
	finish("ok", "%zu files", COUNT);
}
