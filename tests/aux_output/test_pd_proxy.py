"""The reference P/D proxy (demo/pd_proxy.py) against stand-in servers on 127.0.0.1.

Each stand-in answers ``/v1/completions`` from a "single instance" truth: the prefiller
returns the rows of the prompt tokens it computed, the decoder the rows from
``routed_experts_prompt_start`` on; the proxy's splice must give back the truth, byte for
byte, and every request body must be what a P/D pair needs.
"""

from __future__ import annotations

import base64
import io
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from demo import pd_proxy
from demo.pd_proxy import NIXL_PREFILL_PARAMS, PDProxyError, pd_complete

L, K = 2, 2


def encode(rows: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, rows, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode()


class StandIn:
    """One stand-in server: ``answer(body) -> (status, json)``; keeps every request body."""

    def __init__(self, answer):
        self.answer = answer
        self.bodies: list[dict] = []
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stand_in.bodies.append({"path": self.path, **body})
                status, answer = stand_in.answer(body)
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stand_ins():
    made = []

    def make(answer):
        made.append(StandIn(answer))
        return made[-1]

    yield make
    for server in made:
        server.close()


def completion(prompt_ids, output_ids, rows, kv=None, text=""):
    choice = {
        "text": text,
        "prompt_token_ids": prompt_ids,
        "token_ids": output_ids,
        "finish_reason": "length",
        "routed_experts": None if rows is None else encode(rows),
    }
    return {"choices": [choice], "kv_transfer_params": kv}


def pair(stand_ins, prompt_ids, output_ids, *, backoff=0, dtype=np.uint8, decoder_rows=None):
    """A prefiller (trims ``backoff`` prompt tokens, like NIXL) and a decoder of one truth."""
    num_tokens = len(prompt_ids) + len(output_ids)
    truth = np.random.default_rng(num_tokens).integers(0, 8, (num_tokens - 1, L, K)).astype(dtype)

    def prefill(body):
        computed = len(prompt_ids) - backoff
        kv = {"remote_engine_id": "P", "remote_block_ids": [1, 2]}
        return 200, completion(prompt_ids[:computed], output_ids[:1], truth[:computed], kv)

    def decode(body):
        start = body["routed_experts_prompt_start"]
        rows = truth[start:] if decoder_rows is None else decoder_rows(truth, start)
        return 200, completion(prompt_ids, output_ids, rows, text="decoded")

    return stand_ins(prefill), stand_ins(decode), truth


@pytest.mark.parametrize("prompt_kind", ["ids", "text"])
def test_spliced_rows_equal_the_single_instance_rows(stand_ins, prompt_kind):
    prompt_ids, output_ids = list(range(3, 73)), [9, 8, 7, 6, 5, 4, 3]
    prefiller, decoder, truth = pair(stand_ins, prompt_ids, output_ids)
    prompt = prompt_ids if prompt_kind == "ids" else "some text"
    result = pd_complete(
        prefiller.url, decoder.url, "m", prompt, max_tokens=7,
        sampling={"temperature": 0, "ignore_eos": True, "min_tokens": 7},
    )  # fmt: skip
    assert result.routed_experts.dtype == np.uint8 and result.routed_experts.shape == (76, L, K)
    assert result.routed_experts.tobytes() == truth.tobytes()
    assert result.text == "decoded" and result.token_ids == output_ids
    assert result.prompt_token_ids == prompt_ids
    assert (len(result.prefill_rows), len(result.decode_rows)) == (70, 6)

    (prefill_body,) = prefiller.bodies
    assert prefill_body["path"] == "/v1/completions" and prefill_body["prompt"] == prompt
    assert prefill_body["max_tokens"] == 1 and "min_tokens" not in prefill_body
    assert "routed_experts_prompt_start" not in prefill_body
    assert "kv_transfer_params" not in prefill_body  # ExampleConnector: none
    (decode_body,) = decoder.bodies
    assert decode_body["prompt"] == prompt and decode_body["max_tokens"] == 7
    assert decode_body["routed_experts_prompt_start"] == 70 and decode_body["min_tokens"] == 7
    assert decode_body["kv_transfer_params"] == {
        "remote_engine_id": "P",
        "remote_block_ids": [1, 2],
    }
    for body in (prefill_body, decode_body):
        assert body["temperature"] == 0 and body["return_token_ids"] is True
        assert body["stream"] is False


def test_a_trimmed_prefill_is_completed_by_the_decoder(stand_ins):
    """NIXL's prefill backoff: the prefiller computes 3 prompt tokens fewer; the decoder is
    asked for rows from where the prefiller's end, and the splice is still the truth."""
    prompt_ids, output_ids = list(range(3, 43)), [5, 6, 7, 8]
    prefiller, decoder, truth = pair(stand_ins, prompt_ids, output_ids, backoff=3, dtype=np.uint16)
    result = pd_complete(
        prefiller.url, decoder.url, "m", prompt_ids, max_tokens=4,
        prefill_kv_transfer_params=NIXL_PREFILL_PARAMS,
    )  # fmt: skip
    assert prefiller.bodies[0]["kv_transfer_params"] == NIXL_PREFILL_PARAMS
    assert decoder.bodies[0]["routed_experts_prompt_start"] == 37
    assert result.routed_experts.dtype == np.uint16
    assert result.routed_experts.tobytes() == truth.tobytes()


def test_a_prefiller_without_kv_transfer_params_gets_the_decode_leg_marked(stand_ins):
    """The ExampleConnector's prefiller answers no kv_transfer_params: the decode request
    carries ``{"do_remote_prefill": true}``, so a decoder under splice knows its KV came from
    a prefiller; a decoder asked from row 0 answers from its first computed row (64 here),
    and the splice joins by length."""
    prompt_ids, output_ids = list(range(3, 73)), [9, 8, 7]
    num_tokens = len(prompt_ids) + len(output_ids)
    truth = np.random.default_rng(1).integers(0, 8, (num_tokens - 1, L, K)).astype(np.uint8)
    prefiller = stand_ins(lambda body: (200, completion(prompt_ids, [9], truth[:70])))
    decoder = stand_ins(
        lambda body: (200, completion(prompt_ids, output_ids, truth[max(64, body[
            "routed_experts_prompt_start"]):]))
    )  # fmt: skip
    for start, num_decode in ((None, 2), (0, 8)):
        result = pd_complete(
            prefiller.url, decoder.url, "m", prompt_ids, max_tokens=3, decode_prompt_start=start
        )
        assert result.routed_experts.tobytes() == truth.tobytes()
        assert len(result.decode_rows) == num_decode
    first, second = decoder.bodies
    assert (
        first["kv_transfer_params"] == second["kv_transfer_params"] == {"do_remote_prefill": True}
    )
    assert (first["routed_experts_prompt_start"], second["routed_experts_prompt_start"]) == (70, 0)
    for bad in (-1, 1.5, True, "0"):
        with pytest.raises(ValueError, match="decode_prompt_start must be an int >= 0"):
            pd_complete(prefiller.url, decoder.url, "m", [3], max_tokens=2, decode_prompt_start=bad)


def test_one_output_token_needs_no_decode_rows(stand_ins):
    prompt_ids = list(range(3, 20))
    prefiller, decoder, truth = pair(stand_ins, prompt_ids, [4], decoder_rows=lambda t, s: None)
    result = pd_complete(prefiller.url, decoder.url, "m", prompt_ids, max_tokens=1)
    assert result.routed_experts.tobytes() == truth.tobytes() and len(result.decode_rows) == 0


def test_a_decoder_short_of_rows_is_refused_not_padded(stand_ins):
    """A decoder that returns its rows from a later token than asked leaves a gap."""
    prompt_ids = list(range(3, 40))
    prefiller, decoder, _ = pair(
        stand_ins, prompt_ids, [4, 5, 6, 7], decoder_rows=lambda truth, start: truth[start + 2 :]
    )
    with pytest.raises(ValueError, match="prefill_rows has 37 rows, short of the 39"):
        pd_complete(prefiller.url, decoder.url, "m", prompt_ids, max_tokens=4)


def test_missing_rows_fail_closed(stand_ins):
    prompt_ids = list(range(3, 20))
    no_rows = stand_ins(lambda body: (200, completion(prompt_ids, [4], None)))
    prefiller, decoder, _ = pair(stand_ins, prompt_ids, [4, 5], decoder_rows=lambda t, s: None)
    with pytest.raises(PDProxyError, match="prefiller returned no routed_experts"):
        pd_complete(no_rows.url, decoder.url, "m", prompt_ids, max_tokens=2)
    assert decoder.bodies == []  # nothing is decoded without the prefiller's rows
    with pytest.raises(PDProxyError, match="decoder returned no routed_experts"):
        pd_complete(prefiller.url, decoder.url, "m", prompt_ids, max_tokens=2)


def test_server_errors_and_bad_arguments_are_reported(stand_ins):
    failing = stand_ins(lambda body: (400, {"error": {"message": "prompt_start out of range"}}))
    with pytest.raises(PDProxyError, match="answered 400: .*prompt_start out of range"):
        pd_complete(failing.url, failing.url, "m", [3, 4], max_tokens=2)
    with pytest.raises(ValueError, match=r"sampling must not set \['n', 'stream'\]"):
        pd_complete(
            failing.url, failing.url, "m", [3], max_tokens=2, sampling={"n": 2, "stream": 1}
        )
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        pd_complete(failing.url, failing.url, "m", [3], max_tokens=0)
    two = stand_ins(lambda body: (200, {"choices": [{}, {}]}))
    with pytest.raises(PDProxyError, match="answered 2 choices, expected 1"):
        pd_complete(two.url, two.url, "m", [3], max_tokens=2)


def test_command_line_writes_the_spliced_rows(stand_ins, tmp_path, capsys):
    prompt_ids, output_ids = list(range(3, 13)), [4, 5, 6]
    prefiller, decoder, truth = pair(stand_ins, prompt_ids, output_ids)
    out = tmp_path / "rows.npy"
    argv = ["--prefill", prefiller.url + "/", "--decode", decoder.url, "--model", "m",
            "--prompt-ids", ",".join(map(str, prompt_ids)), "--max-tokens", "3",
            "--sampling", '{"temperature": 0}', "--out", str(out)]  # fmt: skip
    assert pd_proxy.main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["token_ids"] == output_ids
    assert summary["routed_experts"] == {
        "shape": [12, L, K], "dtype": "uint8", "prefill_rows": 10, "decode_rows": 2,
    }  # fmt: skip
    assert np.load(out).tobytes() == truth.tobytes()
