"""ZMQ channel endpoints and socket helpers shared by the three processes.

Every channel is PUSH -> PULL; the receiver binds, senders connect. ``IpcPaths`` is created by
the launcher and handed to each child (it pickles as three strings).
"""

from __future__ import annotations

import os
import tempfile
import uuid
from dataclasses import dataclass

import zmq


@dataclass(frozen=True)
class IpcPaths:
    scheduler: str  # TokenizerManager -> scheduler
    detokenizer: str  # scheduler -> detokenizer
    tokenizer_manager: str  # detokenizer, scheduler -> TokenizerManager

    @classmethod
    def fresh(cls) -> IpcPaths:
        base = os.path.join(tempfile.gettempdir(), f"phloem-{uuid.uuid4().hex[:12]}")
        os.makedirs(base, exist_ok=True)
        return cls(
            scheduler=f"ipc://{base}/scheduler",
            detokenizer=f"ipc://{base}/detokenizer",
            tokenizer_manager=f"ipc://{base}/tokenizer_manager",
        )

    def cleanup(self) -> None:
        for ep in (self.scheduler, self.detokenizer, self.tokenizer_manager):
            path = ep.removeprefix("ipc://")
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        try:
            os.rmdir(os.path.dirname(self.scheduler.removeprefix("ipc://")))
        except OSError:
            pass


def pull_socket(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    return sock


def push_socket(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(endpoint)
    return sock


def parent_alive(parent_pid: int) -> bool:
    """Children exit when the process that launched them is gone (never orphaned)."""
    return os.getppid() == parent_pid
