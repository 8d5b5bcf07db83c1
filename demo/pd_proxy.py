"""A reference P/D proxy for routed experts: prefill, then decode, then splice the rows.

For routers to copy. Standard library for HTTP (urllib), numpy, and
``r3capture.aux_output.pd.splice``. Both servers run ``vllm serve ...
--enable-return-routed-experts --aux-output-backend triton --aux-output-pd splice`` with a
P/D KV connector; each can return only the rows it computed, so the proxy:

1. sends the prompt to the prefiller with ``max_tokens=1`` (plus, for connectors that need
   them, the prefill-side ``kv_transfer_params``, e.g. ``NIXL_PREFILL_PARAMS``; the
   ``ExampleConnector`` needs none) and reads its rows ``[Np, L, K]``: one per prompt token
   it computed. ``Np`` is the prompt length, or less when the prefiller trims the prompt's
   last tokens (NIXL's prefill backoff) and the decoder computes them;
2. sends the same prompt to the decoder with the caller's ``max_tokens``,
   ``routed_experts_prompt_start=Np`` and the ``kv_transfer_params`` the prefiller
   answered with (``DECODE_LEG_PARAMS`` when it answered none, as the ``ExampleConnector``
   does: they mark the request as a decode leg), and reads its rows ``[Nd, L, K]`` (those
   from token ``Np`` on; with ``decode_prompt_start=0``, those from the first token the
   decoder computed, where a decoder under ``--aux-output-pd splice`` starts its rows);
3. splices: ``splice(prefill_rows, decode_rows, num_tokens)`` is ``[num_tokens - 1, L, K]``
   (``num_tokens``: the decoder's prompt plus output tokens), the rows one instance
   serving the whole request would return. It refuses, never pads.

    python demo/pd_proxy.py --prefill http://P:8100 --decode http://D:8200 --model M \
        --prompt "Hello" --max-tokens 16 [--kv-transfer nixl] [--decode-prompt-start 0] \
        [--out rows.npy]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from r3capture.aux_output.pd import splice

# What a NIXL prefill request carries: "the decoder will pull this KV". The prefiller's
# answer holds the decode-side parameters (its engine, blocks, host, port) to forward.
NIXL_PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
KV_TRANSFER_PRESETS = {"none": None, "nixl": NIXL_PREFILL_PARAMS}
# What the decode request carries when the prefiller answered no kv_transfer_params: it marks
# the request as a decode leg (its KV comes from a prefiller), so that a decoder under
# --aux-output-pd splice returns only the rows it computed. The ExampleConnector ignores it.
DECODE_LEG_PARAMS = {"do_remote_prefill": True}
# Set by the proxy on each leg; a caller's sampling params must not set them.
_PROXY_FIELDS = ("model", "prompt", "max_tokens", "stream", "n", "routed_experts_prompt_start",
                 "kv_transfer_params", "return_token_ids")  # fmt: skip


class PDProxyError(RuntimeError):
    """A server answered with an error or without what the splice needs."""


@dataclass
class PDResult:
    """One request served by a prefiller and a decoder.

    ``routed_experts`` is ``[len(prompt_token_ids) + len(token_ids) - 1, L, K]``
    (uint8 for <= 256 experts, else uint16); ``prefill_rows`` ``[Np, L, K]`` and
    ``decode_rows`` ``[Nd, L, K]`` are what each server returned.
    """

    text: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    routed_experts: np.ndarray
    prefill_rows: np.ndarray
    decode_rows: np.ndarray
    finish_reason: str | None
    decode_usage: dict | None  # the decoder's ``usage`` (its cached_tokens: the KV it loaded)


def decode_rows(encoded: str | None) -> np.ndarray | None:
    """A choice's ``routed_experts`` field (base64 of an ``.npy`` file) as ``[n, L, K]``."""
    if encoded is None:
        return None
    return np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False)


def post_json(url: str, body: dict, timeout: float) -> dict:
    """POST ``body`` as JSON; the JSON answer, or ``PDProxyError`` with the server's text."""
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as error:
        detail = error.read().decode(errors="replace")[:2000]
        raise PDProxyError(f"{url} answered {error.code}: {detail}") from None


def _only_choice(answer: dict, server: str) -> dict:
    choices = answer.get("choices") or []
    if len(choices) != 1:
        raise PDProxyError(f"the {server} answered {len(choices)} choices, expected 1")
    return choices[0]


def _rows_of(choice: dict, server: str) -> np.ndarray | None:
    rows = decode_rows(choice.get("routed_experts"))
    if rows is not None and rows.ndim != 3:
        raise PDProxyError(f"the {server}'s routed_experts has shape {rows.shape}, not [n, L, K]")
    return rows


