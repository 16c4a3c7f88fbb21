"""Typed IPC messages between the three processes, grouped by receiver (docs/design.md §8).

Channels (all ZMQ PUSH -> PULL over ``ipc://`` sockets made by ``launch.py``)::

    sender               receiver          messages
    TokenizerManager  -> scheduler         ToScheduler (generate, abort, flush, stats, weights, pause,
                                                   memory, shutdown)
    scheduler         -> detokenizer       ToDetokenizer (BatchTokenOut)
    detokenizer       -> TokenizerManager  ToTokenizerManager (BatchStrOut, Ready)
    scheduler         -> TokenizerManager  ToTokenizerManager (Ready, control replies, SchedulerStats, Heartbeat)

Every message is a ``msgspec.Struct`` with a tag; each receiver decodes the union of what it may
receive. No pickle crosses a process boundary. A request's ``SamplingParams`` (also a Struct)
travels as itself inside ``TokenizedGenerateReq``: the tokenizer manager's process built and
validated it, and the scheduler decodes it without checking it again.
"""

from __future__ import annotations

from typing import Any

import msgspec
from phloem.runtime.sampling.params import SamplingParams, decoding_trusted

# ---------------------------------------------------------------------------- to the scheduler


class TokenizedGenerateReq(msgspec.Struct, tag=True, kw_only=True):
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None
    stream: bool = False
    priority: int | None = None
    extra_key: str | None = None
    arrival_time: float = 0.0
    return_prefix_report: bool = False


class AbortReq(msgspec.Struct, tag=True, kw_only=True):
    rid: str | None = None
    abort_all: bool = False
    message: str = "aborted by request"
    # None: the caller's own abort, which the waiting client gets as a normal answer whose
    # finish_reason is {"type": "abort"} (SGLang's contract); else the HTTP error status it gets
    # (503 when the server shuts down)
    status_code: int | None = None


class FlushCacheReq(msgspec.Struct, tag=True, kw_only=True):
    req_id: int


class GetStatsReq(msgspec.Struct, tag=True, kw_only=True):
    req_id: int


class PrefixReportReq(msgspec.Struct, tag=True, kw_only=True):
    """Where ``input_ids`` would stop matching the prefix cache (``runtime/cache/prefix_walk.py``),
    without running anything; the reply's ``data`` is the report with token ids."""

    req_id: int
    input_ids: list[int]
    extra_key: str | None = None


class CudaIpcTensor(msgspec.Struct, kw_only=True):
    """A CUDA tensor of another process, by IPC handle (``runtime/cuda_ipc.py``): where its
    storage is and how the tensor views it. Plain fields: no pickle crosses the boundary."""

    name: str
    size: list[int]
    stride: list[int]
    offset: int  # elements into the storage
    dtype: str  # "float32", "bfloat16", ...
    device: int  # CUDA device index of the storage
    handle: bytes  # the allocation's IPC handle
    storage_size: int  # bytes
    storage_offset: int  # bytes into the allocation
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None = None
    event_sync_required: bool = False


class UpdateWeightsReq(msgspec.Struct, tag=True, kw_only=True):
    """Replace weights in place: from ``model_path`` (a checkpoint of the same architecture), or
    named tensors as safetensors, either a file the engine can read (``tensor_file``) or its bytes
    (``tensor_data``), and/or CUDA tensors shared by IPC handle (``cuda_ipc``; the sender keeps
    them alive until the reply). ``abort_all_requests``: abort running requests first instead of letting
    them finish. The reply's ``data`` holds ``field`` (the request field a refusal is about),
    ``internal`` (an engine fault, logged there) or, after a disk update, ``model_path``."""

    req_id: int
    model_path: str | None = None
    load_format: str | None = None
    tensor_file: str | None = None
    tensor_data: bytes | None = None
    cuda_ipc: list[CudaIpcTensor] = []  # CUDA tensors of the sender, opened in place
    tensor_field: str = "tensor_file"  # the client's name for the tensors, for refusals
    abort_all_requests: bool = False
    flush_cache: bool = True  # False keeps the prefix cache (its KV came from the old weights)


class InitWeightsGroupReq(msgspec.Struct, tag=True, kw_only=True):
    """Join a trainer's process group for weight broadcasts, as rank ``rank_offset`` of
    ``world_size`` (the trainer is rank 0); see :mod:`phloem.runtime.executor.weight_group`."""

    req_id: int
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class UpdateWeightsFromDistributedReq(msgspec.Struct, tag=True, kw_only=True):
    """Receive named tensors broadcast by rank 0 of ``group_name``, in this order, then copy them
    into the weights in place (checked against the model before anything is received)."""

    req_id: int
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False


class DestroyWeightsGroupReq(msgspec.Struct, tag=True, kw_only=True):
    req_id: int
    group_name: str = "weight_update_group"


class GetWeightsReq(msgspec.Struct, tag=True, kw_only=True):
    """The first ``truncate_size`` rows of the weight a checkpoint tensor ``name`` lands in; the
    reply's ``data["values"]`` holds them as nested lists."""

    req_id: int
    name: str
    truncate_size: int = 100


