/*
 * What fuse-broker-helper (helper.c) and fuse-broker-lxcfs (lxcfs.c) share: the uapi
 * numbers musl's headers lack, statx, a mount namespace's table read through the
 * broker's own /proc, the one walk by which either resolves a path in a tenant's
 * namespace, and the move into the caller's cgroups that comes before anything else.
 * Both are static programs built from one .c file each (scripts/build-native); this
 * header is included, not linked.
 *
 * The including program defines, before it:
 *   finish(status, format, ...)  reports "refused" (a rule) or "failed" (the system)
 *                                and exits;
 *   failed(what)                 finish("failed", "WHAT: strerror(errno)").
 */
#ifndef FUSE_BROKER_MOUNTS_H
#define FUSE_BROKER_MOUNTS_H

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define MAX_TABLE (8 << 20)
/* Where Allocate binds the broker's directory in a container (protocol.CONTAINER_DIR;
 * a unit test keeps them equal). */
#define BROKER_DIR "/run/fuse-broker"
/* Mount types never looked inside (policy.NO_WALK; a unit test keeps them equal); an
 * entry ending in '.' is a prefix. Built in, not sent: no message can leave it out. A
 * lookup in one asks a daemon the tenant runs, which may never answer: the asking
 * process then waits in the kernel, past any signal, for as long as the tenant likes. */
#define NO_WALK "fuse,fuse.,fuseblk,fuseblk.,autofs"

/* The new mount API and friends (uapi values; one number on every architecture). */
#define SYS_move_mount_ 429
#define SYS_openat2_ 437
#define MOUNT_ATTR_RDONLY 0x1
#define MOUNT_ATTR_NOSUID 0x2
#define MOUNT_ATTR_NODEV 0x4
#define MOUNT_ATTR_NOEXEC 0x8
#define MOVE_MOUNT_F_EMPTY_PATH 0x4
#define RESOLVE_NO_MAGICLINKS 0x2
#define RESOLVE_NO_SYMLINKS 0x4
#define RESOLVE_BENEATH 0x8
#define AT_STATX_DONT_SYNC 0x4000
#define STATX_MNT_ID 0x1000
#define UMOUNT_NOFOLLOW_ 0x8

