"""Broker mode (issue 14): FUSE mounts for containers that hold no capability.

``server`` is the node's broker (``fuse-device-plugin broker``), ``protocol`` what it and
the fusermount3 shim (``shim/fusermount3.c``) say, ``policy`` its rules, ``caller`` who is
asking, ``mounts`` how a mount reaches the caller's namespace, ``kernel`` the system calls.
docs/broker.md explains the design.
"""
