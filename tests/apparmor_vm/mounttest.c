/* mounttest: one mount(2) call, reported as one line; the guest's probe for what a profile allows.
 *
 *   mounttest NAME SOURCE TARGET FSTYPE FLAGS DATA
 *
 * NAME becomes the process's comm (prctl PR_SET_NAME, at most 15 bytes), so the kernel's audit
 * line for this very call can be found by comm= and profile=. FLAGS is a comma list of
 * nosuid,nodev,noexec,noatime,rdonly,bind,rec,remount or "-" for none; SOURCE, FSTYPE, DATA may
 * be "-" for NULL. In DATA the token "fd=@" is replaced by a fresh /dev/fuse descriptor.
 * A mount that succeeds is detached again at once. Prints
 *   MOUNT name=NAME result=ok|errno=ENAME flags=0xHEX
 * and exits 0 when the mount succeeded, 1 when it failed, 2 on bad usage.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <unistd.h>

static const struct { const char *name; unsigned long bit; } flag_names[] = {
	{"nosuid", MS_NOSUID}, {"nodev", MS_NODEV}, {"noexec", MS_NOEXEC},
	{"noatime", MS_NOATIME}, {"rdonly", MS_RDONLY}, {"bind", MS_BIND},
	{"rec", MS_REC}, {"remount", MS_REMOUNT},
};

static const char *nul(const char *s) { return strcmp(s, "-") == 0 ? NULL : s; }

int main(int argc, char **argv)
{
	if (argc != 7) {
		fprintf(stderr, "usage: mounttest NAME SOURCE TARGET FSTYPE FLAGS DATA\n");
		return 2;
	}
	const char *name = argv[1];
	unsigned long flags = 0;
	char *list = strdup(argv[5]);
	for (char *tok = strtok(list, ","); tok && strcmp(argv[5], "-") != 0; tok = strtok(NULL, ",")) {
		size_t i;
		for (i = 0; i < sizeof(flag_names) / sizeof(flag_names[0]); i++)
			if (strcmp(tok, flag_names[i].name) == 0)
				break;
		if (i == sizeof(flag_names) / sizeof(flag_names[0])) {
			fprintf(stderr, "mounttest: unknown flag %s\n", tok);
			return 2;
		}
		flags |= flag_names[i].bit;
	}

	char data[512];
	const char *d = nul(argv[6]);
	if (d) {
		const char *at = strstr(d, "fd=@");
		if (at) {
			int fd = open("/dev/fuse", O_RDWR);
			if (fd < 0) {
				printf("MOUNT name=%s result=errno=%s stage=open-dev-fuse\n", name, strerrorname_np(errno));
				return 1;
			}
			snprintf(data, sizeof(data), "%.*sfd=%d%s", (int)(at - d), d, fd, at + 4);
		} else {
			snprintf(data, sizeof(data), "%s", d);
		}
		d = data;
	}

	prctl(PR_SET_NAME, name, 0, 0, 0);
	if (mount(nul(argv[2]), argv[3], nul(argv[4]), flags, d) != 0) {
		printf("MOUNT name=%s result=errno=%s flags=0x%lx\n", name, strerrorname_np(errno), flags);
		return 1;
	}
	if (!(flags & MS_REMOUNT))
		umount2(argv[3], MNT_DETACH);
	printf("MOUNT name=%s result=ok flags=0x%lx\n", name, flags);
	return 0;
}
