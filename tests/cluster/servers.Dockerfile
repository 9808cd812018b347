# The servers the cluster stage's FUSE examples talk to, run as pods inside the cluster:
# Debian's sshd (sftp-server included) for sshfs, and moto's S3 server for s3fs (the same
# moto the tests/containers stage runs on the host). Built by images.sh on the Debian base.
ARG BASE
FROM ${BASE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends openssh-server \
    && rm -rf /var/lib/apt/lists/* /etc/ssh/ssh_host_*_key* \
    && mkdir -p /run/sshd
RUN pip install --no-cache-dir 'moto[server]==5.2.5'
