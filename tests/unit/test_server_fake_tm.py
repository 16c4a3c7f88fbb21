"""A fake TokenizerManager for the server tests (no model, no processes).

Tokens are character codes (``"ab" -> [97, 98]``, BOS = 1 when special tokens are added) and the
"model" echoes the prompt: the output is the prompt's tokens, repeated and cut at
``max_new_tokens``; a request whose prompt fits finishes with ``stop``, otherwise with ``length``.
Marker words in the prompt change the behaviour:

- ``ABORTME``: finishes with an abort for an engine failure (status code 503)
- ``GRAMMARFAIL``: finishes before any token with an abort carrying ``status_code`` 400 and the
  field at fault (``param``), as the scheduler's grammar queue does
- ``BADPROMPT``: ``tm.generate`` raises ``InvalidRequest("text", ...)``
- ``SLOW``: sleeps 50 ms per token (for disconnect and abort tests)
- ``TOOLCALL``: the output is text then a tool call in the ``qwen`` format (``TOOL_TEXT``)

The scheduler's heartbeat is a real ``Liveness`` on a clock the test moves (``tm.now``): advance it
past the thresholds to make the engine stalled, ``tm.liveness.beat()`` to revive it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.testclient import TestClient
from phloem.runtime.config import EngineArgs
from phloem.runtime.errors import InvalidRequest
from phloem.runtime.messages import ControlReply
from phloem.runtime.server.app import create_app
from phloem.runtime.tokenizer.liveness import Liveness
from phloem.runtime.tokenizer.request import GenerateRequest

VOCAB = 1000
BOS, EOS = 1, 2
TOOL_TEXT = 'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


class FakeTokenizer:
    vocab_size = VOCAB
    eos_token_ids = {EOS}
    chat_template = "{{ messages }}"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = [ord(c) if ord(c) < VOCAB else ord("?") for c in text]
        return [BOS, *ids] if add_special_tokens else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i < 3))

    def apply_chat_template(
        self, messages: list[dict], *, add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> str:
        for m in messages:
            if m["content"] == "BREAK_TEMPLATE":
                raise ValueError("Conversation roles must alternate")
        head = "tools:" + ",".join(t["function"]["name"] for t in tools) + "\n" if tools else ""
        body = "".join(f"{m['role']}:{m['content']}\n" for m in messages)
        return head + body + ("assistant:" if add_generation_prompt else "")


class FakeTokenizerManager:
    def __init__(self, **args: Any) -> None:
        self.args = EngineArgs(**{"model_path": "fake-model", **args})
        self.tokenizer = FakeTokenizer()
        self.context_len = 4096
        self.model_info = {
            "model_path": "fake-model",
            "served_model_name": "fake",
            "context_length": 4096,
            "vocab_size": VOCAB,
            "chat_template": FakeTokenizer.chat_template,
        }
        self.metrics: Any = None
        self.weight_updates: list[dict[str, Any]] = []
        self.status = "serving"
        self.broken_reason = ""
        self.now = 0.0  # the heartbeat clock, in seconds
        self.liveness = Liveness(watchdog_s=self.args.watchdog_timeout, clock=lambda: self.now)
        self.requests: list[GenerateRequest] = []
        self.running: dict[str, bool] = {}  # rid -> abort requested
        self.cancelled: list[str] = []
        self.finished: list[str] = []
        self.aborts: list[tuple[str | None, bool]] = []
        self.abort_on_shutdown = True  # False: in-flight requests never hear of the shutdown
        self._n = 0

    # ---- generation
    def health(self) -> str:
        if self.status == "serving" and self.liveness.stall():
            return "stalled"
        return self.status

    def health_message(self) -> str:
        if self.status == "broken":
            return self.broken_reason
        return self.liveness.stall() if self.status == "serving" else ""

    def heartbeat_age(self) -> float:
        return self.liveness.silence()

    def _prompt_ids(self, req: GenerateRequest) -> list[int]:
        if self.status != "serving":
            raise InvalidRequest("", f"server is {self.status}")
        ids = list(req.input_ids) if req.input_ids is not None else self.tokenizer.encode(req.text or "")
        if "BADPROMPT" in self.tokenizer.decode(ids):
            raise InvalidRequest("text", "the prompt has 9999 tokens; the model's context length is 4096")
        if len(ids) + req.sampling_params.max_new_tokens > self.context_len:
            raise InvalidRequest(
                "sampling_params.max_new_tokens", "new tokens after the prompt exceed the context length"
            )
        if req.logprob_start_len >= len(ids):
            raise InvalidRequest("logprob_start_len", f"must be < the prompt length {len(ids)}")
        return ids

    async def encode_prompt(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        if len(ids) >= self.context_len:
            raise InvalidRequest(
                "text", f"the prompt has {len(ids)} tokens; the model's context length is {self.context_len}"
            )
        return ids

    async def generate(self, req: GenerateRequest) -> AsyncIterator[dict[str, Any]]:
        ids = self._prompt_ids(req)
        self._n += 1
        rid = req.rid or f"fake-{self._n}"
        if rid in self.running:
            raise InvalidRequest("rid", f"a request with rid {rid!r} is already running")
        self.requests.append(req)
        self.running[rid] = False
        start, done = time.perf_counter(), False
        try:
            async for out in self._run(req, rid, ids):
                yield out
            done = True
        finally:
            self.running.pop(rid, None)
            (self.finished if done else self.cancelled).append(rid)
            if done and self.metrics is not None:
                e2e = time.perf_counter() - start
                self.metrics.observe_request(
                    ttft=e2e / 2,
                    itls=[0.001],
                    e2e=e2e,
                    prompt_tokens=len(ids),
                    completion_tokens=1,
                    cached_tokens=0,
                )

    async def _run(self, req: GenerateRequest, rid: str, ids: list[int]) -> AsyncIterator[dict[str, Any]]:
        text = self.tokenizer.decode(ids)  # markers work for chat (ids) and text prompts alike
        out_ids = _echo(ids, req.sampling_params.max_new_tokens, text)
        if "GRAMMARFAIL" in text:  # the grammar queue aborts before the first token
            yield self._output(req, rid, ids, [], _finish(text, req, ids, []))
            return
        slow = "SLOW" in text
        for k in range(1, len(out_ids) + 1):
            await asyncio.sleep(0.05 if slow else 0)
            if self.running.get(rid) or (self.status != "serving" and self.abort_on_shutdown):
                if self.running.get(rid):  # the caller's abort: an answer, no status
                    reason: dict[str, Any] = {"type": "abort", "message": "aborted by request"}
                else:
                    reason = {"type": "abort", "message": "server is shutting down", "status_code": 503}
                yield self._output(req, rid, ids, out_ids[:k], reason)
                return
            if req.stream and k < len(out_ids):
                yield self._output(req, rid, ids, out_ids[:k], None)
        yield self._output(req, rid, ids, out_ids, _finish(text, req, ids, out_ids))

    def _output(
        self, req: GenerateRequest, rid: str, ids: list[int], out_ids: list[int], reason: dict | None
    ) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": rid,
            "finish_reason": reason,
            "prompt_tokens": len(ids),
            "completion_tokens": len(out_ids),
            "cached_tokens": 3,
            "num_retractions": 0,
            "e2e_latency": 0.01,
        }
        if req.return_logprob:
            meta.update(_logprobs(req, ids, out_ids))
        return {"text": self.tokenizer.decode(out_ids), "output_ids": list(out_ids), "meta_info": meta}

    # ---- control
    def abort(self, rid: str | None = None, *, abort_all: bool = False) -> None:
        self.aborts.append((rid, abort_all))
        for key in list(self.running):
            if abort_all or key == rid:
                self.running[key] = True

    async def flush_cache(self, timeout: float | None = None) -> bool:
        return not self.running

    async def get_server_info(self) -> dict[str, Any]:
        return {
            **self.args.to_dict(),
            "status": self.health(),
            "live": {"num_running_reqs": len(self.running)},
            "version": "test",
        }

    async def update_weights_from_disk(
        self, model_path: str, *, load_format: str | None = None, abort_all_requests: bool = False
    ) -> ControlReply:
        """``/bad`` is refused as a missing file, ``/crash`` fails inside the engine."""
        if model_path == "/bad":
            return ControlReply(
                req_id=0, ok=False, message="model_path: no such file", data={"field": "model_path"}
            )
        if model_path == "/crash":
            return ControlReply(req_id=0, ok=False, message="internal error", data={"internal": True})
        self.weight_updates.append({"model_path": model_path, "abort_all_requests": abort_all_requests})
        return ControlReply(req_id=0, ok=True, message="loaded", data={"model_path": model_path})

    async def update_weights_from_tensor(
        self,
        *,
        tensor_file: str | None = None,
        tensor_data: bytes | None = None,
        field: str = "tensor_file",
        abort_all_requests: bool = False,
    ) -> ControlReply:
        self.weight_updates.append({"tensor_file": tensor_file, "tensor_data": tensor_data, "field": field})
        return ControlReply(req_id=0, ok=True, message=f"loaded {tensor_file or len(tensor_data or b'')}")

    def start_shutdown(self) -> None:
        if self.status == "serving":
            self.status = "shutting_down"


def _echo(ids: list[int], max_new: int, text: str) -> list[int]:
    if "TOOLCALL" in text:
        return [ord(c) for c in TOOL_TEXT][:max_new]
    if not ids:
        return []
    return (ids * (max_new // len(ids) + 1))[:max_new]


def _finish(text: str, req: GenerateRequest, ids: list[int], out_ids: list[int]) -> dict[str, Any]:
    if "ABORTME" in text:
        return {"type": "abort", "message": "engine failure: scheduler died", "status_code": 503}
    if "GRAMMARFAIL" in text:
        return {
            "type": "abort",
            "message": "invalid grammar: does not compile",
            "status_code": 400,
            "param": "sampling_params.json_schema",
        }
    if req.sampling_params.max_new_tokens <= len(ids) and "TOOLCALL" not in text:
        return {"type": "length", "length": len(out_ids)}
    return {"type": "stop", "matched": EOS}


def _logprobs(req: GenerateRequest, ids: list[int], out_ids: list[int]) -> dict[str, Any]:
    def tops(tok: int) -> list[list[Any]] | None:
        n = req.top_logprobs_num
        return [[-0.5 - k, tok + k, None] for k in range(n)] if n else None

    meta: dict[str, Any] = {
        "output_token_logprobs": [[-0.5, t, None] for t in out_ids],
        "output_top_logprobs": [tops(t) for t in out_ids],
    }
    if req.logprob_start_len >= 0:
        prompt = ids[req.logprob_start_len :]
        meta["input_token_logprobs"] = [
            [None if k == 0 else float("-inf"), t, None] for k, t in enumerate(prompt)
        ]
        meta["input_top_logprobs"] = [tops(t) for t in prompt]
    return meta


def make_client(**args: Any) -> tuple[TestClient, FakeTokenizerManager]:
    tm = FakeTokenizerManager(**args)
    return TestClient(create_app(tm), raise_server_exceptions=False), tm


def fake_factory(args: EngineArgs) -> FakeTokenizerManager:
    """For ``run_server`` in a subprocess: ``PHLOEM_FAKE_BREAK_AFTER`` seconds -> health 'broken'."""
    import os

    tm = FakeTokenizerManager(**{k: v for k, v in args.to_dict().items() if k != "model_path"})
    delay = os.environ.get("PHLOEM_FAKE_BREAK_AFTER")
    if delay:
        asyncio.get_running_loop().call_later(float(delay), setattr, tm, "status", "broken")
    return tm
