"""``ModelRunner``: from a model source to logits and sampled tokens (docs/design.md §5).

Owns the model, the KV pool, the ``req_to_token`` table and the attention backend. One call to
:meth:`ModelRunner.forward` runs one batch: move the :class:`ForwardInput` to the device, run the
model (each layer writes its K/V at ``out_slots``), compute logits only where needed, sample, and
gather the logprobs the batch asked for.

dtype on CPU: ``auto`` picks float32. Without native bfloat16 matmuls (AVX-512 BF16 or AMX),
bfloat16 is emulated and decodes slower than float32 (``benchmarks/cpu_model.py`` compares them).
On CUDA ``auto`` picks bfloat16.

Two load-time switches change the kernels, never the loop:

- ``deterministic``: batch-invariant linear layers (fixed 16-row matmul tiles) and attention (one
  float32 call per query row, :mod:`phloem.runtime.attention.batch_invariant`); a request's logits
  are then bit-identical whatever batch it runs in and whether its prefix came from the cache.
- ``quantization``: ``int4`` / ``int8`` weight-only CPU layers (:mod:`phloem.runtime.layers.quant`),
  or ``gguf``: integer dot products on a GGUF's own blocks with int8 activations
  (:mod:`phloem.runtime.layers.qdot`). ``auto`` (the engine's default) takes ``gguf`` on the CPU
  for a float32 model from a GGUF whose quantized tensors are all Q4_1 / Q8_0, else ``none``.

Under tensor parallelism (built in a process where ``distributed.state.init_tp`` ran) the runner
holds this rank's share: the model's layers split themselves (``models/llama.py``), the checkpoint
is read as lazy slices, and :attr:`ModelRunner.heads` (``models/sharding.py``) gives the query and
KV head counts that size the KV pool and the attention backend; ``weight_bytes`` is per rank.

``kv_cache_dtype="fp8_e4m3"`` stores the KV pool as scaled fp8 (one byte per element, so about
twice the tokens fit in the same memory); the attention backends dequantize on read. How its
accuracy is measured: ``docs/benchmarks.md`` ("fp8 KV cache").
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from phloem.runtime.attention.registry import get_attention_backend_class, resolve_attention_backend
from phloem.runtime.cache.host_pool import KVLoad, LayerReadiness, LayerwiseLoader
from phloem.runtime.cache.kv_pool import KVPool, ReqToTokenPool
from phloem.runtime.distributed.slices import TensorLike
from phloem.runtime.distributed.state import TPGroup, get_tp
from phloem.runtime.forward_io import (
    ForwardInput,
    ForwardMode,
    ForwardOutput,
    LogprobRequest,
    SamplingInfo,
    TokenLogprobs,
)
from phloem.runtime.host_copy import to_device, to_host_async
from phloem.runtime.layers.blas import apply_gemm_library
from phloem.runtime.model_files import ModelSource
from phloem.runtime.models.config import ModelConfig
from phloem.runtime.models.registry import get_model_class
from phloem.runtime.models.sharding import per_rank_heads
from torch import nn

__all__ = ["DirectBatcher", "ModelRunner", "greedy_sampling_info"]

logger = logging.getLogger(__name__)

SamplerFn = Callable[[torch.Tensor, SamplingInfo], torch.Tensor]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_KV_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn}  # besides "auto": the compute dtype
_CPU_MAX_DEFAULT_TOKENS = 32768  # CPU pools stay modest unless max_total_tokens says otherwise
_DEFAULT_MEM_FRACTION = {"cpu": 0.25, "cuda": 0.85}
# Logprob rows up to this size reach the host through pinned memory without waiting for the pass
# (a 256-request decode step of a 152k-token vocabulary is 156 MB; 64 rows of 128k, 33 MB).
_PINNED_LOGPROB_BYTES = 256 << 20
# Short extend passes (``extend_graph_tokens``) of up to this many requests replay graphs.
EXTEND_GRAPH_MAX_BS = 32
# Chain decode launches (``chain_width``) of up to this many rows replay graphs (larger batches
# decode without chains).
CHAIN_GRAPH_MAX_BS = 128
# ``chain_width=-1``: chains of this many nodes on CUDA (jump-forward's default there), none on
# the CPU, where a pass costs in proportion to its tokens and host jumps win
CHAIN_DEFAULT_WIDTH = 8


@dataclass(frozen=True)
class _LogitRows:
    """Which hidden rows get logits: ``rows`` into the flat token axis, ``last`` into ``rows``.

    ``starts[r]``: index into ``rows`` of request r's first selected row (``-1`` if only its
    last row is selected); ``first_new[r]``: extend offset of that first selected row.
    """

    rows: torch.Tensor  # [N] int64
    last: torch.Tensor  # [B] int64
    starts: list[int]
    first_new: list[int]


class ModelRunner:
    """Loads a model and runs forward passes over the paged KV pool.

    Parameters
    ----------
    model_source:
        From :func:`phloem.runtime.model_files.resolve_model`.
    dtype:
        ``auto``, ``float32``, ``bfloat16`` or ``float16`` (weights, activations and KV).
    device:
        ``auto`` (CUDA when available), ``cpu`` or ``cuda[:i]``.
    attention_backend:
        Registry name or ``auto``.
    max_total_tokens:
        KV pool size in tokens; default from ``mem_fraction_static`` of device memory minus weights
        (on CPU also capped at 32768).
    mem_fraction_static:
        Fraction of device memory for weights + KV pool (default 0.85 CUDA, 0.25 CPU).
    max_running_requests:
        Rows of ``req_to_token`` (default ``min(256, max_total_tokens // 2)``).
    context_len:
        Override of the model's context length.
    seed:
        Seed for dummy weights.
    sampler:
        ``(logits [B, V] float32, SamplingInfo) -> [B] int64``; default
        :class:`phloem.runtime.sampling.sampler.Sampler`.
    deterministic:
        Batch-invariant kernels (``EngineArgs.enable_deterministic_inference``): bit-identical
        logits for a request whatever its batch and whether its prefix was cached. Slower.
    quantization:
        ``None``/``"none"``, ``"int4"`` or ``"int8"``: weight-only quantized CPU linear layers (see
        :mod:`phloem.runtime.layers.quant`); ``int4`` takes a Q4_1 GGUF's blocks as they are.
        ``"gguf"``: every projection and the LM head on the GGUF's own Q4_1 / Q8_0 blocks with int8
        activations (:mod:`phloem.runtime.layers.qdot`). ``"auto"``: ``gguf`` where it applies
        (CPU, float32, a GGUF quantized only in those types, the kernel builds), else ``none``.
    cpu_threads:
        torch intra-op threads on CPU (default: every core, ``os.cpu_count()``).
    kv_cache_dtype:
        ``auto`` (the compute dtype) or ``fp8_e4m3`` (scaled fp8, per-layer scales of 1.0; see
        :class:`phloem.runtime.cache.kv_pool.KVPool`). Sizes the pool as well as its storage.
    gemm_library:
        ``auto``, ``cublas`` or ``cublaslt``: the library of torch's matmuls on CUDA, chosen before
        the decode graphs are captured (see :mod:`phloem.runtime.layers.blas`).
    """

    def __init__(
        self,
        model_source: ModelSource,
        *,
        dtype: str = "auto",
        device: str = "auto",
        attention_backend: str = "auto",
        max_total_tokens: int | None = None,
        mem_fraction_static: float | None = None,
        max_running_requests: int | None = None,
        context_len: int | None = None,
        seed: int = 0,
        sampler: SamplerFn | None = None,
        deterministic: bool = False,
        quantization: str | None = None,
        cpu_threads: int | None = None,
        cuda_graph_max_bs: int = 256,  # 0 disables decode CUDA graphs
        kv_cache_dtype: str = "auto",
        gemm_library: str = "auto",
        extend_graph_tokens: int = 0,
        chain_width: int = 0,
    ) -> None:
        started = time.perf_counter()
        self.tp = get_tp()  # this process's tensor-parallel rank (one rank unless init_tp ran)
        self.device = _resolve_device(device)
        self.dtype = _resolve_dtype(dtype, self.device)
        self.kv_dtype = _resolve_kv_dtype(kv_cache_dtype, self.dtype)
        self.deterministic = deterministic
        self.quantization = _resolve_quantization(
            quantization, self.device, model_source, self.dtype, tp_size=self.tp.size
        )
        if self.device.type == "cpu":
            torch.set_num_threads(cpu_threads or os.cpu_count() or 1)
        self.model_source = model_source  # what the weights now in the model came from
        # under tensor parallelism this rank's heads (``models/sharding.py``) size the KV pool and
        # the attention backend, and the checkpoint is read slice by slice
        config, weights = _load_checkpoint(model_source, self.tp)
        self.heads = per_rank_heads(config, self.tp)
        self.context_len = int(context_len or config.context_len)
        self.model_config = config.replace(context_len=max(self.context_len, config.context_len))
        self.gemm_library = apply_gemm_library(gemm_library, config.hidden_size, self.device)
        self.model = self._build_model(weights, seed, model_source)
        self.max_total_num_tokens = self._pool_tokens(max_total_tokens, mem_fraction_static)
        self.max_running_requests = int(
            max_running_requests or min(256, max(1, self.max_total_num_tokens // 2))
        )
        self.kv_pool = self._make_kv_pool()
        # On CUDA, host-tier KV loads into the pool land layer by layer inside the forward pass of
        # the batch that reads them (``forward(kv_loads=...)``); on the CPU they are plain copies.
        self.kv_loader = LayerwiseLoader.register(self.kv_pool) if self.device.type == "cuda" else None
        self.req_to_token_pool = ReqToTokenPool(self.max_running_requests, self.context_len, self.device)
        if deterministic:
            from phloem.runtime.attention.batch_invariant import BatchInvariantBackend

            backend_name, backend_cls = "batch_invariant", BatchInvariantBackend
        else:
            backend_name = resolve_attention_backend(attention_backend, self.device)
            backend_cls = get_attention_backend_class(backend_name)
        self.attn_backend = backend_cls(self.kv_pool, self.req_to_token_pool, num_heads=self.heads.num_heads)
        self.attention_backend_name = backend_name
        self._sampler = sampler
        self.cuda_graphs = None
        if (
            self.device.type == "cuda"
            and cuda_graph_max_bs > 0
            and getattr(self.attn_backend, "supports_cuda_graph", False)
        ):
            from phloem.runtime.executor.cuda_graph import CudaGraphRunner

            self.cuda_graphs = CudaGraphRunner(
                self.model,
                self.attn_backend,
                max_bs=min(cuda_graph_max_bs, self.max_running_requests),
                exit=self._decode_exit(),
            )
            self.cuda_graphs.capture()
        self.extend_graphs = None
        if self.cuda_graphs is not None and extend_graph_tokens > 0 and self.tp.size == 1:
            from phloem.runtime.executor.extend_graphs import ExtendGraphs

            self.extend_graphs = ExtendGraphs(
                self, width=extend_graph_tokens, max_bs=min(EXTEND_GRAPH_MAX_BS, self.max_running_requests)
            )
            self.extend_graphs.capture()
        self.chain_decoder = None
        if chain_width < 0:
            chain_width = CHAIN_DEFAULT_WIDTH if self.cuda_graphs is not None else 0
        if chain_width > 0 and self.tp.size == 1:
            from phloem.runtime.executor.chain_decode import ChainDecoder

            graphs = self.cuda_graphs is not None
            self.chain_decoder = ChainDecoder(
                self, width=chain_width,
                max_bs=min(cuda_graph_max_bs, self.max_running_requests, CHAIN_GRAPH_MAX_BS) if graphs else 0,
            )  # fmt: skip
            self.chain_decoder.capture()
        if self.device.type == "cuda":
            from phloem.runtime.sampling.sampler import warm_up_kernels

            t = time.perf_counter()
            launches = warm_up_kernels(self.vocab_size, self.device)
            if launches:
                logger.info("sampling kernels compiled for every batch size: %d launches in %.2f s",
                            launches, time.perf_counter() - t)  # fmt: skip
        logger.info(
            "model runner ready in %.1f s: model=%s (%s) dtype=%s kv_dtype=%s device=%s attention=%s "
            "max_total_num_tokens=%d max_running_requests=%d context_len=%d deterministic=%s "
            "quantization=%s quant_kernel=%s threads=%d gemm=%s",
            time.perf_counter() - started, model_source.path, model_source.kind, self.dtype, self.kv_dtype,
            self.device, backend_name, self.max_total_num_tokens, self.max_running_requests, self.context_len,
            deterministic, self.quantization, self.quant_kernel, torch.get_num_threads(), self.gemm_library,
        )  # fmt: skip

    # ---- construction -------------------------------------------------------------------------
    def _decode_exit(self) -> Any:
        """Early exit for the decode graphs (``decode_exit.py``) when ``PHLOEM_DECODE_EARLY_EXIT``
        is on and this torch can capture conditional nodes; otherwise None. Off by default: the
        GPU machines' torch (2.11) cannot, so the capture inside an IF node has not run on a GPU."""
        from phloem.runtime import switches
        from phloem.runtime.executor.decode_exit import DecodeExit, conditional_graphs_supported

        if self.tp.size > 1 or not switches.DECODE_EARLY_EXIT.flag() or not conditional_graphs_supported():
            return None
        return DecodeExit(self.req_to_token_pool.size, self.device)

    def _build_model(
        self, weights: Mapping[str, TensorLike] | None, seed: int, source: ModelSource
    ) -> nn.Module:
        model = _build_model_on(self.model_config, self.device)
        if weights is None:
            from phloem.runtime.executor.dummy import init_dummy_weights

            init_dummy_weights(model, seed=seed)
        else:
            model.load_weights(weights.items())  # type: ignore[operator]
        self._quantize(model, source)
        _cast_parameters(model, self.dtype)
        if self.deterministic:
            _make_batch_invariant(model)
        return model.eval()

    def _quantize(self, model: nn.Module, source: ModelSource) -> None:
        """Quantize ``model``'s linear layers as ``quantization`` says (``int4`` takes a Q4_1
        GGUF's blocks as they are)."""
        if self.quantization is None:
            return
        if self.quantization == "gguf":
            from phloem.runtime.layers.qdot import quantize_model_gguf

            quantize_model_gguf(model, _gguf_blocks(source, self.model_config))
            return
        from phloem.runtime.layers.quant import quantize_model

        blocks = None
        if self.quantization == "int4" and source.kind == "gguf":
            from phloem.runtime.executor.weights_gguf import load_gguf_q4_blocks

            # a tensor-parallel rank reads only its blocks from the file
            blocks = load_gguf_q4_blocks(source.path, self.model_config, lazy=self.tp.size > 1)
        quantize_model(model, self.quantization, q4_blocks=blocks)

    def _pool_tokens(self, max_total_tokens: int | None, mem_fraction: float | None) -> int:
        if max_total_tokens is not None:
            return int(max_total_tokens)
        cfg = self.model_config
        kv_heads = self.heads.num_kv_heads
        per_token = KVPool.bytes_per_token_for(cfg.num_layers, kv_heads, cfg.head_dim, self.kv_dtype)
        fraction = mem_fraction if mem_fraction is not None else _DEFAULT_MEM_FRACTION[self.device.type]
        budget = kv_budget_bytes(_device_memory(self.device), _free_memory(self.device), fraction, self.weight_bytes)
        tokens = int(budget // per_token)
        if self.device.type == "cpu":
            tokens = min(tokens, _CPU_MAX_DEFAULT_TOKENS)
        if self.tp.size > 1:  # slot ids are shared by every rank: the smallest pool fits them all
            smallest = torch.tensor([tokens], dtype=torch.int64, device=self.device)
            torch.distributed.all_reduce(smallest, op=torch.distributed.ReduceOp.MIN, group=self.tp.device_group)
            tokens = int(smallest.item())
        if tokens < self.context_len // 8:
            raise RuntimeError(
                f"not enough memory for the KV pool: {tokens} tokens fit; lower the context length"
            )
        return tokens

    def _make_kv_pool(self) -> KVPool:
        cfg = self.model_config
        return KVPool(
            cfg.num_layers,
            self.max_total_num_tokens + 1,
            self.heads.num_kv_heads,
            cfg.head_dim,
            self.kv_dtype,
            self.device,
        )

    # ---- weight updates (phloem.runtime.executor.weight_update) -------------------------------
    def update_weights_from_disk(self, model_path: str, load_format: str | None = None) -> str:
        """Load a checkpoint of the same architecture (a GGUF file or a Hugging Face folder) and
        copy it into the model's tensors in place; returns what was loaded.

        The checkpoint goes through the start-up loader path on the CPU (names mapped, fused
        projections stacked, and with ``quantization`` set, quantized the same way, a Q4_1 GGUF's
        blocks taken as they are), then every tensor is checked against the loaded model before
        the first copy. Raises ``InvalidRequest`` naming ``model_path`` or ``load_format``.
        """
        from phloem.runtime.errors import InvalidRequest
        from phloem.runtime.executor import weight_update as wu

        source = self.update_source(model_path, load_format)
        try:
            config, weights = _load_checkpoint(source)
        except wu.UNREADABLE as e:
            raise InvalidRequest("model_path", f"cannot read {source.path}: {e}") from None
        assert weights is not None  # resolve_model gives no dummy source for these formats
        wu.check_same_architecture(self.model_config, config)
        staged = self._staged_model(weights, source)
        plan = wu.plan_full_copy(wu.model_tensors(self.model), wu.model_tensors(staged), "model_path")
        plan.apply()
        self.model_source = source
        logger.info("weights updated from %s (%d tensors)", source.path, len(plan))
        return f"loaded {source.kind} weights from {source.path}"

    def update_source(self, model_path: str, load_format: str | None = None) -> ModelSource:
        """Where :meth:`update_weights_from_disk` would load from; cheap (no weights are read), so
        a bad path or format is refused before anything waits. Raises ``InvalidRequest``."""
        from phloem.runtime.errors import InvalidRequest
        from phloem.runtime.executor.weight_update import check_load_format
        from phloem.runtime.model_files import resolve_model

        fmt = check_load_format(load_format)
        try:
            return resolve_model(model_path, fmt)
        except (OSError, ValueError) as e:
            raise InvalidRequest("model_path", str(e)) from None

    def update_weights_from_tensors(self, tensors: dict[str, torch.Tensor], field: str = "tensors") -> str:
        """Copy named checkpoint tensors (Hugging Face names, any subset) into the model in place;
        all are checked before the first copy. A quantized layer is refused (its float weight is
        gone; :meth:`update_weights_from_disk` requantizes through the loader instead). Raises
        ``InvalidRequest`` naming ``field``."""
        from phloem.runtime.executor import weight_update as wu

        plan = wu.plan_named_copy(self.model, tensors, field)
        plan.apply()
        logger.info("weights updated: %d tensors", len(plan))
        return f"updated {len(plan)} tensors"

    def _staged_model(self, weights: dict[str, torch.Tensor], source: ModelSource) -> nn.Module:
        """A CPU model holding ``weights`` as start-up would have prepared them (quantized when the
        runner is), from which an update copies."""
        from phloem.runtime.errors import InvalidRequest

        model = _build_model_on(self.model_config, torch.device("cpu"))
        try:
            model.load_weights(weights.items())  # type: ignore[operator]
        except ValueError as e:  # an unknown, missing or misshapen tensor
            raise InvalidRequest("model_path", str(e)) from None
        self._quantize(model, source)
        return model

    # ---- public info --------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def weight_bytes(self) -> int:
        """Bytes of all weights, quantized ones included (a tied embedding counted once)."""
        params = sum(p.numel() * p.element_size() for p in self.model.parameters())
        return params + sum(_quant_bytes(m) for m in self.model.modules())

    @property
    def decode_weight_bytes(self) -> int:
        """Weight bytes one decode step reads: all weights except the embedding table (only a
        few rows are gathered), unless the LM head computes with it (tied and not quantized)."""
        from phloem.runtime.layers.embedding import LMHead, VocabEmbedding

        total = self.weight_bytes
        for m in self.model.modules():
            if isinstance(m, VocabEmbedding):
                total -= m.weight.numel() * m.weight.element_size()
            elif isinstance(m, LMHead) and m.tied_to is not None and m.quant is None:
                total += m.full_weight.numel() * m.full_weight.element_size()
        return total

    @property
    def quant_kernel(self) -> str | None:
        """The instruction set of the integer-dot kernel in use (``gguf``), else ``None``."""
        if self.quantization != "gguf":
            return None
        from phloem.runtime.layers.qdot import kernels_isa

        return kernels_isa() or "torch reference"

    @property
    def sampler(self) -> SamplerFn:
        if self._sampler is None:
            from phloem.runtime.sampling.sampler import Sampler

            self._sampler = Sampler()
        return self._sampler

    @sampler.setter
    def sampler(self, fn: SamplerFn) -> None:
        self._sampler = fn

    # ---- forward ------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, fi: ForwardInput, kv_loads: Sequence[KVLoad] = ()) -> ForwardOutput:
        """Run one batch and sample one token per request.

        Writes the batch's K/V into ``kv_pool`` at ``fi.out_slots``. Logits are computed for each
        request's last new token, plus, for requests with an input-logprob start, the rows needed
        for those logprobs. ``next_token_ids`` stays on the device. ``kv_loads``: host-tier KV
        staged for this batch (``LayerwiseLoader.take``); it lands during the pass, layer by layer.
        """
        ready = self._start_loads(kv_loads)
        host = fi
        plan = self._logit_rows(host)
        graph = self._graph_ok(fi, plan, loads=ready is not None)
        if self.device.type == "cpu":
            dev = fi
        elif graph and ready is None:
            dev = fi.with_sampling_on(self.device)  # the graph stages its own inputs (one copy)
        else:
            dev = fi.to(self.device)
        self.attn_backend.layer_ready = ready
        try:
            logits, hidden = self._logits(dev, plan, graph)  # [N, V] float32, [T, H] or None
        finally:
            self.attn_backend.layer_ready = None
            if ready is not None:
                ready.finish()  # every load of this batch is in the pool before anything after it
        last = (
            logits
            if plan.rows.numel() == host.batch_size and not plan.starts
            else logits[to_device(plan.last, logits.device)]
        )
        dev.sampling.vocab_mask = _resolve_mask(dev.sampling.vocab_mask, self.device)
        processed = host.logprobs is not None and any(host.logprobs.processed)
        drawn = None
        if processed:
            next_ids, drawn = self._sample_with_logits(last, dev.sampling)
        else:
            next_ids = self.sampler(last, dev.sampling)  # [B]
        # logprobs: their copy is queued before the tokens' event, which therefore covers both
        logp = None
        if self.tp.size > 1:  # every rank continues from rank 0's draw (tp_step.py)
            self.tp.broadcast(next_ids)
        if host.logprobs is not None:
            logp = self._logprobs_to_host(self._log_softmax(logits, plan, host, drawn))
        cpu_ids, event = to_host_async(next_ids)  # [B]; the scheduler waits on the event
        build = None
        if logp is not None:
            build = functools.partial(self._logprobs, host, plan, logp, cpu_ids)
        return ForwardOutput(
            next_token_ids=next_ids, next_token_ids_cpu=cpu_ids, copy_done=event, logprobs_fn=build,
            hidden_states=hidden if host.return_hidden_states else None,
        )  # fmt: skip

    @torch.inference_mode()
    def forward_steps(self, fi: ForwardInput) -> ForwardOutput | None:
        """Continuous decode batch ``fi`` (``decode_steps > 1``, host tensors) as graph replays
        back to back (:meth:`CudaGraphRunner.replay_steps`), its ``K x B`` tokens read back in one
        copy; ``None`` when the batch has no graph or asks for more than tokens (logprobs, hidden
        states), and the caller runs its steps one :meth:`forward` at a time. The sampler sees
        each step's logits as :meth:`forward` would give them: the scheduler sends such a batch
        only when no row's sampling changes between its steps (``policy.decodes_ahead``)."""
        graphs = self.cuda_graphs
        if (
            graphs is None
            or fi.decode_steps < 2
            or fi.step_slots is None
            or self.tp.size > 1  # the draws inside the replays would need a broadcast each
            or not fi.positions.is_cpu
            or fi.logprobs is not None
            or fi.return_hidden_states
            or not graphs.can_run(fi)
        ):
            return None
        sampling, sample = self._steps_sampling(fi)
        stops = None
        if graphs.exit is not None and sampling.stop_tags is not None and sampling.stop_ids is not None:
            stops = (sampling.stop_tags, sampling.stop_ids)
        tokens = graphs.replay_steps(fi, sample, stops)  # [K, B]
        cpu, event = to_host_async(tokens)
        cpu = cpu.view(tokens.shape)
        steps = [
            ForwardOutput(next_token_ids=tokens[j], next_token_ids_cpu=cpu[j], copy_done=event)
            for j in range(fi.decode_steps)
        ]
        return ForwardOutput(
            next_token_ids=tokens[-1], next_token_ids_cpu=cpu[-1], copy_done=event, steps=steps
        )

    @torch.inference_mode()
    def forward_chain(self, fi: ForwardInput) -> ForwardOutput:
        """Chain decode batch ``fi`` (``chain_width > 0``, host tensors but its ids, which may be
        on the device): ``decode_steps`` chain passes (:mod:`~phloem.runtime.executor.chain_decode`),
        every row's tokens and counts read back in one copy. As in :meth:`forward_steps`, the
        sampler sees each step's logits as :meth:`forward` would give them (the scheduler sends
        such a batch only when no row's sampling changes between its steps)."""
        assert self.chain_decoder is not None, "chain decode launches need chain_width at start-up"
        sampling, sample = self._steps_sampling(fi)
        auto = sampling.automaton
        if auto is not None:  # the first layout reads the starting states
            auto.start(sampling.automaton_rows, sampling.automaton_init)
        ids, ids_cpu, tokens, counts, event = self.chain_decoder.run(
            dataclasses.replace(fi, sampling=sampling), sample
        )
        return ForwardOutput(
            next_token_ids=ids, next_token_ids_cpu=ids_cpu, copy_done=event, chain=(tokens, counts)
        )

    def _steps_sampling(self, fi: ForwardInput) -> tuple[SamplingInfo, Callable[[torch.Tensor], torch.Tensor]]:
        """``fi``'s sampling tensors on the device (its grammar mask resolved) and ``logits ->
        tokens`` for every step of a launch that samples several with them."""
        sampling = fi.with_sampling_on(self.device).sampling
        sampling.vocab_mask = _resolve_mask(sampling.vocab_mask, self.device)
        sampler = self.sampler
        step_sampler = getattr(sampler, "step_sampler", None)  # Sampler's; a plain callable has none
        sample = step_sampler(sampling) if step_sampler is not None else lambda x: sampler(x, sampling)
        return sampling, sample

    @torch.inference_mode()
    def forward_logits(self, fi: ForwardInput) -> torch.Tensor:
        """Float32 logits ``[B, V]`` of each request's last new token (no sampling); for tests."""
        plan = self._logit_rows(fi)
        graph = self._graph_ok(fi, plan)
        # short extend graphs lay their inputs out from the host tensors
        dev = fi if self.device.type == "cpu" or graph == "extend" else fi.to(self.device)
        return self._logits(dev, plan, graph)[0][to_device(plan.last, self.device)]

    def _start_loads(self, loads: Sequence[KVLoad]) -> LayerReadiness | None:
        if not loads:
            return None
        if self.kv_loader is None:
            raise RuntimeError("KV loads were handed to a model runner that has no layer-wise loader")
        return self.kv_loader.start(loads)

    def _logits(
        self, fi: ForwardInput, plan: _LogitRows, graph: str | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits of the planned rows, and the final hidden states of every new token (``None``
        from a CUDA graph replay, which callers asking for hidden states never take). ``graph``:
        :meth:`_graph_ok` of this batch."""
        if graph == "extend":
            assert self.extend_graphs is not None
            return self.extend_graphs.logits(fi), None  # [B, V]: one row per request
        if graph:
            assert self.cuda_graphs is not None
            if self.attn_backend.layer_ready is not None:
                self.attn_backend.layer_ready.wait_all()  # a replay has no per-layer waits
            return self.cuda_graphs.replay(fi), None  # [B, V], valid until the next replay
        self.attn_backend.init_metadata(fi)
        hidden = self.model(fi.input_ids, fi.positions, self.attn_backend)  # [T, H]
        if fi.mode == ForwardMode.DECODE and not plan.starts:
            return self._model_any.compute_logits(hidden), hidden  # one row per request already
        # the row index travels through pinned memory: a pageable copy would make CUDA drain the
        # stream first, so the worker would launch the next pass only once this one had finished
        return self._model_any.compute_logits(hidden[to_device(plan.rows, hidden.device)]), hidden

    def _graph_ok(self, fi: ForwardInput, plan: _LogitRows, *, loads: bool = False) -> str | None:
        """Which captured graph ``fi`` replays: ``"decode"``, ``"extend"`` (a short extend, see
        :mod:`~phloem.runtime.executor.extend_graphs`; not while host-tier KV lands layer by
        layer) or None (eager). Never for hidden states or input logprobs."""
        if (
            self.cuda_graphs is not None
            and not plan.starts
            and not fi.return_hidden_states
            and self.cuda_graphs.can_run(fi)
        ):
            return "decode"
        if self.extend_graphs is not None and not loads and self.extend_graphs.can_run(fi, bool(plan.starts)):
            return "extend"
        return None

    @property
    def _model_any(self) -> Any:
        return self.model

    def _logit_rows(self, fi: ForwardInput) -> _LogitRows:
        """Plan logit rows on the host (see :class:`_LogitRows`)."""
        extend = fi.extend_lens.tolist()
        lp_starts = fi.logprobs.input_logprob_starts if fi.logprobs is not None else []
        wants = [r for r, s in enumerate(lp_starts) if 0 <= s < extend[r]]
        if fi.mode == ForwardMode.DECODE and not wants:
            idx = torch.arange(len(extend))
            return _LogitRows(rows=idx, last=idx, starts=[], first_new=[])
        rows: list[int] = []
        last: list[int] = []
        starts, first_new = [-1] * len(extend), [0] * len(extend)
        offset = 0
        for r, e in enumerate(extend):
            lo = max(lp_starts[r], 1) - 1 if r in wants else e - 1
            starts[r] = len(rows) if r in wants else -1
            first_new[r] = lo
            rows.extend(range(offset + lo, offset + e))
            last.append(len(rows) - 1)
            offset += e
        return _LogitRows(torch.tensor(rows), torch.tensor(last), starts if wants else [], first_new)

    # ---- logprobs -----------------------------------------------------------------------------
    def _sample_with_logits(self, logits: torch.Tensor, info: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens and the logits they were drawn from (``Sampler.sample_with_logits``)."""
        fn = getattr(self.sampler, "sample_with_logits", None)
        if fn is None:
            raise RuntimeError("the installed sampler cannot report the distribution it samples from")
        return fn(logits, info)

    @staticmethod
    def _log_softmax(
        logits: torch.Tensor, plan: _LogitRows, fi: ForwardInput, drawn: torch.Tensor | None
    ) -> torch.Tensor:
        """``[N, V]`` float32 ``log_softmax`` of the logit rows. Raw logits (before any sampling
        transform) everywhere, except the last row of a request in the ``"processed"`` logprob
        mode: that row is ``drawn``'s, the distribution its token was sampled from. Tokens that
        distribution excludes read the lowest finite float32 rather than ``-inf`` (JSON has no
        infinities)."""
        logp = torch.log_softmax(logits.float(), dim=-1)
        if drawn is None:
            return logp
        assert fi.logprobs is not None
        want = [r for r, p in enumerate(fi.logprobs.processed) if p]
        last = _last_rows(plan, fi)
        rows = torch.tensor([int(last[r]) for r in want])
        sel = torch.tensor(want)
        floor = torch.finfo(torch.float32).min
        picked = torch.log_softmax(drawn[to_device(sel, drawn.device)].float(), dim=-1).clamp_min(floor)
        logp[to_device(rows, logp.device)] = picked
        return logp

    @staticmethod
    def _logprobs_to_host(logp: torch.Tensor) -> torch.Tensor:
        """``logp`` (:meth:`_log_softmax`) queued for the host: on a GPU into pinned memory,
        valid once the forward's event fired. A plain ``.cpu()`` here would make the worker wait
        for the pass."""
        if logp.device.type == "cpu":
            return logp
        if logp.numel() * logp.element_size() > _PINNED_LOGPROB_BYTES:
            # input logprobs over a long prompt: pinning that much host memory (kept by the
            # caching host allocator) costs more than one wait for the pass
            return logp.cpu()
        host = torch.empty(logp.shape, dtype=logp.dtype, pin_memory=True)
        return host.copy_(logp, non_blocking=True)

    def _logprobs(
        self, fi: ForwardInput, plan: _LogitRows, logp: torch.Tensor, next_ids: torch.Tensor
    ) -> list[TokenLogprobs]:
        """Per-request logprobs from the host copies of ``log_softmax`` (:meth:`_log_softmax`)
        and of the sampled ids; run once the forward's event fired (``ForwardOutput.logprobs``)."""
        lp = fi.logprobs
        assert lp is not None
        last = _last_rows(plan, fi)
        sampled = next_ids.tolist()
        ids = fi.input_ids.tolist()
        offsets = [0, *torch.cumsum(fi.extend_lens, 0).tolist()]
        out = []
        for r in range(fi.batch_size):
            res = _output_logprobs(lp, r, logp[int(last[r])], sampled[r])
            start = lp.input_logprob_starts[r] if r < len(lp.input_logprob_starts) else -1
            if plan.starts and plan.starts[r] >= 0:
                new_ids = ids[offsets[r] : offsets[r + 1]]
                _input_logprobs(res, lp, r, logp, plan.starts[r] - plan.first_new[r], start, new_ids)
            out.append(res)
        return out


def _last_rows(plan: _LogitRows, fi: ForwardInput) -> torch.Tensor:
    """Each request's row of its last new token among the logit rows."""
    return plan.last if plan.starts or plan.rows.numel() != fi.batch_size else torch.arange(fi.batch_size)


def _output_logprobs(lp: LogprobRequest, r: int, row: torch.Tensor, token: int) -> TokenLogprobs:
    res = TokenLogprobs()
    if bool(lp.return_logprob[r]):
        res.output_logprob = float(row[token])
    k = lp.top_logprobs_nums[r] if r < len(lp.top_logprobs_nums) else 0
    if k > 0:
        res.output_top = _topk(row, k)
    wanted = lp.token_ids_logprob[r] if r < len(lp.token_ids_logprob) else None
    if wanted:
        res.output_token_ids = [(t, float(row[t])) for t in wanted]
    return res


def _input_logprobs(
    res: TokenLogprobs,
    lp: LogprobRequest,
    r: int,
    logp: torch.Tensor,
    base: int,
    start: int,
    new_ids: list[int],
) -> None:
    """Fill input logprobs of new tokens ``start ..`` of request ``r``.

    Row ``base + j`` of ``logp`` holds the distribution after new token ``j``, so new token ``j``
    reads row ``base + j - 1``. New token 0 has no row in this pass: ``None`` (the scheduler starts
    one token earlier when it needs that value).
    """
    k = lp.top_logprobs_nums[r] if r < len(lp.top_logprobs_nums) else 0
    wanted = lp.token_ids_logprob[r] if r < len(lp.token_ids_logprob) else None
    values: list[float | None] = []
    tops: list[list[tuple[int, float]]] = []
    given: list[list[tuple[int, float]]] = []
    for j in range(start, len(new_ids)):
        if j == 0:
            values.append(None)
            tops.append([])
            given.append([])
            continue
        row = logp[base + j - 1]
        values.append(float(row[new_ids[j]]))
        tops.append(_topk(row, k) if k > 0 else [])
        given.append([(t, float(row[t])) for t in wanted] if wanted else [])
    res.input_logprobs = values
    res.input_top = tops if k > 0 else None
    res.input_token_ids = given if wanted else None


def _topk(row: torch.Tensor, k: int) -> list[tuple[int, float]]:
    vals, idx = row.topk(min(k, row.shape[-1]))
    return list(zip(idx.tolist(), vals.tolist()))


# ---- loading ----------------------------------------------------------------------------------
def _resolve_mask(mask: Any, device: torch.device) -> torch.Tensor | None:
    """The grammar bitmask may still be being filled on the CPU (a future) while the forward pass
    runs: sampling waits here, and only here, for it."""
    if mask is not None and hasattr(mask, "result"):
        mask = mask.result()
    if mask is not None and mask.device != device:
        mask = to_device(mask, device)
    return mask


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _resolve_quantization(
    quantization: str | None, device: torch.device, source: ModelSource, dtype: torch.dtype, *, tp_size: int = 1
) -> str | None:
    if quantization in (None, "none"):
        return None
    from phloem.runtime.layers.quant import QUANTIZATION_SCHEMES

    if quantization == "auto":  # (the integer-dot path reads whole tensors' blocks: one rank only)
        return "gguf" if tp_size == 1 and _gguf_blocks_apply(device, source, dtype) else None
    if quantization == "gguf" and tp_size > 1:
        raise ValueError("--quantization gguf is not available with --tp-size above 1 (int4 and int8 are)")
    if quantization not in QUANTIZATION_SCHEMES:
        raise ValueError(
            f"unknown quantization {quantization!r}; expected auto or one of {QUANTIZATION_SCHEMES}"
        )
    if device.type != "cpu":
        raise ValueError(f"quantization {quantization!r} is a CPU path; the device is {device}")
    if quantization == "gguf" and source.kind != "gguf":
        raise ValueError(f"quantization 'gguf' computes on a GGUF file's blocks; the model is {source.kind}")
    return quantization


_GGUF_KERNEL_TYPES = frozenset({"Q4_1", "Q8_0"})  # the block types the integer-dot kernel reads


def _gguf_blocks_apply(device: torch.device, source: ModelSource, dtype: torch.dtype) -> bool:
    """Whether ``auto`` takes the integer-dot path: a float32 CPU model from a GGUF whose quantized
    tensors are all of the kernel's types, on a machine where the kernel builds."""
    if device.type != "cpu" or dtype != torch.float32 or source.kind != "gguf":
        return False
    from phloem.runtime.executor.weights_gguf import gguf_block_types
    from phloem.runtime.layers.qdot import kernels_isa

    types = gguf_block_types(source.path)
    return bool(types) and types <= _GGUF_KERNEL_TYPES and kernels_isa() is not None


def _gguf_blocks(source: ModelSource, cfg: ModelConfig) -> dict[str, Any]:
    """Checkpoint name -> the GGUF's Q4_1 / Q8_0 blocks (none for another source)."""
    if source.kind != "gguf":
        return {}
    from phloem.runtime.executor.weights_gguf import load_gguf_q4_blocks, load_gguf_q8_blocks
    from phloem.runtime.layers.quant import Q4Weight, Q8Weight

    blocks: dict[str, Any] = {k: Q4Weight(*v) for k, v in load_gguf_q4_blocks(source.path, cfg).items()}
    blocks.update({k: Q8Weight(*v) for k, v in load_gguf_q8_blocks(source.path, cfg).items()})
    return blocks


def _make_batch_invariant(model: nn.Module) -> None:
    """Fixed-size row tiles for every float matmul (quantized layers are invariant already)."""
    from phloem.runtime.layers.embedding import LMHead
    from phloem.runtime.layers.linear import BATCH_INVARIANT_ROW_TILE, Linear
    from phloem.runtime.layers.quant import set_batch_invariant

    for m in model.modules():
        if isinstance(m, (Linear, LMHead)):
            m.row_tile = BATCH_INVARIANT_ROW_TILE
    set_batch_invariant(model)


def _quant_bytes(module: nn.Module) -> int:
    from phloem.runtime.layers.quant import QuantizedWeight

    if not isinstance(module, QuantizedWeight):
        return 0
    return sum(b.numel() * b.element_size() for b in module.buffers(recurse=False))


def _resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def _resolve_kv_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The pool's storage dtype: the compute dtype for ``auto``."""
    if kv_cache_dtype == "auto":
        return dtype
    if kv_cache_dtype not in _KV_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}; expected auto, {', '.join(_KV_DTYPES)}")
    return _KV_DTYPES[kv_cache_dtype]


def _load_checkpoint(
    source: ModelSource, tp: TPGroup | None = None
) -> tuple[ModelConfig, dict[str, TensorLike] | None]:
    """Config and weights (HF names); weights are ``None`` for dummy models.

    With a ``tp`` of several ranks the weights are lazy slices (the model reads this rank's share
    of each), and the heads are checked against ``tp`` before any of them is read.
    """
    if tp is not None and tp.size > 1:
        return _load_sliced(source, tp)
    if source.kind == "gguf":
        from phloem.runtime.executor.weights_gguf import load_gguf_weights

        return load_gguf_weights(source.path)
    if source.kind == "safetensors":
        from phloem.runtime.executor.weights_hf import hf_model_config, iter_hf_weights

        return hf_model_config(source.path), dict(iter_hf_weights(source.path))
    return ModelConfig.dummy(source.path), None


def _load_sliced(source: ModelSource, tp: TPGroup) -> tuple[ModelConfig, dict[str, TensorLike] | None]:
    if source.kind == "gguf":
        from phloem.runtime.executor.weights_gguf import gguf_config, load_gguf_slices

        config = gguf_config(source.path)
        per_rank_heads(config, tp)
        return config, dict(load_gguf_slices(source.path))
    if source.kind == "safetensors":
        from phloem.runtime.executor.weights_hf import hf_model_config, iter_hf_slices

        config = hf_model_config(source.path)
        per_rank_heads(config, tp)
        return config, dict(iter_hf_slices(source.path))
    return ModelConfig.dummy(source.path), None


def _build_model_on(cfg: ModelConfig, device: torch.device) -> nn.Module:
    with torch.device(device):
        return get_model_class(cfg.arch)(cfg)


def _cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast parameters only: buffers such as the RoPE tables stay float32."""
    for p in model.parameters():
        p.data = p.data.to(dtype)


def kv_budget_bytes(total: int, free: int | None, fraction: float, weight_bytes: int) -> float:
    """Bytes for the KV pool: ``fraction`` of the device holds the weights and the pool, and the
    rest (``(1 - fraction) x total``) stays free for activations and graphs. On a shared GPU the
    pool also shrinks by what other processes hold: it never takes more than ``free`` (measured with
    the weights loaded) minus that same headroom."""
    budget = total * fraction - weight_bytes
    if free is not None:
        budget = min(budget, free - (1.0 - fraction) * total)
    return budget


def _free_memory(device: torch.device) -> int | None:
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None


def _device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class DirectBatcher:
    """Drive a :class:`ModelRunner` without a scheduler (tests, benchmarks, offline scripts).

    Keeps each sequence's token list and ``req_to_token`` row, hands out KV slots from a simple
    bump counter (no reuse), and builds greedy :class:`ForwardInput` batches.
    """

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.tokens: dict[int, list[int]] = {}  # sequence id -> tokens whose K/V is in the pool
        self._next_slot = 1  # slot 0 is padding

    def new_sequence(self) -> int:
        """A fresh sequence id (its ``req_to_token`` row)."""
        row = self.runner.req_to_token_pool.alloc()
        if row is None:
            raise RuntimeError("no free req_to_token rows")
        self.tokens[row] = []
        return row

    def release(self, seq: int) -> None:
        self.runner.req_to_token_pool.free(seq)
        del self.tokens[seq]

    def build(
        self,
        new_tokens: dict[int, list[int]],
        *,
        decode: bool = False,
        logprobs: LogprobRequest | None = None,
    ) -> ForwardInput:
        """Append ``new_tokens`` per sequence (slots allocated now) and describe the pass."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        prefix: list[int] = []
        extend: list[int] = []
        table = self.runner.req_to_token_pool.req_to_token
        for seq, new in new_tokens.items():
            start = len(self.tokens[seq])
            fresh = torch.arange(self._next_slot, self._next_slot + len(new))
            if self._next_slot + len(new) > self.runner.kv_pool.num_slots:
                raise RuntimeError("KV pool exhausted")
            self._next_slot += len(new)
            table[seq, start : start + len(new)] = fresh.to(table.device)
            self.tokens[seq].extend(new)
            ids += new
            positions += range(start, start + len(new))
            slots += fresh.tolist()
            prefix.append(start)
            extend.append(len(new))
        b = len(new_tokens)
        lens = torch.tensor(extend)
        return ForwardInput(
            mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND,
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            out_slots=torch.tensor(slots, dtype=torch.int64),
            req_pool_indices=torch.tensor(list(new_tokens), dtype=torch.int64),
            seq_lens=torch.tensor(prefix) + lens,
            prefix_lens=torch.tensor(prefix),
            extend_lens=lens,
            sampling=greedy_sampling_info(b),
            logprobs=logprobs,
        )

    def step(
        self, new_tokens: dict[int, list[int]], *, decode: bool = False, **kw: LogprobRequest
    ) -> ForwardOutput:
        """Build and run one pass; returns the runner's output."""
        return self.runner.forward(self.build(new_tokens, decode=decode, **kw))

    def logits(self, new_tokens: dict[int, list[int]], *, decode: bool = False) -> torch.Tensor:
        """Build and run one pass; float32 logits ``[B, V]`` of each last new token."""
        return self.runner.forward_logits(self.build(new_tokens, decode=decode))

    def generate_greedy(
        self, prompt: list[int], max_new_tokens: int, *, stop_ids: frozenset[int] | set[int] = frozenset()
    ) -> list[int]:
        """Greedy continuation of ``prompt`` via one prefill and single-token decode steps."""
        seq = self.new_sequence()
        out: list[int] = []
        try:
            token = self.step({seq: prompt}).synchronize()[0]
            while True:
                out.append(token)
                if token in stop_ids or len(out) >= max_new_tokens:
                    return out
                token = self.step({seq: [token]}, decode=True).synchronize()[0]
        finally:
            self.release(seq)


def greedy_sampling_info(batch_size: int) -> SamplingInfo:
    """:class:`SamplingInfo` for ``batch_size`` greedy rows."""
    return SamplingInfo(
        temperatures=torch.zeros(batch_size),
        top_ps=torch.ones(batch_size),
        top_ks=torch.full((batch_size,), -1, dtype=torch.int64),
        min_ps=torch.zeros(batch_size),
        is_greedy_all=True,
    )
