"""One generation request as the tokenizer manager receives it (after wire parsing).

Both entry points build these: the HTTP server from a ``/generate`` or OpenAI body, the in-process
Engine from its keyword arguments. A batch or ``n > 1`` becomes several of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from phloem.runtime.sampling.params import SamplingParams


@dataclass
class GenerateRequest:
    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: output logprobs only
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None
    return_text_in_logprobs: bool = False
    rid: str | None = None  # filled with a fresh uuid when None
    priority: int | None = None
    extra_key: str | None = None
    stream: bool = False
    return_prefix_report: bool = False  # meta_info.prefix_report (runtime/cache/prefix_walk.py)
