# The tool image of buildah-userns-pod.yaml: Debian's buildah, with fuse-overlayfs mounting
# the layers of its overlay storage. In broker mode fuse-overlayfs's mount(2) fails (no
# CAP_SYS_ADMIN), libfuse runs /usr/bin/fusermount3, which is the broker's shim, and the
# broker mounts in the pod's user and mount namespaces.
#   docker build -t fuse-example-buildah -f manifests/broker/examples/buildah.Dockerfile \
#       manifests/broker/examples
# Push it to your registry (or load it into kind/k3s) and keep the name or change `image:`
# in the example.
#
# It runs as uid 0 of the pod's own user namespace (`hostUsers: false`), not as uid 1000:
# buildah (containers/storage's unshare.MaybeReexecUsingUserNamespace, every subcommand
# except mount) re-executes itself in a new user namespace whenever its effective uid is
# not 0, and under the RuntimeDefault seccomp profile without CAP_SYS_ADMIN that fails
# ("Error during unshare(CLONE_NEWUSER): Operation not permitted"), with any storage
# driver, vfs included. Only an euid of 0 with _CONTAINERS_ROOTLESS_UID set skips it.
FROM debian:bookworm-slim
# buildah pulls uidmap (newuidmap, unused here: no_new_privs, and no re-exec) and
# containers-common (/etc/containers/policy.json, which commit and push read).
# fuse-overlayfs pulls fuse3, whose fusermount3 the pod's shim replaces. No runc or crun:
# RUN steps cannot work under RuntimeDefault (see the pod's header; with RUN steps:
# manifests/examples/rootless-build/).
RUN apt-get update \
    && apt-get install -y --no-install-recommends buildah fuse-overlayfs \
    && rm -rf /var/lib/apt/lists/* \
    && printf '%s\n' \
        '# Everything under /var/lib/containers: an emptyDir in the pod (the root is read-only).' \
        '[storage]' \
        'driver = "overlay"' \
        'graphroot = "/var/lib/containers/storage"' \
        '# buildah counts as rootless (_CONTAINERS_USERNS_CONFIGURED) and takes this one.' \
        'rootless_storage_path = "/var/lib/containers/storage"' \
        'runroot = "/var/lib/containers/run"' \
        '[storage.options.overlay]' \
        '# Layers mounted by fuse-overlayfs (through fusermount3), not by the kernel overlay.' \
        'mount_program = "/usr/bin/fuse-overlayfs"' \
        '# No CAP_CHOWN: files keep our uid instead of the ones in the layer.' \
        'ignore_chown_errors = "true"' \
        '# Do not bind-mount the storage directory onto itself (mount(2): EPERM).' \
        'skip_mount_home = "true"' \
        > /etc/containers/storage.conf
# Read that file, whatever HOME is (a rootless buildah would look in
# $HOME/.config/containers/ first).
ENV CONTAINERS_STORAGE_CONF=/etc/containers/storage.conf
# "We are already in our user namespace": with an euid of 0 and a non-zero rootless uid
# (any value; it only names default paths, all set here) buildah neither re-executes
# itself through newuidmap nor expects CAP_SYS_ADMIN.
ENV _CONTAINERS_USERNS_CONFIGURED=done \
    _CONTAINERS_ROOTLESS_UID=1000 \
    _CONTAINERS_ROOTLESS_GID=1000
# The pod mounts an emptyDir at /var/lib/containers: home, runtime directory (runroot is
# $XDG_RUNTIME_DIR/containers for a rootless buildah) and temporary files (image copies
# go there; /var/tmp is read-only). The pod's script creates run/ and tmp/.
ENV HOME=/var/lib/containers \
    XDG_RUNTIME_DIR=/var/lib/containers/run \
    TMPDIR=/var/lib/containers/tmp
# RUN steps, if any, with chroot isolation, which needs no OCI runtime (none is installed).
# They fail all the same: it creates a mount namespace, which RuntimeDefault refuses.
ENV BUILDAH_ISOLATION=chroot
USER 0:0