struct open_how_ {
	uint64_t flags, mode, resolve;
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

/* One line of mountinfo, the parts the broker judges by. */
struct mount {
	unsigned long id;
	char *dev, *root, *point, *options, *fstype, *super;
	int shared; /* a peer group member: a mount on it would propagate to its peers */
};

struct table {
	char *text;
	int count;
	struct mount *mounts;
};

static int statx_fd(int fd, unsigned mask, struct statx_ *st)
{
	/* DONT_SYNC: a FUSE inode answers from its cache instead of asking its daemon. */
	return (int)syscall(SYS_statx, fd, "", AT_EMPTY_PATH | AT_STATX_DONT_SYNC, mask, st);
}

/* The mount an fd is on. An empty mask: the VFS fills the mount id itself, and FUSE
 * answers an empty mask without a permission check or a request to its daemon. */
static unsigned long mount_id_of(int fd)
{
	struct statx_ st;

	if (statx_fd(fd, 0, &st) == -1)
		failed("statx");
	if (!(st.stx_mask & STATX_MNT_ID))
		finish("failed", "%s", "the kernel does not report mount ids (statx, Linux 5.8+)");
	return (unsigned long)st.stx_mnt_id;
}

/* mountinfo escapes space, tab, newline and backslash as \ooo; undone in place. */
static char *unescape(char *text)
{
	char *in = text, *out = text;

	while (*in) {
		if (in[0] == '\\' && in[1] >= '0' && in[1] <= '3' && in[2] >= '0' && in[2] <= '7'
		    && in[3] >= '0' && in[3] <= '7') {
			*out++ = (char)((in[1] - '0') << 6 | (in[2] - '0') << 3 | (in[3] - '0'));
			in += 4;
		} else {
			*out++ = *in++;
		}
	}
	*out = '\0';
	return text;
}

/* A mount table, read through the broker's own /proc: "self/mountinfo" is the namespace
 * this process is in now, relative to its root (setns made that the namespace's root). */
static void read_table_of(int proc, const char *name, struct table *t)
{
	size_t size = 0, cap = 1 << 16;
	int fd = openat(proc, name, O_RDONLY | O_CLOEXEC);
	char *line;

	if (fd == -1)
		failed("open mountinfo");
	free(t->text);
	free(t->mounts);
	t->text = malloc(cap + 1);
	for (;;) {
		ssize_t n;
		if (size == cap) {
			if (cap >= MAX_TABLE)
				finish("refused", "%s", "the mount table is larger than 8 MiB");
			cap *= 2;
			t->text = realloc(t->text, cap + 1);
		}
		if (!t->text)
			finish("failed", "%s", "out of memory");
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
		finish("failed", "%s", "out of memory");
	for (line = strtok(t->text, "\n"); line; line = strtok(NULL, "\n")) {
		char *field[10], *save = NULL, *dash = strstr(line, " - ");
		struct mount *m = &t->mounts[t->count];
		int n = 0;

		m->shared = 0;
		if (!dash)
			continue;
		*dash = '\0';
		for (char *w = strtok_r(line, " ", &save); w; w = strtok_r(NULL, " ", &save)) {
			if (n < 6)
				field[n++] = w;
			else if (strncmp(w, "shared:", 7) == 0)
				m->shared = 1; /* optional fields until the dash: shared:N, master:N */
		}
		if (n < 6)
			continue;
		m->id = strtoul(field[0], NULL, 10);
		m->dev = field[2];
		m->root = unescape(field[3]);
		m->point = unescape(field[4]);
		m->options = field[5];
		save = NULL;
		m->fstype = strtok_r(dash + 3, " ", &save);
		(void)strtok_r(NULL, " ", &save); /* the source: the tenant's words */
		m->super = strtok_r(NULL, " ", &save);
		if (!m->fstype || !m->super)
			continue;
		t->count++;
	}
}

static void read_table(int proc, struct table *t)
{
	read_table_of(proc, "self/mountinfo", t);
}

static const struct mount *find_id(const struct table *t, unsigned long id)
{
	for (int i = 0; i < t->count; i++)
		if (t->mounts[i].id == id)
			return &t->mounts[i];
	return NULL;
}

/* The last mount listed at exactly this mountpoint: the one on top. */
static const struct mount *find_point(const struct table *t, const char *point)
{
	const struct mount *found = NULL;

	for (int i = 0; i < t->count; i++)
		if (strcmp(t->mounts[i].point, point) == 0)
			found = &t->mounts[i];
	return found;
}

/* Is fstype in the comma-separated list? An entry ending in '.' matches a prefix. */
static int listed(const char *list, const char *fstype)
{
	const char *p = list;

	while (*p) {
		size_t len = strcspn(p, ",");
		if (len && (p[len - 1] == '.' ? strncmp(fstype, p, len) == 0
					 : strlen(fstype) == len && strncmp(fstype, p, len) == 0))
			return 1;
		p += len + (p[len] == ',');
	}
	return 0;
}

/* Looking up a name in a directory asks its filesystem: refuse before asking one whose
 * type is in NO_WALK (a FUSE daemon can stall any lookup, an automounter too). */
static void check_walkable(const struct table *t, int dir, const char *path)
{
	const struct mount *m = find_id(t, mount_id_of(dir));

	if (!m)
		finish("refused", "'%s' refused: the mount table changed while it was resolved",
		       path);
	if (listed(NO_WALK, m->fstype))
		finish("refused", "'%s' is at or inside the %s mount at '%s': the broker does not "
		       "resolve paths through it", path, m->fstype, m->point);
}

/* One component, no symlink of any kind, never above dir. O_PATH without O_DIRECTORY
 * neither opens the file nor triggers an automount. */
static int open_one(int dir, const char *name)
{
	struct open_how_ how = { O_PATH | O_CLOEXEC, 0,
				 RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_BENEATH };

	return (int)syscall(SYS_openat2_, dir, name, &how, sizeof(how));
}

/* The one walk of both programs: path, absolute, from the root of the mount namespace
 * this process is in (setns made it the root), one component at a time, refusing to
 * look inside any mount of a NO_WALK type (t is that namespace's table). Returns an
 * O_PATH fd of what it reached (with whole == 0, of the last component's parent: the
 * caller names the last component itself), or -1 with errno when a component cannot
 * be opened: the including program says why in its own words. */
static int walk_beneath(const struct table *t, const char *path, int whole)
{
	char copy[4096], *save = NULL, *name, *next;
	int cur = open("/", O_PATH | O_DIRECTORY | O_CLOEXEC);

	if (cur == -1)
		failed("open the namespace root");
	if (strlen(path) >= sizeof(copy) || path[0] != '/')
		finish("failed", "bad path from the broker: '%.100s'", path);
	strcpy(copy, path);
	name = strtok_r(copy + 1, "/", &save);
	while (name) {
		int fd, err;
		next = strtok_r(NULL, "/", &save);
		check_walkable(t, cur, path);
		if (!next && !whole)
			return cur;
		fd = open_one(cur, name);
		err = errno;
		close(cur);
		if (fd == -1) {
			errno = err;
			return -1;
		}
		cur = fd;
		name = next;
	}
	return cur;
}

/* Detaches the mount an fd is at the root of (an O_PATH fd, or a new mount's) through the
 * broker's /proc (self/fd/N), so no path in the tenant's namespace is looked up again. */
static int detach(int proc, int fd)
{
	char self[32];

	snprintf(self, sizeof(self), "self/fd/%d", fd);
	if (fchdir(proc) == -1)
		return -1;
	return umount2(self, MNT_DETACH);
}

/* Moves this process into the caller's cgroups (FUSE_BROKER_CGROUPS: "NAME=FD ...",
 * each FD its cgroup.procs opened by the broker, fuse_plugin/broker/cgroups.py) and
 * closes them: what it allocates and the CPU it spends from then on are the caller's.
 * Called first, before anything a tenant can make costly. NULL, or why one move
 * failed: the program then refuses, and runs nothing in the broker's cgroups. */
static const char *join_cgroups(void)
{
	static char why[160];
	const char *list = getenv("FUSE_BROKER_CGROUPS");

	while (list && *list) {
		size_t len = strcspn(list, "=");
		char *end;
		long fd;

		errno = 0;
		fd = strtol(list + len + (list[len] == '='), &end, 10);
		if (len == 0 || len > 40 || list[len] != '=' || errno || end == list + len + 1
		    || fd < 0 || fd > (1 << 20)) {
			snprintf(why, sizeof(why), "bad FUSE_BROKER_CGROUPS from the broker");
			return why;
		}
		if (write((int)fd, "0", 1) != 1) {
			snprintf(why, sizeof(why), "cannot run the helper in the caller's "
				 "%.*s cgroup: %s", (int)len, list, strerror(errno));
			return why;
		}
		close((int)fd);
		list = end + strspn(end, " ");
	}
	return NULL;
}

#endif
