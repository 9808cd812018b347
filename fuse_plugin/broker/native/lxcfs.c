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
#define BROKER_DIR "/run/fuse-broker"
#define MAX_TABLE (8 << 20)
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
#define SYS_move_mount_ 429
#define SYS_openat2_ 437
#define SYS_mount_setattr_ 442
#define OPEN_TREE_CLONE 1
#define OPEN_TREE_CLOEXEC O_CLOEXEC
#define MOVE_MOUNT_F_EMPTY_PATH 0x4
#define MOUNT_ATTR_RDONLY 0x1
#define MOUNT_ATTR_NOSUID 0x2
#define MOUNT_ATTR_NODEV 0x4
#define MOUNT_ATTR_NOEXEC 0x8
#define RESOLVE_NO_MAGICLINKS 0x2
#define RESOLVE_NO_SYMLINKS 0x4
#define RESOLVE_BENEATH 0x8
#define STATX_MNT_ID 0x1000
#define AT_STATX_DONT_SYNC 0x4000
#define UMOUNT_NOFOLLOW_ 0x8

struct open_how_ {
	uint64_t flags, mode, resolve;
};

struct mount_attr_ {
	uint64_t attr_set, attr_clr, propagation, userns_fd;
};

struct statx_ts_ {
	int64_t tv_sec;
	uint32_t tv_nsec, pad;
};

struct statx_ {
	uint32_t stx_mask, stx_blksize;
	uint64_t stx_attributes;
	uint32_t stx_nlink, stx_uid, stx_gid;
	uint16_t stx_mode, pad1;
	uint64_t stx_ino, stx_size, stx_blocks, stx_attributes_mask;
	struct statx_ts_ stx_atime, stx_btime, stx_ctime, stx_mtime;
	uint32_t stx_rdev_major, stx_rdev_minor, stx_dev_major, stx_dev_minor;
	uint64_t stx_mnt_id;
	uint64_t spare[13];
};

struct mount {
	unsigned long id;
	char *dev, *root, *point, *fstype;
	int shared;
};

struct table {
	char *text;
	int count;
	struct mount *mounts;
};

_Noreturn static void finish(int status, const char *word, const char *format, ...)
{
	va_list args;

	printf("%s ", word);
	va_start(args, format);
	vprintf(format, args);
	va_end(args);
	putchar('\n');
	fflush(stdout);
	_exit(status);
}

#define refused(...) finish(2, "refused", __VA_ARGS__)
#define failed(what) finish(1, "failed", "%s: %s", what, strerror(errno))

/* mountinfo escapes space, tab, newline and backslash as \ooo. */
static char *unescape(char *text)
{
	char *in = text, *out = text;

	while (*in) {
		if (in[0] == '\\' && in[1] >= '0' && in[1] <= '7' && in[2] >= '0' && in[2] <= '7'
		    && in[3] >= '0' && in[3] <= '7') {
			*out++ = (char)((in[1] - '0') * 64 + (in[2] - '0') * 8 + (in[3] - '0'));
			in += 4;
		} else {
			*out++ = *in++;
		}
	}
	*out = '\0';
	return text;
}

/* The current mount namespace's table, through the broker's own /proc (opened before
 * any setns: "self" there is this process, whose table is the namespace it is in). */
