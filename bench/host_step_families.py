"""Trace families of the host-step benchmark, as simulator traces.

Each family is a function ``(model, depth, seed) -> sim.Trace``; the simulator
(``sim/engine.py``) turns it into the exact call sequence vLLM 0.33.0's engine makes, which
``sim/recording.py`` records. Every trace is played whole: prefill chunks, finishes, empty
steps, preemptions and resets are steps like any other.

Common to all: hash blocks and KV blocks of 16 tokens, an 8192-token step budget, chunked
prefill (a prompt takes what is left of the budget) and ``depth`` =
``max_concurrent_batches`` (2: async scheduling, MRV2's default). Requests ask for their
whole prompt's routing (``routed_experts_prompt_start = 0``, the RL rollout case) except in
the agentic family, where most turns ask only for their new rows.

This module imports no torch, vLLM or simulator code at import time, so the benchmark's
parent process can list families cheaply.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from bench.models import ModelShape
    from sim.trace import RequestSpec, Trace

BLOCK = 16
BUDGET = 8192
VOCAB = 1000  # sim.trace.VOCAB


@dataclass(frozen=True)
class Family:
    name: str
    description: str
    build: Callable[..., Trace]


class _Requests:
    """Seeded request factory: prompts of random tokens and the token stream each request
    samples (``max_tokens`` plus the slack an async engine samples past a stop)."""

    def __init__(self, seed: int, spec_k: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.slack = 4 * (spec_k + 1) + 4
        self.count = 0

    def tokens(self, n: int) -> tuple[int, ...]:
        return tuple(self.rng.integers(0, VOCAB, n).tolist())

    def between(self, low: int, high: int) -> int:
        return int(self.rng.integers(low, high + 1))

    def make(
        self,
        prompt: tuple[int, ...],
        max_tokens: int,
        *,
        arrival_step: int = 0,
        after: str | None = None,
        accept_prob: float | None = None,
        prompt_start: int = 0,
    ) -> RequestSpec:
        from sim.trace import RequestSpec

        self.count += 1
        return RequestSpec(
            req_id=f"q{self.count:05d}",
            prompt=prompt,
            tokens=self.tokens(max_tokens + self.slack),
            max_tokens=max_tokens,
            prompt_start=prompt_start,
            arrival_step=arrival_step,
            after=after,
            accept_prob=accept_prob,
        )


def _trace(name, model, depth, seed, requests, *, notes, reset_steps=(), **config) -> Trace:
    from sim.trace import EngineConfig, ModelSpec, Trace

    spec = ModelSpec(num_layers=model.num_layers, top_k=model.top_k, num_experts=model.num_experts)
    settings = dict(
        block_size=BLOCK,
        hash_block_size=BLOCK,
        max_num_batched_tokens=BUDGET,
        max_concurrent_batches=depth,
    )
    settings.update(config)
    return Trace(
        name,
        seed,
        spec,
        EngineConfig(**settings),
        tuple(requests),
        reset_steps=tuple(reset_steps),
        max_steps=50_000,
        notes=notes,
    )


def _blocks_for(requests, extra: int = 0) -> int:
    """KV blocks that hold every request's whole sequence at once (no KV pressure)."""
    tokens = sum(len(r.prompt) + r.max_tokens + 16 for r in requests)
    return tokens // BLOCK + len(requests) + extra + 64


def decode(batch: int) -> Family:
    def build(model: ModelShape, depth: int, seed: int) -> Trace:
        g = _Requests(seed)
        reqs = [g.make(g.tokens(g.between(64, 512)), g.between(160, 192)) for _ in range(batch)]
        return _trace(
            f"decode-{batch}",
            model,
            depth,
            seed,
            reqs,
            notes=f"{batch} requests arrive together: prompts 64-512, outputs 160-192 tokens",
            max_num_seqs=batch,
            num_gpu_blocks=_blocks_for(reqs),
        )

    return Family(
        f"decode-{batch}",
        f"{batch} requests decoding together (prompts 64-512 tokens in 8k-token prefill "
        "steps first, then 160-192 output tokens each)",
        build,
    )


