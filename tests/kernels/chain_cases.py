"""A chain step's layout in one launch (``runtime/executor/chain_triton.py``) against the torch
reference (``chain_decode.chain_layout``): every buffer of the padded pass, the forced tokens,
the counts, the slots written into ``req_to_token``, and each row's state and position after it.

Shared by ``test_chain_triton.py`` (compiled on CUDA) and, run as a script, by Triton's CPU
interpreter (``python -m tests.kernels.chain_cases``, in a child process). The table: the free
state 0; a run of states ``1..R`` that each allow one token leading to the next (state ``R``
branches), so a row starting at state ``s`` has ``R - s`` forced tokens ahead; and branching
states after it with random targets. Rows sit in random states (one free, one at the start of
the run, so some walks are cut by the width), at random positions of random request-pool rows,
part-way through a launch (a random number of their block's slots taken already).
"""

from __future__ import annotations

import sys
from functools import partial

import numpy as np
import torch

from .interpreter import interpreted_main, run_checks

SHAPES = [
    (1, 8, 1000, 12),
    (32, 8, 49152, 40),
    (64, 5, 128256, 30),
    (7, 2, 500, 9),
]  # rows, width, vocab, run
SMALL_SHAPES = [(1, 8, 300, 12), (5, 4, 200, 6), (6, 5, 100, 9), (3, 2, 64, 3)]


def chain_table(vocab: int, run: int, seed: int) -> dict[str, torch.Tensor]:
    """``chain``, ``keys`` and ``targets`` of the table the module docstring describes."""
    rng = np.random.default_rng(seed)
    branching = 6
    n = 1 + run + branching
    keys, targets = [], []
    chain = np.full(n, -1, dtype=np.int32)
    for s in range(1, run):  # the run: one token each, on to the next state
        t = int(rng.integers(0, vocab))
        chain[s] = t
        keys.append([s * vocab + t])
        targets.append([s + 1])
    for s in range(run, n):  # branching: several tokens, random targets
        tokens = np.sort(rng.choice(vocab, size=int(rng.integers(2, 5)), replace=False))
        keys.append(list(s * vocab + tokens))
        targets.append(list(rng.integers(0, n, size=len(tokens))))
    flat_keys = np.concatenate([np.array(k, dtype=np.int64) for k in keys] + [[np.iinfo(np.int64).max]])
    flat_targets = np.concatenate([np.array(t, dtype=np.int32) for t in targets] + [[0]])
    order = np.argsort(flat_keys, kind="stable")
    return {
        "chain": torch.from_numpy(chain),
        "keys": torch.from_numpy(flat_keys[order]),
        "targets": torch.from_numpy(flat_targets[order].astype(np.int32)),
    }


def _buffers(rows: int, width: int, device: str) -> dict[str, torch.Tensor]:
    """Output buffers filled with a marker, so an entry neither path writes would show."""
    n = rows * width
    return {
        "ids": torch.full((n,), -7, dtype=torch.int64, device=device),
        "positions": torch.full((n,), -7, dtype=torch.int64, device=device),
        "node_slots": torch.full((n,), -7, dtype=torch.int64, device=device),
        "rows": torch.full((rows,), -7, dtype=torch.int64, device=device),
        "prefix": torch.full((rows,), -7, dtype=torch.int64, device=device),
        "tree_mask": torch.full((rows, width, width), 7, dtype=torch.int8, device=device),
        "last": torch.full((rows,), -7, dtype=torch.int64, device=device),
    }


def check_layout(shape: tuple[int, int, int, int], device: str, seed: int) -> None:
    from phloem.runtime.executor.chain_decode import chain_layout
    from phloem.runtime.executor.chain_triton import chain_layout_triton

    rows_n, width, vocab, run = shape
    table = {k: v.to(device) for k, v in chain_table(vocab, run, seed).items()}
    states = int(table["chain"].shape[0])
    gen = torch.Generator().manual_seed(seed)
    pool, context = 2 * rows_n + 3, 64
    rows = torch.randperm(pool, generator=gen)[:rows_n]
    state = torch.randint(0, states, (pool,), generator=gen, dtype=torch.int32)
    state[rows[0]] = 0  # a free row
    if rows_n > 1:
        state[rows[1]] = 1  # the start of the run: the longest walk
    req_to_token = torch.randint(1, 10_000, (pool, context), generator=gen)
    cur = torch.randint(0, vocab, (rows_n,), generator=gen)
    pos = torch.randint(0, context - width, (rows_n,), generator=gen)
    per_row = 3 * width  # a launch of three steps
    block = torch.randperm(50_000, generator=gen)[: rows_n * per_row].view(rows_n, per_row) + 1
    start = pos - torch.randint(0, per_row - width + 1, (rows_n,), generator=gen)
    results = []
    for fn in (chain_layout, chain_layout_triton):
        st, p, written = state.clone().to(device), pos.clone().to(device), req_to_token.clone().to(device)
        out = _buffers(rows_n, width, device)
        emitted = torch.full((rows_n, width), -7, dtype=torch.int64, device=device)
        counts = torch.full((rows_n,), -7, dtype=torch.int64, device=device)
        fn(state=st, rows=rows.to(device), chain=table["chain"], keys=table["keys"], targets=table["targets"],
           vocab=vocab, req_to_token=written, cur=cur.to(device), pos=p, start=start.to(device),
           block=block.to(device), out=out, emitted=emitted, counts=counts)  # fmt: skip
        results.append({**out, "emitted": emitted, "counts": counts, "state": st, "pos": p, "table": written})
    want, got = results
    for name in want:
        assert torch.equal(got[name].cpu(), want[name].cpu()), (
            f"{name}: {got[name].tolist()} vs {want[name].tolist()}"
        )
    # the reference's own meaning: a row at state s < run walks min(run - s, width - 1) tokens
    walked = want["counts"].cpu() - 1
    for b in range(rows_n):
        s = int(state[rows[b]])
        expect = min(run - s, width - 1) if 1 <= s < run else 0
        assert int(walked[b]) == expect, f"row {b} in state {s} walked {int(walked[b])}, not {expect}"


def run_small(device: str = "cpu") -> int:
    return run_checks(
        (f"chain layout {shape}", partial(check_layout, shape, device, 3)) for shape in SMALL_SHAPES
    )


if __name__ == "__main__":
    sys.exit(interpreted_main(run_small))