def pd_complete(
    prefill_url: str,
    decode_url: str,
    model: str,
    prompt: str | list[int],
    *,
    max_tokens: int,
    sampling: dict[str, Any] | None = None,
    prefill_kv_transfer_params: dict[str, Any] | None = None,
    decode_prompt_start: int | None = None,
    timeout: float = 300.0,
) -> PDResult:
    """Serve one completion through a prefiller and a decoder; return text, tokens and the
    spliced routed experts (see the module docstring for the three steps).

    ``prompt``: text or token ids. ``sampling``: other completion fields, passed to both
    servers (``temperature``, ``seed``, ``ignore_eos``, ...; not ``n`` or ``stream``).
    ``prefill_kv_transfer_params``: what the connector needs on the prefill request (None
    for the ``ExampleConnector``). ``decode_prompt_start``: the decoder's
    ``routed_experts_prompt_start`` (default: the prefiller's row count ``Np``; ``0`` asks a
    decoder under ``--aux-output-pd splice`` for every row it computed, and the splice joins
    by length either way). Raises ``PDProxyError`` when a server fails or omits its rows or
    token ids, ``ValueError`` (from ``splice``) when the rows do not join.
    """
    sampling = dict(sampling or {})
    clash = sorted(set(sampling) & set(_PROXY_FIELDS))
    if clash:
        raise ValueError(f"sampling must not set {clash}: the proxy sets them on each leg")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if decode_prompt_start is not None and (
        isinstance(decode_prompt_start, bool)
        or not isinstance(decode_prompt_start, int)
        or decode_prompt_start < 0
    ):
        raise ValueError(f"decode_prompt_start must be an int >= 0, got {decode_prompt_start!r}")
    common = {"model": model, "prompt": prompt, "stream": False, "return_token_ids": True}

    # 1. Prefill: the prompt's KV (and its rows) only. min_tokens would contradict max_tokens=1.
    prefill_sampling = {k: v for k, v in sampling.items() if k != "min_tokens"}
    prefill_body = {**prefill_sampling, **common, "max_tokens": 1}
    if prefill_kv_transfer_params is not None:
        prefill_body["kv_transfer_params"] = prefill_kv_transfer_params
    prefill = post_json(f"{prefill_url}/v1/completions", prefill_body, timeout)
    prefill_rows = _rows_of(_only_choice(prefill, "prefiller"), "prefiller")
    if prefill_rows is None:
        raise PDProxyError(
            "the prefiller returned no routed_experts: is it serving with "
            "--enable-return-routed-experts?"
        )

    # 2. Decode from where the prefiller's rows end (or from where the decoder's own begin).
    decode_body = {
        **sampling,
        **common,
        "max_tokens": max_tokens,
        "routed_experts_prompt_start": (
            len(prefill_rows) if decode_prompt_start is None else decode_prompt_start
        ),
        "kv_transfer_params": prefill.get("kv_transfer_params") or DECODE_LEG_PARAMS,
    }
    decode = post_json(f"{decode_url}/v1/completions", decode_body, timeout)
    choice = _only_choice(decode, "decoder")
    prompt_ids, output_ids = choice.get("prompt_token_ids"), choice.get("token_ids")
    if prompt_ids is None or output_ids is None:
        raise PDProxyError("the decoder returned no token ids (return_token_ids)")
    num_tokens = len(prompt_ids) + len(output_ids)
    rows = _rows_of(choice, "decoder")
    if rows is None and num_tokens - 1 == len(prefill_rows):
        rows = prefill_rows[:0]  # nothing past the prefiller's rows: no decode rows are owed
    if rows is None:
        raise PDProxyError("the decoder returned no routed_experts")

    # 3. Splice.
    return PDResult(
        text=choice.get("text") or "",
        prompt_token_ids=list(prompt_ids),
        token_ids=list(output_ids),
        routed_experts=splice(prefill_rows, rows, num_tokens),
        prefill_rows=prefill_rows,
        decode_rows=rows,
        finish_reason=choice.get("finish_reason"),
        decode_usage=decode.get("usage"),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", required=True, help="prefiller base URL (http://host:port)")
    parser.add_argument("--decode", required=True, help="decoder base URL")
    parser.add_argument("--model", required=True)
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompt-ids", help="prompt token ids, comma-separated")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument(
        "--sampling", default="{}", help="other fields as JSON, e.g. '{\"temperature\": 0}'"
    )
    parser.add_argument(
        "--kv-transfer",
        choices=sorted(KV_TRANSFER_PRESETS),
        default="none",
        help="prefill-side kv_transfer_params: none (ExampleConnector) or nixl",
    )
    parser.add_argument(
        "--decode-prompt-start",
        type=int,
        default=None,
        help="the decoder's routed_experts_prompt_start (default: the prefiller's row count; "
        "0: every row the decoder computed, with --aux-output-pd splice on the decoder)",
    )
    parser.add_argument("--out", type=Path, help="write the spliced rows here (.npy)")
    args = parser.parse_args(argv)
    prompt_value = (
        args.prompt if args.prompt is not None else [int(t) for t in args.prompt_ids.split(",")]
    )
    result = pd_complete(
        args.prefill.rstrip("/"),
        args.decode.rstrip("/"),
        args.model,
        prompt_value,
        max_tokens=args.max_tokens,
        sampling=json.loads(args.sampling),
        prefill_kv_transfer_params=KV_TRANSFER_PRESETS[args.kv_transfer],
        decode_prompt_start=args.decode_prompt_start,
    )
    if args.out is not None:
        np.save(args.out, result.routed_experts)
    summary = {
        "text": result.text,
        "token_ids": result.token_ids,
        "routed_experts": {
            "shape": list(result.routed_experts.shape),
            "dtype": str(result.routed_experts.dtype),
            "prefill_rows": len(result.prefill_rows),
            "decode_rows": len(result.decode_rows),
        },
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
