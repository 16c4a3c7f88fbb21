"""Round 23 call c: is the continuous-decode Engine test's batch-of-six mismatch the replayed
steps' argmax, or run-to-run scheduling? Four engines in turn (one step per launch, eight, one,
eight), each giving greedy ids of three prompts alone and of six in one batch; prints which rows
differ from the first engine's and at which token, and each engine's prefill passes."""

import json
import os
import sys

from phloem import Engine

sys.path.insert(0, os.getcwd())
from tests.integration.test_engine_speculative import PROMPTS  # noqa: E402

BATCH = PROMPTS[:6]
GREEDY = {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}


def run(k: int) -> tuple[list[list[int]], list[list[int]]]:
    with Engine(
        device="cuda", dtype="bfloat16", log_level="info", load_format="dummy",
        tokenizer_path=os.environ["PHLOEM_TEST_TOKENIZER"], num_continuous_decode_steps=k,
    ) as eng:  # fmt: skip
        print(f"=== engine k={k}", file=sys.stderr, flush=True)
        alone = [eng.generate(p, sampling_params=GREEDY)["output_ids"] for p in BATCH[:3]]
        batch = [o["output_ids"] for o in eng.generate(BATCH, sampling_params=[dict(GREEDY) for _ in BATCH])]
    return alone, batch


def first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), -1)


def main() -> None:
    runs = [(k, run(k)) for k in (1, 8, 1, 8)]
    ref_alone, ref_batch = runs[0][1]
    out = []
    for i, (k, (alone, batch)) in enumerate(runs):
        diffs = {
            "alone": [(r, first_diff(a, b)) for r, (a, b) in enumerate(zip(alone, ref_alone)) if a != b],
            "batch": [(r, first_diff(a, b)) for r, (a, b) in enumerate(zip(batch, ref_batch)) if a != b],
        }
        out.append({"run": i, "k": k, **diffs})
    print(json.dumps(out))


if __name__ == "__main__":  # the engine starts its processes by spawning
    main()
