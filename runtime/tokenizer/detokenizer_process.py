"""⑦ The detokenizer process: token ids in, text deltas out (docs/design.md §2 step 7).

Per request it keeps an incremental decoder (holds back a split multi-byte character) and, for
streaming requests with stop strings, holds back text that could be the start of a stop string.
On finish it trims the matched stop string (unless ``no_stop_trim``) and forgets the request.
"""

from __future__ import annotations

import logging
import os
import signal

import zmq
from phloem.runtime.ipc import IpcPaths, parent_alive, pull_socket, push_socket
from phloem.runtime.messages import (
    BatchStrOut,
    BatchTokenOut,
    Codec,
    Ready,
    ReqOutInit,
    ReqStrOut,
    ReqTokenOut,
    ShutdownReq,
    ToDetokenizer,
    ToTokenizerManager,
)
from phloem.runtime.tokenizer.detokenizer import RequestDecoder

logger = logging.getLogger("phloem.detokenizer")


class Detokenizer:
    """Pure logic of the process (unit-testable without sockets): one ``RequestDecoder`` per
    request in flight, created from the ``init`` that comes with its first output."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestDecoder] = {}

    def handle(self, batch: BatchTokenOut) -> BatchStrOut:
        return BatchStrOut(outs=[self._one(o) for o in batch.outs])

    def _one(self, out: ReqTokenOut) -> ReqStrOut:
        dec = self.states.get(out.rid)
        if dec is None:
            init = out.init or ReqOutInit()
            dec = RequestDecoder(
                self.tokenizer,
                skip_special_tokens=init.skip_special_tokens,
                spaces_between_special_tokens=init.spaces_between_special_tokens,
                stop_strs=init.stop_strs,
                no_stop_trim=init.no_stop_trim,
            )
            self.states[out.rid] = dec
        text = dec.push(list(out.new_ids), out.finished)
        if out.finished is not None:
            del self.states[out.rid]
            # tail_chars only locates the stop string for trimming; it is not part of the wire.
            out.finished = {k: v for k, v in out.finished.items() if k != "tail_chars"}
        return ReqStrOut(out=out, text=text)


def run_detokenizer_process(
    model_source, ipc: IpcPaths, parent_pid: int, log_level: str = "info", tokenizer_path: str | None = None
) -> None:
    logging.basicConfig(level=log_level.upper(), format="[%(asctime)s detokenizer] %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent shuts us down in order
    ctx = zmq.Context()
    out = push_socket(ctx, ipc.tokenizer_manager)
    to_tm = Codec(ToTokenizerManager)
    try:
        from phloem.runtime.tokenizer.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(model_source, tokenizer_path)
        inp = pull_socket(ctx, ipc.detokenizer)
    except Exception as e:  # report and exit: the launcher fails loudly
        out.send(to_tm.encode(Ready(who="detokenizer", error=f"{type(e).__name__}: {e}")))
        return
    detok = Detokenizer(tokenizer)
    codec = Codec(ToDetokenizer)
    out.send(to_tm.encode(Ready(who="detokenizer", info={"pid": os.getpid()})))
    while True:
        if not inp.poll(1000):
            if not parent_alive(parent_pid):
                return
            continue
        msg = codec.decode(inp.recv())
        if isinstance(msg, ShutdownReq):
            return
        out.send(to_tm.encode(detok.handle(msg)))
