/*
 * fuse-broker-helper: the broker's hands inside one caller's namespaces.
 *
 *     FUSE_BROKER_CGROUPS="NAME=FD ..." fuse-broker-helper CTLFD PIDFD MNTNSFD [USERNSFD]
 *
 * The broker (fuse_plugin/broker/helper.py) starts one per request and never waits for
 * it: everything that touches a tenant's objects happens here, in a process the broker
 * can kill at its deadline. The fds are inherited: a SOCK_SEQPACKET control socket, a
 * pidfd of the caller, the caller's mount namespace and, for a caller in a user
 * namespace of its own, that namespace. FUSE_BROKER_CGROUPS names the caller's
 * cgroup.procs files, open for writing, one per hierarchy that accounts memory, CPU or
 * processes (fuse_plugin/broker/cgroups.py): join_cgroups moves this process into each
 * before anything else, so what it allocates and runs is charged to the caller.
 *
 * The conversation: framed, typed messages (frames.py has the layout; the receiver
 * reads each with MSG_TRUNC, so a message longer than its buffer is refused whole, never
 * cut, and a missing, unknown or repeated field refuses it too):
 *   broker: REQUEST       op=mount|unmount path= uid= gid= groups=(u32 array) [fuse_fd=]
 *   helper: the mark      the mount at /run/fuse-broker (Allocate's bind), if any
 *   broker: ANSWER        go=0 (not a broker-mode container) or go=1
 *   helper: the facts     what the kernel says about the target, or a refusal
 *   broker: ANSWER        go=0, or go=1 with the mount's parameters
 *   helper: built         the new, still detached, mount's connection (its device)
 *   broker: ANSWER        go=1 once that connection is recorded (else go=0)
 *   helper: the result    the new mount's id, connection and line, or failed=
 * Every message's fields are declared in fuse_plugin/broker/messages.py.
 *
 * What no message can switch off (a request cut short must not lose them): the
 * walk and every check run with the caller's uid, gid and groups, and never look inside
 * a mount of a type in NO_WALK. The caller's fd is judged from /proc (its fdinfo and the
 * mount table) before it is taken, so a tenant's file whose close waits on its FUSE
 * daemon (FLUSH) is never owned here.
 *
 * Nothing here decides policy (policy.py does, from the facts). What this program
 * guarantees itself: paths are resolved from the root of the caller's mount namespace
 * (setns sets it), never from the caller's root or cwd; one component at a time,
 * without symlinks, and never inside a mount whose type is in NO_WALK (a FUSE daemon
 * can stall any lookup); a non-root caller's walk runs with its own uid, gid and
 * groups and without the capabilities that bypass permissions; the /dev/fuse fd is
 * taken from the caller (pidfd_getfd) and must be the FUSE device, so the mount
 * proves the caller may open /dev/fuse; the mount is built with the new mount API
 * (fsopen in the caller's user namespace, so the superblock belongs to it) and its
 * flags are read back from the mount table and undone if they are not what was asked.
 * Its superblock is created in the caller's PID namespace by a process with the node's
 * credentials that holds nothing but the mount's context and the caller's own /dev/fuse
 * (start_agent, create_in_pidns): the only process of this program a pod can see.
 *
 * Static (musl): it runs with the broker's privileges and loads nothing.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <sched.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/fsuid.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAX_FRAME 163840
#define MAX_FIELDS 16
#define MAX_GROUPS 32768
#define FRAME_MAGIC "FBH1"
#define FRAME_HEAD 12
#define REQUEST 1
#define ANSWER 2
#define REPORT 3
#define MAX_PATH 4096
/* Each message from the broker: the fields it may have, then those it must have, as
 * fuse_plugin/broker/messages.py declares them (its Request, and the answers ANSWERS
 * allows to each report; tests/unit/test_broker_messages.py keeps them equal, and this
 * program's say sites equal its reports). */
#define REQUEST_FIELDS "op path uid gid groups fuse_fd", "op path uid gid groups"
#define ANSWER_TO_MARK "go", "go"
#define ANSWER_TO_MOUNT_FACTS "go source subtype max_read flags attrs", "go"
#define ANSWER_TO_UNMOUNT_FACTS "go lazy", "go"
#define ANSWER_TO_BUILT "go", "go"

/* The new mount API and friends (uapi values; one number on every architecture). */
#define SYS_fsopen_ 430
#define SYS_fsconfig_ 431
#define SYS_fsmount_ 432
#define SYS_close_range_ 436
#define SYS_pidfd_getfd_ 438
#define SYS_faccessat2_ 439
#define FSOPEN_CLOEXEC 0x1
#define FSCONFIG_SET_FLAG 0
#define FSCONFIG_SET_STRING 1
#define FSCONFIG_CMD_CREATE 6
#define FSMOUNT_CLOEXEC 0x1
#define MOUNT_ATTR_NOATIME 0x10
#define MOVE_MOUNT_T_EMPTY_PATH 0x40
#define STATX_TYPE 0x1
#define STATX_MODE 0x2
#define STATX_UID 0x8
#define FUSE_MAJOR 10
#define FUSE_MINOR 229
#define CAP_DAC_OVERRIDE 1
#define CAP_DAC_READ_SEARCH 2
#define CAP_FOWNER 3

struct cap_header {
	uint32_t version;
	int pid;
};

struct cap_data {
	uint32_t effective, permitted, inheritable;
};

/* One received frame's fields, pointing into its buffer (each key and value is
 * followed by a NUL on the wire, so they are C strings; len is the value's size). */
struct fields {
	int count;
	const char *key[MAX_FIELDS];
	const char *value[MAX_FIELDS];
	size_t len[MAX_FIELDS];
};

static int ctl = -1;

