"""Speculative windows (greedy EAGLE chain steps on the device, read back once), run eagerly on a
tiny random model: the chain draft equals the tree drafter's chain, every request that runs to its
length or stop has exactly the plain greedy tokens, accepted lengths above one commit the right
KV, and aborts, retraction and a small pool leave the pool and the tree intact."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from phloem.runtime.cache.allocator import TokenSlotAllocator
from phloem.runtime.cache.cache_manager import CacheManager
from phloem.runtime.cache.radix_tree import RadixTree
from phloem.runtime.executor.model_runner import DirectBatcher, ModelRunner
from phloem.runtime.executor.worker import FutureMap, InlineWorker
from phloem.runtime.sampling.batch import SamplingBatchBuilder
from phloem.runtime.sampling.params import SamplingParams
from phloem.runtime.sampling.stop import StopChecker
from phloem.runtime.scheduler.output import OutputCollector
from phloem.runtime.scheduler.req import Req
from phloem.runtime.scheduler.scheduler import Scheduler, SchedulerConfig
from phloem.runtime.speculative.decoding import EagleDrafter, target_forward
from phloem.runtime.speculative.step import SpecRow, SpeculativeStep
from phloem.runtime.speculative.tree import DraftTree
from phloem.runtime.speculative.window import ChainWindow, WindowRow, chain_accept, chain_accept_sampled

from tests.unit.test_eagle_batch import assert_same_state, random_worker, start
from tests.unit.test_spec_scheduler import add_random_requests
from tests.unit.tiny_model import tiny_runner

EOS = 1


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    torch.set_num_threads(1)
    return tiny_runner(5)


def _spec(runner: ModelRunner, *, window_steps: int = 4, draft_tokens: int = 4) -> SpeculativeStep:
    worker = random_worker(runner, seed=3, num_steps=draft_tokens - 1, topk=1, num_draft_tokens=draft_tokens)
    spec = SpeculativeStep(runner, EagleDrafter(worker), max_tree=draft_tokens)
    spec.window = ChainWindow(runner, worker, max_bs=8, max_steps=window_steps, capture=False)
    return spec


def _scheduler(runner: ModelRunner, spec: SpeculativeStep, pool: int, sent: list, *, decode_steps: int = 4):
    allocator = TokenSlotAllocator(pool, check=True)
    rows = runner.req_to_token_pool
    cache = CacheManager(allocator=allocator, req_to_token=rows.req_to_token, tree=RadixTree())
    cfg = SchedulerConfig(max_running_requests=6, max_prefill_tokens=512, chunked_prefill_size=24,
                          overlap=False, decode_steps=decode_steps)  # fmt: skip
    s = Scheduler(cfg, cache=cache, req_pool=rows, worker=InlineWorker(runner, FutureMap(64)),
                  sampling=SamplingBatchBuilder(runner.vocab_size, eos_token_ids=[EOS]),
                  outputs=OutputCollector(lambda m: sent.extend(m.outs)), spec=spec)  # fmt: skip
    return s, cache, rows


def _run(s: Scheduler) -> None:
    for _ in range(5000):
        if not s.step() and s.is_idle:
            break
    s.drain()
    assert s.is_idle


def _req(rid: str, ids: list[int], params: SamplingParams) -> Req:
    return Req(
        rid=rid, origin_input_ids=ids, params=params, stop_checker=StopChecker(params, eos_token_ids={EOS})
    )


def _outputs(sent: list) -> tuple[dict[str, list[int]], dict[str, dict]]:
    got: dict[str, list[int]] = {}
    for o in sent:
        got.setdefault(o.rid, []).extend(o.new_ids)
    return got, {o.rid: o.finished for o in sent if o.finished is not None}


def _assert_clean(cache: CacheManager, rows) -> None:  # noqa: ANN001
    cache.check_integrity()
    assert cache.free_size + cache.evictable_size == cache.total_size
    assert rows.available_size == rows.size


# ---------------------------------------------------------------------------------- the draft
@pytest.mark.parametrize("draft_tokens", [2, 4, 6])
def test_chain_draft_equals_the_tree_drafter_s_chain(runner, draft_tokens):
    worker = random_worker(runner, seed=1, num_steps=draft_tokens - 1, topk=1, num_draft_tokens=draft_tokens)
    window = ChainWindow(runner, worker, max_bs=8, max_steps=2, capture=False)
    seqs = [3, 0, 5, 1]
    start(worker, seqs, [9, 2, 40, 17], offset=3)
    rows = torch.tensor([worker.cache.row[s] for s in seqs])
    lens = torch.tensor([worker.cache.lens[s] for s in seqs])
    offsets = torch.tensor([worker.offset.get(s, 0) for s in seqs])
    chain = window._draft_chain(rows, lens, offsets, 64)
    tokens, _, parents = worker._grow_core(rows, lens, offsets + lens - 1, 64)
    assert chain.tolist() == tokens[:, : draft_tokens - 1].tolist()
    assert parents[:, : draft_tokens - 1].tolist() == [list(range(draft_tokens - 1))] * len(seqs)


# ---------------------------------------------------------------------------------- through the scheduler
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 9, 10], [100, 200, 300, 100, 200, 7], [9, 8, 7], [42] * 20]


def test_windows_give_the_plain_greedy_tokens(runner):
    spec = _spec(runner)
    sent: list = []
    s, cache, rows = _scheduler(runner, spec, 1024, sent)
    lengths = [23, 9, 30, 2]
    for i, (p, n) in enumerate(zip(PROMPTS, lengths)):
        s.add_request(_req(f"r{i}", p, SamplingParams(max_new_tokens=n, temperature=0.0)))
    _run(s)
    _assert_clean(cache, rows)
    got, finished = _outputs(sent)
    plain = DirectBatcher(runner)
    for i, (p, n) in enumerate(zip(PROMPTS, lengths)):
        assert got[f"r{i}"] == plain.generate_greedy(p, n)
        assert finished[f"r{i}"]["type"] == "length"
    assert spec.window.windows > 0 and spec.window.steps > spec.window.windows
    # the drafter's cache followed every accepted token: its lengths were advanced by the window
    assert spec.verify_count >= spec.window.steps


class _OracleChain:
    """Drafts the true greedy continuation, except at positions where ``position % 5 == 2``:
    accept lengths then vary from 1 to D + 1 within a window."""

    def __init__(self, window: ChainWindow, refs: dict[int, list[int]]) -> None:
        self.window, self.refs = window, refs  # req row -> prompt + greedy output

    def install(self) -> None:
        w = self.window
        table = torch.zeros((w.table.shape[0], 512), dtype=torch.int64)
        for row, seq in self.refs.items():
            table[row, : len(seq)] = torch.tensor(seq)
        depth = w.depth

        def draft(g) -> torch.Tensor:  # noqa: ANN001
            rows, kv_len = g.state[0], g.state[1]
            at = kv_len[:, None] + 1 + torch.arange(depth)  # positions of the drafts
            good = table[rows[:, None], at]
            return torch.where(at % 5 == 2, good + 1, good)

        step = w._step

        def patched(g, width: int, mode: str) -> None:  # noqa: ANN001
            w._draft_chain = lambda *a: draft(g)  # type: ignore[method-assign]
            step(g, width, mode)

        w._step = patched  # type: ignore[method-assign]


def test_accepted_chains_commit_their_kv(runner):
    """With an oracle draft, steps accept several tokens; the tokens after them (computed over the
    committed KV) are still the plain greedy ones, and a stop token ends a request mid-window."""
    plain = DirectBatcher(runner)
    n = 40
    refs = [plain.generate_greedy(p, n) for p in PROMPTS]
    stop_at = refs[1][17]  # a stop token inside a window
    spec = _spec(runner, window_steps=6, draft_tokens=5)
    sent: list = []
    s, cache, rows = _scheduler(runner, spec, 2048, sent, decode_steps=6)
    reqs = []
    for i, p in enumerate(PROMPTS):
        params = SamplingParams(
            max_new_tokens=n, temperature=0.0, stop_token_ids=[stop_at] if i == 1 else None
        )
        reqs.append(_req(f"r{i}", p, params))
        s.add_request(reqs[-1])
    s.step()  # prefill all four: rows known
    oracle = _OracleChain(spec.window, {r.req_pool_idx: [*p, *ref] for r, p, ref in zip(reqs, PROMPTS, refs)})
    oracle.install()
    _run(s)
    _assert_clean(cache, rows)
    got, finished = _outputs(sent)
    for i, ref in enumerate(refs):
        if i == 1:
            cut = ref.index(stop_at) + 1
            assert got["r1"] == ref[:cut] and finished["r1"]["type"] == "stop"
        else:
            assert got[f"r{i}"] == ref
    assert spec.mean_accept_length > 2.0  # several drafts accepted per step
    assert max(r.spec_accepted_tokens / r.spec_verify_ct for r in reqs) > 2.0


def test_random_requests_aborts_and_retraction_keep_pool_and_outputs(runner):
    """Windows mixed with single speculative steps (sampled rows, a waiting request, a short
    pool) and plain steps; aborts in between."""
    spec = _spec(runner)
    sent: list = []
    s, cache, rows = _scheduler(runner, spec, 200, sent)
    reqs = add_random_requests(s, random.Random(2), sampled=0.2)
    _run(s)
    _assert_clean(cache, rows)
    got, finished = _outputs(sent)
    assert set(finished) == {r.rid for r in reqs}
    assert spec.window.windows > 0
    plain = DirectBatcher(runner)
    checked = 0
    for r in reqs:
        if finished[r.rid]["type"] == "length" and r.params.temperature == 0.0:
            assert got[r.rid] == plain.generate_greedy(r.origin_input_ids, r.params.max_new_tokens), r.rid
            checked += 1
    assert checked >= 6


def test_windows_need_a_chain(runner):
    worker = random_worker(runner, num_steps=3, topk=2, num_draft_tokens=6)
    with pytest.raises(ValueError, match="topk must be 1"):
        ChainWindow(runner, worker, max_bs=4, max_steps=4, capture=False)


# ---------------------------------------------------------------------------------- one window = single steps
def test_chain_accept_counts_the_drafts_before_the_first_miss():
    drafts = torch.tensor([[1, 2, 3], [1, 9, 3], [7, 2, 3], [1, 2, 8]])
    target = torch.tensor([[1, 2, 3, 4]] * 4)
    assert chain_accept(drafts, target).tolist() == [4, 2, 1, 3]


@pytest.mark.parametrize("oracle", [False, True])
def test_a_window_equals_single_speculative_steps(runner, oracle):
    """The same drafter and prompts: ``K`` single steps (tree verifier, host acceptance, batched
    catch-up) and one window of ``K`` steps give the same tokens per step, and leave the drafter's
    cache (lengths, K/V, root features) the same. ``oracle``: both draft the greedy continuation
    with a miss at every position ``% 5 == 2`` (accept lengths 1 .. 4), else the random head."""
    plain = DirectBatcher(runner)
    steps, prompts = 5, PROMPTS[:3]
    refs = [[*p, *plain.generate_greedy(p, 40)] for p in prompts]
    first = random_worker(runner, seed=4, num_steps=3, topk=1, num_draft_tokens=4)
    second = copy.deepcopy(first)
    pool, alloc = runner.req_to_token_pool, TokenSlotAllocator(runner.kv_pool.num_slots)
    rows = [pool.alloc() for _ in prompts]

    def prefill(worker) -> list[int]:  # noqa: ANN001
        logits, hidden = target_forward(runner, rows, prompts, [alloc.alloc(len(p)) for p in prompts])
        roots = [int(x.argmax()) for x in logits]
        for row, p, h, root in zip(rows, prompts, hidden, roots):
            worker.prefill(row, [*p, root], h)
        return roots

    def free(kv: list[int]) -> None:
        for row, n in zip(rows, kv):
            alloc.free(pool.req_to_token[row, :n].clone())

    # single steps
    single = SpeculativeStep(runner, EagleDrafter(first), max_tree=4)
    roots, kv = prefill(first), [len(p) for p in prompts]
    per_step: list[list[list[int]]] = [[] for _ in prompts]
    for _ in range(steps):
        if oracle:
            drafts = [[x + 1 if (n + 1 + d) % 5 == 2 else x for d, x in enumerate(refs[i][n + 1 : n + 4])]
                      for i, n in enumerate(kv)]  # fmt: skip
            first.draft_many = lambda seqs, roots, d=drafts: [  # type: ignore[method-assign]
                DraftTree(tokens=[r, *x], parents=[-1, 0, 1, 2]) for r, x in zip(roots, d)
            ]
        items = [SpecRow(r, n, [t]) for r, n, t in zip(rows, kv, roots)]
        for i, res in enumerate(single.verify(items, alloc.alloc(single.plan(items)))):
            alloc.free(res.free_slots)
            kv[i] += res.accept_length
            per_step[i].append(res.tokens)
            roots[i] = res.tokens[-1]
    free(kv)
    # one window
    window = ChainWindow(runner, second, max_bs=4, max_steps=steps, capture=False)
    if oracle:
        _OracleChain(window, dict(zip(rows, refs))).install()
    roots, kv0 = prefill(second), [len(p) for p in prompts]
    span = window.slots_per_row(steps)
    for row, n in zip(rows, kv0):
        pool.req_to_token[row, n : n + span] = alloc.alloc(span)
    got = window.run([WindowRow(r, n, t) for r, n, t in zip(rows, kv0, roots)], steps)
    assert got.tokens == per_step
    if oracle:
        accepted = [len(t) for row in per_step for t in row]
        assert max(accepted) == 4 and min(accepted) == 1
    assert_same_state(first, second, rows)
    for i, (p, ref) in enumerate(zip(prompts, refs)):  # both are plain greedy decoding
        out = [t for step in per_step[i] for t in step]
        assert out == ref[len(p) + 1 : len(p) + 1 + len(out)]
    kv = [n + got.total(i) for i, n in enumerate(kv0)]
    for row, n, k in zip(rows, kv, kv0):
        alloc.free(pool.req_to_token[row, n : k + span].clone())
    free(kv)
    for row in rows:
        pool.free(row)
    assert alloc.available_size == alloc.total_size


# ---------------------------------------------------------------------------------- CUDA graphs
def _windows(runner: ModelRunner, worker, prompts: list[list[int]], windows: list[int], *, capture: bool):  # noqa: ANN001
    """Prefill ``prompts``, then windows of ``windows[i]`` steps; every row's tokens, in order."""
    pool, alloc = runner.req_to_token_pool, TokenSlotAllocator(runner.kv_pool.num_slots)
    rows = [pool.alloc() for _ in prompts]
    window = ChainWindow(runner, worker, max_bs=4, max_steps=max(windows), capture=capture)
    logits, hidden = target_forward(runner, rows, prompts, [alloc.alloc(len(p)) for p in prompts])
    out = [[int(x.argmax())] for x in logits]
    for row, p, h, o in zip(rows, prompts, hidden, out):
        worker.prefill(row, [*p, o[0]], h)
    kv = [len(p) for p in prompts]
    for steps in windows:
        span = window.slots_per_row(steps)
        for row, n in zip(rows, kv):
            runner.req_to_token_pool.req_to_token[row, n : n + span] = alloc.alloc(span).to(runner.device)
        got = window.run([WindowRow(r, n, o[-1]) for r, n, o in zip(rows, kv, out)], steps)
        for i, (row, n) in enumerate(zip(rows, kv)):
            total = got.total(i)
            alloc.free(pool.req_to_token[row, n + total : n + span].cpu())
            kv[i] = n + total
            out[i] += [t for step in got.tokens[i] for t in step]
    for row, n in zip(rows, kv):
        alloc.free(pool.req_to_token[row, :n].cpu())
        pool.free(row)
        worker.release(row)
    assert alloc.available_size == alloc.total_size
    return out, window


