"""Broker mode (issues 14, 20, 21): FUSE mounts for containers that hold no capability.

Follow a request from the socket to the mount in ``server`` (the loop: accept, rules,
helper, reply); ``protocol`` is what it and the fusermount3 shim (``native/fusermount3.c``)
say, ``caller`` who is asking (the kernel's view), ``policy`` every rule, ``helper`` the
conversation with ``native/helper.c`` (the broker's hands in a caller's namespaces),
``records`` what the broker mounted, ``mountinfo`` how its own directory shows in a
mount table, ``probes`` and ``stats`` its probes and metrics, ``kernel`` one system call.
docs/broker.md explains the design and the threat model.
"""
