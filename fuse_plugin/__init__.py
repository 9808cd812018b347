"""fuse-device-plugin: give pods /dev/fuse through the kubelet's device-plugin API.

A pod asks for ``github.com/fuse: 1`` and gets the FUSE device and nothing else, instead
of running ``privileged: true`` (which also hands it every GPU and host device).
"""

__version__ = "0.1.0"
