/*
 * fusermount3 for containers in fuse-device-plugin's broker mode.
 *
 * Allocate binds this binary over /usr/bin/fusermount3, /usr/bin/fusermount and their
 * /bin twins. A FUSE program without CAP_SYS_ADMIN fails mount(2) with EPERM, and
 * libfuse (or a Go FUSE library) then runs it as
 *
 *     fusermount3 [-o OPTIONS] [--] MOUNTPOINT        with _FUSE_COMMFD=N
 *     fusermount3 [-o OPTIONS] [--] MOUNTPOINT        with _FUSE_DEVFD=N (glusterfs)
 *     fusermount3 -u [-q] [-z] [--] MOUNTPOINT
 *     fusermount3 --lxcfs -- COMMAND [ARG...]       (LXCFS views: ours, not fusermount3's)
 *
 * Instead of mounting, it opens /dev/fuse itself (which only a container that Allocate
 * gave the device can do), asks the node's broker over a unix socket to mount it, naming
 * the fd, and once the broker says ok hands that fd to libfuse over _FUSE_COMMFD as real
 * fusermount3 does. The broker takes the fd from this process (pidfd_getfd); nothing
 * travels over the socket but text. See docs/broker-internals.md for the protocol and
 * docs/security.md for why the broker, not this program, is what is trusted.
 *
 * A broker that is restarting (its DaemonSet rolled out: the socket is gone, or left by a
 * broker that was killed, or a stopping broker answered retry=1) is waited for, up to
 * WAIT_SECONDS or $FUSE_BROKER_WAIT, and said so once; try_broker says when a request may
 * be sent again.
 *
 * Static and dependency-free (musl), because it runs in arbitrary images. Every error is
 * one line on stderr and exit status 1.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <limits.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

/* Keep in step with fuse_plugin/broker/protocol.py (a unit test compares them). */
#define BROKER_SOCKET "/run/fuse-broker/broker.sock"
#define SOCKET_ENV "FUSE_BROKER_SOCKET"
#define COMMFD_ENV "_FUSE_COMMFD"
#define DEVFD_ENV "_FUSE_DEVFD"
#define PROTOCOL_VERSION "2"
/* In a reply: "1" when a stopping broker did nothing of the request (ask the next one). */
#define RETRY_FIELD "retry"
/* In a refusal of --lxcfs: "1" when no lxcfs serves yet (asked again within the wait). */
#define LATER_FIELD "later"
#define LATER_PAUSE_MS 500
#define FUSE_DEVICE "/dev/fuse"
#define MAX_MESSAGE 16384
#define REPLY_TIMEOUT_SECONDS 60
/* A broker that is not there is waited for this long: a rollout of its DaemonSet left a
 * node without one for 1.7-5.8 s (issue 35). $FUSE_BROKER_WAIT (whole seconds, 0: no
 * wait) overrides it. */
#define WAIT_ENV "FUSE_BROKER_WAIT"
#define WAIT_SECONDS 30
#define WAIT_MOST 3600
#define BACKOFF_FIRST_MS 20
#define BACKOFF_MOST_MS 500

static const char *progname = "fusermount3";
static int quiet;

_Noreturn static void fail(const char *format, ...)
{
	va_list args;

	if (!quiet) {
		fprintf(stderr, "%s: ", progname);
		va_start(args, format);
		vfprintf(stderr, format, args);
		va_end(args);
		fputc('\n', stderr);
	}
	exit(1);
}

/* Appends "key=value\0" to the request; the broker refuses truncated or unknown fields. */
static void add_field(char *buf, size_t *len, const char *key, const char *value)
{
	int n = snprintf(buf + *len, MAX_MESSAGE - *len, "%s=%s", key, value);

	if (n < 0 || (size_t)n + 1 > MAX_MESSAGE - *len)
		fail("request too long (mountpoint or options)");
	*len += (size_t)n + 1;
}

/* Value of "key=" in a reply of NUL-terminated fields, or NULL. */
static const char *field(const char *buf, size_t len, const char *key)
{
	size_t klen = strlen(key);
	const char *p = buf;

	while (p < buf + len) {
		size_t flen = strnlen(p, (size_t)(buf + len - p));
		if (flen > klen && strncmp(p, key, klen) == 0 && p[klen] == '=')
			return p + klen + 1;
		p += flen + 1;
	}
	return NULL;
}

