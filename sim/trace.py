"""Deterministic workload traces for the capture simulator.

A trace fixes the model shape, the engine configuration and every request (prompt, the
token stream the model samples, output length, routed-experts prompt start, arrival, abort,
multi-turn dependency). Everything random comes from ``numpy.random.default_rng(seed)``,
so equal arguments give equal traces; the simulator's own randomness (speculative
acceptance) is seeded from ``Trace.seed`` as well.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

VOCAB = 1000


@dataclass(frozen=True)
class ModelSpec:
    """Routing shape: rows are ``[num_layers, top_k]`` expert ids in ``[0, num_experts)``
    (uint8 when ``num_experts <= 256``, else uint16); the first ``num_dense_layers`` are 0."""

    num_layers: int = 4
    top_k: int = 2
    num_experts: int = 16
    num_dense_layers: int = 0

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.uint8 if self.num_experts <= 256 else np.uint16)

    @property
    def row_nbytes(self) -> int:
        return self.num_layers * self.top_k * self.dtype.itemsize


@dataclass(frozen=True)
class EngineConfig:
    """Scheduler/KV/worker knobs of the mini engine (names follow vLLM's).

    ``max_concurrent_batches=2`` is async scheduling (step N+1 is scheduled, begun and
    prepared before step N's output is processed). ``num_spec_tokens`` drafts per decode
    step, each accepted with ``accept_prob`` until the first rejection; a request gets drafts
    for a step with ``draft_prob`` (an n-gram proposer often finds no match, so steps of one
    token per request follow rejected drafts). ``offload_blocks``
    adds an external KV tier (a KV connector double; doubles the scheduler's pin capacity);
    ``async_kv_load`` loads its hits one step later (``request_loading``). ``cap_hits=False``
    leaves out ``max_cache_hit``/``cap_external_hit`` (to reach the store's fail-closed
    path). ``max_bytes=None`` sizes the store like vLLM (``num_gpu_blocks`` KV blocks).
    ``pad_tokens_to`` pads each step like a CUDA graph (extra garbage rows + one padded
    request in ``query_start_loc_np``). ``kv_delivery`` stands for a KV connector whose
    hand-off must be delivered (vLLM's ``requires_kv_delivery``, a producer role): a
    preempted request's output still in flight is then dropped, and the request may be
    scheduled again while it is. ``remote_prefill`` adds a P/D KV connector (NIXL's decoder
    side) that loads the prompt KV of decode-leg requests (``RequestSpec.remote_prefill``)
    from a prefiller, asynchronously with ``async_kv_load``. ``replay_default``: whether a
    request that does not say gets routed experts (``--aux-output-replay-default``).
    """

    block_size: int = 16
    hash_block_size: int = 16
    num_gpu_blocks: int = 512
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 256
    long_prefill_token_threshold: int = 0
    max_concurrent_batches: int = 1
    num_spec_tokens: int = 0
    accept_prob: float = 0.7
    draft_prob: float = 1.0
    offload_blocks: int = 0
    async_kv_load: bool = False
    cap_hits: bool = True
    max_bytes: int | None = None
    pad_tokens_to: int = 0
    kv_delivery: bool = False
    remote_prefill: bool = False
    replay_default: bool = True


@dataclass(frozen=True)
class RequestSpec:
    """One request. ``tokens`` is the stream the model samples after the prompt: the
    output is ``tokens[:max_tokens]``; the slack after it is what an async engine samples
    past the stop before it notices. ``after``: arrives ``arrival_step`` steps after that
    request finished (multi-turn); otherwise at step ``arrival_step``. ``abort_step``:
    the client aborts it before that step is scheduled. ``accept_prob``: this request's
    per-draft acceptance probability (None: the engine's ``accept_prob``).
    ``remote_prefill``: a decode-leg request (``kv_transfer_params`` with
    ``do_remote_prefill``) whose first ``remote_prefill`` prompt tokens' KV a prefiller
    computed (the prompt less NIXL's prefill backoff); None for other requests.
    ``load_steps``: steps an asynchronous KV load of it takes. ``replay``: its
    ``extra_args["aux_output_replay"]`` (whether it wants its routed experts); None leaves
    the key out (the engine's ``replay_default``)."""

    req_id: str
    prompt: tuple[int, ...]
    tokens: tuple[int, ...]
    max_tokens: int
    prompt_start: int = 0
    arrival_step: int = 0
    after: str | None = None
    abort_step: int | None = None
    accept_prob: float | None = None
    remote_prefill: int | None = None
    load_steps: int = 1
    replay: bool | None = None

    def gets_rows(self, config: EngineConfig) -> bool:
        """Whether this request wants its routed experts on an engine of ``config``."""
        return config.replay_default if self.replay is None else self.replay


@dataclass(frozen=True)
class Trace:
    name: str
    seed: int
    model: ModelSpec
    config: EngineConfig
    requests: tuple[RequestSpec, ...]
    reset_steps: tuple[int, ...] = ()
    max_steps: int = 20_000
    notes: str = field(default="", compare=False)

    def replace(self, **changes: object) -> Trace:
        return dataclasses.replace(self, **changes)

    def with_config(self, **changes: object) -> Trace:
        return dataclasses.replace(self, config=dataclasses.replace(self.config, **changes))

    def opted_out(self) -> frozenset[str]:
        """Ids of the requests that want no routed experts."""
        return frozenset(q.req_id for q in self.requests if not q.gets_rows(self.config))

    def all_opted_in(self) -> Trace:
        """This trace with every request wanting its rows (the switch left out): what vLLM
        0.33.0, which has no switch, runs."""
        requests = tuple(dataclasses.replace(q, replay=None) for q in self.requests)
        return self.replace(requests=requests).with_config(replay_default=True)

    def with_opt_outs(self, share: float, *, seed: int | None = None) -> Trace:
        """This trace with ``share`` of its requests (rounded) opting out of routed experts
        (``replay=False``), chosen by a generator of its own (``seed``, default the
        trace's), so the rest of the trace is as it was; of the others, a third say
        ``replay=True`` explicitly and the rest leave the key out. Under
        ``replay_default=False`` those that leave it out get no rows either."""
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"share must be in [0, 1], got {share}")
        r = np.random.default_rng([self.seed if seed is None else seed, 0x0F7])
        order = r.permutation(len(self.requests)).tolist()
        num_out = round(share * len(order))
        num_explicit = (len(order) - num_out) // 3
        replays = dict.fromkeys(order[:num_out], False)
        replays.update(dict.fromkeys(order[num_out : num_out + num_explicit], True))
        requests = [
            dataclasses.replace(q, replay=replays.get(i)) for i, q in enumerate(self.requests)
        ]
        return self.replace(requests=tuple(requests), name=f"{self.name}-optout{share:g}")


class _Gen:
    """Seeded helpers shared by the scenario builders."""

    def __init__(self, seed: int, slack: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.slack = slack
        self.count = 0

    def toks(self, n: int) -> tuple[int, ...]:
        return tuple(int(t) for t in self.rng.integers(0, VOCAB, n))

    def request(
        self,
        prompt: tuple[int, ...],
        max_tokens: int,
        *,
        prompt_start: int | None = None,
        arrival_step: int = 0,
        after: str | None = None,
        abort_step: int | None = None,
        start_frac: float = 0.3,
    ) -> RequestSpec:
        if prompt_start is None:
            # Most requests want the whole prompt; some start later, some at the end.
            roll = self.rng.random()
            if roll < 1 - start_frac:
                prompt_start = 0
            elif roll < 1 - start_frac / 3:
                prompt_start = int(self.rng.integers(0, len(prompt) + 1))
            else:
                prompt_start = len(prompt)
        req = RequestSpec(
            req_id=f"r{self.count:04d}",
            prompt=prompt,
            tokens=self.toks(max_tokens + self.slack),
            max_tokens=max_tokens,
            prompt_start=prompt_start,
            arrival_step=arrival_step,
            after=after,
            abort_step=abort_step,
        )
        self.count += 1
        return req


def _slack(config: EngineConfig) -> int:
    return 4 * (config.num_spec_tokens + 1) + 4


def _config(defaults: dict[str, object], overrides: dict[str, object]) -> EngineConfig:
    merged = dict(defaults)
    merged.update(overrides)
    return EngineConfig(**merged)  # type: ignore[arg-type]


def _sizes(size: str) -> int:
    scales = {"tiny": 1, "small": 2, "medium": 6, "large": 24}
    if size not in scales:
        raise ValueError(f"size must be one of {sorted(scales)}; got {size!r}")
    return scales[size]


def decode_trace(seed: int = 0, size: str = "small", **config: object) -> Trace:
    """Many short requests decoding together."""
    s = _sizes(size)
    cfg = _config(dict(max_num_seqs=16 * s, max_num_batched_tokens=256 * s), config)
    g = _Gen(seed, _slack(cfg))
    reqs = [
        g.request(
            g.toks(int(g.rng.integers(4, 40))),
            int(g.rng.integers(6, 24 + 4 * s)),
            arrival_step=int(g.rng.integers(0, 4)),
        )
        for _ in range(12 * s)
    ]
    return Trace("decode", seed, ModelSpec(), cfg, tuple(reqs))


def chunked_prefill_trace(seed: int = 0, size: str = "small", **config: object) -> Trace:
    """Long prompts split over several steps by a small token budget."""
    s = _sizes(size)
    defaults = dict(
        max_num_batched_tokens=48 * s,
        long_prefill_token_threshold=40 * s,
        block_size=16,
        hash_block_size=8,
    )
    cfg = _config(defaults, config)
    g = _Gen(seed, _slack(cfg))
    reqs = [
        g.request(
            g.toks(int(g.rng.integers(60 * s, 170 * s))),
            int(g.rng.integers(3, 12)),
            arrival_step=2 * i,
        )
        for i in range(3 + s)
    ]
    return Trace(
        "chunked_prefill", seed, ModelSpec(num_layers=3, top_k=3, num_experts=64), cfg, tuple(reqs)
    )


def multi_turn_trace(seed: int = 0, size: str = "small", **config: object) -> Trace:
    """Conversations whose next turn extends the previous turn's tokens (prefix hits),
    all sharing a system prompt."""
    s = _sizes(size)
    cfg = _config({}, config)
    g = _Gen(seed, _slack(cfg))
    system = g.toks(int(g.rng.integers(20, 40)))
    reqs: list[RequestSpec] = []
    for conv in range(2 + s):
        history = system + g.toks(int(g.rng.integers(3, 30)))
        prev: str | None = None
        for _turn in range(2 + s // 2):
            max_tokens = int(g.rng.integers(4, 20))
            req = g.request(
                history,
                max_tokens,
                arrival_step=conv if prev is None else int(g.rng.integers(0, 3)),
                after=prev,
            )
            reqs.append(req)
            history = history + req.tokens[:max_tokens] + g.toks(int(g.rng.integers(2, 25)))
            prev = req.req_id
    return Trace(
        "multi_turn",
        seed,
        ModelSpec(num_experts=300, top_k=3),
        cfg,
        tuple(reqs),
        notes="uint16 rows (300 experts)",
    )


def spec_decode_trace(seed: int = 0, size: str = "small", **config: object) -> Trace:
    """Speculative decoding with random rejections (synchronous scheduling)."""
    defaults = dict(num_spec_tokens=3, accept_prob=0.6, hash_block_size=4, block_size=8)
    defaults.update(config)
    base = decode_trace(seed, size, **defaults)
    return base.replace(name="spec_decode")


def async_trace(seed: int = 0, size: str = "small", **config: object) -> Trace:
    """Async scheduling (two steps in flight), no drafts, mixed prefill and decode."""
    defaults = dict(max_concurrent_batches=2, max_num_batched_tokens=96)
    s = _sizes(size)
    cfg = _config(defaults, config)
    g = _Gen(seed, _slack(cfg))
    reqs = [
        g.request(
            g.toks(int(g.rng.integers(5, 90))),
            int(g.rng.integers(2, 20)),
            arrival_step=int(g.rng.integers(0, 12)),
        )
        for _ in range(10 * s)
    ]
    return Trace("async", seed, ModelSpec(), cfg, tuple(reqs))


def async_spec_trace(seed: int = 0, size: str = "small", **config: object) -> Trace:
    """Async scheduling with drafts: the scheduler's optimistic num_computed_tokens runs
    ahead of the true positions after a rejection (the worker must reattach). A tight
    budget leaves some running requests unscheduled, which yields hash-only updates."""
    defaults = dict(
        num_spec_tokens=3,
        accept_prob=0.5,
        draft_prob=0.6,
        block_size=8,
        hash_block_size=4,
        max_num_batched_tokens=40,
    )
    defaults.update(config)
    return async_trace(seed, size, **defaults).replace(name="async_spec")


def preemption_trace(seed: int = 0, size: str = "small", **config: object) -> Trace:
    """Too few KV blocks: running requests are preempted and recomputed (with prefix hits
    on their own surviving blocks)."""
    s = _sizes(size)
    defaults = dict(
        num_gpu_blocks=14 + 2 * s,
        block_size=8,
        hash_block_size=8,
        max_num_batched_tokens=64,
        max_num_seqs=8,
    )
    cfg = _config(defaults, config)
    g = _Gen(seed, _slack(cfg))
    reqs = [
        g.request(
            g.toks(int(g.rng.integers(10, 40))),
            int(g.rng.integers(10, 30)),
            arrival_step=int(g.rng.integers(0, 6)),
        )
        for _ in range(6 * s)
    ]
    return Trace(
        "preemption", seed, ModelSpec(num_layers=2, top_k=4, num_experts=8), cfg, tuple(reqs)
    )


def reset_trace(seed: int = 0, size: str = "small", **config: object) -> Trace:
    """Multi-turn prefix reuse with prefix-cache resets mid-run (generation bumps)."""
    base = multi_turn_trace(seed, size, **config)
    return base.replace(name="reset", reset_steps=(9, 25, 41))


def eviction_trace(seed: int = 0, size: str = "small", **config: object) -> Trace:
    """A small GPU cache backed by an offload tier, a small store, and prompts that come
    back after their blocks left the GPU: external hits must be capped to pinned blocks
    (with ``cap_hits=False`` the worker fails closed with BlockObjectStoreError)."""
    s = _sizes(size)
    defaults = dict(
        num_gpu_blocks=12,
        block_size=8,
        hash_block_size=4,
        offload_blocks=400,
        max_num_batched_tokens=64,
        max_num_seqs=4,
        max_bytes=6 * 4 * 2 * 2 * 4,
    )
    cfg = _config(defaults, config)
    g = _Gen(seed, _slack(cfg))
    model = ModelSpec(num_layers=2, top_k=2)
    prompts = [g.toks(int(g.rng.integers(17, 40))) for _ in range(6 + 2 * s)]
    reqs = []
    for rnd in range(3):
        order = g.rng.permutation(len(prompts))
        for k, idx in enumerate(order):
            prompt = prompts[idx] + (g.toks(int(g.rng.integers(1, 6))) if rnd else ())
            reqs.append(g.request(prompt, int(g.rng.integers(2, 8)), arrival_step=rnd * 30 + k * 2))
    return Trace("eviction", seed, model, cfg, tuple(reqs))


def finish_in_flight_trace(seed: int = 0, size: str = "small", **config: object) -> Trace:
    """Async + drafts with client aborts landing while the request's steps are in flight,
    and stops that trim accepted drafts."""
    s = _sizes(size)
    defaults = dict(
        max_concurrent_batches=2,
        num_spec_tokens=2,
        accept_prob=0.8,
        block_size=8,
        hash_block_size=4,
        max_num_batched_tokens=80,
    )
    cfg = _config(defaults, config)
    g = _Gen(seed, _slack(cfg))
    reqs = []
    for _ in range(8 * s):
        arrival = int(g.rng.integers(0, 10))
        abort = arrival + int(g.rng.integers(1, 14)) if g.rng.random() < 0.4 else None
        reqs.append(
            g.request(
                g.toks(int(g.rng.integers(4, 50))),
                int(g.rng.integers(1, 16)),
                arrival_step=arrival,
                abort_step=abort,
            )
        )
    return Trace("finish_in_flight", seed, ModelSpec(num_dense_layers=1), cfg, tuple(reqs))


def shared_prefix_trace(seed: int = 0, size: str = "small", **config: object) -> Trace:
    """Async scheduling; groups of requests with one long common prefix arrive together
    or one step apart, so prefix hits land on blocks computed in the same step or in a
    step still in flight (the worker must publish before it materializes)."""
    s = _sizes(size)
    cfg = _config(
        dict(
            max_concurrent_batches=2,
            block_size=8,
            hash_block_size=4,
            max_num_batched_tokens=160,
            max_num_seqs=8,
        ),
        config,
    )
    g = _Gen(seed, _slack(cfg))
    reqs = []
    for group in range(2 + s):
        prefix = g.toks(int(g.rng.integers(24, 60)))
        for k in range(3):
            reqs.append(
                g.request(
                    prefix + g.toks(int(g.rng.integers(1, 9))),
                    int(g.rng.integers(2, 10)),
                    arrival_step=6 * group + (k if k < 2 else 0),
                )
            )
    return Trace("shared_prefix", seed, ModelSpec(top_k=3, num_experts=32), cfg, tuple(reqs))


ROLLOUTS = ("agentic", "groups")


def random_trace(seed: int, *, rollout: str | None = None, **overrides: object) -> Trace:
    """Everything drawn from the seed: config (async, drafts, chunking, preemption
    pressure, hash/KV block sizes, offload, padding), shared prefixes, multi-turn chains,
    aborts and resets. ``overrides`` replace drawn EngineConfig fields.

    ``rollout`` reshapes the requests as an RL rollout sends them (``_rollout``):
    ``agentic``, most requests asking only for their new rows; ``groups``, some prompts
    sampled several times at once. The rest of the trace is the seed's as without it."""
    if rollout is not None and rollout not in ROLLOUTS:
        raise ValueError(f"rollout must be one of {ROLLOUTS} or None, got {rollout!r}")
    g = _Gen(seed, 0)
    r = g.rng
    hbs = int(r.choice([2, 4, 8]))
    block_size = hbs * int(r.choice([1, 2]))
    async_ = bool(r.random() < 0.5)
    spec = int(r.choice([0, 0, 1, 2, 3]))
    offload = int(r.choice([0, 64, 400]))
    cfg = dict(
        block_size=block_size,
        hash_block_size=hbs,
        num_gpu_blocks=0,
        max_num_seqs=int(r.integers(2, 9)),
        max_num_batched_tokens=int(r.integers(24, 97)),
        long_prefill_token_threshold=int(r.choice([0, 0, 16])),
        max_concurrent_batches=2 if async_ else 1,
        num_spec_tokens=spec,
        accept_prob=float(r.uniform(0.2, 0.95)),
        offload_blocks=offload,
        async_kv_load=bool(offload and r.random() < 0.5),
        pad_tokens_to=int(r.choice([0, 0, 8])),
        draft_prob=float(r.choice([1.0, 1.0, 0.5])),
    )
    cfg.update(overrides)
    config = EngineConfig(**cfg)  # type: ignore[arg-type]
    g.slack = _slack(config)
    model = ModelSpec(
        num_layers=int(r.integers(1, 4)),
        top_k=int(r.integers(1, 4)),
        num_experts=int(r.choice([8, 64, 260])),
        num_dense_layers=int(r.choice([0, 0, 1])),
    )
    model = dataclasses.replace(
        model, num_dense_layers=min(model.num_dense_layers, model.num_layers - 1)
    )
    shared = [g.toks(int(r.integers(4, 30))) for _ in range(2)]
    reqs: list[RequestSpec] = []
    for _ in range(int(r.integers(3, 13))):
        roll = r.random()
        after = None
        if reqs and roll < 0.2:
            # Next turn of the previous request's conversation.
            prev = reqs[-1]
            after = prev.req_id
            prompt = prev.prompt + prev.tokens[: prev.max_tokens] + g.toks(int(r.integers(1, 10)))
            arrival = int(r.integers(0, 3))
        elif reqs and roll < 0.4:
            # An earlier prompt comes back later (its blocks may have left the GPU).
            prompt = reqs[int(r.integers(0, len(reqs)))].prompt + g.toks(int(r.integers(0, 6)))
            arrival = int(r.integers(10, 50))
        else:
            prefix = shared[int(r.integers(0, 2))] if r.random() < 0.5 else ()
            prompt = prefix + g.toks(int(r.integers(1, 40)))
            arrival = int(r.integers(0, 20))
        abort = arrival + int(r.integers(1, 20)) if after is None and r.random() < 0.15 else None
        reqs.append(
            g.request(
                prompt, int(r.integers(1, 20)), arrival_step=arrival, after=after, abort_step=abort
            )
        )
    # Enough KV blocks for the longest request alone (else it could never run), and
    # sometimes barely more, so that requests preempt each other.
    longest = max(len(q.prompt) + q.max_tokens for q in reqs) + 2 * (config.num_spec_tokens + 1)
    floor = -(-longest // config.block_size) + 1
    blocks = max(config.num_gpu_blocks, int(floor * r.uniform(1.0, 4.0)), floor)
    config = dataclasses.replace(
        config, num_gpu_blocks=int(overrides.get("num_gpu_blocks", blocks))
    )
    resets = tuple(sorted({int(x) for x in r.integers(5, 60, int(r.choice([0, 0, 1, 2])))}))
    if config.async_kv_load:
        resets = ()  # vLLM refuses a prefix-cache reset while KV loads hold blocks
    if rollout is not None:
        reqs = _rollout(rollout, seed, reqs, g.slack)
    return Trace(f"random-{seed}", seed, model, config, tuple(reqs), reset_steps=resets)


def _rollout(kind: str, seed: int, reqs: list[RequestSpec], slack: int) -> list[RequestSpec]:
    """``reqs`` reshaped as an RL rollout sends them, from a generator of its own (the
    seed's other draws stay as they are).

    ``agentic``: 80 % of requests ask only for the rows they add: half from the prompt's end
    (``routed_experts_prompt_start = len(prompt)``), half from where their turn's new part
    starts (after the previous turn's prompt and answer; for a first turn, a random point).
    ``groups``: up to three prompts that start a conversation are sampled 2-6 times, the
    samples arriving with the first, each with its own tokens (GRPO's n samples)."""
    g = _Gen(seed + 1_000_003, slack)
    r = g.rng
    by_id = {q.req_id: q for q in reqs}
    if kind == "agentic":
        reshaped = []
        for q in reqs:
            roll = r.random()
            if roll < 0.4:
                start = len(q.prompt)
            elif roll < 0.8:
                prev = by_id.get(q.after) if q.after is not None else None
                start = (
                    len(prev.prompt) + prev.max_tokens
                    if prev is not None
                    else int(r.integers(0, len(q.prompt) + 1))
                )
            else:
                start = 0
            reshaped.append(dataclasses.replace(q, prompt_start=min(start, len(q.prompt))))
        return reshaped
    firsts = [q for q in reqs if q.after is None]
    chosen = {q.req_id for q in r.permutation(firsts)[: int(r.integers(1, 4))]}
    grouped = []
    for q in reqs:
        grouped.append(q)
        if q.req_id in chosen:
            for n in range(int(r.integers(1, 6))):
                tokens = g.toks(q.max_tokens + slack)
                grouped.append(dataclasses.replace(q, req_id=f"{q.req_id}s{n}", tokens=tokens))
    return grouped


SCENARIOS: dict[str, Callable[..., Trace]] = {
    "decode": decode_trace,
    "chunked_prefill": chunked_prefill_trace,
    "multi_turn": multi_turn_trace,
    "spec_decode": spec_decode_trace,
    "async": async_trace,
    "async_spec": async_spec_trace,
    "preemption": preemption_trace,
    "reset": reset_trace,
    "eviction": eviction_trace,
    "finish_in_flight": finish_in_flight_trace,
    "shared_prefix": shared_prefix_trace,
}


def make_trace(scenario: str, seed: int = 0, size: str = "small", **config: object) -> Trace:
    """The named scenario's trace; ``config`` overrides EngineConfig fields."""
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r}; choose from {sorted(SCENARIOS)}")
    return SCENARIOS[scenario](seed, size, **config)


__all__ = [
    "EngineConfig",
    "ModelSpec",
    "RequestSpec",
    "SCENARIOS",
    "Trace",
    "make_trace",
    "random_trace",
]
