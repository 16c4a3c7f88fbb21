"""Write an EAGLE head with random weights for a dummy target shape (cost measurements only).

A head trained for a target needs that target's real weights; for shapes that run with dummy
weights (``--dummy-shape``) this gives a head of the right shape so that ``step_profile.py
--head F`` can time speculative steps. Its drafts are random: the accept length stays near 1 and
only the cost of a step means anything. Weights are written in float16 (as shipped heads).

    python3 -m benchmarks.gpu.random_head --dummy-shape llama3-8b --out /tmp/llama_head.safetensors
"""

from __future__ import annotations

import argparse
import sys

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dummy-shape", required=True)
    ap.add_argument("--draft-vocab", type=int, default=16384, help="rows of the draft LM head")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from phloem.runtime.models.config import DUMMY_SHAPES
    from phloem.runtime.speculative.eagle import EagleConfig, EagleHead, save_eagle_head

    cfg = EagleConfig.from_target(DUMMY_SHAPES[args.dummy_shape], draft_vocab_size=args.draft_vocab)
    head = EagleHead(cfg)
    head.reset_parameters(torch.Generator().manual_seed(args.seed))
    with torch.no_grad():  # nonzero residual branches, so a step does the work a trained head does
        for lin in (head.o_proj, head.down_proj):
            lin.weight.normal_(0.0, 0.02)
    head.token_map = torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(args.seed))[
        : cfg.draft_vocab_size
    ]
    save_eagle_head(head, args.out, info={"random": True, "dummy_shape": args.dummy_shape, "seed": args.seed})
    print(f"wrote {args.out}: {sum(p.numel() for p in head.parameters()) / 1e6:.1f} M parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