def long_tail(batch: int) -> Family:
    """The end of a rollout batch: a few requests left decoding long outputs."""
    text = (
        f"the long tail of a batch: {batch} request{'s' if batch > 1 else ''} decoding "
        "512-1,024 output tokens (prompts 256-2,048)"
    )

    def build(model: ModelShape, depth: int, seed: int) -> Trace:
        g = _Requests(seed)
        reqs = [g.make(g.tokens(g.between(256, 2048)), g.between(512, 1024)) for _ in range(batch)]
        return _trace(
            f"long-tail-{batch}",
            model,
            depth,
            seed,
            reqs,
            notes=text,
            max_num_seqs=max(batch, 8),
            num_gpu_blocks=_blocks_for(reqs),
        )

    return Family(f"long-tail-{batch}", text, build)


def n_samples() -> Family:
    """GRPO's group sampling: each prompt is sampled n times (n = 8 or 16), the samples
    arriving together and sharing the prompt's prefix; groups arrive in waves."""
    text = (
        "GRPO groups: 24 prompts of 256-2,048 tokens, each sampled n = 8 or 16 times "
        "(outputs 64-512 tokens), a group every 16 steps"
    )

    def build(model: ModelShape, depth: int, seed: int) -> Trace:
        g = _Requests(seed)
        reqs = []
        for group in range(24):
            prompt = g.tokens(g.between(256, 2048))
            for _ in range(8 if g.rng.random() < 0.5 else 16):
                reqs.append(g.make(prompt, g.between(64, 512), arrival_step=16 * group))
        return _trace(
            "n-samples",
            model,
            depth,
            seed,
            reqs,
            notes=text,
            max_num_seqs=128,
            num_gpu_blocks=_blocks_for(reqs),
        )

    return Family("n-samples", text, build)