/* Sends one REPORT frame of the given key, value pairs (NULL-terminated list). One that
 * does not fit is never sent cut: a short failure goes instead. Exits on a send failure:
 * a broker that stopped listening has given up on this request. */
static void say(const char *key, ...)
{
	static char out[MAX_FRAME];
	size_t len = FRAME_HEAD;
	uint32_t total;
	int count = 0, whole = 1;
	va_list args;

	va_start(args, key);
	for (; key; key = va_arg(args, const char *)) {
		const char *value = va_arg(args, const char *);
		size_t k = strlen(key), v;
		uint32_t v32;
		if (!value)
			value = "";
		v = strlen(value);
		if (count == MAX_FIELDS || k > 255 || len + k + v + 7 > sizeof(out)) {
			whole = 0;
			break;
		}
		out[len++] = (char)k;
		memcpy(out + len, key, k + 1);
		len += k + 1;
		v32 = (uint32_t)v;
		memcpy(out + len, &v32, 4);
		len += 4;
		memcpy(out + len, value, v + 1);
		len += v + 1;
		count++;
	}
	va_end(args);
	if (!whole) {
		say("status", "failed", "message", "the helper's report does not fit in one frame",
		    NULL);
		_exit(1);
	}
	total = (uint32_t)len;
	memcpy(out, FRAME_MAGIC, 4);
	memcpy(out + 4, &total, 4);
	out[8] = REPORT;
	out[9] = (char)count;
	out[10] = out[11] = 0;
	if (send(ctl, out, len, MSG_NOSIGNAL) != (ssize_t)len)
		_exit(1);
}

/* What a refusal is about, for the broker's log and metrics (policy.Refused.kind). */
static const char *refusal_kind = "path";

/* Ends the request: refused (a rule about the target) or failed (the system said no). */
static void finish(const char *status, const char *format, ...)
{
	char text[1024];
	va_list args;

	va_start(args, format);
	vsnprintf(text, sizeof(text), format, args);
	va_end(args);
	say("status", status, "message", text, "kind", refusal_kind, NULL);
	_exit(0);
}

static void refused(const char *format, const char *a, const char *b)
{
	finish("refused", format, a, b);
}

static void failed(const char *what)
{
	finish("failed", "%s: %s", what, strerror(errno));
}

#include "mounts.h"

/* Reads one frame of type kind into fields pointing into buf; NULL, or what is wrong. */
static const char *parse(const char *buf, size_t n, int kind, struct fields *f)
{
	uint32_t total;
	size_t at = FRAME_HEAD;
	int count;

	f->count = 0;
	if (n < FRAME_HEAD || memcmp(buf, FRAME_MAGIC, 4) != 0 || buf[10] || buf[11])
		return "it is not a frame";
	memcpy(&total, buf + 4, 4);
	if (total != n)
		return "its length is not what arrived";
	if ((unsigned char)buf[8] != kind)
		return "it is not the expected type of message";
	count = (unsigned char)buf[9];
	if (count > MAX_FIELDS)
		return "it has too many fields";
	for (int i = 0; i < count; i++) {
		size_t k, v;
		uint32_t v32;
		const char *key, *value;
		if (at + 1 > n)
			return "a field runs past its end";
		k = (unsigned char)buf[at++];
		if (k == 0 || at + k + 1 > n || buf[at + k] != 0 || memchr(buf + at, 0, k))
			return "a field's name is malformed";
		key = buf + at;
		at += k + 1;
		if (at + 4 > n)
			return "a field runs past its end";
		memcpy(&v32, buf + at, 4);
		at += 4;
		v = v32;
		if (v >= n - at || buf[at + v] != 0)
			return "a field runs past its end";
		value = buf + at;
		at += v + 1;
		for (int j = 0; j < f->count; j++)
			if (strcmp(f->key[j], key) == 0)
				return "a field is given twice";
		if (strcmp(key, "groups") != 0 && memchr(value, 0, v))
			return "a text field holds a NUL byte";
		f->key[f->count] = key;
		f->value[f->count] = value;
		f->len[f->count++] = v;
	}
	if (at != n)
		return "bytes follow its last field";
	return NULL;
}

static int has(const struct fields *f, const char *key)
{
	for (int i = 0; i < f->count; i++)
		if (strcmp(f->key[i], key) == 0)
			return 1;
	return 0;
}

/* The message's fields must be among allowed (space-separated names), and include
 * needed: a message that says less than it must is refused whole, never guessed at. */
static const char *schema(const struct fields *f, const char *allowed, const char *needed)
{
	char want[256], *save = NULL;

	for (int i = 0; i < f->count; i++) {
		size_t k = strlen(f->key[i]);
		const char *p = strstr(allowed, f->key[i]);
		while (p && !((p == allowed || p[-1] == ' ') && (p[k] == ' ' || p[k] == '\0')))
			p = strstr(p + 1, f->key[i]);
		if (!p)
			return "it has a field this helper does not know";
	}
	snprintf(want, sizeof(want), "%s", needed);
	for (char *w = strtok_r(want, " ", &save); w; w = strtok_r(NULL, " ", &save))
		if (!has(f, w))
			return "it lacks a field it must have";
	return NULL;
}

/* Receives one frame of type kind, read whole (MSG_TRUNC reports a longer one, which is
 * refused, not cut), and checks it against its schema. */
static void hear(char *buf, int kind, const char *allowed, const char *needed,
		 struct fields *out)
{
	ssize_t n = recv(ctl, buf, MAX_FRAME, MSG_TRUNC);
	const char *wrong;

	if (n <= 0)
		_exit(1); /* the broker went away or gave up */
	if (n > MAX_FRAME)
		finish("failed", "a message of %zd bytes from the broker is larger than %d: "
		       "refused whole", n, MAX_FRAME);
	wrong = parse(buf, (size_t)n, kind, out);
	if (!wrong)
		wrong = schema(out, allowed, needed);
	if (wrong)
		finish("failed", "bad message from the broker: %s", wrong);
}