/*
 * The mountpoint in the container's own view, with no symlink left in it (the broker
 * refuses any). To mount, the whole path, as mount(2) would follow it. To unmount, the
 * parent through realpath and the last component as given, as fusermount3 does: a dead
 * FUSE mount fails stat and must still be unmountable.
 */
static void resolve(const char *mountpoint, int whole, char *out)
{
	char copy[PATH_MAX], parent[PATH_MAX];
	char *slash, *last;
	size_t len = strlen(mountpoint);

	if (len == 0 || len >= sizeof(copy))
		fail("bad mountpoint '%s'", mountpoint);
	if (whole) {
		if (!realpath(mountpoint, out))
			fail("bad mountpoint '%s': %s", mountpoint, strerror(errno));
		return;
	}
	memcpy(copy, mountpoint, len + 1);
	while (len > 1 && copy[len - 1] == '/')
		copy[--len] = '\0';
	slash = strrchr(copy, '/');
	last = slash ? slash + 1 : copy;
	if (strcmp(last, ".") == 0 || strcmp(last, "..") == 0 || strcmp(copy, "/") == 0) {
		if (!realpath(copy, out))
			fail("bad mountpoint '%s': %s", mountpoint, strerror(errno));
		return;
	}
	if (slash == copy)
		strcpy(parent, "/");
	else if (slash) {
		*slash = '\0';
		if (!realpath(copy, parent))
			fail("bad mountpoint '%s': %s", mountpoint, strerror(errno));
	} else if (!getcwd(parent, sizeof(parent)))
		fail("cannot get the current directory: %s", strerror(errno));
	if (snprintf(out, PATH_MAX, "%s%s%s", parent, strcmp(parent, "/") ? "/" : "",
		     last) >= PATH_MAX)
		fail("mountpoint path too long");
}

/* $FUSE_BROKER_WAIT as whole seconds in ASCII digits (not " 5", "+5" or "5s"). */
static long wait_seconds(void)
{
	const char *text = getenv(WAIT_ENV);
	long seconds = 0;
	const char *p;

	if (!text)
		return WAIT_SECONDS;
	for (p = text; *p >= '0' && *p <= '9' && seconds <= WAIT_MOST; p++)
		seconds = seconds * 10 + (*p - '0');
	if (p == text || *p || seconds > WAIT_MOST)
		fail("%s must be a whole number of seconds from 0 to %d, got '%.20s'", WAIT_ENV,
		     WAIT_MOST, text);
	return seconds;
}

static long long now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void sleep_ms(long long ms)
{
	struct timespec ts = { .tv_sec = (time_t)(ms / 1000),
			       .tv_nsec = (long)(ms % 1000) * 1000000 };

	while (nanosleep(&ts, &ts) == -1 && errno == EINTR)
		;
}

/* Whether the socket's directory is there: Allocate binds it in broker mode only, and
 * it outlives the broker (a hostPath that the broker never removes), so without it
 * there is nothing to wait for. */
static int socket_dir_exists(const char *path)
{
	char dir[sizeof(((struct sockaddr_un *)0)->sun_path)];
	char *slash;
	struct stat st;

	strcpy(dir, path);
	slash = strrchr(dir, '/');
	if (!slash)
		strcpy(dir, ".");
	else if (slash == dir)
		dir[1] = '\0';
	else
		*slash = '\0';
	return stat(dir, &st) == 0 && S_ISDIR(st.st_mode);
}

_Noreturn static void unreachable(const char *path, const char *why)
{
	fail("cannot reach the FUSE mount broker at %s: %s (broker mode needs the broker "
	     "running on this node and the pod's github.com/fuse allocation)", path, why);
}

enum attempt { ANSWERED, NOT_LISTENING, NOT_READ, STOPPING };

/*
 * One connection, one request, one reply. NOT_LISTENING (the socket is missing while its
 * directory is there, or nobody listens on it: errno says which) and NOT_READ (the broker
 * went away without reading the request) are the two outcomes that leave the request
 * untouched, so it may be sent again. The kernel tells NOT_READ apart: a unix socket
 * closed with the request still in its queue, or never accepted, resets its peer
 * (ECONNRESET), and a send that failed put nothing in it. A connection closed after
 * the broker read the request (EOF) is not tried again: the mount may have been made.
 * STOPPING: the broker answered, but with retry=1: it is stopping (SIGTERM) and did
 * nothing of the request, so the broker that replaces it is asked.
 */
