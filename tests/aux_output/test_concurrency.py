"""Concurrency: begin_step / prepare_output on the step thread while process_output runs
on an output thread, as vLLM's async model runner does (WorkerAsyncOutputCopy).

In threaded mode the simulator hands each step's process_output to a single output
thread as soon as the step is enqueued, then schedules, begins and prepares the next step
while that thread works; the scheduler consumes outputs in order. Results must equal the
sequential run byte for byte, for vLLM's worker and for r3capture's, under a tiny GIL
switch interval that forces interleavings inside the workers' critical sections.
"""

from __future__ import annotations

import sys
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim import (
    make_trace,
    make_vllm_worker,
    r3capture_worker_factory,
    random_trace,
    run_trace,
)
from sim.compare import diff_results, only_reference_fails
from sim.interleaving import EAGERNESS, DrawnInterleaving
from sim.workers import WorkerSizing, make_r3capture_worker

pytest.importorskip("vllm.distributed.aux_output_connector.worker")

WORKERS = {
    "vllm": make_vllm_worker,
    "r3capture": r3capture_worker_factory(kernel_impl="reference"),
}


@pytest.fixture
def tiny_switch_interval():
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


@pytest.mark.parametrize("worker", sorted(WORKERS))
@pytest.mark.parametrize(
    "scenario, overrides",
    [
        ("async_spec", {}),
        ("finish_in_flight", {}),
        ("preemption", {"max_concurrent_batches": 2, "num_spec_tokens": 1}),
    ],
)
def test_threaded_equals_sequential(worker, scenario, overrides, tiny_switch_interval):
    trace = make_trace(scenario, seed=11, **overrides)
    sequential = run_trace(trace, WORKERS[worker])
    for _ in range(2):
        threaded = run_trace(trace, WORKERS[worker], threaded=True)
        assert diff_results(sequential, threaded) is None
        assert threaded.stats.max_in_flight == 2


def test_threaded_r3capture_matches_vllm_sequential(tiny_switch_interval):
    trace = make_trace("async", seed=5, size="small")
    ref = run_trace(trace, make_vllm_worker)
    got = run_trace(trace, WORKERS["r3capture"], threaded=True)
    assert diff_results(ref, got) is None


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
@given(
    seed=st.integers(0, 2**31 - 1),
    order=st.integers(0, 2**31 - 1),
    depth=st.sampled_from([2, 3]),
    destination=st.sampled_from(["auto", "staging"]),
)
def test_workers_agree_on_every_drawn_order_of_process_output(seed, order, depth, destination):
    """``process_output`` of a step may run before, between or after the step thread's
    calls for the next steps. A drawn order (``interleave_seed``) replays the same one for
    both workers: their outputs and errors must agree step for step; the threaded mode cannot
    repeat an order, so it cannot compare runs whose errors depend on it. Where vLLM's worker
    fails (a request resumed with a step of its earlier run in flight), r3capture must run
    clean with the routing oracle's rows instead."""
    trace = random_trace(seed, max_concurrent_batches=depth)
    ref = run_trace(trace, make_vllm_worker, interleave_seed=order, catch_errors=True, check=False)
    factory = r3capture_worker_factory(kernel_impl="reference", destination=destination)
    got = run_trace(trace, factory, interleave_seed=order, catch_errors=True, check=False)
    difference = diff_results(ref, got)
    assert difference is None or only_reference_fails(ref, got), difference


def test_drawn_interleaving_runs_calls_in_step_order_and_repeats_its_order():
    def boundaries_run(seed):
        ran: list[int] = []
        order = DrawnInterleaving(seed)
        futures = []
        at_boundary = []
        for step in range(40):
            order.boundary()
            at_boundary.append(len(ran))
            futures.append(order.submit(lambda step=step: ran.append(step) or step))
            if step >= 2:  # the engine needs step - 2's result (depth 3)
                order.run_through(futures[step - 2])
                assert futures[step - 2].result() == step - 2
        order.run_through(futures[-1])
        assert ran == list(range(40))
        return order.eagerness, at_boundary

    eagerness, first = boundaries_run(7)
    assert eagerness in EAGERNESS
    assert boundaries_run(7) == (eagerness, first)
    # Before step s the engine has forced the calls of steps up to s - 3; across seeds,
    # some calls run earlier than that, and some boundaries run nothing beyond it.
    forced = [max(step - 2, 0) for step in range(40)]
    orders = [boundaries_run(seed)[1] for seed in range(8)]
    assert any(ran > need for order in orders for ran, need in zip(order, forced))
    assert any(ran == need for order in orders for ran, need in zip(order[3:], forced[3:]))
    assert len({tuple(order) for order in orders}) > 1


def test_drawn_interleaving_keeps_a_failed_call_for_the_engine():
    order = DrawnInterleaving(0)

    def fail():
        raise KeyError("r1")

    failed = order.submit(fail)
    after = order.submit(lambda: "ok")
    order.run_through(after)
    with pytest.raises(KeyError, match="r1"):
        failed.result()
    assert after.result() == "ok"


