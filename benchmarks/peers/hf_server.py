"""A small OpenAI-compatible server over Hugging Face ``generate``: the "plain transformers" peer.

    python benchmarks/peers/hf_server.py --port 30102 [--model-path X.gguf] [--max-batch 8] [--threads N]

Routes: ``/v1/completions``, ``/v1/chat/completions`` (streamed or not), ``/v1/models``,
``/health``. Concurrent requests are batched statically: the worker takes up to ``--max-batch``
waiting requests (those that agree on ``ignore_eos``), left-pads them and runs one ``generate``;
requests that arrive meanwhile wait for the next batch. Greedy only (temperature is ignored), no stop
strings, no JSON schemas (a request with one gets a 400). Tokens stream as the batch decodes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class Job:
    prompt_ids: list[int]
    max_tokens: int
    ignore_eos: bool
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # token ids, then None


class BatchStreamer:
    """A ``generate`` streamer: the first ``put`` is the prompt, then one ``[batch]`` tensor per step."""

    def __init__(self, jobs: list[Job], loop: asyncio.AbstractEventLoop, eos: set[int]) -> None:
        self.jobs, self.loop, self.eos = jobs, loop, eos
        self.prompt_seen = False
        self.done = [False] * len(jobs)
        self.counts = [0] * len(jobs)

    def put(self, value: Any) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        for i, token in enumerate(value.reshape(-1).tolist()):
            self._one(i, int(token))

    def _one(self, i: int, token: int) -> None:
        job = self.jobs[i]
        if self.done[i]:
            return
        if token in self.eos and not job.ignore_eos:
            self._close(i)
            return
        self.counts[i] += 1
        self.loop.call_soon_threadsafe(job.queue.put_nowait, token)
        if self.counts[i] >= job.max_tokens:
            self._close(i)

    def _close(self, i: int) -> None:
        self.done[i] = True
        self.loop.call_soon_threadsafe(self.jobs[i].queue.put_nowait, None)

    def end(self) -> None:
        for i in range(len(self.jobs)):
            if not self.done[i]:
                self._close(i)


class HFModel:
    def __init__(self, model_path: str | None, max_batch: int) -> None:
        import torch
        from phloem.runtime.model_files import resolve_model
        from phloem.runtime.tokenizer.tokenizer import load_tokenizer
        from transformers import AutoModelForCausalLM

        src = resolve_model(model_path)
        self.name = src.name
        self.tokenizer = load_tokenizer(src)
        if src.kind == "gguf":
            folder, file = os.path.dirname(src.path), os.path.basename(src.path)
            self.model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(src.path, dtype=torch.float32)
        self.model.eval()
        self.max_batch = max_batch
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.waiting: asyncio.Queue[Job] = asyncio.Queue()

    def generate(self, jobs: list[Job], loop: asyncio.AbstractEventLoop) -> None:
        """Runs in a worker thread; tokens reach each job's queue as they are made."""
        import torch

        width = max(len(j.prompt_ids) for j in jobs)
        ids = [[self.pad] * (width - len(j.prompt_ids)) + j.prompt_ids for j in jobs]
        mask = [[0] * (width - len(j.prompt_ids)) + [1] * len(j.prompt_ids) for j in jobs]
        longest = max(j.max_tokens for j in jobs)
        streamer = BatchStreamer(jobs, loop, self.tokenizer.eos_token_ids)
        extra = {"min_new_tokens": longest} if jobs[0].ignore_eos else {}
        try:
            with torch.inference_mode():
                self.model.generate(
                    input_ids=torch.tensor(ids),
                    attention_mask=torch.tensor(mask),
                    max_new_tokens=longest,
                    do_sample=False,
                    pad_token_id=self.pad,
                    streamer=streamer,
                    **extra,
                )
        finally:
            streamer.end()

    async def worker(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            jobs = [await self.waiting.get()]
            await asyncio.sleep(0.005)  # let requests sent together join the batch
            held: list[Job] = []
            while not self.waiting.empty() and len(jobs) < self.max_batch:
                job = self.waiting.get_nowait()
                (jobs if job.ignore_eos == jobs[0].ignore_eos else held).append(job)
            for job in held:
                self.waiting.put_nowait(job)
            try:
                await loop.run_in_executor(None, self.generate, jobs, loop)
            except Exception as exc:  # the jobs were closed; keep serving the next batch
                print(f"generate failed: {type(exc).__name__}: {exc}", flush=True)


# ---- HTTP ----------------------------------------------------------------------------------------
def bad_request(message: str) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": "invalid_request_error", "code": 400}}, status=400
    )


