"""The greedy step under device automata (``runtime/sampling/automaton_triton.py``) against the
torch path: mask rows gathered by state, ``argmax`` of the masked logits, ``TableSnapshot.advance``.

Shared by ``test_automaton_triton.py`` (compiled kernels on CUDA) and, run as a script, by
Triton's CPU interpreter (``python -m tests.kernels.automaton_cases`` with ``TRITON_INTERPRET=1``,
in a child process). The table is random: ``S`` states, each allowing a random subset of the
vocabulary (one state allows a single token), with random targets; rows sit in random states,
one row in the free state, rows take random request-pool rows; some rows repeat their allowed
max at a later allowed position (the lowest-index tie rule).
"""

from __future__ import annotations

import sys
from functools import partial

import numpy as np
import torch

from .interpreter import interpreted_main, run_checks

SHAPES = [(1, 49152, 40), (64, 49152, 300), (256, 128256, 50), (7, 1000, 5)]  # rows, vocab, states
SMALL_SHAPES = [(1, 3000, 6), (5, 2500, 9), (3, 700, 3)]


def random_table(vocab: int, states: int, seed: int):
    """A ``TableSnapshot`` of ``states`` random automaton states after the free state 0."""
    from phloem.grammars.automaton import TableSnapshot

    rng = np.random.default_rng(seed)
    words = (vocab + 31) // 32
    masks = [np.full(words, -1, dtype=np.int32)]
    keys, targets = [], []
    for s in range(1, states + 1):
        k = 1 if s == 1 else int(rng.integers(1, max(2, vocab // 3)))
        tokens = np.sort(rng.choice(vocab, size=k, replace=False))
        bits = np.zeros(words * 32, dtype=np.uint8)
        bits[tokens] = 1
        masks.append(np.packbits(bits, bitorder="little").view(np.int32))
        keys.append(s * vocab + tokens)
        targets.append(rng.integers(0, states + 1, size=k).astype(np.int32))
    keys.append(np.array([np.iinfo(np.int64).max]))
    targets.append(np.zeros(1, dtype=np.int32))
    return TableSnapshot(
        masks=torch.from_numpy(np.stack(masks)),
        keys=torch.from_numpy(np.concatenate(keys).astype(np.int64)),
        targets=torch.from_numpy(np.concatenate(targets)),
        vocab_size=vocab,
        chain=torch.full((states + 1,), -1, dtype=torch.int32),  # not read by the greedy step
    )


def check_step(shape: tuple[int, int, int], dtype: torch.dtype, device: str, seed: int) -> None:
    from phloem.grammars.bitmask import apply_bitmask_ref
    from phloem.runtime.sampling.automaton_triton import automaton_greedy

    rows_n, vocab, states = shape
    snap = random_table(vocab, states, seed)
    masks, keys, targets = (t.to(device) for t in (snap.masks, snap.keys, snap.targets))
    gen = torch.Generator().manual_seed(seed)
    pool = 2 * rows_n + 3
    rows = torch.randperm(pool, generator=gen)[:rows_n].to(device)
    state = torch.randint(0, states + 1, (pool,), generator=gen, dtype=torch.int32).to(device)
    state[rows[0]] = 0  # one free row
    x = (torch.randn((rows_n, vocab), generator=gen) * 4).to(dtype).to(device)
    for r in range(1, rows_n, 2):  # ties among the allowed tokens
        allowed = np.flatnonzero(np.unpackbits(snap.masks[int(state[rows[r]])].numpy().view(np.uint8), bitorder="little")[:vocab])
        if len(allowed) > 1:
            x[r, int(allowed[-1])] = x[r].max() + 1
            x[r, int(allowed[0])] = x[r, int(allowed[-1])]
    before = state.clone()
    states = before[rows]
    ref_logits = apply_bitmask_ref(x.float().clone(), masks[states.long()])
    ref_tokens = ref_logits.argmax(dim=-1)
    dev_snap = type(snap)(
        masks=masks, keys=keys, targets=targets, vocab_size=vocab, chain=snap.chain.to(device)
    )
    ref_next = dev_snap.advance(states.long(), ref_tokens)
    tokens = automaton_greedy(x, state, rows, masks, keys, targets)
    assert torch.equal(tokens.cpu(), ref_tokens.cpu()), f"tokens {tokens.tolist()[:8]} vs {ref_tokens.tolist()[:8]}"
    assert torch.equal(state[rows].cpu().long(), ref_next.cpu().long()), "next states"
    untouched = torch.ones(pool, dtype=torch.bool)
    untouched[rows.cpu()] = False
    assert torch.equal(state.cpu()[untouched], before.cpu()[untouched]), "rows outside the batch changed"


def run_small(device: str = "cpu") -> int:
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    return run_checks(
        (f"automaton step {shape} {dn}", partial(check_step, shape, dt, device, 3))
        for shape in SMALL_SHAPES
        for dn, dt in dtypes.items()
    )


if __name__ == "__main__":
    sys.exit(interpreted_main(run_small))