static const char *get(const struct fields *f, const char *key)
{
	for (int i = 0; i < f->count; i++)
		if (strcmp(f->key[i], key) == 0)
			return f->value[i];
	return "";
}

static long number(const char *text, long max)
{
	char *end;
	long value;

	if (strspn(text, "0123456789") != strlen(text) || strlen(text) > 10)
		finish("failed", "bad message from the broker: bad number '%.20s'", text);
	errno = 0;
	value = strtol(text, &end, 10);
	if (!*text || *end || errno || value < 0 || value > max)
		finish("failed", "bad message from the broker: bad number '%s'", text);
	return value;
}

/* The request's groups: an array of u32, each a valid id, at most MAX_GROUPS. */
static const char *group_array(const struct fields *req, size_t *count)
{
	const char *raw = NULL;
	size_t len = 0;

	for (int i = 0; i < req->count; i++)
		if (strcmp(req->key[i], "groups") == 0) {
			raw = req->value[i];
			len = req->len[i];
		}
	if (!raw || len % 4 != 0 || len / 4 > MAX_GROUPS)
		finish("failed", "bad message from the broker: groups of %zu bytes", len);
	for (size_t i = 0; i < len / 4; i++) {
		uint32_t one;
		memcpy(&one, raw + 4 * i, 4);
		if (one > 0xfffffffeu)
			finish("failed", "%s", "bad message from the broker: a group id of -1");
	}
	*count = len / 4;
	return raw;
}

/* The whole request is checked before anything is done for it: a field that fails its
 * type ends the request here, not halfway through. */
static int check_request(const struct fields *req)
{
	size_t n;
	int mount = strcmp(get(req, "op"), "mount") == 0;

	if (!mount && strcmp(get(req, "op"), "unmount") != 0)
		finish("failed", "bad message from the broker: unknown op '%s'", get(req, "op"));
	if (mount != has(req, "fuse_fd"))
		finish("failed", "%s", "bad message from the broker: fuse_fd goes with mount, "
		       "and only with mount");
	if (mount)
		number(get(req, "fuse_fd"), 1 << 20);
	number(get(req, "uid"), 0xfffffffe);
	number(get(req, "gid"), 0xfffffffe);
	group_array(req, &n);
	if (get(req, "path")[0] != '/' || strlen(get(req, "path")) >= MAX_PATH)
		finish("failed", "%s", "bad message from the broker: the path");
	return mount;
}

/* Take the caller's uid, gid and groups for every permission check from here on;
 * done before entering its user namespace, with the ids as the node sees them. Every
 * caller, node root included (whose ids keep root's powers): there is no request in
 * which the walk runs as anyone else. The groups arrive as an array of u32, all of
 * them (a frame holds up to MAX_GROUPS; the broker refuses a caller with more). */
static void become_caller(const struct fields *req)
{
	static gid_t groups[MAX_GROUPS];
	size_t n;
	const char *raw = group_array(req, &n);
	uid_t uid = (uid_t)number(get(req, "uid"), 0xfffffffe);
	gid_t gid = (gid_t)number(get(req, "gid"), 0xfffffffe);

	for (size_t i = 0; i < n; i++) {
		uint32_t one;
		memcpy(&one, raw + 4 * i, 4);
		groups[i] = (gid_t)one;
	}
	if (setgroups(n, groups) == -1)
		failed("setgroups");
	setfsgid(gid);
	setfsuid(uid);
	if ((uid_t)setfsuid((uid_t)-1) != uid || (gid_t)setfsgid((gid_t)-1) != gid)
		finish("failed", "%s", "cannot take the caller's uid and gid");
}

/* Clear, from the effective set, the capabilities that bypass file permissions.
 * Entering a user namespace grants them all there; a caller who is not root in it
 * must be judged without them. */
static void drop_dac(void)
{
	struct cap_header h = { 0x20080522, 0 }; /* _LINUX_CAPABILITY_VERSION_3 */
	struct cap_data d[2];

	if (syscall(SYS_capget, &h, d) == -1)
		failed("capget");
	d[0].effective &= ~(1u << CAP_DAC_OVERRIDE | 1u << CAP_DAC_READ_SEARCH | 1u << CAP_FOWNER);
	if (syscall(SYS_capset, &h, d) == -1)
		failed("capset");
}

static const char *reason(int err)
{
	switch (err) {
	case ELOOP:
		return "a symlink is on the way (the shim resolves links; a link here means it "
		       "changed or the client is not the shim)";
	case ENOTDIR:
		return "it is not a directory";
	case ENOENT:
		return "it does not exist";
	case EACCES:
		return "the caller may not search a directory on the way";
	case EXDEV:
		return "it leaves the namespace's root";
	default:
		return strerror(err);
	}
}

/* The shared walk (mounts.h), with this program's words for a component it cannot open. */
static int walk(const struct table *t, const char *path, int whole)
{
	int fd = walk_beneath(t, path, whole);

	if (fd == -1) {
		if (errno == EACCES)
			refusal_kind = "permission";
		refused("mountpoint '%s' refused: %s", path, reason(errno));
	}
	return fd;
}

/* First of all, what shows whether Allocate gave this namespace broker mode: the
 * mount at /run/fuse-broker. The broker judges it before anything else is looked at. */
static void present_mark(const struct table *t)
{
	static char buf[MAX_FRAME];
	struct fields answer;
	const struct mount *mark = find_point(t, BROKER_DIR);

	say("status", "mark", "mark_dev", mark ? mark->dev : "", "mark_root",
	    mark ? mark->root : "", NULL);
	hear(buf, ANSWER, ANSWER_TO_MARK, &answer);
	if (strcmp(get(&answer, "go"), "1") != 0)
		_exit(0);
}

