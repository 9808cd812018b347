"""``fuse-device-plugin doctor``: what a node needs for FUSE pods (``checks``), and what a
FUSE error message means (``explain``, the table the README's error section is made from)."""

from fuse_plugin.doctor.checks import add_flags, run

__all__ = ["add_flags", "run"]
