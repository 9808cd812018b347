"""``python -m fuse_plugin`` is the same as the ``fuse-device-plugin`` command."""

import sys

from fuse_plugin.cli import main

sys.exit(main())
