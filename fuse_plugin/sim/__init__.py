"""The rigs around the plugin, not the plugin: a kubelet stand-in and a fake node
(``kubelet``), a runc harness (``oci``), and ``demo``, which drives the real plugin
through them. ``serve`` never imports this package."""
