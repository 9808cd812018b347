"""The demo's kubelet stand-in with the tests' hook: refusing Register calls on demand."""

from __future__ import annotations

from pathlib import Path

from fuse_plugin.api import api_pb2 as api
from fuse_plugin.demo import kubelet
from fuse_plugin.demo.kubelet import Registration, socket_files

__all__ = ["KubeletStandIn", "Registration", "socket_files"]


class KubeletStandIn(kubelet.KubeletStandIn):
    """``refuse_next`` Register calls are refused, as a kubelet still starting would."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.refuse_next = 0

    def validate(self, request: api.RegisterRequest) -> str:
        problem = super().validate(request)
        if not problem and self.refuse_next > 0:
            self.refuse_next -= 1
            problem = "device manager not ready (refused by test)"
        return problem