PAUSE_MODES = ("abort", "retract", "in_place")
MEMORY_TAGS = ("kv_cache", "weights")  # what release_memory_occupation can give back


class PauseGenerationReq(msgspec.Struct, tag=True, kw_only=True):
    """Stop launching steps until ``ContinueGenerationReq``. ``mode``: ``abort`` ends every request
    now, ``retract`` sends running requests back to the waiting queue (their KV freed, recomputed
    on continue), ``in_place`` keeps them and their KV as they are."""

    req_id: int
    mode: str = "abort"


class ContinueGenerationReq(msgspec.Struct, tag=True, kw_only=True):
    req_id: int


class MemoryOccupationReq(msgspec.Struct, tag=True, kw_only=True):
    """Release (``release``) or take back the device memory of ``tags`` (``kv_cache``,
    ``weights``); release is refused while a request holds KV."""

    req_id: int
    release: bool
    tags: list[str]


class ShutdownReq(msgspec.Struct, tag=True, kw_only=True):
    pass


ToScheduler = (
    TokenizedGenerateReq
    | AbortReq
    | FlushCacheReq
    | GetStatsReq
    | PrefixReportReq
    | UpdateWeightsReq
    | InitWeightsGroupReq
    | UpdateWeightsFromDistributedReq
    | DestroyWeightsGroupReq
    | GetWeightsReq
    | PauseGenerationReq
    | ContinueGenerationReq
    | MemoryOccupationReq
    | ShutdownReq
)

# ---------------------------------------------------------------------------- to the detokenizer


class ReqOutInit(msgspec.Struct, kw_only=True):
    """Sent with a request's first output: how the detokenizer must decode it."""

    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stop_strs: list[str] = []
    stream: bool = False
    no_stop_trim: bool = False


class ReqTokenOut(msgspec.Struct, kw_only=True):
    """New output of one request since its previous ReqTokenOut."""

    rid: str
    new_ids: list[int]
    finished: dict[str, Any] | None = None  # finish_reason wire dict
    init: ReqOutInit | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cached_tokens_details: dict[str, int] | None = None  # {device, host, storage}
    num_retractions: int = 0
    # [logprob, token_id] pairs; top lists are [[logprob, token_id], ...] per position.
    output_logprobs: list[list[Any]] | None = None
    output_top_logprobs: list[list[list[Any]]] | None = None
    output_token_ids_logprobs: list[list[list[Any]]] | None = None
    input_logprobs: list[list[Any]] | None = None
    input_top_logprobs: list[list[list[Any]]] | None = None
    input_token_ids_logprobs: list[list[list[Any]]] | None = None
    spec: dict[str, Any] | None = None
    prefix_report: dict[str, Any] | None = None  # prefix_walk.report_ids, with the first output


class BatchTokenOut(msgspec.Struct, tag=True, kw_only=True):
    outs: list[ReqTokenOut]


ToDetokenizer = BatchTokenOut | ShutdownReq

# ---------------------------------------------------------------------------- to the tokenizer manager


class ReqStrOut(msgspec.Struct, kw_only=True):
    """ReqTokenOut plus the newly decoded text."""

    out: ReqTokenOut
    text: str  # new text since the previous ReqStrOut of this rid


class BatchStrOut(msgspec.Struct, tag=True, kw_only=True):
    outs: list[ReqStrOut]


class Ready(msgspec.Struct, tag=True, kw_only=True):
    who: str  # "scheduler" | "detokenizer"
    info: dict[str, Any] = {}
    error: str | None = None  # startup failed: why


class ControlReply(msgspec.Struct, tag=True, kw_only=True):
    req_id: int
    ok: bool
    message: str = ""
    data: dict[str, Any] = {}


class SchedulerStats(msgspec.Struct, tag=True, kw_only=True):
    """Periodic live stats for /metrics and get_server_info (counters are cumulative)."""

    stats: dict[str, float]
    grammar_compilation_times: list[float] = []  # seconds of each compile since the last message


class Heartbeat(msgspec.Struct, tag=True, kw_only=True):
    """Sent about once a second by a thread of the scheduler process, also while a step runs: the
    manager tells a stopped or frozen process (no beats) from a busy one (beats, growing loop age)."""

    loop_age: float  # seconds since the scheduler loop last completed an iteration
    doing: str = ""  # what the loop is in the middle of ("process DECODE", "handle FlushCacheReq")


ToTokenizerManager = BatchStrOut | Ready | ControlReply | SchedulerStats | Heartbeat


class Codec:
    """Encode any message; decode the union one receiver accepts."""

    def __init__(self, receives: Any) -> None:
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(receives)

    def encode(self, msg: msgspec.Struct) -> bytes:
        return self._enc.encode(msg)

    def decode(self, data: bytes) -> Any:
        # Messages come from phloem's own processes, which validated what they carry.
        with decoding_trusted():
            return self._dec.decode(data)