/* A small procfs file, NUL-terminated; -1 with errno when it cannot be read. */
static ssize_t read_small(int proc, const char *name, char *out, size_t size)
{
	int fd = openat(proc, name, O_RDONLY | O_CLOEXEC);
	ssize_t n;

	if (fd == -1)
		return -1;
	n = read(fd, out, size - 1);
	close(fd);
	if (n >= 0)
		out[n] = '\0';
	return n;
}

static ssize_t readlink_at(int dir, const char *name, char *out, size_t size)
{
	ssize_t n = readlinkat(dir, name, out, size - 1);

	if (n >= 0)
		out[n] = '\0';
	return n;
}

/* The number after "key:" at the start of a line of a procfs file, in base; -1 if absent. */
static long line_number(const char *text, const char *key, int base)
{
	size_t len = strlen(key);

	for (const char *p = text; p && *p; p = strchr(p, '\n') ? strchr(p, '\n') + 1 : NULL)
		if (strncmp(p, key, len) == 0 && p[len] == ':')
			return strtol(p + len + 1, NULL, base);
	return -1;
}

/* Judge the caller's fd N without taking it, from what the kernel says about it (the
 * fd's flags and mount in /proc/PID/fdinfo/N, that mount's type in the caller's table,
 * and a statx through /proc/PID/fd/N that FUSE answers from its cache): a file whose
 * close could wait on a tenant (a FUSE file's FLUSH, a lingering socket) is refused
 * before this process ever owns it. */
static void judge_fd(int proc, long pid, const char *number_text)
{
	char name[64], info[1024], link[128];
	const char *not_fuse = "the caller's fd %s is not /dev/fuse opened for reading and "
			       "writing%s";
	struct table t = { 0 };
	const struct mount *m;
	struct statx_ st;
	long flags, mnt_id;
	ssize_t n;

	snprintf(name, sizeof(name), "%ld/fdinfo/%s", pid, number_text);
	if (read_small(proc, name, info, sizeof(info)) == -1) {
		if (errno == ENOENT)
			refused("the caller has no open fd %s%s", number_text,
				" (the shim sends the /dev/fuse it opened)");
		failed("read the caller's fdinfo");
	}
	flags = line_number(info, "flags", 8);
	mnt_id = line_number(info, "mnt_id", 10);
	if (flags == -1 || mnt_id == -1)
		finish("failed", "%s", "the caller's fdinfo has no flags or mnt_id");
	snprintf(name, sizeof(name), "%ld/fd/%s", pid, number_text);
	n = readlink_at(proc, name, link, sizeof(link));
	if (n > 0 && link[0] != '/')
		refused(not_fuse, number_text, " (it is not a file at a path)");
	if ((flags & O_PATH) || (flags & O_ACCMODE) != O_RDWR)
		refused(not_fuse, number_text, "");
	snprintf(name, sizeof(name), "%ld/mountinfo", pid);
	read_table_of(proc, name, &t);
	m = find_id(&t, (unsigned long)mnt_id);
	if (!m)
		refused(not_fuse, number_text, " (its mount is not in the caller's namespace)");
	if (listed(NO_WALK, m->fstype))
		refused(not_fuse, number_text, " (it is a file in a FUSE mount)");
	snprintf(name, sizeof(name), "%ld/fd/%s", pid, number_text);
	if (syscall(SYS_statx, proc, name, AT_STATX_DONT_SYNC, STATX_TYPE, &st) == -1)
		failed("statx the caller's fd");
	if (!S_ISCHR(st.stx_mode) || st.stx_rdev_major != FUSE_MAJOR
	    || st.stx_rdev_minor != FUSE_MINOR)
		refused(not_fuse, number_text, "");
	free(t.text);
	free(t.mounts);
}

/* The caller's own /dev/fuse, judged first (judge_fd) and then taken from its fd table
 * and checked again: an fd of the FUSE device, opened for reading and writing (not an
 * O_PATH handle of some node named like it). A caller that swaps another file in
 * between the two makes this process own that file; the broker counts such a helper
 * until it has exited, and gives its container no other. */
static int take_fuse_fd(int proc, int pidfd, const char *number_text)
{
	int fd;
	struct statx_ st;
	int flags;
	long pid;
	char name[64], info[1024];

	refusal_kind = "allocation";
	number(number_text, 1 << 20);
	snprintf(name, sizeof(name), "self/fdinfo/%d", pidfd);
	if (read_small(proc, name, info, sizeof(info)) == -1)
		failed("read the pidfd's fdinfo");
	pid = line_number(info, "Pid", 10);
	if (pid <= 0)
		refused("the calling process has exited%s%s", "", "");
	judge_fd(proc, pid, number_text);
	fd = (int)syscall(SYS_pidfd_getfd_, pidfd, (int)number(number_text, 1 << 20), 0);
	if (fd == -1) {
		if (errno == EBADF)
			refused("the caller has no open fd %s%s", number_text,
				" (the shim sends the /dev/fuse it opened)");
		failed("pidfd_getfd");
	}
	flags = fcntl(fd, F_GETFL);
	if (flags == -1 || statx_fd(fd, STATX_TYPE, &st) == -1)
		failed("inspect the caller's fd");
	if ((flags & O_PATH) || (flags & O_ACCMODE) != O_RDWR || !S_ISCHR(st.stx_mode)
	    || st.stx_rdev_major != FUSE_MAJOR || st.stx_rdev_minor != FUSE_MINOR)
		refused("the caller's fd %s is not /dev/fuse opened for reading and writing%s",
			number_text, " (it changed while it was judged)");
	refusal_kind = "path";
	return fd;
}

