# fuse-device-plugin: one image for every DaemonSet in manifests/ - the plugin (`serve`,
# the default), the profile installer (`install-profiles`) and broker mode's mount broker
# (`broker`).
#
#   docker build -t fuse-device-plugin:0.2.0 .
#
# Stage 1 builds the wheel and broker mode's two static programs (musl); stage 2 is a slim
# Python with only that wheel, its runtime dependencies (all binary wheels: no compiler),
# those two programs and apparmor_parser. No build tools, pip cache or apt lists
# are left in the final image.

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS builder
WORKDIR /src
# Broker mode's fusermount3 shim (runs inside arbitrary workload images) and
# fuse-broker-helper (the broker's hands in a caller's namespaces): static, no loader.
# The compiler comes first and the C sources alone next, so a Python change rebuilds
# only the wheel.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc musl-tools \
    && rm -rf /var/lib/apt/lists/*
COPY scripts/build-native ./scripts/build-native
COPY fuse_plugin/broker/native ./fuse_plugin/broker/native
RUN scripts/build-native /native
COPY pyproject.toml README.md ./
COPY fuse_plugin ./fuse_plugin
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${PYTHON_IMAGE}
ARG VERSION=0.2.0
LABEL org.opencontainers.image.title="fuse-device-plugin" \
      org.opencontainers.image.description="Kubernetes device plugin that gives pods /dev/fuse (github.com/fuse) without privileged: true, plus least-privilege AppArmor and seccomp profiles" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# apparmor_parser: `install-profiles` loads the AppArmor profiles with it. The plugin
# never runs it (and has no capability that would let it load anything).
# The broker builds FUSE mounts with the kernel's mount API (its helper below), so no
# fusermount3 is installed.
# lxcfs: the `lxcfs` command's LXCFS views for broker mode (its own DaemonSet runs it;
# Debian's package brings libfuse3, not fusermount3).
RUN apt-get update \
    && apt-get install -y --no-install-recommends apparmor lxcfs \
    && rm -rf /var/lib/apt/lists/*
COPY --from=builder /native/ /usr/local/libexec/fuse-device-plugin/
# The one wheel the builder made, whatever pyproject.toml's version names it.
COPY --from=builder /wheels/ /tmp/wheels/
RUN pip install --no-cache-dir /tmp/wheels/*.whl \
    && rm -rf /tmp/wheels \
    && fuse-device-plugin --version
# Runs as root on purpose: the kubelet's device-plugin directory is root-owned, and the
# manifests drop every capability. The kubelet stops pods with SIGTERM; the plugin
# removes its socket and exits on it.
STOPSIGNAL SIGTERM
ENTRYPOINT ["fuse-device-plugin"]
CMD ["serve"]