def test_successive_windows_give_the_plain_greedy_tokens(runner):
    """Windows of different lengths one after another (the draft key width grows past 64, within
    the draft cache reserved at start: no graph is dropped)."""
    base = random_worker(runner, seed=3, num_steps=3, topk=1, num_draft_tokens=4)
    plain = DirectBatcher(runner)
    out, window = _windows(runner, base, PROMPTS[:3], [6, 1, 8, 8, 8], capture=False)
    for p, o in zip(PROMPTS, out):
        assert o == plain.generate_greedy(p, len(o))
    assert {width for _, width, _ in window.graphs} == {64, 128}  # one graph per key width


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_window_graphs_equal_the_eager_window_on_cuda():
    from phloem.runtime.executor.dummy import init_dummy_weights
    from phloem.runtime.model_files import ModelSource

    cuda = ModelRunner(ModelSource("dummy", "tiny-llama"), dtype="float32", device="cuda",
                       max_total_tokens=4096, max_running_requests=8)  # fmt: skip
    init_dummy_weights(cuda.model, seed=5, std=0.2)
    base = random_worker(cuda, seed=3, num_steps=3, topk=1, num_draft_tokens=4)
    plain = DirectBatcher(cuda)
    for prompts in (PROMPTS[:1], PROMPTS[:3]):  # padded batches of 1 and 4
        eager, _ = _windows(cuda, copy.deepcopy(base), prompts, [6, 6, 3], capture=False)
        graphs, window = _windows(cuda, copy.deepcopy(base), prompts, [6, 6, 3], capture=True)
        assert graphs == eager
        assert window.captured >= 1 and all(g.graph is not None for g in window.graphs.values())
        for p, o in zip(prompts, graphs):
            assert o == plain.generate_greedy(p, len(o))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_rope_table_gives_the_computed_tables_on_cuda(runner):
    head = random_worker(runner, seed=2).head.cuda()
    positions = torch.randint(0, 4000, (3, 5), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.inference_mode():
        want = head.rope(positions)
        head.cache_rope(4096)
        got = head.rope(positions)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert got[0].shape == want[0].shape == (3, 5, 1, head.cfg.head_dim // 2)


# ---------------------------------------------------------------------------------- sampled rows
def _params(
    rows: int, temperature: float, top_k: int = -1, top_p: float = 1.0, min_p: float = 0.0
) -> torch.Tensor:
    return torch.tensor([[temperature], [float(top_k)], [top_p], [min_p]]).expand(4, rows).contiguous()


@pytest.mark.parametrize(
    "temperature, top_k, top_p, min_p", [(1.0, -1, 1.0, 0.0), (0.7, 4, 1.0, 0.0), (1.3, -1, 0.8, 0.05)]
)
def test_sampled_chains_keep_the_target_distribution(temperature, top_k, top_p, min_p):
    """20,000 identical rows in one call: the first emitted token is distributed as the target's
    first distribution, and the second (after an accepted first draft) as the second node's; the
    first draft is accepted at the rate of its target probability."""
    from phloem.runtime.speculative.verify import SpecSampling, target_probs

    from tests.unit.test_spec_verify import chi_square_pvalue

    rows, vocab = 20_000, 12
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(5)) * 1.5
    sampling = SpecSampling(temperature, top_k, top_p, min_p)
    want = target_probs(logits, sampling)  # [3, V]: the plain sampler's distributions
    drafts = torch.tensor(
        [int(want[0].argmax()), int(want[1].argsort()[-2])]
    )  # a likely and a less likely draft
    params = _params(rows, temperature, top_k, top_p, min_p)
    emitted, accept = chain_accept_sampled(
        drafts.expand(rows, 2), logits.expand(rows, 3, vocab), params, filters=top_k > 0 or top_p < 1.0,
        generator=torch.Generator().manual_seed(11),
    )  # fmt: skip
    assert chi_square_pvalue(torch.bincount(emitted[:, 0], minlength=vocab).float(), want[0]) > 1e-3
    second = emitted[accept >= 2, 1]
    assert chi_square_pvalue(torch.bincount(second, minlength=vocab).float(), want[1]) > 1e-3
    rate = float((accept >= 2).float().mean())
    assert abs(rate - float(want[0, drafts[0]])) < 0.02
    assert set(accept.tolist()) <= {1, 2, 3} and (accept == 3).any()


def test_greedy_rows_among_sampled_ones_keep_the_argmax_rule():
    logits = torch.randn(4, 3, 10, generator=torch.Generator().manual_seed(2))
    best = logits.argmax(dim=-1)  # [4, 3]
    drafts = torch.stack([best[0, :2], torch.tensor([best[1, 0], 9 - best[1, 1]]), best[2, :2], best[3, :2]])
    params = torch.cat([_params(2, 0.0), _params(2, 1.0)], dim=1)  # rows 0, 1 greedy
    emitted, accept = chain_accept_sampled(drafts, logits, params, filters=False)
    assert accept[:2].tolist() == [3, 2]
    assert emitted[0].tolist() == best[0].tolist() and emitted[1, :2].tolist() == best[1, :2].tolist()


def test_sampled_windows_through_the_scheduler(runner):
    """All-sampled batches take windows (with and without top-k/top-p); outputs run to their
    length or stop, and the pool is intact."""
    spec = _spec(runner)
    sent: list = []
    s, cache, rows = _scheduler(runner, spec, 1024, sent)
    params = [SamplingParams(max_new_tokens=25, temperature=0.8),
              SamplingParams(max_new_tokens=30, temperature=1.0, top_k=5, top_p=0.9),
              SamplingParams(max_new_tokens=12, temperature=0.5, min_p=0.1)]  # fmt: skip
    for i, (p, sp) in enumerate(zip(PROMPTS, params)):
        s.add_request(_req(f"r{i}", p, sp))
    _run(s)
    _assert_clean(cache, rows)
    got, finished = _outputs(sent)
    for i, sp in enumerate(params):
        assert finished[f"r{i}"]["type"] in ("length", "stop")
        assert 1 <= len(got[f"r{i}"]) <= sp.max_new_tokens
    assert {mode for _, _, mode in spec.window.graphs} == {"filter"}  # one row filters: the batch does
    assert spec.window.steps > 0


def test_a_cache_growth_drops_the_graphs_and_renews_the_slot_table(runner):
    base = random_worker(runner, seed=3, num_steps=3, topk=1, num_draft_tokens=4)
    _, window = _windows(runner, base, PROMPTS[:2], [4], capture=False)
    assert window.graphs
    old_slots = base.cache.slots
    base.cache.ensure(rows=0, length=2 * base.cache.capacity[1])  # a long prompt arrived
    window._graph(1, 64, "greedy", window._host_state([], [], [], 1), window._host_params([], 1))
    assert list(window.graphs) == [(1, 64, "greedy")]  # the old ones are gone
    rows, length = base.cache.capacity
    assert base.cache.slots.shape == (rows, length) and old_slots.shape[1] == length // 2
    assert torch.equal(base.cache.slots.flatten(), torch.arange(rows * length))