static void fsconfig_string(int fs, const char *key, const char *value)
{
	if (*value && syscall(SYS_fsconfig_, fs, FSCONFIG_SET_STRING, key, value, 0) == -1)
		finish("failed", "mount option %s: %s", key, strerror(errno));
}

static int has_option(const char *list, const char *want)
{
	size_t len = strlen(want);

	for (const char *p = list; p && *p; p = strchr(p, ',') ? strchr(p, ',') + 1 : NULL)
		if (strncmp(p, want, len) == 0 && (p[len] == ',' || p[len] == '\0'))
			return 1;
	return 0;
}

/* The superblock takes the PID namespace of the process that creates it (the kernel
 * names every requester to the daemon by its pid there, and pid 0 for processes outside
 * it), so one step must run in a process of the caller's PID namespace, where the pod
 * sees it and can name it. That step is one call, fsconfig(FSCONFIG_CMD_CREATE), on a
 * context this process opened (in the caller's user namespace, so the superblock belongs
 * to it) and configured. The process that makes it is built so that the pod can do
 * nothing to it beyond ending its own request:
 *   - its credentials are the node's: it is forked by an agent that this process forked
 *     before it took the caller's ids and user namespace (start_agent), so a pod's root,
 *     whose capabilities (CAP_KILL...) count only in its own user namespace and whose
 *     ids (hostUsers: false) are not the node's uid 0, may not signal, ptrace or prlimit
 *     it, nor open its /proc files; it is not in the caller's mount namespace either;
 *   - it is not dumpable (inherited from this process; nothing in it execs or changes
 *     ids), so ptrace, pidfd_getfd and /proc/PID/{fd/N,fdinfo,root,cwd,mem,environ,ns}
 *     need CAP_SYS_PTRACE in the node's user namespace, even for the node's uid 0 (the
 *     capabilities it holds, which a pod's do not include, ask for the same);
 *   - from its first instruction it holds two descriptors, the context and the caller's
 *     own /dev/fuse (whose number, set as "fd", the kernel may look up at CMD_CREATE):
 *     the agent closes its socket to this process and the caller's pidfd before the
 *     fork, and reports by its exit status;
 *   - every signal it can block is blocked. The node's uid 0 (a hostUsers: true pod's
 *     root) may still SIGKILL or SIGSTOP it: the agent waits for stops too, ends a
 *     stopped step, and the request fails at once saying why; the context goes with this
 *     process, and nothing was recorded or attached.
 * The agent lives in the broker's PID and mount namespaces, which no pod sees, and dies
 * with this process (PR_SET_PDEATHSIG), as the step dies with the agent; a step whose
 * agent died before its PR_SET_PDEATHSIG makes its one call and exits. */
/* The agent's exit status says how the step went (the agent holds no channel to this
 * process while the step lives, so that the step inherits none): */
#define STEP_CREATED 0 /* 1..127: the errno of FSCONFIG_CMD_CREATE */
#define STEP_KILLED 128 /* + the signal that ended the step */
#define STEP_STOPPED 200 /* + the signal that stopped it (then the agent ended it) */
#define STEP_NO_SETNS 240 /* setns into the caller's PID namespace failed: errno sent */
#define STEP_NO_FORK 241
#define STEP_DUMPABLE 242 /* the step found itself dumpable, and did nothing */
#define STEP_NO_CONTEXT 243
#define STEP_LOST 244 /* the agent could not wait for the step or send setns's errno */

/* Close every descriptor but keep[0..n-1] (sorted, ascending). */
static void keep_only(const int *keep, int n)
{
	unsigned lo = 0;

	for (int i = 0; i <= n; i++) {
		unsigned hi = i < n ? (unsigned)keep[i] : ~0u;
		if (hi > lo && syscall(SYS_close_range_, lo, hi - 1, 0) == -1)
			for (unsigned fd = lo; fd < hi && fd < 65536; fd++)
				close((int)fd); /* before Linux 5.9 */
		lo = hi + 1;
	}
}

/* The step: in the caller's PID namespace, with the node's credentials, holding the
 * context and the caller's /dev/fuse and nothing else from its first instruction. */
static void step(int fs)
{
	prctl(PR_SET_PDEATHSIG, SIGKILL);
	if (prctl(PR_GET_DUMPABLE, 0, 0, 0, 0) != 0)
		_exit(STEP_DUMPABLE);
	if (syscall(SYS_fsconfig_, fs, FSCONFIG_CMD_CREATE, NULL, NULL, 0) == -1)
		_exit(errno > 0 && errno < STEP_KILLED ? errno : EIO);
	_exit(STEP_CREATED);
}

/* The agent: waits for a context, has the step create its superblock, and exits with how
 * that went. */
