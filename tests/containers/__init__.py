"""Real containers (runc) built the way the kubelet and containerd build them; see ``oci``."""
