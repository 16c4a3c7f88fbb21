"""EAGLE draft head, its KV cache and tree drafting (docs/design.md §7).

The head predicts the target's next *feature* (final hidden state) from the previous feature
and the current token, then reads tokens off it with the target's own LM head::

    draft position j:  x = fc([embed(t_j) ; f_{j-1}])          2H -> H
                       g_j = decoder_layer(x)                    ~ f_j (the target's feature)
                       logits_j = lm_head(g_j)                   ~ the target's next-token logits

Only ``fc`` and one decoder layer are trained; the embedding and the LM head are the target's
(the LM head may be restricted to a frequent-token draft vocabulary, ``token_map``, which makes
each draft step several times cheaper on a large vocabulary).

One speculative cycle for a request whose newest token ``t_n`` (position ``n``) has no target KV::

    draft:   g_n is known (last catch-up output) -> level 1 = top-k of lm_head(g_n)
             levels 2..num_steps: expand the ``topk`` best frontier nodes (cumulative log prob),
             each with the *predicted* feature of its parent; keep the best
             ``num_draft_tokens - 1`` nodes overall -> DraftTree rooted at t_n
    verify:  target accepts t_n -> a_1 .. a_m and emits bonus b  (verify.py)
    catch up: extend the draft cache at positions n+1 .. n+m+1 with tokens a_1 .. a_m, b and the
             target's *true* features f_n .. f_{n+m}; its last output is the next g

Tree nodes' draft KV lives in temporary tensors for the duration of one drafting call; only
catch-up writes the request's committed draft cache. A step drafts and catches up the whole batch
at once (:meth:`EagleDraftWorker.draft_many`, :meth:`EagleDraftWorker.extend_many`); the tests
check them against a reference that grows one request's tree node by node
(``tests/oracles/eagle_reference.py``).
"""

from __future__ import annotations

import copy
import heapq
import json
import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from phloem.runtime.attention.base import varying_shape_sdpa
from phloem.runtime.host_copy import pack_to_device, to_device
from phloem.runtime.layers.cpu_matmul import use_weight_major, weight_major_linear
from phloem.runtime.layers.fusion import use_fused, use_row_fusion
from phloem.runtime.layers.linear import Linear
from phloem.runtime.layers.rotary import rope_inv_freq
from phloem.runtime.speculative.draft_attention import draft_attend
from phloem.runtime.speculative.tree import DraftTree
from torch import nn

if TYPE_CHECKING:
    from phloem.runtime.speculative.draft_graph import EagleGraphs

__all__ = [
    "EagleConfig",
    "EagleDraftWorker",
    "EagleHead",
    "DraftKVCache",
    "load_eagle_head",
    "save_eagle_head",
]


@dataclass(frozen=True)
class EagleConfig:
    """Shape of a draft head (hidden size and attention shape follow the target)."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # the target's
    draft_vocab_size: int  # rows of the draft LM head (== vocab_size: no restriction)
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5

    @classmethod
    def from_target(cls, cfg: Any, *, draft_vocab_size: int | None = None) -> EagleConfig:
        """From the target's :class:`~phloem.runtime.models.config.ModelConfig`."""
        return cls(
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            vocab_size=cfg.vocab_size,
            draft_vocab_size=min(draft_vocab_size or cfg.vocab_size, cfg.vocab_size),
            rope_theta=cfg.rope_theta,
            rms_norm_eps=cfg.rms_norm_eps,
        )

    def matches(self, cfg: Any) -> bool:
        return (self.hidden_size, self.vocab_size, self.head_dim) == (
            cfg.hidden_size,
            cfg.vocab_size,
            cfg.head_dim,
        )


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if _fused(x):
        from phloem.runtime.layers import fused_triton

        return fused_triton.rmsnorm(x, weight, eps)
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def _fused(x: torch.Tensor) -> bool:
    """The runtime's fused kernels (one launch for a norm, a rotation, a SwiGLU) at inference on
    CUDA; training keeps the autograd-friendly torch ops (the kernels have no backward)."""
    return use_fused(x) and not torch.is_grad_enabled()


def _folds(x: torch.Tensor, linear: nn.Module) -> bool:
    """Whether the norm before ``linear`` runs inside it (``fusion.use_row_fusion`` on the rows of
    ``x``), at inference only."""
    return _fused(x) and use_row_fusion(x.reshape(-1, x.shape[-1]), linear)