static void agent(int sock, int pidfd, int fuse, pid_t parent)
{
	char byte, control[CMSG_SPACE(sizeof(int))];
	struct iovec io = { &byte, 1 };
	struct msghdr msg = { 0 };
	struct cmsghdr *cmsg;
	sigset_t all;
	int fs = -1, status, keep[3] = { sock, pidfd, fuse };
	pid_t child;

	prctl(PR_SET_PDEATHSIG, SIGKILL);
	if (getppid() != parent)
		_exit(STEP_LOST); /* the helper is gone already */
	for (int i = 0; i < 2; i++) /* sorted, for keep_only */
		for (int j = 0; j < 2 - i; j++)
			if (keep[j] > keep[j + 1]) {
				int t = keep[j];
				keep[j] = keep[j + 1];
				keep[j + 1] = t;
			}
	keep_only(keep, 3);
	msg.msg_iov = &io;
	msg.msg_iovlen = 1;
	msg.msg_control = control;
	msg.msg_controllen = sizeof(control);
	if (recvmsg(sock, &msg, 0) != 1 || !(cmsg = CMSG_FIRSTHDR(&msg))
	    || cmsg->cmsg_type != SCM_RIGHTS)
		_exit(STEP_NO_CONTEXT); /* or no mount to make: the request ended before */
	memcpy(&fs, CMSG_DATA(cmsg), sizeof(int));
	if (setns(pidfd, CLONE_NEWPID) == -1) {
		int err = errno;
		_exit(send(sock, &err, sizeof(err), MSG_NOSIGNAL) == (ssize_t)sizeof(err)
		      ? STEP_NO_SETNS : STEP_LOST);
	}
	close(sock);
	close(pidfd);
	/* Only SIGKILL and SIGSTOP reach the step; the mask is inherited at fork. */
	sigfillset(&all);
	sigprocmask(SIG_BLOCK, &all, NULL);
	child = fork();
	if (child == -1)
		_exit(STEP_NO_FORK);
	if (child == 0)
		step(fs);
	close(fs);
	close(fuse);
	while (waitpid(child, &status, WUNTRACED) == -1)
		if (errno != EINTR)
			_exit(STEP_LOST);
	if (WIFSTOPPED(status)) {
		kill(child, SIGKILL);
		while (waitpid(child, NULL, 0) == -1 && errno == EINTR)
			;
		_exit(STEP_STOPPED + (WSTOPSIG(status) & 31));
	}
	if (WIFSIGNALED(status))
		_exit(STEP_KILLED + WTERMSIG(status));
	_exit(WEXITSTATUS(status));
}

static pid_t agent_pid = -1;

/* Forks the agent, before this process takes on the caller's ids or namespaces; returns
 * this end of the socket pair to it. */
static int start_agent(int pidfd, int fuse)
{
	int pair[2];
	pid_t parent = getpid();

	if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, pair) == -1)
		failed("socketpair");
	agent_pid = fork();
	if (agent_pid == -1)
		failed("fork the agent");
	if (agent_pid == 0)
		agent(pair[1], pidfd, fuse, parent);
	close(pair[1]);
	return pair[0];
}

/* The step's one call, made in the caller's PID namespace by the agent's child. */
static void create_in_pidns(int agent_sock, int fs)
{
	char byte = 0, control[CMSG_SPACE(sizeof(int))] = { 0 };
	struct iovec io = { &byte, 1 };
	struct msghdr msg = { 0 };
	struct cmsghdr *cmsg;
	int status, code, err = 0;
	const char *why = "a process of the caller's may have sent it";

	msg.msg_iov = &io;
	msg.msg_iovlen = 1;
	msg.msg_control = control;
	msg.msg_controllen = sizeof(control);
	cmsg = CMSG_FIRSTHDR(&msg);
	cmsg->cmsg_level = SOL_SOCKET;
	cmsg->cmsg_type = SCM_RIGHTS;
	cmsg->cmsg_len = CMSG_LEN(sizeof(int));
	memcpy(CMSG_DATA(cmsg), &fs, sizeof(int));
	if (sendmsg(agent_sock, &msg, MSG_NOSIGNAL) != 1)
		failed("hand the mount's context to the agent");
	while (waitpid(agent_pid, &status, 0) == -1)
		if (errno != EINTR)
			failed("wait for the agent");
	if (!WIFEXITED(status))
		finish("failed", "the agent that makes the mount's step in the caller's PID "
		       "namespace was ended by signal %d", WTERMSIG(status));
	code = WEXITSTATUS(status);
	if (code == STEP_NO_SETNS) {
		if (recv(agent_sock, &err, sizeof(err), MSG_DONTWAIT) != (ssize_t)sizeof(err))
			err = 0;
		errno = err;
		failed("setns pid");
	}
	close(agent_sock);
	if (code == STEP_CREATED)
		return;
	if (code < STEP_KILLED) {
		errno = code;
		failed("create the FUSE superblock");
	}
	if (code > STEP_KILLED && code <= STEP_KILLED + 64)
		finish("failed", "the mount's step in the caller's PID namespace was ended by "
		       "signal %d (%s): %s", code - STEP_KILLED, strsignal(code - STEP_KILLED), why);
	if (code > STEP_STOPPED && code < STEP_STOPPED + 32)
		finish("failed", "the mount's step in the caller's PID namespace was stopped by "
		       "signal %d (%s), and given up: %s", code - STEP_STOPPED,
		       strsignal(code - STEP_STOPPED), why);
	finish("failed", "the mount's step in the caller's PID namespace %s",
	       code == STEP_NO_FORK ? "could not be forked"
	       : code == STEP_DUMPABLE ? "was dumpable: not made"
	       : "ended without saying how it went");
}

/* Build the FUSE mount as the verdict says: the context in the current (the caller's)
 * user namespace, its superblock in the caller's PID namespace (create_in_pidns), the
 * mount here; returns the detached mount's fd. */
static int build(int agent_sock, int fuse, const struct fields *v, uid_t uid, gid_t gid)
{
	char text[32];
	unsigned attrs = MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV;
	const char *flags = get(v, "flags");
	int fs = (int)syscall(SYS_fsopen_, "fuse", FSOPEN_CLOEXEC), mnt;

	if (fs == -1)
		failed("fsopen fuse");
	snprintf(text, sizeof(text), "%d", fuse);
	fsconfig_string(fs, "fd", text);
	fsconfig_string(fs, "rootmode", "40000");
	snprintf(text, sizeof(text), "%u", uid);
	fsconfig_string(fs, "user_id", text);
	snprintf(text, sizeof(text), "%u", gid);
	fsconfig_string(fs, "group_id", text);
	fsconfig_string(fs, "source", get(v, "source"));
	fsconfig_string(fs, "subtype", get(v, "subtype"));
	fsconfig_string(fs, "max_read", get(v, "max_read"));
	for (const char *p = flags; *p;) {
		char one[32];
		size_t len = strcspn(p, ",");
		if (len == 0 || len >= sizeof(one))
			finish("failed", "bad flags '%s' from the broker", flags);
		memcpy(one, p, len);
		one[len] = '\0';
		if (syscall(SYS_fsconfig_, fs, FSCONFIG_SET_FLAG, one, NULL, 0) == -1)
			finish("failed", "mount option %s: %s", one, strerror(errno));
		p += len + (p[len] == ',');
	}
	create_in_pidns(agent_sock, fs);
	attrs |= has_option(get(v, "attrs"), "ro") ? MOUNT_ATTR_RDONLY : 0;
	attrs |= has_option(get(v, "attrs"), "noexec") ? MOUNT_ATTR_NOEXEC : 0;
	attrs |= has_option(get(v, "attrs"), "noatime") ? MOUNT_ATTR_NOATIME : 0;
	mnt = (int)syscall(SYS_fsmount_, fs, FSMOUNT_CLOEXEC, attrs);
	if (mnt == -1)
		failed("fsmount");
	close(fs);
	return mnt;
}

