"""``fuse-device-plugin dra``: FUSE through Dynamic Resource Allocation (docs/dra.md).

A kubelet DRA plugin beside (or instead of) the device plugin: the node's FUSE device is
published in a ResourceSlice, the scheduler allocates it to ResourceClaims (or to a pod's
``github.com/fuse: 1`` through a DeviceClass with ``extendedResourceName``), and
NodePrepareResources answers each claim with a CDI device whose spec this driver writes.

Parts: ``settings`` (flags), ``claims`` (the allocation as the API server holds it),
``prepare`` (claims to CDI specs), ``service`` (the two gRPC services on the kubelet's
plugin sockets), ``slices`` (the ResourceSlice), ``driver`` (assembly and the run loop),
``command`` (the CLI entry). Only ``claims`` and ``slices`` import the Kubernetes client,
and nothing outside this package imports them: ``serve`` never loads it.
"""
