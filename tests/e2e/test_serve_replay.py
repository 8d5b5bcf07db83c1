"""Per-request routed experts on a real ``vllm serve --aux-output-backend triton`` (tiny
Qwen3-MoE, float32, CPU): requests that opt out (``vllm_xargs: {"aux_output_replay":
false}``) get no rows, those that want rows get HF's router top-k, also when they hit the
prefix cache on blocks an opted-out request computed, and a malformed switch is a 400.

Two servers, one after the other: one stage with the default (rows for every request unless
it opts out), and two pipeline stages started with ``--aux-output-replay-default off``
(rows only for requests that ask), answering the same requests (the ones that want rows say
so there, the others leave the key out).
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import numpy as np
import pytest

from demo.scenario import FIRST_TOKEN_ID, decode_routed_experts, read_counters, server_launch
from demo.serve import VLLMServer
from demo.tiny_model import TINY_CONFIG

pytestmark = pytest.mark.e2e

KEY = "aux_output_replay"


@dataclass
class Answer:
    """One completion: its tokens, its rows (None: the server returned none) and how many
    bytes the response body had."""

    prompt: list[int]
    output: list[int]
    rows: np.ndarray | None
    prompt_start: int
    cached_tokens: int
    body_bytes: int

    @property
    def sequence(self) -> list[int]:
        return self.prompt + self.output


@dataclass
class ReplayRun:
    answers: dict[str, Answer] = field(default_factory=dict)
    wants_rows: dict[str, bool] = field(default_factory=dict)
    refusals: dict[str, tuple[int, str]] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    # The server's own count of rows returned and withheld: its last log line of them.
    logged: dict[str, int] = field(default_factory=dict)


def _post(base_url: str, body: dict) -> tuple[int, bytes]:
    request = urllib.request.Request(
        base_url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def _complete(base_url, model, prompt, max_tokens, switch, prompt_start=0) -> Answer:
    """``switch``: the value sent as ``vllm_xargs.aux_output_replay``; None sends no key."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
        "ignore_eos": True,
    }
    if switch is not None:
        body["vllm_xargs"] = {KEY: switch}
    if prompt_start:
        body["routed_experts_prompt_start"] = prompt_start
    status, raw = _post(base_url, body)
    assert status == 200, raw[-2000:]
    answer = json.loads(raw)
    choice = answer["choices"][0]
    encoded = choice.get("routed_experts")
    details = answer["usage"].get("prompt_tokens_details") or {}
    return Answer(
        prompt=list(prompt),
        output=list(choice["token_ids"]),
        rows=None if encoded is None else decode_routed_experts(encoded),
        prompt_start=prompt_start,
        cached_tokens=details.get("cached_tokens") or 0,
        body_bytes=len(raw),
    )


