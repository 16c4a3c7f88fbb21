"""Token bitmasks: allocation and applying a mask to logits (torch reference + Triton fast path).

Layout: ``bitmask`` is int32 ``[batch, ceil(vocab_size / 32)]``; bit ``j`` of word ``w`` allows
token ``32 * w + j``. Logits may be wider than ``32 * words``; the extra columns are disallowed.
"""

from __future__ import annotations

import torch

try:  # Triton is optional; without it (or without CUDA) the reference is used.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None


def bitmask_words(vocab_size: int) -> int:
    """Number of int32 words in one mask row."""
    return (vocab_size + 31) // 32


def allocate_bitmask(batch: int, vocab_size: int, *, pin_memory: bool = False) -> torch.Tensor:
    """A CPU int32 mask ``[batch, ceil(vocab_size / 32)]`` with every token allowed."""
    return torch.full((batch, bitmask_words(vocab_size)), -1, dtype=torch.int32, pin_memory=pin_memory)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The bool ``[batch, vocab_size]`` view of a mask (True = allowed)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [batch, words, 32]
    allowed = bits.flatten(1).bool()  # [batch, 32 * words]
    if vocab_size <= allowed.shape[1]:
        return allowed[:, :vocab_size]
    pad = allowed.new_zeros((allowed.shape[0], vocab_size - allowed.shape[1]))
    return torch.cat([allowed, pad], dim=1)


def apply_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set disallowed logits to ``-inf`` in place (pure torch reference); returns ``logits``.

    Meaning, as a plain loop::

        for b in range(logits.shape[0]):
            for t in range(logits.shape[1]):
                w, j = divmod(t, 32)
                allowed = w < bitmask.shape[1] and (int(bitmask[b, w]) >> j) & 1
                if not allowed:
                    logits[b, t] = -inf

    Parameters
    ----------
    logits : torch.Tensor
        Float ``[batch, vocab]`` on any device.
    bitmask : torch.Tensor
        Int32 ``[batch, words]``, on the device of ``logits`` or on the CPU.
    """
    bitmask = bitmask.to(logits.device, non_blocking=True)
    allowed = unpack_bitmask(bitmask, logits.shape[1])
    return logits.masked_fill_(~allowed, float("-inf"))


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set disallowed logits to ``-inf`` in place; Triton on CUDA, the reference elsewhere."""
    if logits.is_cuda and triton is not None:
        return apply_bitmask_triton(logits, bitmask)
    return apply_bitmask_ref(logits, bitmask)


def apply_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor, *, block: int = 4096) -> torch.Tensor:
    """Triton version of :func:`apply_bitmask_ref` (same meaning); ``logits`` on a GPU."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    bitmask = bitmask.to(logits.device, non_blocking=True)
    batch, vocab = logits.shape
    grid = (batch, triton.cdiv(vocab, block))
    _apply_bitmask_kernel[grid](
        logits,
        bitmask,
        vocab,
        bitmask.shape[1],
        logits.stride(0),
        bitmask.stride(0),
        BLOCK=block,
    )
    return logits


if triton is not None:

    @triton.jit
    def _apply_bitmask_kernel(
        logits_ptr, mask_ptr, vocab, words, logits_stride, mask_stride, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0)
        tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] token ids
        in_vocab = tokens < vocab
        word = tokens // 32
        packed = tl.load(mask_ptr + row * mask_stride + word, mask=in_vocab & (word < words), other=0)
        allowed = ((packed >> (tokens % 32)) & 1) != 0
        tl.store(logits_ptr + row * logits_stride + tokens, -float("inf"), mask=in_vocab & ~allowed)
