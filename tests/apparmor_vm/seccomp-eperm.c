/*
 * seccomp-eperm COMMAND [ARG...]: run COMMAND under a seccomp filter that refuses the
 * mount system calls with EPERM, as the container runtime's default seccomp profile does
 * for a container without CAP_SYS_ADMIN (mount is not on its allow-list, and its default
 * action is EPERM). Everything else is allowed. Broker mode's guest check uses it to show
 * what the order of the kernel's checks means: seccomp first (EPERM, libfuse runs
 * fusermount3), else the LSM (EACCES under `deny mount`, libfuse gives up).
 */
#include <errno.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>
#include <stdio.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#define REFUSE(nr) \
	BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, (nr), 0, 1), \
	BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EPERM & SECCOMP_RET_DATA))

int main(int argc, char *argv[])
{
	struct sock_filter filter[] = {
		BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
		BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH_X86_64, 1, 0),
		BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS),
		BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
		REFUSE(__NR_mount),
		REFUSE(__NR_umount2),
		REFUSE(__NR_fsopen),
		REFUSE(__NR_fsmount),
		REFUSE(__NR_move_mount),
		REFUSE(__NR_open_tree),
		BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
	};
	struct sock_fprog prog = { .len = sizeof(filter) / sizeof(filter[0]), .filter = filter };

	if (argc < 2) {
		fprintf(stderr, "usage: seccomp-eperm COMMAND [ARG...]\n");
		return 2;
	}
	if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == -1 ||
	    prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) == -1) {
		perror("seccomp-eperm");
		return 1;
	}
	execvp(argv[1], argv + 1);
	perror(argv[1]);
	return 127;
}
