"""The API resources the driver reads and writes, as lightkube generic resources.

Generic resources are plain dicts of the JSON the API server sent, where lightkube's
typed models decode strictly: a claim's opaque parameters that are not a JSON object
would raise a decoding error inside NodePrepareResources instead of being refused with
a message, and fields newer than the installed models would be dropped from a slice
read back. The driver checks what it reads itself (``claims``, ``slices``).
"""

from __future__ import annotations

from lightkube.generic_resource import create_global_resource, create_namespaced_resource

ResourceClaim = create_namespaced_resource("resource.k8s.io", "v1", "ResourceClaim",
                                           "resourceclaims")
ResourceSlice = create_global_resource("resource.k8s.io", "v1", "ResourceSlice",
                                       "resourceslices")
Node = create_global_resource("", "v1", "Node", "nodes")