def _rope_pair(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` ``[..., Hq, D]`` and ``k`` ``[..., Hk, D]`` rotated with tables ``[..., 1, D/2]``."""
    if _fused(q) and q.stride(-1) == 1 and k.stride(-1) == 1:
        from phloem.runtime.layers import fused_triton

        lead, half = q.shape[:-2], cos.shape[-1]
        cos, sin = (t.expand(*lead, 1, half).reshape(-1, half) for t in (cos, sin))  # positions may broadcast
        q2, k2 = fused_triton.rope_(q.reshape(-1, *q.shape[-2:]), k.reshape(-1, *k.shape[-2:]), cos, sin)
        return q2.view(*lead, *q.shape[-2:]), k2.view(*lead, *k.shape[-2:])
    return _rope(q, cos, sin), _rope(k, cos, sin)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)  # rotate-half layout, as the target
    # float32 tables promote the product: cast back so q matches the cached k/v dtype (bf16 on GPU)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class EagleHead(nn.Module):
    """``fc`` + one Llama decoder layer (module docstring). Parameters only; attention over a
    cache is done by the caller through :meth:`project` and :meth:`finish`. The projections are
    the runtime's :class:`Linear` (the target's few-row routes: the skinny kernel on CUDA in
    16-bit dtypes, weight-major on the CPU; ``F.linear`` elsewhere, training included)."""

    token_map: torch.Tensor
    inv_freq: torch.Tensor

    def __init__(self, cfg: EagleConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, hq, hk, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.split = [hq * d, hk * d, hk * d]
        self.fc = Linear(2 * h, h, bias=True)
        self.input_norm = nn.Parameter(torch.ones(h))
        self.qkv_proj = Linear(h, sum(self.split), bias=False)
        self.o_proj = Linear(hq * d, h, bias=False)
        self.post_norm = nn.Parameter(torch.ones(h))
        self.gate_up_proj = Linear(h, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, h, bias=False)
        self.register_buffer("token_map", torch.arange(cfg.draft_vocab_size), persistent=False)
        self.register_buffer("inv_freq", rope_inv_freq(d, cfg.rope_theta), persistent=False)
        self.rope_table: torch.Tensor | None = None  # cache_rope(): inference on CUDA

    def reset_parameters(self, generator: torch.Generator | None = None, std: float = 0.02) -> None:
        """Start as "feature of the previous position": ``fc`` passes the feature half through and
        the residual branches start at zero, so training begins from a stable identity."""
        h = self.cfg.hidden_size
        with torch.no_grad():
            for lin in (self.fc, self.qkv_proj, self.gate_up_proj):
                lin.weight.normal_(0.0, std, generator=generator)
            self.fc.weight[:, h:] += torch.eye(h)
            self.fc.bias.zero_()
            self.o_proj.weight.zero_()
            self.down_proj.weight.zero_()
            self.input_norm.fill_(1.0)
            self.post_norm.fill_(1.0)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin tables ``[..., 1, D/2]`` of ``positions``: read from :meth:`cache_rope`'s
        table at inference on CUDA (one gather instead of four kernels), else computed."""
        table = self.rope_table
        if table is not None and positions.is_cuda and not torch.is_grad_enabled():
            rows = table[positions]  # [..., 2, D/2]
            return rows[..., 0:1, :], rows[..., 1:2, :]
        angles = positions.float()[..., None] * self.inv_freq  # [..., D/2]
        return angles.cos().unsqueeze(-2), angles.sin().unsqueeze(-2)  # [..., 1, D/2]

    def cache_rope(self, max_positions: int) -> None:
        """Keep cos and sin of positions ``0 .. max_positions - 1`` ``[P, 2, D/2]``, computed by
        the same ops as :meth:`rope` (so the values are the same bits on the same device)."""
        angles = torch.arange(max_positions, device=self.inv_freq.device).float()[:, None] * self.inv_freq
        self.rope_table = torch.stack([angles.cos(), angles.sin()], dim=1)

    def project(
        self, emb: torch.Tensor, feat: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[..., H]`` token embeddings and features -> residual ``x`` and roped ``q, k, v``
        ``[..., heads, D]``."""
        c = self.cfg
        x = self.fc(torch.cat([emb, feat.to(emb.dtype)], dim=-1))
        if _folds(x, self.qkv_proj):  # the norm inside the few-row projection (row_fused)
            from phloem.runtime.layers.row_fused import norm_linear_rows

            qkv, _ = norm_linear_rows(x.reshape(-1, x.shape[-1]), None, self.input_norm, c.rms_norm_eps,
                                      self.qkv_proj.weight, self.qkv_proj.bias)  # fmt: skip
            qkv = qkv.view(*x.shape[:-1], qkv.shape[-1])
        else:
            qkv = self.qkv_proj(_rms_norm(x, self.input_norm, c.rms_norm_eps))
        q, k, v = qkv.split(self.split, dim=-1)
        q = q.unflatten(-1, (c.num_heads, c.head_dim))
        k = k.unflatten(-1, (c.num_kv_heads, c.head_dim))
        v = v.unflatten(-1, (c.num_kv_heads, c.head_dim))
        cos, sin = self.rope(positions)
        q, k = _rope_pair(q, k, cos, sin)
        return x, q, k, v

    def finish(self, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Residual ``x`` and attention output ``[..., Hq, D]`` -> predicted feature ``[..., H]``."""
        o = self.o_proj(attn_out.flatten(-2))
        if x.shape == o.shape and _folds(o, self.gate_up_proj):  # add, norm, gate/up, SiLU x mul: one launch
            from phloem.runtime.layers.row_fused import norm_linear_rows

            lead, w = o.shape[:-1], o.shape[-1]
            act, h = norm_linear_rows(o.reshape(-1, w), x.reshape(-1, w), self.post_norm, self.cfg.rms_norm_eps,
                                      self.gate_up_proj.weight, glu=True)  # fmt: skip
            return h.view(*lead, w) + self.down_proj(act).view(*lead, w)
        x = x + o
        gate_up = self.gate_up_proj(_rms_norm(x, self.post_norm, self.cfg.rms_norm_eps))
        if _fused(gate_up):
            from phloem.runtime.layers import fused_triton

            return x + self.down_proj(fused_triton.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)

    def forward_dense(
        self, emb: torch.Tensor, feat: torch.Tensor, lengths: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Training path: ``[B, L, H]`` sequences from position 0, causal attention (padding at the
        end of a row never influences the row's real positions). Returns ``[B, L, H]``."""
        b, n, _ = emb.shape
        positions = torch.arange(n, device=emb.device).expand(b, n)
        x, q, k, v = self.project(emb, feat, positions)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
        )  # [B, Hq, L, D]
        return self.finish(x, o.transpose(1, 2))


# ---------------------------------------------------------------------------------- save / load
def save_eagle_head(
    head: EagleHead, path: str, *, dtype: torch.dtype = torch.float16, info: dict | None = None
) -> None:
    """Write ``head`` as safetensors: weights in ``dtype``, ``token_map`` (int64), config in metadata."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in head.state_dict().items()}
    tensors["token_map"] = head.token_map.detach().to("cpu", torch.int64).contiguous()
    meta = {"eagle_config": json.dumps(asdict(head.cfg)), "info": json.dumps(info or {})}
    save_file(tensors, path, metadata=meta)


def load_eagle_head(
    path: str, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> EagleHead:
    """Inverse of :func:`save_eagle_head`."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        cfg = EagleConfig(**json.loads(f.metadata()["eagle_config"]))
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no items()
    head = EagleHead(cfg)
    token_map = tensors.pop("token_map")
    head.load_state_dict({k: v.float() for k, v in tensors.items()})
    head.token_map = token_map
    return head.to(device=device, dtype=dtype).eval()


# ---------------------------------------------------------------------------------- draft cache
class DraftKVCache:
    """The draft head's committed state in its own pool (apart from the target's): dense K/V
    ``[rows, length, Hk, D]`` and the newest output feature ``[rows, H]`` of every sequence.

    Each sequence (keyed by the scheduler's ``req_pool_idx``) owns one row, taken at its first
    write and returned by :meth:`release`; batched code gathers rows with one index tensor. Rows
    and length start small and double when a write needs more (all rows share the length). The
    catch-up writes here, and so does a window's chain draft, past the committed entries, where
    the step's catch-up writes again (:mod:`.window`); tree drafting uses temporary tensors.
    Entries past a sequence's length are stale but finite (the store starts zeroed), so
    masked-out keys never produce NaN. ``slots`` ``[rows, length]`` numbers the entries as one
    token pool, for the decode kernel of :mod:`.draft_attention`.
    """

    def __init__(
        self,
        num_kv_heads: int,
        head_dim: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        *,
        rows: int = 4,
        length: int = 64,
    ) -> None:
        self.k = torch.zeros((rows, length, num_kv_heads, head_dim), dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.features = torch.zeros((rows, hidden_size), dtype=dtype, device=device)
        self.slots = _slot_table(rows, length, self.k.device)
        self.lens: dict[int, int] = {}  # seq -> committed entries
        self.row: dict[int, int] = {}  # seq -> its row in k, v, features
        self._free = list(range(rows))  # a heap: the lowest free row first

    @property
    def capacity(self) -> tuple[int, int]:
        """``(rows, length)`` allocated now."""
        return self.k.shape[0], self.k.shape[1]

    def reserve(self, seqs: list[int], lengths: list[int]) -> list[int]:
        """Give every sequence a row and room for ``lengths`` entries; returns their rows.
        Views from :meth:`get` and tensors indexed before a growth are stale afterwards."""
        for seq in seqs:
            if seq not in self.row:
                if not self._free:
                    self._resize(2 * self.k.shape[0], self.k.shape[1])
                self.row[seq] = heapq.heappop(self._free)
                self.lens[seq] = 0
        need = max(lengths, default=0)
        if need > self.k.shape[1]:
            self._resize(self.k.shape[0], 2 ** math.ceil(math.log2(need)))
        return [self.row[s] for s in seqs]

    def ensure(self, rows: int, length: int) -> None:
        """Room for at least ``rows`` sequences of ``length`` entries (length rounded up to a
        power of two, as growth does)."""
        r, n = self.capacity
        if rows > r or length > n:
            self._resize(max(r, rows), max(n, 2 ** math.ceil(math.log2(max(length, 1)))))

    def _resize(self, rows: int, length: int) -> None:
        r, n = self.capacity
        k = self.k.new_zeros((rows, length, *self.k.shape[2:]))
        v = torch.zeros_like(k)
        k[:r, :n], v[:r, :n] = self.k, self.v
        features = self.features.new_zeros((rows, self.features.shape[1]))
        features[:r] = self.features
        self.k, self.v, self.features = k, v, features
        self.slots = _slot_table(rows, length, k.device)
        for i in range(r, rows):
            heapq.heappush(self._free, i)

    def append(self, seq: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append ``k, v`` ``[m, Hk, D]`` after the sequence's committed entries."""
        n, m = self.lens.get(seq, 0), k.shape[0]
        (row,) = self.reserve([seq], [n + m])
        self.k[row, n : n + m] = k
        self.v[row, n : n + m] = v
        self.lens[seq] = n + m

    def get(self, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Committed ``K, V`` ``[len, Hk, D]`` (views, valid until the next write)."""
        if seq not in self.row:
            empty = self.k.new_empty((0, *self.k.shape[2:]))
            return empty, empty
        row, n = self.row[seq], self.lens[seq]
        return self.k[row, :n], self.v[row, :n]

    def release(self, seq: int) -> None:
        if seq in self.row:
            heapq.heappush(self._free, self.row.pop(seq))
            del self.lens[seq]


def _slot_table(rows: int, length: int, device: torch.device) -> torch.Tensor:
    """``[rows, length]``: entry ``(r, j)``'s index in the cache viewed as ``rows * length`` slots
    (how :mod:`.draft_attention` reads a row through the target's decode kernel)."""
    return torch.arange(rows * length, device=device).view(rows, length)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``q`` ``[m, Hq, D]`` over ``k, v`` ``[S, Hk, D]`` with bool ``mask`` ``[m, S]`` -> ``[m, Hq, D]``."""
    o = varying_shape_sdpa(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=None if mask is None else mask[None, None], enable_gqa=True,
    )  # fmt: skip
    return o[0].transpose(0, 1)


def _attend_batch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``q`` ``[B, m, Hq, D]`` over ``k, v`` ``[B, Hq, S, D]`` (KV heads already repeated: with a
    mask, CUDA's fused kernels take no GQA and would fall back to the unfused one) with bool
    ``mask`` ``[B, m, S]`` -> ``[B, m, Hq, D]``."""
    o = varying_shape_sdpa(q.transpose(1, 2), k, v, attn_mask=mask[:, None])
    return o.transpose(1, 2)


def _topk(x: torch.Tensor, k: int, chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """``x.topk(k, dim=-1)`` (values and indices, best first) in two passes over a long last axis.

    One row of a ~50k vocabulary is a single-block top-k on CUDA, slow for one row; the best
    ``k`` of each ``chunk`` first, then of those, spreads the work over many blocks. ``k == 1`` is
    a max. Ties may pick a different index than one pass would (any of them is a valid answer).
    """
    n = x.shape[-1]
    if k == 1:
        top, idx = x.max(dim=-1, keepdim=True)
        return top, idx
    if n <= 2 * chunk or k > chunk:
        return x.topk(k, dim=-1)
    pad = -n % chunk
    if pad:
        x = F.pad(x, (0, pad), value=float("-inf"))
    part, part_idx = x.unflatten(-1, (-1, chunk)).topk(k, dim=-1)  # [..., n / chunk, k]
    top, at = part.flatten(-2).topk(k, dim=-1)
    base = torch.div(at, k, rounding_mode="floor") * chunk
    return top, base + part_idx.flatten(-2).gather(-1, at)


# ---------------------------------------------------------------------------------- worker
class _DraftAhead:
    """Trees drafted ahead (:meth:`EagleDraftWorker.draft_ahead`): ``[B, 2, n]`` kept tokens and
    parents on their way to the host, and the sequence and root each row was drafted for."""

    def __init__(self, seqs: list[int], roots: list[int], picked: torch.Tensor) -> None:
        cuda = picked.device.type == "cuda"
        self.host = torch.empty(picked.shape, dtype=picked.dtype, pin_memory=cuda)
        self.host.copy_(picked, non_blocking=cuda)  # out of the graph pool before another graph runs
        self.event = torch.cuda.Event() if cuda else None
        if self.event is not None:
            self.event.record()
        self.rows = {s: (i, root) for i, (s, root) in enumerate(zip(seqs, roots))}

    def forget(self, seqs: list[int]) -> None:
        for s in seqs:
            self.rows.pop(s, None)

    def trees(self, seqs: list[int], roots: list[int]) -> list[DraftTree] | None:
        """The trees of ``seqs`` if every one was drafted ahead with the same root, else None."""
        idx = []
        for s, root in zip(seqs, roots):
            got = self.rows.get(s)
            if got is None or got[1] != root:
                return None
            idx.append(got[0])
        if self.event is not None:
            self.event.synchronize()
        return EagleDraftWorker.trees(roots, self.host[idx])


class EagleDraftWorker:
    """Runs an :class:`EagleHead` for many sequences: prefill/catch-up and tree drafting.

    Parameters
    ----------
    head:
        The trained head (moved to the target's device and dtype here).
    embed_weight, lm_head_weight:
        The target's ``[V, H]`` embedding and LM head weights (the same tensor when tied).
    num_steps, topk, num_draft_tokens:
        Tree depth, branching per level and nodes verified per step *including the root*;
        ``topk == 1`` drafts a chain of ``num_steps`` tokens.
    """

    def __init__(
        self,
        head: EagleHead,
        *,
        embed_weight: torch.Tensor,
        lm_head_weight: torch.Tensor,
        num_steps: int = 3,
        topk: int = 1,
        num_draft_tokens: int | None = None,
    ) -> None:
        if num_steps < 1 or topk < 1:
            raise ValueError("num_steps and topk must be >= 1")
        self.head = head.to(device=embed_weight.device, dtype=embed_weight.dtype).eval()
        self.embed_weight = embed_weight.detach()
        self.token_map = head.token_map.to(embed_weight.device)
        self.lm_weight = lm_head_weight.detach()[self.token_map].contiguous()  # [Vd, H]
        self.lm_dot: Any = None  # quantize_like_target(): the draft LM head as Q8_0 blocks
        self.num_steps, self.topk = num_steps, topk
        self.max_nodes = 1 + topk + (num_steps - 1) * topk * topk
        self.num_draft_tokens = min(num_draft_tokens or num_steps + 1, self.max_nodes)
        c = head.cfg
        self.cache = DraftKVCache(
            c.num_kv_heads, c.head_dim, c.hidden_size, embed_weight.dtype, embed_weight.device
        )
        self.offset: dict[int, int] = {}  # seq -> sequence position of its first draft entry
        # tree slots of draft_many: level l (1-based) writes its topk rows at (l - 1) * topk + row
        slots = (num_steps - 1) * topk
        self._own_slot = torch.eye(slots, dtype=torch.bool, device=embed_weight.device).view(
            num_steps - 1, topk, slots
        )  # [levels, topk, slots]: each row's own slot
        self.graphs: EagleGraphs | None = None  # use_graphs(): draft and catch-up as CUDA graphs
        self._ahead: _DraftAhead | None = None  # draft_ahead(): trees launched before they are asked for

    @classmethod
    def for_runner(cls, head: EagleHead, runner: Any, **kw: Any) -> EagleDraftWorker:
        """Share ``runner.model``'s embedding and LM head."""
        model = runner.model
        embed = model.model.embed_tokens.weight
        lm = model.lm_head.tied_to.weight if model.lm_head.tied_to is not None else model.lm_head.weight
        if not head.cfg.matches(runner.model_config):
            raise ValueError("the EAGLE head was trained for a different target shape")
        worker = cls(head, embed_weight=embed, lm_head_weight=lm, **kw)
        if getattr(runner, "quantization", None) == "gguf" and worker.device.type == "cpu":
            worker.quantize_like_target()
        if worker.device.type == "cuda":  # draft positions never pass the target's context
            worker.head.cache_rope(runner.context_len + worker.num_steps + 1)
        return worker

    @property
    def device(self) -> torch.device:
        return self.embed_weight.device

    def quantize_like_target(self) -> None:
        """Compute as a ``--quantization gguf`` target does on the CPU: the head's projections and
        the draft LM head as Q8_0 blocks with int8 activations (:mod:`~phloem.runtime.layers.qdot`),
        a quarter of the bytes a float32 draft step reads. Drafts only propose (the target's
        verify decides every token), so outputs do not change; drafts may, slightly."""
        from phloem.runtime.layers.qdot import Q8DotWeight, q8_blocks_from_float

        self.head = copy.deepcopy(self.head)  # the caller's head stays float (training reads it)
        h = self.head
        for lin in (h.fc, h.qkv_proj, h.o_proj, h.gate_up_proj, h.down_proj):
            lin.set_quantized(Q8DotWeight.from_blocks(q8_blocks_from_float(lin.weight.data)))
        self.lm_dot = Q8DotWeight.from_blocks(q8_blocks_from_float(self.lm_weight))

    def use_graphs(self, max_bs: int, *, capture: bool = True, reserve: int = 0) -> None:
        """Run :meth:`draft_many` and :meth:`extend_many` of up to ``max_bs`` sequences through
        padded fixed-shape passes, captured as CUDA graphs (``capture=False``: the same padded
        passes, eager; how the CPU tests pin them); ``reserve``: draft-cache positions to hold
        from the start. See :mod:`.draft_graph`."""
        from phloem.runtime.speculative.draft_graph import EagleGraphs

        self.graphs = EagleGraphs(self, max_bs=max_bs, capture=capture, reserve=reserve)

    def root_feature(self, seq: int) -> torch.Tensor:
        """``g`` at the sequence's newest draft position ``[H]`` (a view, valid until the next write)."""
        return self.cache.features[self.cache.row[seq]]

    def _heads(self, kv: torch.Tensor) -> torch.Tensor:
        """``[B, S, Hk, D]`` -> ``[B, Hq, S, D]``, each KV head repeated for its query heads."""
        c = self.head.cfg
        return kv.transpose(1, 2).repeat_interleave(c.num_heads // c.num_kv_heads, dim=1)

    def _gather_heads(
        self, store: torch.Tensor, rows: torch.Tensor, width: int, extra: int = 0
    ) -> torch.Tensor:
        """:meth:`_heads` of ``store[rows, :width]`` in one copy, followed by ``extra`` zero
        positions: ``[B, Hq, width + extra, D]``."""
        c = self.head.cfg
        group = c.num_heads // c.num_kv_heads
        out = store.new_empty((rows.shape[0], c.num_kv_heads, group, width + extra, c.head_dim))
        out[:, :, :, :width] = store[rows, :width].transpose(1, 2)[:, :, None]
        out[:, :, :, width:] = 0
        return out.flatten(1, 2)

    # ---- committed path -----------------------------------------------------------------------
    @torch.inference_mode()
    def extend(self, seq: int, tokens: list[int], features: torch.Tensor) -> None:
        """Append draft positions for ``tokens``, where ``features[i]`` is the target's feature at
        the position before ``tokens[i]`` (prefill: a zero row for position 0, then the prompt's
        features; catch-up: the features :class:`VerifyResult` returns). Sets the root feature.

        One sequence, no padding (prefill and plain decode steps); :meth:`extend_many` is the
        batched form with the same results, and this method is its reference in tests.
        """
        self._forget_ahead([seq])
        start = self.cache.lens.get(seq, 0)
        ids = torch.tensor(tokens, dtype=torch.int64, device=self.device)
        first = self.offset.get(seq, 0) + start
        positions = torch.arange(first, first + len(tokens), device=ids.device)
        x, q, k, v = self.head.project(F.embedding(ids, self.embed_weight), features, positions)
        self.cache.append(seq, k, v)
        k_all, v_all = self.cache.get(seq)
        m = len(tokens)
        causal = torch.ones(m, start + m, dtype=torch.bool, device=ids.device).tril(diagonal=start)
        g = self.head.finish(x, _attend(q, k_all, v_all, causal))
        self.cache.features[self.cache.row[seq]] = g[-1]

    @torch.inference_mode()
    def extend_many(
        self, seqs: list[int], tokens_per_seq: list[list[int]], features_per_seq: list[torch.Tensor]
    ) -> None:
        """:meth:`extend` for several distinct sequences in one padded pass (catch-up after a
        verify). Layout, with ``M`` = the most new tokens of a sequence and ``W`` = the longest
        sequence after the write::

            queries  [B, M]   row b: tokens_per_seq[b], then padding (computed, never read back)
            keys     [B, W]   row b: its draft cache after the write, stale entries past the end
            mask     [B, M, W]  key j visible to query i of row b  <=>  j <= lens[b] + i

        Padding queries write their K/V past the end of their row, where nothing reads before a
        later write replaces it. With CUDA graphs on (:meth:`use_graphs`) the pass is replayed.
        """
        if not seqs:
            return
        self._forget_ahead(seqs)
        if self.graphs is not None and self.graphs.extend(seqs, tokens_per_seq, features_per_seq):
            return
        m = max(len(t) for t in tokens_per_seq)
        flat, entry, width = self.extend_inputs(seqs, tokens_per_seq, len(seqs), m)
        dev = cast(list[torch.Tensor], pack_to_device([flat, entry], self.device))
        views = self.extend_views(dev[0], len(seqs), m)
        feats = torch.cat(features_per_seq)
        padded = feats.new_zeros((len(seqs) * m, feats.shape[-1]))
        padded[dev[1]] = feats
        self._extend_core(*views, padded.view(len(seqs), m, -1), width)

    def extend_inputs(
        self, seqs: list[int], tokens_per_seq: list[list[int]], bs: int, m: int, *, pad_row: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Host side of a catch-up for ``bs >= len(seqs)`` rows of ``m >= max(counts)`` queries:
        reserves room (``lens + m`` entries, padding included), advances ``cache.lens``, and
        returns the flat int64 inputs (see :meth:`extend_views`), the flat ``[B * M]`` index of
        every real query, and the key width the real queries need. Spare rows (``bs > len(seqs)``)
        read and write ``pad_row`` at positions ``0 .. m - 1``."""
        counts = [len(t) for t in tokens_per_seq]
        starts = [self.cache.lens.get(s, 0) for s in seqs]
        rows = self.cache.reserve(seqs, [s + m for s in starts])
        ids: list[int] = []
        positions: list[int] = []
        draft_pos: list[int] = []
        entry: list[int] = []
        for b, (s, toks, n) in enumerate(zip(seqs, tokens_per_seq, starts)):
            first = self.offset.get(s, 0) + n
            ids += [*toks, *[0] * (m - len(toks))]
            positions += range(first, first + m)
            draft_pos += range(n, n + m)
            entry += range(b * m, b * m + len(toks))
            self.cache.lens[s] = n + len(toks)
        pad = bs - len(seqs)
        for _ in range(pad):
            ids += [0] * m
            positions += range(m)
            draft_pos += range(m)
        last = [c - 1 for c in counts] + [0] * pad
        flat = torch.tensor(ids + positions + draft_pos + rows + [pad_row] * pad + last, dtype=torch.int64)
        return flat, torch.tensor(entry, dtype=torch.int64), max(n + c for n, c in zip(starts, counts))

    @staticmethod
    def extend_views(
        flat: torch.Tensor, bs: int, m: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``ids, positions, draft_pos`` ``[bs, m]`` and ``rows, last`` ``[bs]`` out of ``flat``."""
        n = bs * m
        return (flat[:n].view(bs, m), flat[n : 2 * n].view(bs, m), flat[2 * n : 3 * n].view(bs, m),
                flat[3 * n : 3 * n + bs], flat[3 * n + bs : 3 * n + 2 * bs])  # fmt: skip

    def _extend_core(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        draft_pos: torch.Tensor,
        rows: torch.Tensor,
        last: torch.Tensor,
        feats: torch.Tensor,
        width: int,
    ) -> None:
        """The device part of :meth:`extend_many` (device work only: a CUDA graph captures it).
        ``feats`` ``[B, M, H]``: the features before each query; ``last``: each row's last real
        query, whose output becomes the row's root feature."""
        b, m = ids.shape
        x, q, k, v = self.head.project(F.embedding(ids, self.embed_weight), feats, positions)
        dest = (rows[:, None].expand(b, m), draft_pos)  # x [B, M, H]; q [B, M, Hq, D]; k, v [B, M, Hk, D]
        self.cache.k.index_put_(dest, k)
        self.cache.v.index_put_(dest, v)
        c = self.cache
        g = self.head.finish(x, draft_attend(q, c.k, c.v, c.slots, rows, draft_pos + 1, width))  # [B, M, H]
        self.cache.features[rows] = g[torch.arange(b, device=ids.device), last]

    def prefill(self, seq: int, tokens: list[int], features: torch.Tensor, *, start: int = 0) -> None:
        """Start a sequence: ``tokens`` = the prompt tokens computed by the target's prefill, from
        position ``start``, then the first sampled token; ``features`` = the target's features at
        those prompt positions ``[len(tokens) - 1, H]``.

        ``start > 0`` (the first ``start`` tokens came from the prefix cache, without features):
        the draft begins at that position and never attends the cached part (lower acceptance,
        same output).
        """
        self.offset[seq] = start
        zero = torch.zeros_like(features[:1])
        self.extend(seq, tokens, torch.cat([zero, features]))

    def release(self, seq: int) -> None:
        self._forget_ahead([seq])
        self.cache.release(seq)
        self.offset.pop(seq, None)

    # ---- drafting -----------------------------------------------------------------------------
    def draft_logits(self, g: torch.Tensor) -> torch.Tensor:
        """Float32 logits over the draft vocabulary after features ``g`` ``[..., H]``."""
        if self.lm_dot is not None:
            return self.lm_dot.matmul(g.reshape(-1, g.shape[-1])).view(*g.shape[:-1], -1)
        w = self.lm_weight
        return (weight_major_linear(g, w) if use_weight_major(g, w) else F.linear(g, w)).float()

    def _top(self, g: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` best draft tokens after features ``g`` ``[..., H]``: their log probabilities
        and draft-vocabulary indices, ``[..., k]`` each, best first."""
        logits = self.draft_logits(g)
        top, idx = _topk(logits, k)
        return top - torch.logsumexp(logits, dim=-1, keepdim=True), idx

    def draft_many(self, seqs: list[int], roots: list[int]) -> list[DraftTree]:
        """One draft tree per sequence, rooted at ``roots[b]`` (its newest token, at draft
        position ``cache.lens[seq] - 1``); the same trees as :meth:`draft`, grown together.

        Every request keeps a frontier of exactly ``topk`` rows, so a level is one batched pass
        over ``[B, topk]`` queries, and all bookkeeping stays on the device: the only host sync is
        reading the finished trees.
        """
        if not seqs:
            return []
        ahead, self._ahead = self._ahead, None
        if ahead is not None and (trees := ahead.trees(seqs, roots)) is not None:
            return trees
        if self.graphs is not None and (picked := self.graphs.draft(seqs)) is not None:
            return self.trees(roots, picked)
        return self.trees(roots, self._select_core(*self._grow_many(seqs)))

    @torch.inference_mode()
    def draft_ahead(self, seqs: list[int], roots: list[int]) -> None:
        """Launch the next :meth:`draft_many` of ``seqs`` now, right behind the catch-up that
        precedes it, and copy its trees to the host without waiting: the GPU drafts while the
        scheduler does its bookkeeping, and the next ``draft_many`` of any subset of ``seqs``
        with the same roots only reads them. A later write to a sequence's draft cache
        (catch-up, prefill, release) drops its tree. Only with CUDA graphs (elsewhere the draft
        runs on the host thread anyway)."""
        self._ahead = None
        if self.graphs is None or not seqs:
            return
        picked = self.graphs.draft(seqs)
        if picked is not None:
            self._ahead = _DraftAhead(seqs, roots, picked)

    def _forget_ahead(self, seqs: list[int]) -> None:
        if self._ahead is not None:
            self._ahead.forget(seqs)

    @torch.inference_mode()
    def _grow_many(self, seqs: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every candidate of every sequence's tree: tokens, cumulative log probs (float64, as
        :meth:`_grow` sums them) and parents, ``[B, max_nodes - 1]`` each on the device.

        Candidates are numbered in creation order, as :meth:`_grow` creates them (``K`` = topk,
        root = 0; candidate ``c`` sits at column ``c - 1``)::

            level 1 (root's children)           1 .. K
            expansion l = 1 .. num_steps - 1    K + (l-1)*K*K + 1 + row*K + j   (row: frontier row,
                                                                                 j: its j-th child)

        Keys of a level: the committed draft cache padded to the longest in the batch, then
        ``(num_steps - 1) * K`` tree slots (level ``l`` writes its frontier at ``(l-1)*K + row``);
        a frontier row sees its request's committed entries, its ancestors' slots and its own.
        """
        host = self.draft_inputs(seqs, len(seqs))
        rows, lens_t, root_pos_t = to_device(host, self.device).unbind(0)  # [B] each
        return self._grow_core(rows, lens_t, root_pos_t, int(host[1].max()))

    def draft_inputs(self, seqs: list[int], bs: int, *, pad_row: int = 0) -> torch.Tensor:
        """``[3, bs]`` int64 host inputs of a draft: each row's cache row, committed length and
        root position; spare rows (``bs > len(seqs)``) read ``pad_row`` as a one-entry sequence."""
        pad = bs - len(seqs)
        lens = [self.cache.lens[s] for s in seqs]
        root_pos = [self.offset.get(s, 0) + n - 1 for s, n in zip(seqs, lens)]
        return torch.tensor([[self.cache.row[s] for s in seqs] + [pad_row] * pad, lens + [1] * pad,
                             root_pos + [0] * pad])  # fmt: skip

    def _grow_core(
        self, rows: torch.Tensor, lens_t: torch.Tensor, root_pos_t: torch.Tensor, width: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The device part of :meth:`_grow_many` (device work only: a CUDA graph captures it);
        ``width >= max(lens_t)`` committed keys are read per row."""
        b, kk, dev = rows.shape[0], self.topk, self.device
        slots = (self.num_steps - 1) * kk
        g = self.cache.features[rows]  # [B, H]
        keys = self._gather_heads(self.cache.k, rows, width, slots)  # [B, Hq, W + slots, D]
        values = self._gather_heads(self.cache.v, rows, width, slots)
        committed = (torch.arange(width, device=dev) < lens_t[:, None])[:, None].expand(b, kk, width)

        # every candidate but the root, in creation order
        tokens = torch.empty((b, self.max_nodes - 1), dtype=torch.int64, device=dev)
        scores = torch.empty((b, self.max_nodes - 1), dtype=torch.float64, device=dev)
        parents = torch.zeros((b, self.max_nodes - 1), dtype=torch.int64, device=dev)
        top, idx = self._top(g, kk)  # [B, K]
        f_tok, f_score = self.token_map[idx], top.double()  # scores in float64, as draft() sums them
        f_num = torch.arange(1, kk + 1, device=dev).expand(b, kk)
        tokens[:, :kk], scores[:, :kk] = f_tok, f_score
        f_feat = g[:, None].expand(b, kk, -1)  # [B, K, H]: each frontier row's parent feature
        seen = torch.zeros((b, kk, slots), dtype=torch.bool, device=dev)  # tree slots of its ancestors
        for level in range(1, self.num_steps):
            x, q, k, v = self.head.project(
                F.embedding(f_tok, self.embed_weight), f_feat, root_pos_t[:, None] + level
            )  # x [B, K, H]; q [B, K, Hq, D]; k, v [B, K, Hk, D]
            at = width + (level - 1) * kk
            keys[:, :, at : at + kk] = self._heads(k)
            values[:, :, at : at + kk] = self._heads(v)
            seen = seen | self._own_slot[level - 1]
            mask = torch.cat([committed, seen], dim=-1)  # [B, K, W + slots]
            out = self.head.finish(x, _attend_batch(q, keys, values, mask))  # [B, K, H]
            top, idx = self._top(out, kk)  # [B, K, K]
            new_tok = self.token_map[idx].flatten(1)  # [B, K*K], creation order
            new_score = (f_score[..., None] + top.double()).flatten(1)
            base = kk + (level - 1) * kk * kk
            tokens[:, base : base + kk * kk], scores[:, base : base + kk * kk] = new_tok, new_score
            parents[:, base : base + kk * kk] = f_num.repeat_interleave(kk, dim=1)
            if level == self.num_steps - 1:
                break
            # expand the topk best new candidates next (ties: creation order, as a stable sort)
            best = torch.sort(-new_score, dim=-1, stable=True).indices[:, :kk]  # [B, K]
            parent_row = torch.div(best, kk, rounding_mode="floor")
            f_tok, f_score, f_num = new_tok.gather(1, best), new_score.gather(1, best), base + 1 + best
            f_feat = out.gather(1, parent_row[..., None].expand(-1, -1, out.shape[-1]))
            seen = seen.gather(1, parent_row[..., None].expand(-1, -1, slots))
        return tokens, scores, parents

    def _select_core(self, tokens: torch.Tensor, scores: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
        """:meth:`_select` on ``[B, max_nodes - 1]`` candidates (creation order; ``parents`` by
        candidate number, root = 0), on the device: ``[B, 2, num_draft_tokens - 1]`` kept tokens
        and their parents (renumbered, root = 0)."""
        b, n = tokens.shape[0], self.num_draft_tokens - 1
        keep = torch.sort(-scores, dim=-1, stable=True).indices[:, :n].sort(dim=-1).values  # [B, n]
        renumber = torch.zeros((b, self.max_nodes), dtype=torch.int64, device=tokens.device)
        renumber.scatter_(1, keep + 1, torch.arange(1, n + 1, device=tokens.device).expand(b, n))
        return torch.stack([tokens.gather(1, keep), renumber.gather(1, parents.gather(1, keep))], dim=1)

    @staticmethod
    def trees(roots: list[int], picked: torch.Tensor) -> list[DraftTree]:
        """The trees of :meth:`_select_core`'s output (one device->host copy)."""
        return [DraftTree(tokens=[root, *toks], parents=[-1, *pars])
                for root, (toks, pars) in zip(roots, picked.tolist())]  # fmt: skip