static void read_table(int proc, struct table *t)
{
	size_t size = 0, cap = 1 << 16;
	int fd = openat(proc, "self/mountinfo", O_RDONLY | O_CLOEXEC);
	char *line;

	if (fd == -1)
		failed("open mountinfo");
	free(t->text);
	free(t->mounts);
	t->text = malloc(cap + 1);
	for (;;) {
		ssize_t n;
		if (!t->text)
			finish(1, "failed", "%s", "out of memory");
		if (size == cap) {
			if (cap >= MAX_TABLE)
				refused("%s", "the mount table is larger than 8 MiB");
			cap *= 2;
			t->text = realloc(t->text, cap + 1);
			continue;
		}
		n = read(fd, t->text + size, cap - size);
		if (n < 0)
			failed("read mountinfo");
		if (n == 0)
			break;
		size += (size_t)n;
	}
	close(fd);
	t->text[size] = '\0';
	t->count = 0;
	t->mounts = calloc(size / 16 + 1, sizeof(*t->mounts));
	if (!t->mounts)
		finish(1, "failed", "%s", "out of memory");
	for (line = strtok(t->text, "\n"); line; line = strtok(NULL, "\n")) {
		char *field[6], *save = NULL, *dash = strstr(line, " - ");
		struct mount *m = &t->mounts[t->count];
		int n = 0;

		if (!dash)
			continue;
		*dash = '\0';
		m->shared = 0;
		for (char *w = strtok_r(line, " ", &save); w; w = strtok_r(NULL, " ", &save)) {
			if (n < 6)
				field[n++] = w;
			else if (strncmp(w, "shared:", 7) == 0)
				m->shared = 1;
		}
		if (n < 6)
			continue;
		m->id = strtoul(field[0], NULL, 10);
		m->dev = field[2];
		m->root = unescape(field[3]);
		m->point = unescape(field[4]);
		m->fstype = strtok_r(dash + 3, " ", &save);
		if (m->fstype)
			t->count++;
	}
}

/* The last mount listed at exactly this point: the one on top. */
static const struct mount *on_top(const struct table *t, const char *point)
{
	const struct mount *found = NULL;

	for (int i = 0; i < t->count; i++)
		if (strcmp(t->mounts[i].point, point) == 0)
			found = &t->mounts[i];
	return found;
}

static const struct mount *by_id(const struct table *t, unsigned long id)
{
	for (int i = 0; i < t->count; i++)
		if (t->mounts[i].id == id)
			return &t->mounts[i];
	return NULL;
}

/* An O_PATH fd of an absolute directory, one component at a time from the namespace's
 * root, with no symlink of any kind and never above the root. */
static int walk(const char *path)
{
	char copy[256], *save = NULL;
	int cur = open("/", O_PATH | O_DIRECTORY | O_CLOEXEC);

	if (cur == -1)
		failed("open the namespace root");
	snprintf(copy, sizeof(copy), "%s", path);
	for (char *name = strtok_r(copy + 1, "/", &save); name;
	     name = strtok_r(NULL, "/", &save)) {
		struct open_how_ how = { O_PATH | O_DIRECTORY | O_CLOEXEC, 0,
					 RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS |
					 RESOLVE_BENEATH };
		int fd = (int)syscall(SYS_openat2_, cur, name, &how, sizeof(how));
		if (fd == -1)
			refused("%s cannot be reached in the container without a symlink: %s",
				path, strerror(errno));
		close(cur);
		cur = fd;
	}
	return cur;
}

static unsigned long mount_id_of(int fd)
{
	struct statx_ st;

	/* An empty mask: the VFS fills the mount id itself, asking no filesystem. */
	if (syscall(SYS_statx, fd, "", AT_EMPTY_PATH | AT_STATX_DONT_SYNC, 0, &st) == -1)
		failed("statx");
	if (!(st.stx_mask & STATX_MNT_ID))
		finish(1, "failed", "%s", "the kernel gives no mount id (Linux 5.8+ needed)");
	return (unsigned long)st.stx_mnt_id;
}