def run_replay_scenario(base_url: str, model: str, *, opt_in_default: bool) -> ReplayRun:
    """The requests both servers answer. ``opt_in_default``: the server gives rows only to
    requests that ask, so those that want rows send ``true`` and the others no key;
    otherwise those that want rows send no key (or ``true``) and the others ``false``."""
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(60)
    run = ReplayRun()

    def prompt(n: int) -> list[int]:
        return rng.integers(FIRST_TOKEN_ID, TINY_CONFIG["vocab_size"], size=n).tolist()

    def ask(name, tokens, max_tokens, wants_rows, prompt_start=0, explicit=False):
        if opt_in_default:
            switch = True if wants_rows else None
        else:
            switch = (True if explicit else None) if wants_rows else False
        run.wants_rows[name] = wants_rows
        answer = _complete(base_url, model, tokens, max_tokens, switch, prompt_start)
        run.answers[name] = answer
        return answer

    # An opted-out first turn computes a prompt; the next turn, which wants rows, hits its
    # blocks in the prefix cache and gets their rows from what the opted-out turn captured.
    first = ask("out_first", prompt(70), 8, False)
    second = first.sequence + prompt(20)
    ask("in_hit", second, 8, True)
    ask("in_prompt_start", second, 4, True, prompt_start=50, explicit=True)
    ask("out_same", second, 8, False)
    # A batch sharing a two-block prefix, the two kinds interleaved, sent at once.
    shared = prompt(64)
    jobs = [(f"batch{i}", shared + prompt(5 + 7 * i), 10, i % 2 == 0) for i in range(6)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        list(pool.map(lambda job: ask(*job), jobs))
    # Malformed switches: refused by name, never read as true or false.
    for name, value in (("string", "false"), ("two", 2), ("fraction", 0.5)):
        status, raw = _post(
            base_url,
            {"model": model, "prompt": prompt(8), "max_tokens": 2, "vllm_xargs": {KEY: value}},
        )
        run.refusals[name] = (status, raw.decode(errors="replace"))
    with urllib.request.urlopen(base_url + "/metrics", timeout=30) as response:
        run.metrics = read_counters(response.read().decode())
    return run


_COUNTS_LINE = re.compile(
    r"routed experts: (?P<rows_returned>\d+) rows returned to (?P<requests_with_rows>\d+) "
    r"requests; (?P<rows_withheld>\d+) rows withheld from (?P<requests_without_rows>\d+)"
)


def _serve(model, env, log_dir, *, pipeline_stages, opt_in_default) -> ReplayRun:
    name, args, env = server_launch("triton", tiny=True, env=env, pipeline_stages=pipeline_stages)
    if opt_in_default:
        args = [*args, "--aux-output-replay-default", "off"]
    # Log the counts at every finished request, so the last line has them all.
    env = {**env, "R3CAPTURE_REPLAY_LOG_INTERVAL_S": "0"}
    log_path = log_dir / f"{name}-replay.log"
    with VLLMServer(model, args, env=env, log_path=log_path) as server:
        run = run_replay_scenario(server.base_url, model, opt_in_default=opt_in_default)
        lines = _COUNTS_LINE.findall(log_path.read_text(errors="replace"))
    if lines:
        run.logged = dict(zip(_COUNTS_LINE.groupindex, map(int, lines[-1])))
    return run


@pytest.fixture(scope="module")
def replay_run(tiny_model, server_env, log_dir) -> ReplayRun:
    return _serve(tiny_model, server_env, log_dir, pipeline_stages=1, opt_in_default=False)


@pytest.fixture(scope="module")
def replay_pp2_opt_in_run(tiny_model, server_env, log_dir) -> ReplayRun:
    return _serve(tiny_model, server_env, log_dir, pipeline_stages=2, opt_in_default=True)


@pytest.fixture(params=["replay_run", "replay_pp2_opt_in_run"])
def run(request) -> ReplayRun:
    return request.getfixturevalue(request.param)


def test_opted_out_requests_get_no_rows_and_the_others_hf_routers(run, hf_router):
    for name, answer in run.answers.items():
        if not run.wants_rows[name]:
            assert answer.rows is None, name
            continue
        expected = hf_router.topk(answer.sequence)[answer.prompt_start : -1]
        assert answer.rows is not None, name
        assert answer.rows.dtype == np.uint8 and answer.rows.shape == expected.shape, name
        np.testing.assert_array_equal(answer.rows, expected, err_msg=name)


def test_a_request_that_wants_rows_gets_them_from_an_opted_out_requests_blocks(run):
    """``in_hit`` extends ``out_first`` (prompt + answer + 20 tokens): two whole 32-token
    blocks come from the prefix cache, computed by the opted-out request, and every row of
    them comes back (checked against HF above)."""
    hit = run.answers["in_hit"]
    assert hit.cached_tokens == 64
    assert len(hit.rows) == len(hit.sequence) - 1
    assert run.answers["in_prompt_start"].cached_tokens >= 64


def test_both_servers_answer_the_same_tokens_and_rows(replay_run, replay_pp2_opt_in_run):
    for name, answer in replay_run.answers.items():
        other = replay_pp2_opt_in_run.answers[name]
        assert other.output == answer.output, name
        assert (other.rows is None) == (answer.rows is None), name
        if answer.rows is not None:
            assert other.rows.tobytes() == answer.rows.tobytes(), name


def test_a_switch_that_is_not_a_boolean_is_a_400_naming_it(run):
    for name, (status, body) in run.refusals.items():
        assert status == 400, (name, status, body[-500:])
        assert "aux_output_replay must be a boolean" in body, (name, body[-500:])


def test_the_response_bytes_and_the_servers_counters_show_the_saving(run):
    """The same prompt and answer, with and without rows: the rows' base64 ``.npy`` is the
    difference. The server computed (``model_tokens``) every opted-out request's tokens like
    any other's (their rows were captured for later prefix hits) but returned none of them:
    rows returned = rows of requests that wanted them only."""
    with_rows, without = run.answers["in_hit"], run.answers["out_same"]
    assert with_rows.output == without.output
    row_bytes = with_rows.rows.nbytes
    assert with_rows.body_bytes - without.body_bytes >= row_bytes
    answers = run.answers.values()
    returned = sum(len(a.rows) for a in answers if a.rows is not None)
    withheld = sum(len(a.sequence) - 1 - a.prompt_start for a in answers if a.rows is None)
    # Every request's rows were computed or hit (vLLM's counters: model tokens, one per
    # request more than its rows; prefix-cache hits per request in its usage).
    assert run.metrics["requests"] == len(run.answers)
    computed = run.metrics["model_tokens"] - run.metrics["requests"]
    cached = sum(a.cached_tokens for a in answers)
    assert computed + cached == sum(len(a.sequence) - 1 for a in answers)
    assert withheld > 0.4 * (returned + withheld)
    # The server's own counts (its log line) say the same.
    assert run.logged == {
        "rows_returned": returned,
        "requests_with_rows": sum(a.rows is not None for a in answers),
        "rows_withheld": withheld,
        "requests_without_rows": sum(a.rows is None for a in answers),
    }
    print(
        f"\nrows returned {returned}, withheld {withheld} (computed {computed:.0f}, hit "
        f"{cached}); in_hit: {with_rows.body_bytes} B with its rows, {without.body_bytes} B "
        f"without ({row_bytes} B of rows)"
    )
