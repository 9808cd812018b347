"""Broker mode: FUSE mounts for containers that hold no capability.

Follow a request from the socket to the mount in ``server`` (the loop: start and stop,
accept, the selector's turns), ``requests`` (each request from its connection to its
answer, the helper's reports heard in turn), ``replies`` (how each ends: its one reply
and log line), ``scheduler`` (which request's helper runs when; helpers past their deadline,
killed, stuck), ``events`` (what the loop's selector hands back, one type a kind of
file), ``conversation`` (one request: its states, its rules, the verdict on what
the helper reached, the record of a new mount) and ``reports`` (the helper's words, each in
its turn). ``command`` runs it, ``settings`` holds its flags, ``node`` sets up the node
(the shim, fusectl). ``protocol`` is what the broker and the fusermount3 shim
(``native/fusermount3.c``) say, ``messages`` every message the loop and its helper say
(carried in ``frames``), ``helper``
the helper process (``native/helper.c``: the broker's hands in a caller's namespaces),
``caller`` who is asking (the kernel's view), ``policy`` every rule, ``records`` what the
broker mounted, ``admission`` the mount caps over one count of the records and the requests
in flight, ``mountinfo`` how its own directory shows in a mount table, ``budget``
how much it logs about one tenant, ``probes`` and ``stats`` its probes and metrics,
``kernel`` one system call. docs/broker-internals.md explains the design, docs/security.md
the rules and the threat model.
"""