static enum attempt try_broker(const char *path, const char *request, size_t len,
			       char *reply, size_t *reply_len)
{
	struct sockaddr_un addr = { .sun_family = AF_UNIX };
	struct timeval timeout = { .tv_sec = REPLY_TIMEOUT_SECONDS };
	const char *retry;
	int sock, sent, err;
	ssize_t n;

	strcpy(addr.sun_path, path);
	sock = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
	if (sock == -1)
		fail("socket: %s", strerror(errno));
	if (connect(sock, (struct sockaddr *)&addr, sizeof(addr)) == -1) {
		err = errno;
		close(sock);
		if (err == ECONNREFUSED || (err == ENOENT && socket_dir_exists(path))) {
			errno = err;
			return NOT_LISTENING;
		}
		unreachable(path, strerror(err));
	}
	setsockopt(sock, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
	/* A broker that refuses at once (busy) has answered and closed before the request
	 * arrives: the send fails, and the answer is still there to read. */
	sent = send(sock, request, len, MSG_NOSIGNAL) == (ssize_t)len;
	if (!sent && errno != EPIPE && errno != ECONNRESET)
		fail("sending to the FUSE mount broker: %s", strerror(errno));
	n = recv(sock, reply, MAX_MESSAGE - 1, 0);
	err = errno;
	close(sock);
	if ((n == -1 && err == ECONNRESET) || (n == 0 && !sent))
		return NOT_READ;
	if (n <= 0)
		fail("the FUSE mount broker %s", n == 0 ? "closed the connection (restarting?)"
						       : strerror(err));
	reply[n] = '\0';
	*reply_len = (size_t)n;
	retry = field(reply, *reply_len, RETRY_FIELD);
	return retry && strcmp(retry, "1") == 0 ? STOPPING : ANSWERED;
}

/*
 * One request, one reply (text only). A broker that is not there, or went away before
 * reading the request, or is stopping and asked for it again, is waited for (said once),
 * with a short backoff, up to the wait; then the error is the one it would have been at
 * once (a stopping broker's: its reply, which the caller reads).
 */
static void ask_broker(const char *request, size_t len, char *reply, size_t *reply_len)
{
	const char *path = getenv(SOCKET_ENV) ? getenv(SOCKET_ENV) : BROKER_SOCKET;
	long seconds = wait_seconds();
	long long deadline = 0, pause = BACKOFF_FIRST_MS, left;
	int waiting = 0;
	enum attempt outcome;

	if (strlen(path) >= sizeof(((struct sockaddr_un *)0)->sun_path))
		fail("broker socket path too long: %s", path);
	while ((outcome = try_broker(path, request, len, reply, reply_len)) != ANSWERED) {
		const char *why = outcome == NOT_READ ? "it closed the connection unread"
				  : outcome == STOPPING ? "it is stopping"
				  : strerror(errno);
		if (!waiting) {
			waiting = 1;
			deadline = now_ms() + seconds * 1000;
			if (seconds && !quiet)
				fprintf(stderr, "%s: the FUSE mount broker at %s is not answering "
					"(%s); waiting up to %ld s for it to restart\n", progname,
					path, why, seconds);
		}
		left = deadline - now_ms();
		if (left <= 0) {
			if (outcome == NOT_READ)
				fail("the FUSE mount broker at %s closed the connection before reading "
				     "the request (restarting?)", path);
			if (outcome == STOPPING)  /* what it said, as it would have at once */
				return;
			unreachable(path, why);
		}
		sleep_ms(pause < left ? pause : left);
		pause = pause * 2 < BACKOFF_MOST_MS ? pause * 2 : BACKOFF_MOST_MS;
	}
}

/* Sends the request and exits with the broker's message unless it says ok. */
static void request(const char *op, const char *path, const char *options, int fuse_fd,
		    const char *flags, const char *mount_id, char *reply, size_t *reply_len)
{
	char buf[MAX_MESSAGE], number[16];
	size_t len = 0;
	const char *status, *message;

	add_field(buf, &len, "v", PROTOCOL_VERSION);
	add_field(buf, &len, "op", op);
	add_field(buf, &len, "path", path);
	if (options)
		add_field(buf, &len, "options", options);
	if (fuse_fd != -1) {
		snprintf(number, sizeof(number), "%d", fuse_fd);
		add_field(buf, &len, "fuse_fd", number);
	}
	if (flags && *flags)
		add_field(buf, &len, "flags", flags);
	if (mount_id)
		add_field(buf, &len, "mount_id", mount_id);
	ask_broker(buf, len, reply, reply_len);
	status = field(reply, *reply_len, "status");
	message = field(reply, *reply_len, "message");
	if (!status || strcmp(status, "ok") != 0)
		fail("%s", message ? message : "the FUSE mount broker gave no answer");
}

/*
 * LXCFS views (fuse_plugin/broker/lxcfs.py): the broker binds the node's lxcfs files over
 * this container's /proc files (a fixed list; the request names nothing), records this
 * process, and binds them again whenever lxcfs restarts, for as long as this process
 * lives: so it becomes COMMAND (exec), and the workload is what the broker watches. No
 * lxcfs yet (the refusal says later=1): asked again within the wait, then COMMAND is
 * not run.
 */
_Noreturn static void lxcfs_views(char *const command[])
{
	char buf[64], reply[MAX_MESSAGE];
	size_t len, reply_len;
	long seconds = wait_seconds();
	long long deadline = now_ms() + seconds * 1000;
	const char *status, *message, *later;
	int said = 0;

	if (!command[0])
		fail("--lxcfs needs the command to run: %s --lxcfs -- COMMAND [ARG...]", progname);
	for (;;) {
		len = 0;
		add_field(buf, &len, "v", PROTOCOL_VERSION);
		add_field(buf, &len, "op", "lxcfs");
		ask_broker(buf, len, reply, &reply_len);
		status = field(reply, reply_len, "status");
		if (status && strcmp(status, "ok") == 0)
			break;
		message = field(reply, reply_len, "message");
		later = field(reply, reply_len, LATER_FIELD);
		if (!later || strcmp(later, "1") != 0 || now_ms() >= deadline)
			fail("%s", message ? message : "the FUSE mount broker gave no answer");
		if (!said && !quiet)
			fprintf(stderr, "%s: %s; waiting up to %ld s for it\n", progname, message,
				seconds);
		said = 1;
		sleep_ms(deadline - now_ms() < LATER_PAUSE_MS ? deadline - now_ms()
							       : LATER_PAUSE_MS);
	}
	execvp(command[0], command);
	fail("cannot run %s: %s", command[0], strerror(errno));
}

/* As fusermount3 does: one byte of payload, the fd in SCM_RIGHTS. */
static void send_fd(int sock, int fd)
{
	char byte = 0;
	char control[CMSG_SPACE(sizeof(int))];
	struct iovec iov = { .iov_base = &byte, .iov_len = 1 };
	struct msghdr msg = { .msg_iov = &iov, .msg_iovlen = 1,
			      .msg_control = control, .msg_controllen = sizeof(control) };
	struct cmsghdr *cmsg = CMSG_FIRSTHDR(&msg);
	ssize_t n;

	memset(control, 0, sizeof(control));
	cmsg->cmsg_level = SOL_SOCKET;
	cmsg->cmsg_type = SCM_RIGHTS;
	cmsg->cmsg_len = CMSG_LEN(sizeof(int));
	memcpy(CMSG_DATA(cmsg), &fd, sizeof(fd));
	do
		n = sendmsg(sock, &msg, MSG_NOSIGNAL);
	while (n == -1 && errno == EINTR);
	if (n != 1)
		fail("sending the FUSE fd to %s: %s", COMMFD_ENV, strerror(errno));
}

/*
 * Removes auto_unmount from the options (the broker is asked instead, once the daemon
 * has gone); returns whether it was there. Commas escaped with a backslash stay.
 */
static int take_auto_unmount(char *options)
{
	char *out = options, *start = options, *p = options;
	int found = 0;

	for (;;) {
		if (*p == '\\' && p[1]) {
			p += 2;
			continue;
		}
		if (*p == ',' || *p == '\0') {
			size_t len = (size_t)(p - start);
			int end = *p == '\0';
			if (len == 12 && strncmp(start, "auto_unmount", 12) == 0)
				found = 1;
			else if (len) {
				if (out != options)
					*out++ = ',';
				memmove(out, start, len);
				out += len;
			}
			if (end)
				break;
			start = ++p;
			continue;
		}
		p++;
	}
	*out = '\0';
	return found;
}

/* auto_unmount: wait, like fusermount3, until the daemon closes its end, then unmount. */
static void watch_and_unmount(int commfd, const char *path, const char *mount_id)
{
	char buf[16], reply[MAX_MESSAGE];
	size_t reply_len;
	sigset_t all;
	ssize_t n;

	setsid();
	if (chdir("/") == -1)
		fail("chdir /: %s", strerror(errno));
	sigfillset(&all);
	sigprocmask(SIG_BLOCK, &all, NULL);
	do
		n = recv(commfd, buf, sizeof(buf), 0);
	while (n > 0 || (n == -1 && errno == EINTR));
	quiet = 1;
	request("unmount", path, NULL, -1, "lazy,auto", mount_id, reply, &reply_len);
}

static void usage(void)
{
	printf("%s: [options] mountpoint\n"
	       "Options:\n"
	       " -h                print help\n"
	       " -V                print version\n"
	       " -o opt[,opt...]   mount options\n"
	       " -u                unmount\n"
	       " -q                quiet\n"
	       " -z                lazy unmount\n"
	       " --lxcfs -- CMD    LXCFS views over this container's /proc, then run CMD\n"
	       "Mounts are made by the node's FUSE mount broker (fuse-device-plugin).\n",
	       progname);
	exit(1);
}

int main(int argc, char *argv[])
{
	static const struct option long_options[] = {
		{ "unmount", no_argument, NULL, 'u' },
		{ "lazy", no_argument, NULL, 'z' },
		{ "quiet", no_argument, NULL, 'q' },
		{ "help", no_argument, NULL, 'h' },
		{ "version", no_argument, NULL, 'V' },
		{ "lxcfs", no_argument, NULL, 'L' },
		{ NULL, 0, NULL, 0 },
	};
	char path[PATH_MAX], reply[MAX_MESSAGE], options[MAX_MESSAGE] = "";
	const char *commfd_text, *devfd_text, *mount_id;
	size_t reply_len;
	int ch, unmount = 0, lazy = 0, automatic, commfd, fd, views = 0;

	if (argc > 0 && argv[0][0])
		progname = strrchr(argv[0], '/') ? strrchr(argv[0], '/') + 1 : argv[0];
	while ((ch = getopt_long(argc, argv, "hVo:uzq", long_options, NULL)) != -1) {
		switch (ch) {
		case 'h':
			usage();
			break;
		case 'V':
			printf("%s version: 3 (fuse-device-plugin broker shim)\n", progname);
			return 0;
		case 'o':
			if (strlen(optarg) >= sizeof(options))
				fail("options too long");
			strcpy(options, optarg);
			break;
		case 'u':
			unmount = 1;
			break;
		case 'z':
			lazy = 1;
			break;
		case 'q':
			quiet = 1;
			break;
		case 'L':
			views = 1;
			break;
		default:
			return 1;
		}
	}
	if (views && (unmount || lazy || options[0]))
		fail("--lxcfs takes no other option");
	if (views)
		lxcfs_views(argv + optind);
	if (lazy && !unmount)
		fail("-z can only be used with -u");
	if (optind >= argc)
		fail("missing mountpoint argument");
	if (argc > optind + 1)
		fail("extra arguments after the mountpoint");
	resolve(argv[optind], !unmount, path);

	if (unmount) {
		request("unmount", path, NULL, -1, lazy ? "lazy" : "", NULL, reply, &reply_len);
		return 0;
	}
	/* glusterfs's helper protocol: the caller opened /dev/fuse and passes it in; the
	 * mount is made with it and only the exit status is read. */
	devfd_text = getenv(DEVFD_ENV);
	if (devfd_text) {
		take_auto_unmount(options);
		request("mount", path, options, atoi(devfd_text), "", NULL, reply, &reply_len);
		return 0;
	}
	commfd_text = getenv(COMMFD_ENV);
	if (!commfd_text)
		fail("old style mounting not supported");
	commfd = atoi(commfd_text);
	automatic = take_auto_unmount(options);
	/* As real fusermount3 does: the caller's own open of the device. */
	fd = open(FUSE_DEVICE, O_RDWR | O_CLOEXEC);
	if (fd == -1)
		fail("failed to open %s: %s", FUSE_DEVICE, strerror(errno));
	request("mount", path, options, fd, "", NULL, reply, &reply_len);
	send_fd(commfd, fd);
	close(fd);
	if (automatic) {
		mount_id = field(reply, reply_len, "mount_id");
		watch_and_unmount(commfd, path, mount_id);
	}
	return 0;
}