/* Step 1, in lxcfs's namespace: a detached, read-only clone of each of its files. */
static void clone_sources(int proc, int trees[COUNT])
{
	struct table t = { 0 };
	struct mount_attr_ attr = { MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV |
				    MOUNT_ATTR_NOEXEC, 0, 0, 0 };
	const struct mount *m;
	char path[256];

	read_table(proc, &t);
	m = on_top(&t, LXCFS_DIR);
	if (!m || strcmp(m->fstype, LXCFS_TYPE) != 0)
		refused("lxcfs is not mounted at %s in its container (found %s)", LXCFS_DIR,
			m ? m->fstype : "nothing");
	for (size_t i = 0; i < COUNT; i++) {
		snprintf(path, sizeof(path), "%s%s/%s", LXCFS_DIR, TARGETS[i].dir, TARGETS[i].name);
		trees[i] = (int)syscall(SYS_open_tree_, AT_FDCWD, path,
					OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC);
		if (trees[i] == -1)
			finish(1, "failed", "lxcfs's %s: %s", path, strerror(errno));
		if (syscall(SYS_mount_setattr_, trees[i], "", AT_EMPTY_PATH, &attr,
			    sizeof(attr)) == -1)
			failed("mount_setattr");
	}
}

/* Step 2: the lxcfs binds already on the file, top first, and nothing under another. */
static void remove_stale(int proc, struct table *t, const char *path)
{
	for (int n = 0;; n++) {
		const struct mount *m;
		read_table(proc, t);
		m = on_top(t, path);
		if (!m || strcmp(m->fstype, LXCFS_TYPE) != 0)
			return;
		if (n == MAX_STALE)
			refused("more than %d lxcfs mounts are stacked on %s", MAX_STALE, path);
		if (umount2(path, MNT_DETACH | UMOUNT_NOFOLLOW_) == -1)
			failed("umount a stale lxcfs bind");
	}
}

/* Step 3: the file's directory is on the namespace's own procfs (sysfs) mount and
 * nothing the broker did not make covers the file; then the clone goes on it. */
static void bind_one(int proc, const struct target *to, int tree)
{
	struct table t = { 0 };
	char path[256];
	const struct mount *base, *dir, *top;
	int fd;

	snprintf(path, sizeof(path), "%s/%s", to->dir, to->name);
	remove_stale(proc, &t, path);
	base = on_top(&t, to->on);
	if (!base || strcmp(base->fstype, to->fstype) != 0)
		refused("the container's %s is not a %s mount", to->on, to->fstype);
	top = on_top(&t, path);
	if (top)
		refused("%s is covered by a %s mount the broker did not make", path, top->fstype);
	fd = walk(to->dir);
	dir = by_id(&t, mount_id_of(fd));
	if (!dir || dir->id != base->id)
		refused("%s is not on the container's %s mount at %s", to->dir, to->fstype, to->on);
	if (dir->shared)
		refused("the container's %s mount is shared with a peer group: a bind on it "
			"would propagate", to->on);
	if (syscall(SYS_move_mount_, tree, "", fd, to->name, MOVE_MOUNT_F_EMPTY_PATH) == -1)
		finish(1, "failed", "bind lxcfs over %s: %s", path, strerror(errno));
	close(fd);
	close(tree);
	free(t.text);
	free(t.mounts);
}

static int fd_arg(const char *text)
{
	char *end;
	long fd = strtol(text, &end, 10);

	if (!*text || *end || fd < 3 || fd > 65535)
		finish(1, "failed", "bad fd argument '%.20s'", text);
	return (int)fd;
}

int main(int argc, char *argv[])
{
	int trees[COUNT], proc, source, target;
	struct table t = { 0 };
	const struct mount *mark;

	if (argc != 5)
		finish(1, "failed", "%s", "usage: fuse-broker-lxcfs MARK_DEV MARK_ROOT "
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
	mark = on_top(&t, BROKER_DIR);
	if (!mark || strcmp(mark->dev, argv[1]) != 0 || strcmp(mark->root, argv[2]) != 0)
		refused("%s", "this container was not given broker mode by the device plugin (no "
			"/run/fuse-broker bind of the broker's directory in its mount namespace); "
			"request github.com/fuse in its own resources");
	for (size_t i = 0; i < COUNT; i++)
		bind_one(proc, &TARGETS[i], trees[i]);
	finish(0, "ok", "%zu files", COUNT);
}
