"""Short extend passes replayed from CUDA graphs (docs/design.md §5).

An extend pass of a few tokens per request costs what a decode step costs on the GPU (the weights
are read once either way), but it runs eagerly: hundreds of kernel launches from Python, several
decode steps' worth of time for a small model. Jump-forward makes such passes often: every forced
run of a grammar (a JSON key and its punctuation) is one extend of ``1 + k`` tokens.

A request's new tokens form a chain, which is a draft tree of one branch, so the verify pass's
padded graphs (:class:`~phloem.runtime.executor.verify_graph.VerifyGraphRunner`) compute it
exactly: node ``i`` sits at position ``prefix_len + i``, reads the cached prefix and nodes
``0..i``, and writes its K/V to the slot the extend would have written. A batch of at most
``max_bs`` requests, each with at most ``width`` new tokens, no input logprobs and no hidden
states, replays the smallest captured batch size; anything else runs the eager extend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from phloem.runtime.forward_io import ForwardInput, ForwardMode
from phloem.runtime.host_copy import to_device

__all__ = ["ExtendGraphs"]


@dataclass(frozen=True)
class _Chain:
    """The draft-tree view of one request's new tokens (what ``VerifyGraphRunner`` reads)."""

    tokens: list[int]

    @property
    def depths(self) -> range:
        return range(len(self.tokens))

    @property
    def parents(self) -> list[int]:
        return list(range(-1, len(self.tokens) - 1))

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class _ChainRequest:
    tree: _Chain
    kv_len: int  # the cached prefix
    slots: torch.Tensor  # [len(tree)] the slots the extend writes
    req_pool_idx: int


class ExtendGraphs:
    """Extend passes of at most ``max_bs`` requests and ``width`` new tokens each, from graphs.

    Parameters
    ----------
    runner:
        The :class:`~phloem.runtime.executor.model_runner.ModelRunner` (CUDA, one rank).
    width:
        New tokens per request a graph holds (every request is padded to it).
    max_bs:
        Largest batch captured.
    """

    def __init__(self, runner: Any, *, width: int, max_bs: int) -> None:
        from phloem.runtime.executor.verify_graph import VerifyGraphRunner

        self.width = width
        self.limit = max_bs
        # on the CPU nothing is captured and the same padded pass runs eagerly (tests read it)
        self.verify = VerifyGraphRunner(
            runner, nodes=width, max_bs=max_bs if runner.device.type == "cuda" else 0
        )
        self.device = runner.device
        self.passes = 0  # extends run here (a benchmark reads it)

    def capture(self) -> None:
        self.verify.capture()

    def drop(self) -> None:
        """Forget the graphs (their memory pool too); :meth:`can_run` is False until recaptured."""
        self.verify.graphs, self.verify.outputs, self.verify.pool = {}, {}, None

    def can_run(self, fi: ForwardInput, wants_rows: bool) -> bool:
        """Whether ``fi`` replays a graph. ``wants_rows``: the pass must give logits of more rows
        than each request's last (input logprobs)."""
        return (
            fi.mode == ForwardMode.EXTEND
            and not wants_rows
            and not fi.return_hidden_states
            and 0 < fi.batch_size <= self.limit
            and (bool(self.verify.graphs) or self.device.type == "cpu")
            and fi.extend_lens.is_cpu  # the layout is built on the host (the ids may be on the device)
            and int(fi.extend_lens.max()) <= self.width
        )

    def logits(self, fi: ForwardInput) -> torch.Tensor:
        """Float logits ``[B, V]`` of each request's last new token. Every tensor of ``fi`` but
        ``input_ids`` is on the host; the ids may be on the device already (the worker resolves
        future ids there), so they are written into the padded layout there, never read back."""
        lens = fi.extend_lens.tolist()
        ids = [0] * fi.num_tokens  # placeholders: the ids are written on the device (never read here)
        prefix = fi.prefix_lens.tolist()
        rows = fi.req_pool_indices.tolist()
        reqs: list[_ChainRequest] = []
        last: list[int] = []
        where: list[int] = []
        offset = 0
        for b, n in enumerate(lens):
            chain = _Chain(ids[offset : offset + n])
            reqs.append(_ChainRequest(chain, prefix[b], fi.out_slots[offset : offset + n], rows[b]))
            where.extend(range(b * self.width, b * self.width + n))
            last.append(b * self.width + n - 1)
            offset += n
        logits, _ = self.verify.run(reqs, device_ids=(torch.tensor(where), fi.input_ids))
        self.passes += 1
        return logits[to_device(torch.tensor(last), logits.device)]