def test_threaded_and_drawn_orders_exclude_each_other():
    with pytest.raises(ValueError, match="threaded and interleave_seed"):
        run_trace(make_trace("decode", seed=0), make_vllm_worker, threaded=True, interleave_seed=1)


def test_stress_step_thread_against_output_thread(tiny_switch_interval):
    """A raw producer/consumer stress of one r3capture worker: the step thread issues
    begin_step + prepare_output for 8 decoding requests as fast as two steps in flight
    allow; the output thread consumes in order. Every request's rows must come back
    complete and in order, equal to what the step thread wrote."""
    from r3capture.aux_output.types import AuxOutputConnectorMetadata, PackedBlockHashes

    sizes = WorkerSizing.for_model(
        num_layers=2,
        top_k=2,
        num_experts=16,
        hash_block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_concurrent_batches=2,
        max_bytes=1 << 16,
    )
    handle = make_r3capture_worker(sizes, kernel_impl="reference")
    req_ids = [f"q{i}" for i in range(8)]
    num_steps = 120
    rng = np.random.default_rng(0)
    written = {r: [] for r in req_ids}
    received = {r: [] for r in req_ids}
    slots = threading.Semaphore(2)
    pendings: list = []
    cond = threading.Condition()
    errors: list[BaseException] = []

    def hashes_for(step):
        # Position `step` completes hash block step // 4 when step % 4 == 3.
        if step % 4 != 3:
            return {}
        return {r: PackedBlockHashes((f"{r}/{step // 4}".encode() * 32)[:32], 32) for r in req_ids}

    def producer():
        try:
            for step in range(num_steps):
                slots.acquire()
                meta = AuxOutputConnectorMetadata(
                    0, dict.fromkeys(req_ids, max(step - 1, 0)), hashes_for(step), ()
                )
                handle.begin_step(meta)
                rows = rng.integers(0, 16, (8, 2, 2), dtype=np.int32)
                handle.capture_buffer[:8] = torch.from_numpy(rows)
                for i, r in enumerate(req_ids):
                    written[r].append(rows[i].astype(np.uint8))
                qsl = np.arange(9, dtype=np.int32)
                batch = SimpleNamespace(
                    req_ids=req_ids,
                    num_reqs=8,
                    query_start_loc_np=qsl,
                    num_computed_tokens_np=np.full(8, step, np.int32),
                    query_start_loc=torch.from_numpy(qsl.copy()),
                    positions=torch.full((8,), step, dtype=torch.int64),
                    # The same eight requests all along: MRV2 keeps their indices.
                    idx_mapping_np=np.arange(8),
                    idx_mapping=torch.arange(8),
                )
                pending = handle.prepare_output(batch, np.zeros(8, np.int32))
                pending.enqueue_cpu_copy(
                    num_sampled=np.ones(8, np.int32), num_rejected=np.zeros(8, np.int32)
                )
                with cond:
                    pendings.append(pending)
                    cond.notify()
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)
            with cond:
                pendings.append(None)
                cond.notify()

    def consumer():
        try:
            for _ in range(num_steps):
                with cond:
                    cond.wait_for(lambda: pendings)
                    pending = pendings.pop(0)
                if pending is None:
                    return
                out = pending.process_output()
                slots.release()
                for r, item in out.items():
                    received[r].append((item.token_start, item.rows.copy()))
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)
            slots.release()

    threads = [threading.Thread(target=producer), threading.Thread(target=consumer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    handle.close()
    assert not errors, errors
    for r in req_ids:
        starts = [s for s, _ in received[r]]
        rows = np.concatenate([rows for _, rows in received[r]])
        assert starts[0] == 0
        assert len(rows) == num_steps
        assert np.array_equal(rows, np.stack(written[r]))


def test_output_copies_on_a_cpu_call_enqueue_at_once_and_wait_for_nothing():
    # On a CUDA capture buffer OutputCopies records vLLM's copy event, and process_output
    # waits on it (the gpu tests run the simulator that way); on a CPU every copy is done
    # when enqueue_cpu_copy returns, so nothing is recorded and nothing waits.
    import torch

    from sim.copy_stream import OutputCopies

    calls = []
    copies = OutputCopies(torch.device("cpu"))
    assert copies.enqueue(lambda: calls.append("enqueue")) is None
    assert calls == ["enqueue"]

    def process():
        return "outputs"

    assert OutputCopies.after(None, process) is process


def test_output_copies_wait_for_the_event_before_processing():
    from sim.copy_stream import OutputCopies

    order = []

    class Event:
        def synchronize(self):
            order.append("wait")

    run = OutputCopies.after(Event(), lambda: order.append("process") or "outputs")
    assert order == [] and run() == "outputs" and order == ["wait", "process"]