/* Crash-only records: the broker records the new connection before the mount becomes
 * visible. The detached mount's superblock is the connection (its device 0:N); the
 * broker answers go=1 once its record is written, and only then is the mount attached
 * onto target, the very fd walked to. A broker that dies before that leaves a detached
 * mount, dropped when this process exits; one that dies after finds its record. */
/* The superblock's device of a new FUSE mount. An empty mask: FUSE answers it with the
 * device even to a process it would refuse anything else (the helper's real uid is not
 * the mount's user_id), on kernels that have that exception. Older ones (Debian 12's 6.1)
 * refuse it with EACCES: then a child that is wholly the caller (real, effective and saved
 * ids: FUSE checks all three, not the fsuid the walk used) asks, and says what it got. */
static void new_mount_device(int mnt, uid_t uid, gid_t gid, struct statx_ *st)
{
	int pair[2], status;
	pid_t child;

	if (statx_fd(mnt, 0, st) == 0)
		return;
	if (errno != EACCES || pipe2(pair, O_CLOEXEC) == -1)
		failed("statx the new mount");
	child = fork();
	if (child == -1)
		failed("fork to statx the new mount as the caller");
	if (child == 0) {
		close(pair[0]);
		if (setgroups(0, NULL) == -1 || setresgid(gid, gid, gid) == -1
		    || setresuid(uid, uid, uid) == -1 || statx_fd(mnt, 0, st) == -1)
			_exit(1);
		_exit(write(pair[1], st, sizeof(*st)) == (ssize_t)sizeof(*st) ? 0 : 1);
	}
	close(pair[1]);
	if (read(pair[0], st, sizeof(*st)) != (ssize_t)sizeof(*st)) {
		close(pair[0]);
		waitpid(child, &status, 0);
		errno = EACCES;
		failed("statx the new mount as the caller");
	}
	close(pair[0]);
	waitpid(child, &status, 0);
}

static void announce_and_attach(int mnt, int target, uid_t uid, gid_t gid)
{
	static char buf[MAX_FRAME];
	char dev[32];
	struct statx_ st;
	struct fields answer;

	new_mount_device(mnt, uid, gid, &st);
	snprintf(dev, sizeof(dev), "%u:%u", st.stx_dev_major, st.stx_dev_minor);
	say("status", "built", "dev", dev, NULL);
	hear(buf, ANSWER, ANSWER_TO_BUILT, &answer);
	if (strcmp(get(&answer, "go"), "1") != 0)
		_exit(0);
	if (syscall(SYS_move_mount_, mnt, "", target, "",
		    MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH) == -1)
		failed("move_mount");
}

/* The new mount as the table shows it must carry what was asked; else it is undone. */
static void verify(int proc, int mnt, const struct fields *v, uid_t uid, gid_t gid)
{
	struct table t = { 0 };
	const struct mount *m;
	char want[64];
	const char *problem = NULL;

	read_table(proc, &t);
	m = find_id(&t, mount_id_of(mnt));
	if (!m)
		problem = "it is not in the mount table";
	else if (!has_option(m->options, "nosuid") || !has_option(m->options, "nodev"))
		problem = "it is not nosuid,nodev";
	else if (has_option(get(v, "attrs"), "ro") && !has_option(m->options, "ro"))
		problem = "it is not read-only";
	else if (has_option(get(v, "attrs"), "noexec") && !has_option(m->options, "noexec"))
		problem = "it is not noexec";
	else if (has_option(get(v, "flags"), "allow_other") != has_option(m->super, "allow_other"))
		problem = "allow_other is not as asked";
	if (!problem && m) {
		snprintf(want, sizeof(want), "user_id=%u", uid);
		if (!has_option(m->super, want))
			problem = "its user_id is not the caller's";
		snprintf(want, sizeof(want), "group_id=%u", gid);
		if (!problem && !has_option(m->super, want))
			problem = "its group_id is not the caller's";
	}
	if (problem) {
		detach(proc, mnt);
		finish("failed", "the mount was undone: %s", problem);
	}
	say("status", "ok", "mnt_id", (snprintf(want, sizeof(want), "%lu", m->id), want),
	    "dev", m->dev, "options", m->options, NULL);
}

