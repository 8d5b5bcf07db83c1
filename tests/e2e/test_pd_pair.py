"""Prefill/decode disaggregation with routed experts: two real `vllm serve` on an
``ExampleConnector`` pair, requests through the reference proxy (demo/pd_proxy.py).

Both servers run ``--enable-return-routed-experts --aux-output-backend triton
--aux-output-pd splice`` and share a fresh directory for the KV (``ExampleConnector`` ignores
``kv_role``: both sides save and load, so nothing else may share it). Each is bound to one
core. Every request's spliced rows must be byte-identical to the rows one instance (the
prefiller, serving the whole request afterwards) returns, and equal HF transformers' router
top-k; the decoder must really have loaded the prompt's KV (a 32-token-block-aligned hit).

The decoder is asked for its rows from the prefiller's last row (the proxy's default) and
from row 0: under ``splice`` a decode-leg request (the proxy marks it with
``kv_transfer_params: {"do_remote_prefill": true}``, which the ``ExampleConnector`` ignores)
returns only the rows from its first computed token, so it never asks its store for rows of
KV it loaded, and the engine stays alive.

Single, concurrent and multi-turn requests (later turns hit the decoder's own prefix cache,
then load the rest) run on one pair; n-gram speculative decoding on a second pair with the
same speculative config on both servers, started once the first has stopped.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from demo.pd_pair import BLOCK, pd_servers, start_all, stop_all
from demo.pd_proxy import pd_complete
from demo.scenario import FIRST_TOKEN_ID, SPECULATIVE_CONFIG, complete, read_counters
from demo.tiny_model import TINY_CONFIG

pytestmark = pytest.mark.e2e

SHAPE = (TINY_CONFIG["num_hidden_layers"], TINY_CONFIG["num_experts_per_tok"])
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def pd_pair(request, tiny_model, server_env, log_dir, tmp_path_factory):
    """(prefiller, decoder) as ``make pd-demo`` starts them (demo/pd_pair.py: one core each),
    started side by side and always stopped.

    A test parametrized indirectly with a speculative config gets a pair that both run it.
    The fixture is module-scoped and cached by that parameter: pytest stops the plain pair
    before it starts the speculative one (never four servers at once), so the speculative
    tests come last in this module."""
    speculative = getattr(request, "param", None)
    suffix = "" if speculative is None else f"-{speculative['method']}"
    shared = str(tmp_path_factory.mktemp(f"pd-kv-shared{suffix}"))
    servers = pd_servers(
        tiny_model, shared, server_env, log_dir, suffix=suffix, speculative=speculative
    )
    try:
        start_all(servers)
        yield servers
    finally:
        stop_all(servers)


def _example_connector_hit(prompt_len: int) -> int:
    """The tokens the decoder loads: whole blocks of the prompt but its last token. The
    ``ExampleConnector`` saves the KV of ``(len - 1) // B * B`` tokens but looks up
    ``(len - 2) // B * B``: the two agree unless ``len % B == 1`` (those prompts miss, so
    the prompts here avoid such lengths)."""
    assert prompt_len % BLOCK != 1, "the ExampleConnector never hits such a prompt"
    return (prompt_len - 2) // BLOCK * BLOCK


def _prompt(seed: int, n: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return rng.integers(FIRST_TOKEN_ID, TINY_CONFIG["vocab_size"], size=n).tolist()


def _through_proxy(pd_pair, prompt: list[int], max_tokens: int, decode_prompt_start=None):
    prefiller, decoder = pd_pair
    return pd_complete(
        prefiller.base_url, decoder.base_url, prefiller.model, prompt,
        max_tokens=max_tokens, sampling=GREEDY, decode_prompt_start=decode_prompt_start,
    )  # fmt: skip


def _check_against_single_instance(
    pd_pair, hf_router, prompt, max_tokens, result, decode_prompt_start=None
):
    """The spliced rows equal one instance's (the prefiller serving the whole request) and
    HF's; the decoder loaded the prompt's whole blocks from the prefiller (or, for a prompt
    it served before, hit them in its own prefix cache) and returned its rows from
    ``decode_prompt_start`` (default: the prefiller's last row), or from its first computed
    token when that is later."""
    prefiller, _ = pd_pair
    sequence = prompt + result.token_ids
    hit = _example_connector_hit(len(prompt))
    assert result.prompt_token_ids == prompt and len(result.token_ids) == max_tokens
    assert len(result.prefill_rows) == len(prompt)
    first_row = max(len(prompt) if decode_prompt_start is None else decode_prompt_start, hit)
    assert len(result.decode_rows) == len(sequence) - 1 - first_row
    cached = result.decode_usage["prompt_tokens_details"]["cached_tokens"]
    assert cached == hit > 0, result.decode_usage

    rows = result.routed_experts
    assert rows.dtype == np.uint8 and rows.shape == (len(sequence) - 1, *SHAPE)
    import openai

    client = openai.OpenAI(base_url=prefiller.base_url + "/v1", api_key="unused", timeout=300)
    single = complete(client, prefiller.model, "single", prompt, max_tokens)
    assert single.output == result.token_ids
    assert single.rows.dtype == rows.dtype and single.rows.shape == rows.shape
    assert single.rows.tobytes() == rows.tobytes()
    np.testing.assert_array_equal(rows, hf_router.topk(sequence)[:-1])


def test_single_request_spliced_rows_equal_one_instance_and_hf(pd_pair, hf_router):
    prompt = _prompt(70, 70)
    result = _through_proxy(pd_pair, prompt, 8)
    _check_against_single_instance(pd_pair, hf_router, prompt, 8, result)


def test_concurrent_requests_spliced_rows_equal_one_instance_and_hf(pd_pair, hf_router):
    jobs = [(_prompt(100 + n, n), max_tokens) for n, max_tokens in ((40, 6), (66, 10), (100, 4))]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: _through_proxy(pd_pair, *job), jobs))
    for (prompt, max_tokens), result in zip(jobs, results):
        _check_against_single_instance(pd_pair, hf_router, prompt, max_tokens, result)
    prefiller, decoder = pd_pair
    assert prefiller.alive() and decoder.alive()


def test_decoder_asked_from_row_0_returns_the_rows_it_computed_and_stays_alive(pd_pair, hf_router):
    """``routed_experts_prompt_start=0`` on the decoder: rows from the first token it
    computed (the ``ExampleConnector`` loads 64 of a 70-token prompt, so rows 64 on). The
    same prompt again hits the loaded KV in the decoder's own prefix cache: still rows from
    64, never a store lookup of rows it does not hold. Two prompts at once, then both
    servers are alive."""
    prompt = _prompt(200, 70)
    for _ in range(2):
        result = _through_proxy(pd_pair, prompt, 5, decode_prompt_start=0)
        assert len(result.decode_rows) == 70 + 5 - 1 - 64
        _check_against_single_instance(pd_pair, hf_router, prompt, 5, result, 0)
    jobs = [(_prompt(300 + n, n), max_tokens) for n, max_tokens in ((50, 4), (95, 3))]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: _through_proxy(pd_pair, *job, 0), jobs))
    for (prompt, max_tokens), result in zip(jobs, results):
        _check_against_single_instance(pd_pair, hf_router, prompt, max_tokens, result, 0)
    prefiller, decoder = pd_pair
    assert prefiller.alive() and decoder.alive()


def _decoder_counters(pd_pair) -> dict[str, float]:
    """The decoder's prefix-cache hit tokens, local (``prefix_cache_hit_tokens``) and loaded
    through the KV connector (``external_hit_tokens``), and its n-gram draft counters."""
    _, decoder = pd_pair
    text = decoder.metrics()
    counters = read_counters(text)
    counters["external_hit_tokens"] = sum(
        float(value)
        for value in re.findall(
            r"^vllm:external_prefix_cache_hits_total(?:{[^}]*})? (\S+)$", text, re.M
        )
    )
    return counters


def test_multi_turn_conversation_spliced_rows_equal_one_instance_and_hf(pd_pair, hf_router):
    """Three turns, each prompt the previous prompt, its answer and new tokens. From the
    second turn on the decoder hits its own prefix cache for the earlier turns' whole blocks
    (those it loaded and those it computed while decoding) and loads the rest of the new
    prompt's whole blocks from the prefiller; every turn's splice is byte-identical to one
    instance and to HF. The second turn asks the decoder from row 0: rows from its first
    computed token, none of the rows of its local hit."""
    # (new prompt tokens, max_tokens, decode_prompt_start, local hit, loaded) per turn:
    # turn 1 decodes 70 + 30 tokens, so the decoder computes block 2 (tokens 64-95) itself.
    turns = [(70, 30, None, 0, 64), (40, 12, 0, 96, 32), (30, 6, None, 128, 32)]
    prompt: list[int] = []
    for turn, (new_tokens, max_tokens, start, local_hit, loaded) in enumerate(turns):
        prompt = prompt + _prompt(400 + turn, new_tokens)
        before = _decoder_counters(pd_pair)
        result = _through_proxy(pd_pair, prompt, max_tokens, decode_prompt_start=start)
        _check_against_single_instance(pd_pair, hf_router, prompt, max_tokens, result, start)
        after = _decoder_counters(pd_pair)
        hits = {
            key: after[key] - before[key]
            for key in ("prefix_cache_hit_tokens", "external_hit_tokens")
        }
        assert hits == {"prefix_cache_hit_tokens": local_hit, "external_hit_tokens": loaded}, (
            f"turn {turn + 1}"
        )
        assert local_hit + loaded == _example_connector_hit(len(prompt))
        prompt = prompt + result.token_ids
    prefiller, decoder = pd_pair
    assert prefiller.alive() and decoder.alive()


def test_plain_request_on_the_decoder_recomputes_the_prefix_it_loaded(pd_pair, hf_router):
    """After a P/D request, the same prompt sent straight to the decoder as a plain request
    (no ``do_remote_prefill``), asked from row 0. The decoder's prefix cache holds the KV it
    loaded (64 tokens) and the ``ExampleConnector`` offers that KV again, but the decoder has
    none of those rows: under ``splice`` both hits are refused, so the request computes the
    whole prompt (no local nor external hit, every token through the model) and returns all
    its rows, equal to one instance and HF, and the decoder stays alive."""
    import openai

    prompt, max_tokens = _prompt(500, 70), 5
    result = _through_proxy(pd_pair, prompt, max_tokens)
    _check_against_single_instance(pd_pair, hf_router, prompt, max_tokens, result)
    prefiller, decoder = pd_pair
    client = openai.OpenAI(base_url=decoder.base_url + "/v1", api_key="unused", timeout=300)
    before = _decoder_counters(pd_pair)
    plain = complete(client, decoder.model, "plain", prompt, max_tokens)
    after = _decoder_counters(pd_pair)
    assert decoder.alive() and prefiller.alive()
    assert plain.cached_tokens == 0
    hits = {
        key: after[key] - before[key]
        for key in ("prefix_cache_hit_tokens", "external_hit_tokens", "model_tokens")
    }
    assert hits == {
        "prefix_cache_hit_tokens": 0,
        "external_hit_tokens": 0,
        "model_tokens": len(prompt) + max_tokens,
    }
    sequence = prompt + plain.output
    assert plain.output == result.token_ids
    assert plain.rows.shape == (len(sequence) - 1, *SHAPE)
    assert plain.rows.tobytes() == result.routed_experts.tobytes()  # = one instance's
    np.testing.assert_array_equal(plain.rows, hf_router.topk(sequence)[:-1])


# Runs last (see pd_pair): its pair replaces the plain one.
@pytest.mark.parametrize("pd_pair", [SPECULATIVE_CONFIG], indirect=True, ids=["ngram"])
def test_speculative_decoding_spliced_rows_equal_one_instance_and_hf(pd_pair, hf_router):
    """Both servers draft with n-grams. Repeating prompts make the decoder propose drafts it
    accepts and rejects; the splice is byte-identical to one instance serving the request
    with the same speculative config (the prefiller) and to HF, asked from the prefiller's
    last row and from row 0."""
    before = _decoder_counters(pd_pair)
    jobs = [([5, 6, 7, 8, 9] * 14, 40, None), ([11, 12, 13, 14] * 12, 30, 0)]
    for prompt, max_tokens, start in jobs:
        result = _through_proxy(pd_pair, prompt, max_tokens, decode_prompt_start=start)
        _check_against_single_instance(pd_pair, hf_router, prompt, max_tokens, result, start)
    after = _decoder_counters(pd_pair)
    drafted = after["spec_draft_tokens"] - before["spec_draft_tokens"]
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    assert 0 < accepted < drafted, (accepted, drafted)
    prefiller, decoder = pd_pair
    assert prefiller.alive() and decoder.alive()
