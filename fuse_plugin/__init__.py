"""fuse-device-plugin: give pods /dev/fuse through the kubelet's device-plugin API.

A pod asks for ``github.com/fuse: 1`` and gets the FUSE device and nothing else, instead
of running ``privileged: true`` (which also hands it every GPU and host device).
"""

from importlib.metadata import PackageNotFoundError, version

try:
    # pyproject.toml is the one place the version is written.
    __version__ = version("fuse-device-plugin")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