static void mount_op(int proc, int agent_sock, int fuse, const struct fields *req)
{
	static char buf[MAX_FRAME];
	char mode[16], owner[16], writable[2] = "-", mount[24];
	char ids[2][16];
	const char *path = get(req, "path");
	struct fields verdict;
	struct table t = { 0 };
	struct statx_ st;
	const struct mount *m;
	uid_t uid = (uid_t)setfsuid((uid_t)-1); /* as the caller's namespace names them */
	gid_t gid = (gid_t)setfsgid((gid_t)-1);
	int target, mnt;

	read_table(proc, &t);
	present_mark(&t);
	target = walk(&t, path, 1);
	/* Nothing below may ask a stallable filesystem, the target's included. */
	check_walkable(&t, target, path);
	m = find_id(&t, mount_id_of(target));
	if (statx_fd(target, STATX_TYPE | STATX_MODE | STATX_UID, &st) == -1)
		failed("statx the mountpoint");
	if (!S_ISDIR(st.stx_mode))
		refused("mountpoint '%s' refused: %s", path, reason(ENOTDIR));
	writable[0] = syscall(SYS_faccessat2_, target, "", W_OK,
			      AT_EMPTY_PATH | AT_EACCESS) == 0 ? '1' : '0';
	snprintf(mode, sizeof(mode), "%o", st.stx_mode & 07777);
	snprintf(owner, sizeof(owner), "%u", st.stx_uid);
	snprintf(mount, sizeof(mount), "%lu", m->id);
	snprintf(ids[0], sizeof(ids[0]), "%u", uid);
	snprintf(ids[1], sizeof(ids[1]), "%u", gid);
	say("status", "facts", "mount", mount, "fstype", m->fstype, "mount_point", m->point,
	    "shared", m->shared ? "1" : "0", "mode", mode, "owner", owner,
	    "writable", writable, "uid", ids[0], "gid", ids[1], NULL);
	hear(buf, ANSWER, ANSWER_TO_MOUNT_FACTS, &verdict);
	if (strcmp(get(&verdict, "go"), "1") != 0)
		_exit(0);
	mnt = build(agent_sock, fuse, &verdict, uid, gid);
	announce_and_attach(mnt, target, uid, gid);
	verify(proc, mnt, &verdict, uid, gid);
}

static void unmount_op(int proc, const struct fields *req)
{
	static char buf[MAX_FRAME];
	char id[24];
	const char *path = get(req, "path"), *name = strrchr(path, '/') + 1;
	struct fields verdict;
	struct table t = { 0 };
	const struct mount *m;
	int parent, top;

	read_table(proc, &t);
	present_mark(&t);
	parent = walk(&t, path, 0);
	/* Crossing into the mount on top of name asks nothing of its filesystem. */
	top = open_one(parent, name);
	if (top == -1)
		refused("'%s' refused: %s", path, reason(errno));
	m = find_id(&t, mount_id_of(top));
	if (!m || strcmp(m->point, path) != 0)
		refused("'%s' is not a mountpoint%s", path, "");
	close(top); /* an open fd, even O_PATH, would keep the mount busy */
	snprintf(id, sizeof(id), "%lu", m->id);
	say("status", "facts", "mount", id, "fstype", m->fstype, "dev", m->dev, NULL);
	hear(buf, ANSWER, ANSWER_TO_UNMOUNT_FACTS, &verdict);
	if (strcmp(get(&verdict, "go"), "1") != 0)
		_exit(0);
	if (fchdir(parent) == -1)
		failed("fchdir");
	if (umount2(name, UMOUNT_NOFOLLOW_ | (strcmp(get(&verdict, "lazy"), "1") ? 0 : MNT_DETACH))
	    == -1)
		failed("umount");
	say("status", "ok", "mnt_id", id, NULL);
}

int main(int argc, char *argv[])
{
	static char buf[MAX_FRAME];
	struct fields req;
	int pidfd, mntns, userns = -1, proc, mount, fuse = -1, agent_sock = -1;
	const char *uncharged;

	if (argc != 4 && argc != 5) {
		fprintf(stderr, "usage: fuse-broker-helper CTLFD PIDFD MNTNSFD [USERNSFD]\n");
		return 2;
	}
	/* Not dumpable before it enters a tenant's namespaces, as runc's nsexec: a process
	 * of the tenant's user namespace could otherwise ptrace the helper (its creds then
	 * belong to that namespace) or read its memory through /proc. Changing the fsuid in
	 * become_caller has the same effect only where suid_dumpable is 0 and the fsuid
	 * changes (not for a node-root caller). Its children inherit it: the agent, and the
	 * step in the caller's PID namespace (build), whose ids are the node's. */
	if (prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) == -1)
		failed("prctl PR_SET_DUMPABLE");
	ctl = (int)number(argv[1], 1 << 20);
	uncharged = join_cgroups(); /* first: all that follows is the caller's */
	pidfd = (int)number(argv[2], 1 << 20);
	mntns = (int)number(argv[3], 1 << 20);
	if (argc == 5)
		userns = (int)number(argv[4], 1 << 20);
	hear(buf, REQUEST, REQUEST_FIELDS, &req);
	if (uncharged) {
		refusal_kind = "caller";
		refused("%s; the broker runs no helper outside its caller's cgroups%s",
			uncharged, "");
	}
	mount = check_request(&req);
	/* With the broker's own credentials: the caller's fd, and the broker's /proc,
	 * through which the caller's mount table is read after setns. */
	proc = open("/proc", O_PATH | O_DIRECTORY | O_CLOEXEC);
	if (proc == -1)
		failed("open /proc");
	if (mount) {
		fuse = take_fuse_fd(proc, pidfd, get(&req, "fuse_fd"));
		/* Forked before this process takes the caller's ids and user namespace: the
		 * agent's, and its step's, credentials stay the node's (build). */
		agent_sock = start_agent(pidfd, fuse);
	}
	become_caller(&req);
	if (userns != -1 && setns(userns, CLONE_NEWUSER) == -1)
		failed("setns user");
	if (setns(mntns, CLONE_NEWNS) == -1)
		failed("setns mnt");
	if (setfsuid((uid_t)-1) != 0)
		drop_dac();
	if (mount)
		mount_op(proc, agent_sock, fuse, &req);
	else
		unmount_op(proc, &req);
	return 0;
}
