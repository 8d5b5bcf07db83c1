"""The host-step benchmark's recording, replay, stand-ins and ratio gate.

A simulator run is recorded (``sim/recording.py``); replaying the recording through vLLM
0.33.0's worker connector and through r3capture's must reproduce the simulator's outputs
step for step; the kernel stand-in must keep r3capture's kernel out of the timed calls.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
import torch

from bench import stand_ins
from bench.host_step_families import FAMILIES
from bench.host_step_replay import CALLS, KINDS, replay, step_kinds
from bench.stand_ins import FreeParts, KernelStandIn, SnapshotStandIn, kernel_binding
from r3capture.aux_output import step_launcher, worker
from sim import make_trace, run_trace, vllm_scheduler
from sim.recording import PREPARE, Recording, record_trace

pytest.importorskip("vllm.distributed.aux_output_connector.worker")

PROVIDERS = ("vllm-0.33.0", "r3capture")


@pytest.mark.parametrize("scenario", ["async_spec", "reset", "shared_prefix"])
def test_replay_reproduces_the_simulator(scenario, tmp_path):
    """Async depth 2 with drafts, prefix-cache resets, same-step prefix hits: both
    connectors' replays give the simulator's outputs, also from a saved recording."""
    trace = make_trace(scenario, seed=0)
    recording = record_trace(trace, tmp_path / "rec")
    assert recording.error is None and "engine_error" not in recording.info
    sim = run_trace(trace, scheduler_factory=vllm_scheduler)
    assert recording.num_steps == sim.stats.steps
    assert len(recording.digests) == len(sim.steps) > 0
    loaded = Recording.load(tmp_path / "rec")
    assert np.array_equal(np.asarray(loaded.rows), np.asarray(recording.rows))
    for provider in PROVIDERS:
        with KernelStandIn() as exclusion:
            times = replay(loaded, provider, exclusion=exclusion)
        assert times.error is None, times.error
        assert times.digests == recording.digests, provider
        assert times.calls.shape == (len(CALLS), recording.num_steps, 2)
        assert (times.calls >= 0).all()
        assert times.launches == sum(1 for e in recording.events if e[0] == PREPARE)
        if provider == "vllm-0.33.0":
            assert times.background.sum() > 0  # the store writer's CPU time was read


def test_the_shadow_makes_every_call_just_before_the_timed_one(monkeypatch):
    """With ``shadow``, the other connector makes each recorded call untimed, right before
    the timed connector's (both from fresh state); the timed outputs are the simulator's
    and the shadow's own time lands in no timed call (here a 50 ms sleep in each of its
    begin_steps)."""
    import time as clock

    from sim.workers import make_vllm_worker

    trace = make_trace("async_spec", seed=0)
    recording = record_trace(trace)
    order = []
    shadowed = {"name": None}
    slow_ns = 50_000_000
    vllm_class = type(make_vllm_worker(recording.sizing).worker)
    pairs = (
        (worker.TritonAuxOutputWorker, "r3capture"),
        (vllm_class, "vllm-0.33.0"),
    )
    for cls, name in pairs:
        original = cls.begin_step

        def begin_step(self, metadata, original=original, name=name):
            order.append(name)
            if name == shadowed["name"]:
                clock.sleep(slow_ns / 1e9)
            return original(self, metadata)

        monkeypatch.setattr(cls, "begin_step", begin_step)
    begins = sum(1 for e in recording.events if e[0] == "begin_step")
    for timed in PROVIDERS:
        (shadowed["name"],) = [p for p in PROVIDERS if p != timed]
        order.clear()
        with KernelStandIn() as exclusion:
            times = replay(recording, timed, exclusion=exclusion, shadow=True)
        assert times.error is None and times.digests == recording.digests, timed
        assert order == [shadowed["name"], timed] * begins
        assert times.calls[CALLS.index("begin_step"), :, 0].max() < slow_ns // 5


def test_recorded_request_indices_are_the_simulators_and_the_replay_hands_them_back():
    """The request indices (MRV2's ``idx_mapping``) the simulator gave each batch are
    recorded and every replayed batch carries them again, on the host and as an int64
    tensor; the trace gives one finished request's index to a new one while its step is in
    flight, and both connectors still reproduce the outputs."""
    import torch

    from bench.host_step_replay import _build_inputs
    from sim.recording import vllm_metadata_types
    from sim.workers import WorkerHandle, make_vllm_worker

    handed: list[list[int]] = []

    def factory(sizes):
        inner = make_vllm_worker(sizes)

        def prepare(batch, num_rejected):
            assert torch.equal(batch.idx_mapping, torch.from_numpy(batch.idx_mapping_np))
            handed.append(batch.idx_mapping_np.tolist())
            return inner.prepare_output(batch, num_rejected)

        return WorkerHandle("indices", inner.worker, inner.capture_buffer, prepare, lambda: 0)

    trace = make_trace("finish_in_flight", seed=3)
    recording = record_trace(trace, worker_factory=factory)
    assert recording.error is None and "engine_error" not in recording.info
    calls = {e[1]: e[2] for e in recording.events if e[0] == PREPARE}
    assert [calls[step].idx_mapping.tolist() for step in sorted(calls)] == handed
    # Some index serves two requests over the trace.
    owners: dict[int, set[str]] = {}
    for call in calls.values():
        for req_id, index in zip(call.req_ids, call.idx_mapping.tolist()):
            owners.setdefault(index, set()).add(req_id)
    assert max(len(ids) for ids in owners.values()) > 1
    batches = _build_inputs(recording, vllm_metadata_types()).batches
    assert sorted(batches) == sorted(calls)
    for step, batch in batches.items():
        assert batch.idx_mapping_np.tolist() == calls[step].idx_mapping.tolist()
        assert batch.idx_mapping.dtype == torch.int64
        assert batch.idx_mapping.tolist() == calls[step].idx_mapping.tolist()
    for provider in PROVIDERS:
        with KernelStandIn() as exclusion:
            times = replay(recording, provider, exclusion=exclusion)
        assert times.error is None, times.error
        assert times.digests == recording.digests, provider


def test_replayed_batches_carry_the_simulators_draft_counts():
    """Each replayed batch's ``num_draft_tokens``, worked out from the recording, is the
    one the simulator's batch carried (MRV2's: the step's drafts); the trace has steps with
    drafts and steps without."""
    from bench.host_step_replay import _build_inputs
    from sim.recording import vllm_metadata_types
    from sim.workers import WorkerHandle, make_vllm_worker

    handed: list[int] = []

    def factory(sizes):
        inner = make_vllm_worker(sizes)

        def prepare(batch, num_rejected):
            handed.append(batch.num_draft_tokens)
            return inner.prepare_output(batch, num_rejected)

        return WorkerHandle("drafts", inner.worker, inner.capture_buffer, prepare, lambda: 0)

    recording = record_trace(make_trace("async_spec", seed=0), worker_factory=factory)
    assert recording.error is None and "engine_error" not in recording.info
    batches = _build_inputs(recording, vllm_metadata_types()).batches
    assert [batches[step].num_draft_tokens for step in sorted(batches)] == handed
    assert 0 in handed and max(handed) > 0


def test_replay_reports_a_broken_connector_as_different_digests(monkeypatch):
    """A connector whose rows are wrong must not match the recording (the ratio gate)."""
    from vllm.distributed.aux_output_connector import worker as vllm_worker

    recording = record_trace(make_trace("spec_decode", seed=0))
    original = vllm_worker.PendingAuxOutput.enqueue_cpu_copy

    def flip(self, num_sampled, num_rejected):
        original(self, num_sampled, num_rejected)
        self.routed_experts = self.routed_experts.copy()
        self.routed_experts[..., 0] ^= 1

    monkeypatch.setattr(vllm_worker.PendingAuxOutput, "enqueue_cpu_copy", flip)
    times = replay(recording, "vllm-0.33.0")
    assert times.digests != recording.digests


def _slow(function, slow_ns):
    def slow(*args, **kwargs):
        end = time.thread_time_ns() + slow_ns
        while time.thread_time_ns() < end:
            pass
        return function(*args, **kwargs)

    return slow


def _slow_kernel_replay_inputs(monkeypatch, slow_ns):
    """The spec_decode recording, its forward steps, and a list that counts the launches of
    the kernel's CPU emulation, made to cost ``slow_ns`` of CPU per launch."""
    recording = record_trace(make_trace("spec_decode", seed=0))
    module, attr = kernel_binding()
    launched = []
    slow = _slow(getattr(module, attr), slow_ns)

    def slow_kernel(*args, **kwargs):
        launched.append(1)
        return slow(*args, **kwargs)

    monkeypatch.setattr(module, attr, slow_kernel)
    forward = [e[1] for e in recording.events if e[0] == PREPARE]
    return recording, forward, launched


def test_kernel_stand_in_binds_the_kernel_the_worker_launches():
    """The stand-in wraps the CPU emulation of the kernel r3capture's worker launches
    (``GatherAllocLaunch``'s torch reference), not that of another kernel."""
    from r3capture.kernels import alloc_reference

    module, attr = kernel_binding()
    assert module is alloc_reference
    assert getattr(module, attr) is alloc_reference.gather_alloc_reference_checked


def test_kernel_stand_in_excludes_the_device_work(monkeypatch):
    """A deliberately slow kernel (50 ms of CPU per launch) shows up in r3capture's
    prepare_output without the stand-in and not with it; one launch per forward step."""
    slow_ns = 50_000_000
    recording, forward, launched = _slow_kernel_replay_inputs(monkeypatch, slow_ns)
    module, attr = kernel_binding()
    slow_kernel = getattr(module, attr)
    prepare = CALLS.index("prepare_output")

    plain = replay(recording, "r3capture")
    assert plain.digests == recording.digests
    assert (plain.calls[prepare, forward, 1] >= slow_ns).all()
    assert len(launched) == len(forward)

    with KernelStandIn() as exclusion:
        excluded = replay(recording, "r3capture", exclusion=exclusion)
        assert getattr(module, attr) is not slow_kernel
    assert getattr(module, attr) is slow_kernel
    assert excluded.digests == recording.digests
    assert excluded.launches == len(forward)
    assert len(launched) == 2 * len(forward)  # the stand-in still runs the kernel
    assert excluded.excluded_cpu_ns >= slow_ns * len(forward)
    main = excluded.calls[:3, :, :].sum(axis=0)  # [steps, (wall, cpu)]
    assert (main[:, 1] < slow_ns // 5).all(), main[:, 1].max()
    assert np.median(main[:, 0]) < slow_ns // 5


def test_deferred_kernel_runs_outside_every_call_and_keeps_the_outputs(monkeypatch):
    """``KernelStandIn(defer=True)``: a slow kernel (50 ms of CPU per launch) runs where the
    host would wait for the device, in no timed call, every launch exactly once, and the
    outputs stay the simulator's (the rows are read before the next step replaces them)."""
    slow_ns = 50_000_000
    recording, forward, launched = _slow_kernel_replay_inputs(monkeypatch, slow_ns)
    with KernelStandIn(defer=True) as exclusion:
        deferred = replay(recording, "r3capture", exclusion=exclusion)
    assert deferred.digests == recording.digests
    assert deferred.launches == len(launched) == len(forward)
    assert deferred.excluded_cpu_ns >= slow_ns * len(forward)
    assert (deferred.calls[:, :, 1] < slow_ns // 5).all(), deferred.calls[:, :, 1].max()


def test_deferred_kernel_keeps_the_launchers_arguments_until_settled():
    """Under ``defer`` the stand-in keeps the launcher's own dict of arguments, no copy (a
    copy costs the timed call what no GPU launch does); a next launch with that dict still
    pending is refused rather than emulated later on the next step's values."""
    module, attr = kernel_binding()
    args = {"query_start_loc": None}
    with KernelStandIn(defer=True) as exclusion:
        kernel = getattr(module, attr)
        kernel(args, "static", "shape")
        (pending,) = exclusion._deferred
        assert pending[1][0] is args and pending[1][1:] == ("static", "shape")
        with pytest.raises(RuntimeError, match="not settled before the next launch"):
            kernel(args, "static", "shape")
        assert exclusion.launches == 2 and len(exclusion._deferred) == 1
        exclusion._deferred.clear()  # placeholders: nothing to emulate at exit
        kernel({"query_start_loc": None}, "static", "shape")  # another dict: no conflict
        assert len(exclusion._deferred) == 1
        exclusion._deferred.clear()


def test_deferred_kernel_settles_before_the_device_side_waits(monkeypatch):
    """A store replacing its arena waits for the device (``DeviceSide.wait_idle``): under
    ``defer`` the launches not yet run run first; the method is restored on exit."""
    from r3capture.aux_output.device_side import DeviceSide

    original = DeviceSide.wait_idle
    ran = []
    side = type("Side", (), {"device": torch.device("cpu")})()
    with KernelStandIn(defer=True) as exclusion:
        exclusion._deferred.append((ran.append, ("launch",), {}))
        DeviceSide.wait_idle(side)
        assert ran == ["launch"]
    assert DeviceSide.wait_idle is original


def test_free_parts_take_their_whole_time_out_of_the_calls(monkeypatch):
    """A what-if run: the input checks made slow (5 ms of CPU per call) show in every
    main-thread call that runs them without ``FreeParts`` and in none with it; the outputs
    stay the simulator's and every wrapped name is restored afterwards. The host counts'
    check runs in ``process_output`` (the output thread), not in the main thread's
    ``enqueue_cpu_copy``, and is not one of the main thread's input checks."""
    recording = record_trace(make_trace("spec_decode", seed=0))
    slow_ns = 5_000_000
    slowed = [
        (worker, "checked_emit_starts"),
        (step_launcher, "checked_batch_arrays"),
        (worker, "check_host_counts"),
    ]
    for owner, attr in slowed:
        monkeypatch.setattr(owner, attr, _slow(getattr(owner, attr), slow_ns))
    slow_functions = [getattr(owner, attr) for owner, attr in slowed]
    forward = [e[1] for e in recording.events if e[0] == PREPARE]
    begin, prepare, enqueue, process = (CALLS.index(c) for c in CALLS[:4])

    with KernelStandIn() as exclusion:
        plain = replay(recording, "r3capture", exclusion=exclusion)
        with FreeParts(exclusion, ["input-checks"]):
            free = replay(recording, "r3capture", exclusion=exclusion)
    assert [getattr(owner, attr) for owner, attr in slowed] == slow_functions
    assert plain.digests == free.digests == recording.digests
    for call in (begin, prepare):
        assert (plain.calls[call, forward, 1] >= slow_ns).all(), CALLS[call]
    assert (plain.calls[enqueue, forward, 1] < slow_ns // 5).all()
    assert (plain.calls[process, forward, 1] >= 2 * slow_ns).all()
    # Two slowed checks a step (10 ms) are out; what stays is the worker's own work, far
    # below half of one even on a loaded VM (up to 1.1 ms a step seen there).
    main = free.calls[:3, :, 1].sum(axis=0)
    assert (main < slow_ns // 2).all(), main.max()
    assert (free.calls[process, forward, 1] >= 2 * slow_ns).all()
    assert free.excluded_cpu_ns >= 2 * slow_ns * len(forward)


def test_publication_counted_free_leaves_the_outputs_and_takes_its_time_out(monkeypatch):
    """``--free publication``: keys, binding, pins and teardown still run (later prefix hits
    read what they bound), their time is excluded from the calls that made them (here each
    store call made 2 ms slower: every process_output that binds pays it, unless free)."""
    from r3capture.aux_output.publisher import Publisher

    recording = record_trace(make_trace("multi_turn", seed=0))
    slow_ns = 2_000_000
    flushes = []
    slow_flush = _slow(Publisher.flush, slow_ns)

    def flush(self):
        flushes.append(len(self._queued))
        return slow_flush(self)

    monkeypatch.setattr(Publisher, "flush", flush)
    process = CALLS.index("process_output")
    with KernelStandIn() as exclusion:
        plain = replay(recording, "r3capture", exclusion=exclusion)
        binding = len(flushes) - flushes.count(0)
        with FreeParts(exclusion, ["publication"]):
            free = replay(recording, "r3capture", exclusion=exclusion)
    assert Publisher.flush is flush  # restored
    assert plain.digests == free.digests == recording.digests
    assert binding > 10
    spent = plain.calls[process, :, 1].sum() - free.calls[process, :, 1].sum()
    assert spent >= binding * slow_ns * 0.9, (spent, binding)


def test_free_parts_refuses_an_unknown_part(capsys):
    # slot-planning named host work that no longer exists (the kernel takes the slots).
    for gone in ("slot-taking", "slot-planning"):
        with KernelStandIn() as exclusion, pytest.raises(ValueError, match=gone):
            FreeParts(exclusion, [gone])
    from bench.host_step_bench import main

    with pytest.raises(SystemExit) as exited:
        main(["--free", "slot-planning", "--families", "decode-1"])
    assert exited.value.code == 2
    assert "slot-planning" in capsys.readouterr().err


def test_models_beyond_the_headline_two_are_accepted_and_unknown_ones_refused(capsys):
    from bench.host_step_bench import KNOWN_MODELS, MODELS, main
    from bench.models import MODELS as SHAPES

    assert set(MODELS) < set(KNOWN_MODELS) == {shape.name for shape in SHAPES}
    with pytest.raises(SystemExit) as exited:
        main(["--models", "Mixtral-8x7B,Mixtral-8x22B", "--families", "decode-1"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "Mixtral-8x22B" in err and "'Mixtral-8x7B'" not in err.split("unknown")[-1]


def test_max_num_seqs_replaces_the_familys_and_keys_the_recording(tmp_path, capsys):
    from bench.host_step_bench import main
    from bench.host_step_replay import family_trace, recording_dir

    own = family_trace("decode-8", "Qwen3-30B-A3B", 2, 0)
    wide = family_trace("decode-8", "Qwen3-30B-A3B", 2, 0, max_num_seqs=1024)
    assert own.config.max_num_seqs == 8 and wide.config.max_num_seqs == 1024
    assert wide.with_config(max_num_seqs=8) == own  # nothing else changes
    args = (tmp_path, "decode-8", "Qwen3-30B-A3B", 2, 0)
    assert recording_dir(*args) != recording_dir(*args, 1024)
    with pytest.raises(SystemExit) as exited:
        main(["--max-num-seqs", "0", "--families", "decode-1"])
    assert exited.value.code == 2
    assert "--max-num-seqs must be >= 1" in capsys.readouterr().err


def test_snapshot_stand_in_returns_the_staged_cast_for_one_launch_each_way(monkeypatch):
    import torch

    capturer = type("C", (), {})()
    capturer.shape_per_token = (2, 3)
    capturer.output_dtype_name = "uint8"
    capturer.output_dtype = torch.uint8
    capturer.device_buffer = torch.arange(4 * 6, dtype=torch.int32).reshape(4, 2, 3)
    snapshot = SnapshotStandIn(capturer)
    with pytest.raises(RuntimeError, match="no snapshot of 3 rows"):
        snapshot.snapshot_routing_data(3)
    snapshot.stage(3)
    calls = []
    monkeypatch.setattr(stand_ins, "launch_stand_in", lambda: calls.append("launch"))
    on_device = snapshot.snapshot_routing_data(3)
    assert calls == ["launch"] and snapshot.launches == 1
    # vLLM's enqueue_cpu_copy: the device-to-host copy costs a launch too.
    out = on_device.to("cpu", non_blocking=True)
    assert calls == ["launch", "launch"]
    assert out.dtype == torch.uint8 and torch.equal(out, capturer.device_buffer[:3].to(torch.uint8))


def test_step_kinds():
    spec = record_trace(make_trace("spec_decode", seed=0))
    kinds = step_kinds(spec)
    assert len(kinds) == spec.num_steps and set(kinds) <= set(KINDS)
    assert "spec-decode" in kinds
    hits = record_trace(make_trace("shared_prefix", seed=0))
    assert "prefix-hit" in step_kinds(hits)


def test_families_build():
    """Every family builds for both model shapes and both depths (no simulation)."""
    from bench.models import KIMI_K2, QWEN3_30B_A3B

    for family in FAMILIES.values():
        for model in (QWEN3_30B_A3B, KIMI_K2):
            for depth in (1, 2):
                trace = family.build(model, depth, 0)
                assert trace.config.max_concurrent_batches == depth
                assert trace.config.hash_block_size == 16
                assert trace.model.num_layers == model.num_layers
                assert trace.model.dtype == model.np_dtype
                assert trace == family.build(model, depth, 0)  # deterministic


def test_agentic_turns_mostly_ask_for_their_new_rows():
    """The agentic family: multi-turn conversations with tool outputs of 20-500 tokens, most
    turns asking only for the rows they add (``routed_experts_prompt_start`` at the prompt's
    end or at the new tool output's start), 4-8 turns each."""
    from bench.models import QWEN3_30B_A3B

    trace = FAMILIES["agentic"].build(QWEN3_30B_A3B, 2, 0)
    requests = {r.req_id: r for r in trace.requests}
    at_end = inside = whole = 0
    turns: dict[str, int] = {}
    for r in trace.requests:
        if r.prompt_start == len(r.prompt):
            at_end += 1
        elif r.prompt_start > 0:
            inside += 1
        else:
            whole += 1
        first = r
        while first.after is not None:
            first = requests[first.after]
        turns[first.req_id] = turns.get(first.req_id, 0) + 1
        if r.after is not None:
            previous = requests[r.after]
            # The previous turn's prompt and answer, then a tool output of 20-500 tokens.
            answer = previous.tokens[: previous.max_tokens]
            assert r.prompt[: len(previous.prompt) + len(answer)] == previous.prompt + answer
            assert 20 <= len(r.prompt) - len(previous.prompt) - len(answer) <= 500
    assert len(turns) == 64 and set(turns.values()) <= set(range(4, 9))
    assert (at_end + inside) / len(trace.requests) >= 0.7 and at_end and inside and whole


def test_the_long_tail_and_n_sample_families():
    from bench.models import QWEN3_30B_A3B

    for batch in (1, 8):
        trace = FAMILIES[f"long-tail-{batch}"].build(QWEN3_30B_A3B, 2, 0)
        assert len(trace.requests) == batch
        assert all(r.max_tokens >= 512 for r in trace.requests)
    trace = FAMILIES["n-samples"].build(QWEN3_30B_A3B, 2, 0)
    groups: dict[tuple, int] = {}
    for r in trace.requests:
        groups[r.prompt] = groups.get(r.prompt, 0) + 1
    assert len(groups) == 24 and set(groups.values()) == {8, 16}


def test_families_at_sizes_the_registry_does_not_list(capsys):
    """``decode-N`` and ``spec-kN`` build at any size in range; other names are refused,
    naming the accepted forms, by ``family`` and by the command line."""
    from bench.host_step_families import MAX_DECODE_BATCH, MAX_SPEC_K, family
    from bench.host_step_replay import family_trace
    from bench.models import QWEN3_30B_A3B

    assert family("decode-8") is FAMILIES["decode-8"]
    trace = family("decode-48").build(QWEN3_30B_A3B, 2, 0)
    assert trace.config.max_num_seqs == 48 and len(trace.requests) == 48
    assert trace == family_trace("decode-48", QWEN3_30B_A3B.name, 2, 0)
    spec = family("spec-k2").build(QWEN3_30B_A3B, 2, 0)
    assert spec.config.num_spec_tokens == 2
    assert family(f"decode-{MAX_DECODE_BATCH}").name == f"decode-{MAX_DECODE_BATCH}"
    for name in (
        "decode-0",
        "decode-08",
        f"decode-{MAX_DECODE_BATCH + 1}",
        f"spec-k{MAX_SPEC_K + 1}",
        "spec-k0",
        "decode-",
        "prefill-2",
    ):
        with pytest.raises(KeyError, match="decode-N"):
            family(name)
    from bench.host_step_bench import main

    with pytest.raises(SystemExit) as exited:
        main(["--families", "decode-48,decode-0"])
    assert exited.value.code == 2
    refused = capsys.readouterr().err.split("unknown")[-1]
    assert "'decode-0'" in refused and "decode-48" not in refused


def test_the_opted_out_families_are_their_base_with_half_of_the_requests_opted_out():
    """``X-optout50`` is family ``X``'s trace (same requests, tokens and engine) with half of
    its requests opting out of routed experts, for any family name."""
    from bench.host_step_families import family
    from bench.models import QWEN3_30B_A3B
    from sim.trace import RequestSpec

    for name in ("decode-128", "multi-turn-short", "decode-48", "spec-k2"):
        base = family(name).build(QWEN3_30B_A3B, 2, 0)
        half = family(f"{name}-optout50").build(QWEN3_30B_A3B, 2, 0)
        assert half.name == f"{name}-optout50" and half.config == base.config
        strip = [dataclasses.replace(q, replay=None) for q in half.requests]
        assert strip == list(base.requests)
        assert len(half.opted_out()) == round(len(half.requests) / 2)
        assert isinstance(half.requests[0], RequestSpec)
    assert "decode-128-optout50" in FAMILIES and "multi-turn-short-optout50" in FAMILIES
    with pytest.raises(KeyError, match="-optout50"):
        family("-optout50")


def test_a_recording_of_opted_out_requests_replays_without_their_rows():
    """An opted-out trace is recorded through vLLM's connector wrapped as under ``triton``:
    its opted-out requests' emit starts are the one no request reaches, and both connectors'
    replays reproduce the simulator, in which those requests return nothing."""
    from r3capture.aux_output.replay import NO_EMIT_START

    trace = make_trace("multi_turn", seed=0).with_opt_outs(0.5)
    recording = record_trace(trace)
    assert recording.error is None and recording.info["opted_out"] == len(trace.opted_out())
    emit_starts = {}
    for event in recording.events:
        if event[0] == "begin_step" and event[2] is not None:
            emit_starts.update(event[2][1])
    assert {r for r, start in emit_starts.items() if start == NO_EMIT_START} == trace.opted_out()
    all_in = record_trace(trace.all_opted_in())
    assert recording.info["emitted_rows"] < all_in.info["emitted_rows"]
    for provider in PROVIDERS:
        with KernelStandIn() as exclusion:
            times = replay(recording, provider, exclusion=exclusion)
        assert times.error is None and times.digests == recording.digests, provider


def test_a_what_if_figure_says_so_in_its_title():
    from types import SimpleNamespace

    from bench.host_step_bench import _figure

    pytest.importorskip("matplotlib")
    ours = SimpleNamespace(params={"cpu_ratio_total": 1.5, "cpu_ratio_p50": 1.2})
    summaries = {
        ("decode-8", "Kimi-K2", 2): {"pairs": {"main": (None, ours), "output": (None, ours)}}
    }
    measured = _figure(summaries)._suptitle.get_text()
    what_if = _figure(summaries, ["input-checks"])._suptitle.get_text()
    assert "what-if" not in measured
    assert what_if.startswith(measured)
    assert what_if.endswith("what-if: r3capture with input-checks counted as free")


def test_the_figure_draws_a_bar_per_model_it_was_given():
    from types import SimpleNamespace

    from bench.host_step_bench import _figure

    pytest.importorskip("matplotlib")
    ours = SimpleNamespace(params={"cpu_ratio_total": 1.5, "cpu_ratio_p50": 1.2})
    pairs = {"main": (None, ours), "output": (None, ours)}
    models = ("Mixtral-8x7B", "gpt-oss-120b", "DeepSeek-V3")
    figure = _figure({("decode-8", model, 2): {"pairs": pairs} for model in models})
    labels = [text.get_text() for text in figure.axes[0].get_legend().get_texts()]
    assert [label for label in labels if label.endswith(": whole trace")] == [
        f"{model}: whole trace" for model in models
    ]


def test_full_store_family_evicts_in_steady_state(monkeypatch):
    """The full-store family reaches the state it is named for: no preemption, and most new
    slots are those of blocks the store evicted (the routing shape does not change that, so
    a tiny one keeps the test short)."""
    from bench.models import ModelShape
    from r3capture.store import slot_pool
    from sim import r3capture_worker_factory

    taken = {"slots": 0, "reused": 0}
    take = slot_pool.SlotPool.take

    def counting_take(pool, n):
        taken["slots"] += n
        taken["reused"] += min(n, pool.num_free)
        return take(pool, n)

    monkeypatch.setattr(slot_pool.SlotPool, "take", counting_take)
    trace = FAMILIES["full-store"].build(ModelShape("tiny", 2, 2, 8), 2, 0)
    # run_trace checks every request's rows against the simulator's ground truth.
    result = run_trace(trace, r3capture_worker_factory(kernel_impl="reference"))
    assert result.stats.preemptions == 0
    assert taken["reused"] > 0.5 * taken["slots"], taken