def agentic() -> Family:
    """Agent rollouts: each turn's prompt is the conversation so far (a prefix-cache hit),
    the model's last answer (a tool call) and a tool's output; most turns ask only for the
    rows they add, as an RL client that kept the earlier turns' rows does."""
    text = (
        "64 agent conversations, 4-8 turns, 32-64 running at once: a system prompt shared "
        "by 8 conversations (1k-2k tokens), tool outputs of 20-500 tokens, answers of "
        "16-160 tokens; 80% of turns ask only for new rows (routed_experts_prompt_start at "
        "the prompt's end or at the tool output's start)"
    )

    def build(model: ModelShape, depth: int, seed: int) -> Trace:
        g = _Requests(seed)
        systems = [g.tokens(g.between(1024, 2048)) for _ in range(8)]
        reqs, last_turns = [], []
        for conv in range(64):
            history = systems[conv % 8] + g.tokens(g.between(32, 256))
            new_from = len(systems[conv % 8])
            prev = None
            for _ in range(g.between(4, 8)):
                roll = g.rng.random()
                start = 0 if roll < 0.2 else (new_from if roll < 0.6 else len(history))
                out = g.between(16, 160)
                req = g.make(
                    history,
                    out,
                    # Half the conversations start at once, the rest as the first ones end.
                    arrival_step=(conv // 32) * 60 if prev is None else g.between(0, 2),
                    after=prev,
                    prompt_start=start,
                )
                reqs.append(req)
                new_from = len(history) + out
                history = history + req.tokens[:out] + g.tokens(g.between(20, 500))
                prev = req.req_id
            last_turns.append(req)
        return _trace(
            "agentic",
            model,
            depth,
            seed,
            reqs,
            notes=text,
            max_num_seqs=64,
            # Every conversation at its longest turn at once: no KV pressure.
            num_gpu_blocks=_blocks_for(last_turns),
        )

    return Family("agentic", text, build)


def prefill() -> Family:
    def build(model: ModelShape, depth: int, seed: int) -> Trace:
        g = _Requests(seed)
        reqs = [
            g.make(g.tokens(g.between(16_384, 40_960)), g.between(1, 4), arrival_step=4 * i)
            for i in range(12)
        ]
        return _trace(
            "prefill",
            model,
            depth,
            seed,
            reqs,
            notes="12 prompts of 16k-40k tokens in 8k-token chunks, 1-4 output tokens",
            max_num_seqs=16,
            num_gpu_blocks=_blocks_for(reqs),
        )

    return Family(
        "prefill",
        "12 long prompts (16k-40k tokens) in 8192-token chunks, 1-4 output tokens",
        build,
    )


def multi_turn(kind: str) -> Family:
    """Conversations whose next turn extends the previous one (prompt + answer + a new user
    message): its prefix is a KV-cache hit, and its routing comes from the store."""
    if kind == "short":
        conversations, turns, first, message, answer = 24, 8, (100, 300), (100, 250), (16, 64)
        text = "24 conversations x 8 turns; prefix hits grow from ~100 to ~2,000 tokens"
    else:
        conversations, turns, first, message, answer = 12, 5, (8_192, 10_240), (200, 800), (16, 64)
        text = "12 conversations x 5 turns; prefix hits of 8k-13k tokens"

    def build(model: ModelShape, depth: int, seed: int) -> Trace:
        g = _Requests(seed)
        reqs = []
        for conv in range(conversations):
            history = g.tokens(g.between(*first))
            prev = None
            for _ in range(turns):
                out = g.between(*answer)
                req = g.make(
                    history,
                    out,
                    arrival_step=conv % 8 if prev is None else g.between(0, 2),
                    after=prev,
                )
                reqs.append(req)
                history = history + req.tokens[:out] + g.tokens(g.between(*message))
                prev = req.req_id
        return _trace(
            f"multi-turn-{kind}",
            model,
            depth,
            seed,
            reqs,
            notes=text,
            max_num_seqs=32,
            num_gpu_blocks=_blocks_for(reqs),
        )

    return Family(f"multi-turn-{kind}", text, build)


def speculative(k: int) -> Family:
    def build(model: ModelShape, depth: int, seed: int) -> Trace:
        g = _Requests(seed, spec_k=k)
        reqs = [
            g.make(
                g.tokens(g.between(64, 512)),
                g.between(192, 256),
                accept_prob=float(g.rng.uniform(0.3, 0.9)),
            )
            for _ in range(128)
        ]
        return _trace(
            f"spec-k{k}",
            model,
            depth,
            seed,
            reqs,
            notes=f"128 requests, k={k} drafts, per-request acceptance 0.3-0.9, draft_prob 0.7",
            max_num_seqs=128,
            num_spec_tokens=k,
            draft_prob=0.7,
            num_gpu_blocks=_blocks_for(reqs, extra=128 * k),
        )

    return Family(
        f"spec-k{k}",
        f"128 requests with k={k} drafts: per-request acceptance rates 0.3-0.9, drafts "
        "proposed for 70% of steps",
        build,
    )


def mixed() -> Family:
    text = (
        "waves of shared prompts (n=4 samples each, 512-2k tokens) beside decodes; KV "
        "pressure preempts; one prefix-cache reset mid-trace"
    )

    def build(model: ModelShape, depth: int, seed: int) -> Trace:
        g = _Requests(seed)
        reqs = []
        for wave in range(24):
            prompt = g.tokens(g.between(512, 2048))
            for _ in range(4):
                reqs.append(g.make(prompt, g.between(48, 192), arrival_step=12 * wave))
        # KV for ~40 running requests of average size: later waves preempt earlier ones.
        blocks = 40 * (1280 + 120) // BLOCK
        return _trace(
            "mixed",
            model,
            depth,
            seed,
            reqs,
            notes=text,
            reset_steps=(150,),
            max_num_seqs=64,
            num_gpu_blocks=blocks,
        )

    return Family("mixed", text, build)


def full_store() -> Family:
    """A long rollout on a bounded KV cache: the KV cache and the store fill, then every new
    block evicts a stored one (the steady state of a serving worker), with no preemption."""
    text = (
        "a stream of 512 requests (prompts 1k-4k tokens, 32-64 output tokens, 16 every 12 "
        "steps) on a KV cache of 1.5x the running requests' blocks: the store fills (and "
        "grows once, as vLLM's does when every block is pinned), then every new block "
        "evicts a stored one"
    )

    def build(model: ModelShape, depth: int, seed: int) -> Trace:
        g = _Requests(seed)
        reqs = [
            g.make(g.tokens(g.between(1024, 4096)), g.between(32, 64), arrival_step=12 * (i // 16))
            for i in range(512)
        ]
        return _trace(
            "full-store",
            model,
            depth,
            seed,
            reqs,
            notes=text,
            max_num_seqs=256,
            num_gpu_blocks=FULL_STORE_RUNNING * _MEAN_FULL_STORE_BLOCKS * 3 // 2,
        )

    return Family("full-store", text, build)


def opted_out(base: Family) -> Family:
    """``base`` with half of its requests opting out of routed experts (``aux_output_replay
    = False``: evaluation, judge or teacher requests beside the rollouts), chosen by a
    generator of their own, so the trace is otherwise ``base``'s: its host time per step
    against ``base``'s is what the switch saves."""
    name = f"{base.name}{OPT_OUT_SUFFIX}"

    def build(model: ModelShape, depth: int, seed: int) -> Trace:
        trace = base.build(model, depth, seed).with_opt_outs(0.5)
        return trace.replace(name=name, notes=f"{trace.notes}; half of the requests opted out")

    return Family(name, f"{base.description}; half of the requests opted out of their rows", build)


OPT_OUT_SUFFIX = "-optout50"


# Requests running at once in the full-store family, which sizes its KV cache: each lives
# ~55 steps (a few of prefill, 32-64 of decode), so ~4.5 arrival waves of 16 run together;
# and the KV blocks of its mean request (2,560 prompt and 48 output tokens, one block of
# slack).
FULL_STORE_RUNNING = 72
_MEAN_FULL_STORE_BLOCKS = (2560 + 48 + BLOCK) // BLOCK


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        decode(1),
        decode(8),
        long_tail(1),
        long_tail(8),
        decode(32),
        decode(128),
        decode(256),
        decode(512),
        prefill(),
        multi_turn("short"),
        multi_turn("long"),
        speculative(1),
        speculative(3),
        speculative(5),
        mixed(),
        n_samples(),
        agentic(),
        full_store(),
        opted_out(decode(128)),
        opted_out(multi_turn("short")),
    )
}

# Sizes a family name may ask for beyond ``FAMILIES``: ``decode-N`` up to the engine size
# vLLM serves with on H100/H200-class GPUs, ``spec-kN`` up to 8 drafts.
MAX_DECODE_BATCH = 1024
MAX_SPEC_K = 8
_SIZED = (
    (re.compile(r"decode-([1-9][0-9]*)"), decode, MAX_DECODE_BATCH),
    (re.compile(r"spec-k([1-9][0-9]*)"), speculative, MAX_SPEC_K),
)


def family(name: str) -> Family:
    """The family called ``name``: one of ``FAMILIES``, or ``decode-N`` (N requests,
    1 <= N <= ``MAX_DECODE_BATCH``) or ``spec-kN`` (N drafts, 1 <= N <= ``MAX_SPEC_K``) at a
    size ``FAMILIES`` does not list, or any of them with ``-optout50`` (half of its requests
    opted out of routed experts). Raises ``KeyError`` naming what is accepted."""
    found = FAMILIES.get(name)
    if found is not None:
        return found
    if name.endswith(OPT_OUT_SUFFIX) and len(name) > len(OPT_OUT_SUFFIX):
        return opted_out(family(name.removesuffix(OPT_OUT_SUFFIX)))
    for pattern, make, limit in _SIZED:
        match = pattern.fullmatch(name)
        if match and int(match.group(1)) <= limit:
            return make(int(match.group(1)))
    raise KeyError(
        f"unknown host_step family {name!r}: one of {', '.join(FAMILIES)}, or "
        f"decode-N (1 <= N <= {MAX_DECODE_BATCH}) or spec-kN (1 <= N <= {MAX_SPEC_K}), "
        f"each also with {OPT_OUT_SUFFIX}"
    )


QUICK_FAMILIES = (
    "long-tail-8",
    "decode-32",
    "decode-256",
    "prefill",
    "multi-turn-short",
    "spec-k3",
    "mixed",
    "agentic",
)