async def tokens_of(job: Job):
    while (token := await job.queue.get()) is not None:
        yield token


async def handle(request: web.Request, chat: bool) -> web.StreamResponse:
    hf: HFModel = request.app["hf"]
    body = await request.json()
    if body.get("response_format") or body.get("json_schema"):
        return bad_request("this server does not support JSON schemas")
    if chat:
        prompt = hf.tokenizer.apply_chat_template(body.get("messages") or [])
    else:
        prompt = body.get("prompt") or ""
    max_tokens = int(body.get("max_tokens") or 16)
    job = Job(hf.tokenizer.encode(prompt), max_tokens, bool(body.get("ignore_eos")))
    hf.waiting.put_nowait(job)
    ctx = {"id": f"hf-{uuid.uuid4().hex}", "created": int(time.time()), "model": hf.name, "chat": chat}
    if body.get("stream"):
        return await stream(
            request, hf, job, ctx, bool((body.get("stream_options") or {}).get("include_usage"))
        )
    ids = [t async for t in tokens_of(job)]
    text = hf.tokenizer.decode(ids)
    choice = {"index": 0, "finish_reason": finish(ids, job)}
    choice |= {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
    return web.json_response({**header(ctx), "choices": [choice], "usage": usage(job, ids)})


def header(ctx: dict[str, Any]) -> dict[str, Any]:
    kind = "chat.completion" if ctx["chat"] else "text_completion"
    return {"id": ctx["id"], "object": kind, "created": ctx["created"], "model": ctx["model"]}


def finish(ids: list[int], job: Job) -> str:
    return "length" if len(ids) >= job.max_tokens else "stop"


def usage(job: Job, ids: list[int]) -> dict[str, int]:
    n_in = len(job.prompt_ids)
    return {"prompt_tokens": n_in, "completion_tokens": len(ids), "total_tokens": n_in + len(ids)}


async def stream(
    request: web.Request, hf: HFModel, job: Job, ctx: dict[str, Any], with_usage: bool
) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    ids: list[int] = []
    sent = ""
    async for token in tokens_of(job):
        ids.append(token)
        text = hf.tokenizer.decode(ids)
        if text.endswith("\ufffd") or len(text) == len(sent):
            continue  # half a UTF-8 character (wait for the rest), or a special token (no text)
        await resp.write(event(ctx, text[len(sent) :], None))
        sent = text
    await resp.write(event(ctx, "", finish(ids, job)))
    if with_usage:
        await resp.write(
            b"data: "
            + json.dumps({**header(ctx), "choices": [], "usage": usage(job, ids)}).encode()
            + b"\n\n"
        )
    await resp.write(b"data: [DONE]\n\n")
    return resp


def event(ctx: dict[str, Any], piece: str, finish_reason: str | None) -> bytes:
    if ctx["chat"]:
        choice = {"index": 0, "delta": {"content": piece} if piece else {}, "finish_reason": finish_reason}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": piece, "finish_reason": finish_reason}
        kind = "text_completion"
    payload = {**header(ctx), "object": kind, "choices": [choice]}
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def build_app(hf: HFModel) -> web.Application:
    app = web.Application()
    app["hf"] = hf

    async def start_worker(app: web.Application) -> None:
        app["worker"] = asyncio.create_task(hf.worker())

    app.on_startup.append(start_worker)

    async def completions(request: web.Request) -> web.StreamResponse:
        return await handle(request, chat=False)

    async def chat(request: web.Request) -> web.StreamResponse:
        return await handle(request, chat=True)

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "serving"})

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": hf.name, "object": "model"}]})

    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    return app


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, default=30102)
    p.add_argument(
        "--model-path", default=None, help="GGUF or Hugging Face directory (default: phloem's default model)"
    )
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, every core)")
    ns = p.parse_args(argv)
    if ns.threads:
        import torch

        torch.set_num_threads(ns.threads)
    hf = HFModel(ns.model_path, ns.max_batch)
    web.run_app(
        build_app(hf),
        host="127.0.0.1",
        port=ns.port,
        print=lambda *a: print(f"hf_server on 127.0.0.1:{ns.port}", flush=True),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
