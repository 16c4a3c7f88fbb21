"""A minimal RL loop: REINFORCE on the default model, rollouts from phloem, updates in torch.

The trainer keeps its own float32 copy of the model (transformers loading the same GGUF file the
engine serves). Each step:

1. the engine samples a batch of rollouts of one chat prompt, each with its own seed and its raw
   output logprobs (``logprob_mode: "raw"``, the model's own distribution, before temperature);
2. a toy reward scores each completion: shorter answers score higher;
3. the trainer recomputes the rollouts' logprobs with its copy (they match the engine's: that is
   what the raw mode is for, and the gap is printed) and takes one policy-gradient step,
   ``-(reward - mean reward) * sum of the completion's token logprobs``, on a few parameters only
   (the final norm by default: cheap, and enough to move the answer's length);
4. the updated tensors go to the engine by name (``Engine.update_weights_from_tensor``), so the
   next rollouts come from the new policy.

Runs on the CPU in a few minutes::

    .venv/bin/python examples/rl_reinforce.py
    .venv/bin/python examples/rl_reinforce.py --steps 2 --batch 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch

PROMPT = "What is the capital of France?"
TRAINED = ("model.norm.weight",)  # Hugging Face names, as the engine takes them


def load_policy(path: str, trained: tuple[str, ...]) -> torch.nn.Module:
    """The default model as a plain float32 torch module; only ``trained`` keep their gradients."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )
    names = dict(model.named_parameters())
    missing = [n for n in trained if n not in names]
    if missing:
        raise SystemExit(f"no parameter named {missing[0]!r} in the model")
    for name, param in names.items():
        param.requires_grad_(name in trained)
    return model.eval()  # no dropout: the trainer's distribution is the engine's


def completion_logprobs(model: torch.nn.Module, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """Logprob of each completion token after the prompt and the completion so far, ``[n]``."""
    ids = torch.tensor([prompt + completion])
    logits = model(ids).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(completion)]
    return torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(completion)[:, None])[:, 0]


def reward(num_tokens: int, max_new_tokens: int) -> float:
    """Toy reward: 1 for an empty answer, 0 for one that ran out of tokens."""
    return 1.0 - num_tokens / max_new_tokens


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="policy-gradient steps")
    parser.add_argument("--batch", type=int, default=8, help="rollouts per step")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=0.05, help="Adam learning rate")
    parser.add_argument("--seed", type=int, default=0, help="first rollout seed")
    parser.add_argument("--train", nargs="+", default=list(TRAINED), help="parameters to train")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the loop; returns the mean reward and logprob gap of each step and the updates pushed."""
    from phloem.runtime.model_files import resolve_model

    from phloem import Engine

    args = parse_args(argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # the engine's processes compute beside this one: no oversubscription
    path = resolve_model(None).path
    policy = load_policy(path, tuple(args.train))
    params = {n: p for n, p in policy.named_parameters() if n in args.train}
    opt = torch.optim.Adam(params.values(), lr=args.lr)
    history: dict[str, Any] = {"rewards": [], "gaps": [], "updates": 0}

    # float32 weights: the trainer pushes float tensors, and compares its logprobs with the engine's
    # (the CPU default computes on the GGUF's quantized blocks, which hold no float projections)
    with Engine(log_level="warning", quantization="none") as engine:
        chat = [{"role": "user", "content": PROMPT}]
        tok = engine.tm.tokenizer
        prompt = tok.encode(tok.apply_chat_template(chat, add_generation_prompt=True))
        t0 = time.perf_counter()
        for step in range(args.steps):
            sampling = [
                {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                 "sampling_seed": args.seed + step * args.batch + i, "logprob_mode": "raw"}
                for i in range(args.batch)
            ]  # fmt: skip
            outs = engine.generate(input_ids=[prompt] * args.batch, sampling_params=sampling, return_logprob=True)
            rollouts = [o["output_ids"] for o in outs]
            rewards = [reward(len(r), args.max_new_tokens) for r in rollouts]
            baseline = statistics.fmean(rewards)

            opt.zero_grad()
            gap = 0.0
            for out, ids, r in zip(outs, rollouts, rewards):
                if not ids:
                    continue
                logp = completion_logprobs(policy, prompt, ids)
                served = torch.tensor([t[0] for t in out["meta_info"]["output_token_logprobs"]])
                gap = max(gap, (logp.detach() - served).abs().max().item())
                # REINFORCE with the batch mean as baseline; sum over tokens, mean over rollouts
                (-(r - baseline) * logp.sum() / args.batch).backward()
            opt.step()

            ok, message = engine.update_weights_from_tensor({n: p.detach() for n, p in params.items()})
            if not ok:
                raise SystemExit(f"weight update failed: {message}")
            history["updates"] += 1
            history["rewards"].append(baseline)
            history["gaps"].append(gap)
            mean_len = statistics.fmean(len(r) for r in rollouts)
            print(f"step {step} ({time.perf_counter() - t0:.0f} s): mean reward {baseline:.3f}  mean length {mean_len:.1f} tokens  "
                  f"trainer-engine logprob gap {gap:.1e}  pushed {', '.join(params)}")  # fmt: skip

        sample = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": args.max_new_tokens, "temperature": 0})
        print(f"greedy answer after training: {sample['text']!r}")
    print(f"done: {history['updates']} weight updates pushed to the engine")
    return history


if __name__ == "__main__":  # Engine starts its processes with spawn
    main()
