/*
 * fuse-broker-enter: the broker's one step inside a caller's mount namespace.
 *
 *     fuse-broker-enter attach NSFD TREEFD TARGETFD
 *     fuse-broker-enter unmount NSFD PARENTFD NAME [lazy]
 *
 * The broker (fuse_plugin/broker/mounts.py) runs it with the fds inherited: the caller's
 * /proc/PID/ns/mnt, the detached FUSE mount (open_tree) or the mountpoint's parent, and
 * the mountpoint, all opened and checked by the broker beforehand. It enters the
 * namespace with setns, then either attaches the mount onto TARGETFD (move_mount) or
 * unmounts NAME inside PARENTFD without following a symlink. It opens no path and loads
 * nothing after setns, so nothing from the container's root is ever used, and it is
 * static for the same reason: the broker's setns must happen in a single-threaded
 * process, and a small exec is cheaper than forking the broker.
 *
 * Exit 0 when done; 1 with one line on stderr otherwise.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef SYS_move_mount
#define SYS_move_mount 429
#endif
#define MOVE_MOUNT_F_EMPTY_PATH 0x00000004
#define MOVE_MOUNT_T_EMPTY_PATH 0x00000040
#ifndef UMOUNT_NOFOLLOW
#define UMOUNT_NOFOLLOW 0x00000008
#endif

static int fd_arg(const char *text)
{
	char *end;
	long value = strtol(text, &end, 10);

	if (*text == '\0' || *end != '\0' || value < 0 || value > 1 << 20) {
		fprintf(stderr, "fuse-broker-enter: bad fd '%s'\n", text);
		exit(1);
	}
	return (int)value;
}

static void fail(const char *what)
{
	fprintf(stderr, "%s: %s\n", what, strerror(errno));
	exit(1);
}

int main(int argc, char *argv[])
{
	int attach = argc == 5 && strcmp(argv[1], "attach") == 0;
	int unmount = (argc == 5 || argc == 6) && strcmp(argv[1], "unmount") == 0;
	int flags = UMOUNT_NOFOLLOW;

	if (!attach && !unmount) {
		fprintf(stderr, "usage: fuse-broker-enter attach NSFD TREEFD TARGETFD | "
				"unmount NSFD PARENTFD NAME [lazy]\n");
		return 1;
	}
	if (setns(fd_arg(argv[2]), CLONE_NEWNS) == -1)
		fail("setns");
	if (attach) {
		if (syscall(SYS_move_mount, fd_arg(argv[3]), "", fd_arg(argv[4]), "",
			    MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH) == -1)
			fail("move_mount");
		return 0;
	}
	if (argc == 6) {
		if (strcmp(argv[5], "lazy") != 0) {
			fprintf(stderr, "fuse-broker-enter: unknown flag '%s'\n", argv[5]);
			return 1;
		}
		flags |= MNT_DETACH;
	}
	if (strchr(argv[4], '/') || !strcmp(argv[4], ".") || !strcmp(argv[4], "..")) {
		fprintf(stderr, "fuse-broker-enter: '%s' is not a name in the parent\n", argv[4]);
		return 1;
	}
	if (fchdir(fd_arg(argv[3])) == -1)
		fail("fchdir");
	if (umount2(argv[4], flags) == -1)
		fail("umount");
	return 0;
}
