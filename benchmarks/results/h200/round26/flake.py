"""Round 26: does the auto continuous decode Engine test's batch-of-six mismatch (round 25, call
c) come back, and with which path? Engines in turn, each giving greedy ids of three prompts alone
and of six in one batch (the test's calls), as ``RUNS`` lists them: steps per launch (1, or 0 for
auto) and ``PHLOEM_DECODE_ROPE``. Prints, per engine, which rows differ from the first engine of
the same ROPE setting and at which token; the prefill passes are in the log (info level)."""

import json
import os
import sys

from phloem import Engine

sys.path.insert(0, os.getcwd())
from tests.integration.test_engine_speculative import PROMPTS  # noqa: E402

BATCH = PROMPTS[:6]
GREEDY = {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}
RUNS = [(1, "1"), (0, "1"), (1, "1"), (0, "1"), (1, "0"), (0, "0")]


def run(k: int, rope: str) -> tuple[list[list[int]], list[list[int]], dict]:
    os.environ["PHLOEM_DECODE_ROPE"] = rope  # read by the scheduler process at import
    with Engine(
        device="cuda", dtype="bfloat16", log_level="info", load_format="dummy",
        tokenizer_path=os.environ["PHLOEM_TEST_TOKENIZER"], num_continuous_decode_steps=k,
    ) as eng:  # fmt: skip
        print(f"=== engine k={k} rope={rope}", file=sys.stderr, flush=True)
        alone = [eng.generate(p, sampling_params=GREEDY)["output_ids"] for p in BATCH[:3]]
        batch = [o["output_ids"] for o in eng.generate(BATCH, sampling_params=[dict(GREEDY) for _ in BATCH])]
        live = eng.get_server_info()["live"]
    return alone, batch, {"continuous_decode_steps_total": live.get("continuous_decode_steps_total")}


def first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), -1)


def main() -> None:
    refs: dict[str, tuple] = {}
    for i, (k, rope) in enumerate(RUNS):
        alone, batch, live = run(k, rope)
        ref = refs.setdefault(rope, (alone, batch))
        diffs = {
            "alone": [(r, first_diff(a, b)) for r, (a, b) in enumerate(zip(alone, ref[0])) if a != b],
            "batch": [(r, first_diff(a, b)) for r, (a, b) in enumerate(zip(batch, ref[1])) if a != b],
        }
        print(json.dumps({"run": i, "k": k, "rope": rope, **diffs, **live}), flush=True)


if __name__ == "__main__":  # the engine starts its processes by spawning
    main()
