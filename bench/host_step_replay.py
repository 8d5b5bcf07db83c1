"""Replay recorded worker-connector calls through one connector, timing every call by thread.

A recording (``sim/recording.py``) holds every call vLLM 0.33.0's engine made to its worker
connector on one simulated trace, in order. ``replay`` drives a fresh connector through the
same calls and measures each one:

* ``begin_step`` / ``prepare_output`` / ``enqueue_cpu_copy`` run on the thread that launches
  the next forward (main thread); ``process_output`` on the output thread. Each call's wall
  time (``perf_counter_ns``) and thread CPU time (``thread_time_ns``) is added to the step it
  belongs to.
* Background threads the connector started (vLLM's store writer, ``vllm-aux-output-writer``)
  are drained after every call (``queue.join()``), outside the timed calls, and their CPU
  time since the previous read (``pthread_getcpuclockid``) is added to that call's step.
  A call that itself waits for the writer (vLLM's prefix-hit read joins the queue) has
  that wait excluded: the writer's CPU time already counts that work.
* Inputs are built before the loop (metadata objects of vLLM's own classes, input batches
  with their recorded request indices, ``idx_mapping`` and ``idx_mapping_np``, numpy
  arrays, the step's ``num_draft_tokens`` as MRV2 sets it, the device ``num_rejected``
  tensor); rows go into the capture buffer and vLLM's
  snapshot cast is made outside the timed calls; r3capture's kernel (its torch reference on
  a CPU, which also takes the step's new slots) runs where the host would next wait for
  the device (``--inline-kernel``: inside the launching call, its time excluded). Both
  sides pay one launch stand-in per launch instead (``bench/stand_ins.py``).
* The garbage collector runs as in vLLM's engine, which freezes its start-up heap
  (``gc.freeze()``): everything alive before the timed loop (imports, the connector, the
  prebuilt inputs) is frozen, and the collections the calls' own garbage triggers land in
  the calls that trigger them.
* The other connector shadows the timed one (the default; ``--alone`` turns it off): it
  makes every call too, untimed, just before the timed connector's. A GPU runs r3capture's
  kernel off the host, but here its CPU emulation runs between r3capture's calls and
  evicts the caches and branch history its next call would have found warm; vLLM's calls,
  alone, find theirs warm. In a serving engine the forward pass, the scheduler and the
  sampler run between the calls of either. With the shadow, each timed call follows the
  same CPU work on both sides: both connectors' calls and the emulation.
* Every ``process_output``'s outputs are digested (``sim.recording.digest_outputs``); the
  first failing call ends the replay and is reported as ``(step, call, exception type)``.

Child-process commands (the parent is ``bench/host_step_bench.py``)::

    python -m bench.host_step_replay record --cache DIR --model NAME --depth D --seed S
        [--max-num-seqs N] FAMILY...
    python -m bench.host_step_replay replay --connector NAME --out FILE DIR...

``record`` writes each missing recording under
``DIR/<family>_<model>_d<depth>_s<seed>[_seqs<N>]_<version>``
with a ``meta.json`` (step kinds, digests, counts) and prints the directories as JSON;
``replay`` replays the recordings in order, one fresh connector each, and pickles the times.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import inspect
import json
import pickle
import shutil
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

# Bump when the simulator or the recording format changes what a recording holds.
RECORDING_VERSION = "rec2"  # rec2: batches carry idx_mapping
CONNECTORS = ("vllm-0.33.0", "r3capture")
CALLS = ("begin_step", "prepare_output", "enqueue_cpu_copy", "process_output")
KINDS = ("empty", "finish-only", "decode", "spec-decode", "prefill-chunk", "prefix-hit", "mixed")
WARMUP_EVENTS = 120


# ---------------------------------------------------------------------------- step kinds


def step_kinds(recording: Any) -> list[str]:
    """Kind of every step of a recording, from what the worker sees.

    No forward: ``finish-only`` (terminal events only) or ``empty``. With a forward, per
    request: ``decode`` (one row, sampled), ``spec`` (several rows, all sample positions:
    ``num_sampled + num_rejected == rows``), else a prefill chunk. A request whose first
    schedule started past its emit start (a prefix-cache hit) materializes stored rows when
    it first samples: that step is ``prefix-hit``. Otherwise ``mixed`` (prefill beside
    decode or spec), ``prefill-chunk``, ``spec-decode`` or ``decode``.
    """
    from sim.recording import BEGIN, ENQUEUE, PREPARE

    metas: dict[int, Any] = {}
    prepares: dict[int, Any] = {}
    enqueues: dict[int, Any] = {}
    for event in recording.events:
        if event[0] == BEGIN:
            metas[event[1]] = event[2]
        elif event[0] == PREPARE:
            prepares[event[1]] = event[2]
        elif event[0] == ENQUEUE:
            enqueues[event[1]] = event[2]
    kinds = []
    hit_pending: dict[str, bool] = {}  # live requests: stored rows still to emit
    generation = 0
    for step in range(recording.num_steps):
        meta = metas.get(step)
        emit = {}
        if meta is not None:
            meta_generation, requests, _, finished, _, _ = meta
            if meta_generation != generation:
                hit_pending.clear()
                generation = meta_generation
            for req_id in finished:
                hit_pending.pop(req_id, None)
            emit = dict(requests)
        call = prepares.get(step)
        if call is None:
            kinds.append("finish-only" if meta is not None and meta[3] else "empty")
            continue
        enq = enqueues.get(step)
        counts = np.diff(call.query_start_loc[: len(call.req_ids) + 1])
        sampled = enq.num_sampled if enq is not None else np.ones(len(counts), np.int32)
        rejected = enq.num_rejected if enq is not None else call.num_rejected
        has = {"decode": False, "spec": False, "prefill": False, "hit": False}
        for i, req_id in enumerate(call.req_ids):
            n, tok = int(counts[i]), int(call.num_computed[i])
            if req_id not in hit_pending:
                start = emit.get(req_id)
                hit_pending[req_id] = start is not None and start < tok
            if sampled[i] > 0 and hit_pending[req_id]:
                has["hit"] = True
                hit_pending[req_id] = False
            if n > 1 and int(sampled[i]) + int(rejected[i]) == n:
                has["spec"] = True
            elif n == 1 and sampled[i] > 0:
                has["decode"] = True
            else:
                has["prefill"] = True
        if has["hit"]:
            kinds.append("prefix-hit")
        elif has["prefill"]:
            kinds.append("mixed" if has["decode"] or has["spec"] else "prefill-chunk")
        elif has["spec"]:
            kinds.append("spec-decode")
        else:
            kinds.append("decode")
    return kinds


# ---------------------------------------------------------------------------- recordings


def model_shape(name: str) -> Any:
    from bench.models import MODELS

    for model in MODELS:
        if model.name == name:
            return model
    raise ValueError(f"unknown model {name!r}; known: {[m.name for m in MODELS]}")


def _fingerprint(trace: Any) -> str:
    return hashlib.blake2b(repr(trace).encode(), digest_size=8).hexdigest()


def recording_dir(
    cache: Path, family: str, model: str, depth: int, seed: int, max_num_seqs: int | None = None
) -> Path:
    seqs = f"_seqs{max_num_seqs}" if max_num_seqs else ""
    return cache / f"{family}_{model}_d{depth}_s{seed}{seqs}_{RECORDING_VERSION}"


def family_trace(
    family: str, model: str, depth: int, seed: int, max_num_seqs: int | None = None
) -> Any:
    """The family's trace; ``max_num_seqs`` replaces its engine's (the family's own is sized
    to its traffic; vLLM's serve default on H100/H200-class GPUs is 1,024), which sizes
    the connectors and caps the requests the scheduler runs at once."""
    from bench.host_step_families import family as named_family

    trace = named_family(family).build(model_shape(model), depth, seed)
    return trace.with_config(max_num_seqs=max_num_seqs) if max_num_seqs else trace


def ensure_recording(
    cache: Path, family: str, model: str, depth: int, seed: int, max_num_seqs: int | None = None
) -> Path:
    """The directory of this trace's recording, recorded now unless the cache holds it for
    the same trace (same fingerprint) and version."""
    from sim.recording import record_trace

    trace = family_trace(family, model, depth, seed, max_num_seqs)
    fingerprint = _fingerprint(trace)
    directory = recording_dir(cache, family, model, depth, seed, max_num_seqs)
    meta_path = directory / "meta.json"
    if meta_path.exists():
        try:
            if json.loads(meta_path.read_text()).get("fingerprint") == fingerprint:
                return directory
        except (OSError, ValueError):
            pass
    shutil.rmtree(directory, ignore_errors=True)
    t0 = time.perf_counter()
    recording = record_trace(trace, directory)
    if "engine_error" in recording.info or recording.error is not None:
        raise RuntimeError(
            f"{family}/{model}/d{depth}: the simulator run failed: "
            f"{recording.info.get('engine_error') or recording.error}"
        )
    kinds = step_kinds(recording)
    meta = {
        "family": family,
        "model": model,
        "depth": depth,
        "seed": seed,
        "max_num_seqs": trace.config.max_num_seqs,
        "version": RECORDING_VERSION,
        "fingerprint": fingerprint,
        "notes": trace.notes,
        "shape": [model_shape(model).num_layers, model_shape(model).top_k],
        "dtype": np.dtype(trace.model.dtype).name,
        "kinds": kinds,
        "digests": recording.digests,
        "info": recording.info,
        "record_seconds": round(time.perf_counter() - t0, 1),
    }
    meta_path.write_text(json.dumps(meta))
    return directory


# ---------------------------------------------------------------------------- connectors


class _WriterWait:
    """vLLM's store barrier as the calls that hit it see it.

    ``get_concatenated`` (a prefix hit in ``process_output``) waits on the writer's queue
    (``queue.join()``) until every queued write is applied. That wait is the writer's work,
    counted as the writer's CPU time: it is excluded from the waiting call (wall and thread
    CPU, like the kernel stand-in), so it is not counted twice. ``drain`` is the plain
    barrier, for use outside the timed calls.
    """

    def __init__(self, queue: Any) -> None:
        self.excluded_wall_ns = 0
        self.excluded_cpu_ns = 0
        self.drain = queue.join
        wall, cpu = time.perf_counter_ns, time.thread_time_ns

        def join() -> None:
            w0, c0 = wall(), cpu()
            try:
                self.drain()
            finally:
                c1, w1 = cpu(), wall()
                self.excluded_wall_ns += w1 - w0
                self.excluded_cpu_ns += c1 - c0

        queue.join = join


@dataclass
class _Connector:
    """One worker connector as the replay drives it."""

    name: str
    handle: Any
    capture: np.ndarray  # numpy view of the capture buffer (int32 [T, L, K])
    prepare: Any  # (input_batch, num_rejected tensor) -> pending | None
    stage: Any  # (num_rows) -> None: untimed work before prepare_output
    drain: Any  # () -> None: wait for background work
    threads: list[threading.Thread]
    snapshot: Any = None
    # Time inside the connector's calls that is counted elsewhere (excluded_wall/cpu_ns).
    exclusions: tuple = ()

    def background_cpu_ns(self) -> int:
        total = 0
        for thread in self.threads:
            if thread.is_alive():
                total += time.clock_gettime_ns(time.pthread_getcpuclockid(thread.ident))
        return total


def _noop(*_: Any) -> None:
    return None


def make_connector(name: str, sizing: Any) -> _Connector:
    """A fresh connector with its stand-ins, its prepare adapter and its background threads."""
    from bench.stand_ins import SnapshotStandIn
    from sim.workers import make_r3capture_worker, make_vllm_worker

    before = set(threading.enumerate())
    if name == "vllm-0.33.0":
        handle = make_vllm_worker(sizing)
        worker = handle.worker
        snapshot = SnapshotStandIn(worker._capturer)
        worker._capturer = snapshot
        writer_wait = _WriterWait(worker._store._queue)
        threads = [t for t in threading.enumerate() if t not in before]
        if not any(t.name == "vllm-aux-output-writer" for t in threads):
            raise RuntimeError("vLLM's store writer thread (vllm-aux-output-writer) not found")
        return _Connector(
            name,
            handle,
            handle.capture_buffer.numpy(),
            lambda batch, _rejected: worker.prepare_output(batch),
            snapshot.stage,
            writer_wait.drain,
            threads,
            snapshot,
            (writer_wait,),
        )
    if name == "r3capture":
        handle = make_r3capture_worker(sizing, kernel_impl="reference")
        worker = handle.worker
        threads = [t for t in threading.enumerate() if t not in before]
        if "num_rejected" in inspect.signature(worker.prepare_output).parameters:

            def prepare(batch: Any, rejected: Any) -> Any:
                return worker.prepare_output(batch, num_rejected=rejected)

        else:

            def prepare(batch: Any, rejected: Any) -> Any:
                return worker.prepare_output(batch)

        return _Connector(
            name, handle, handle.capture_buffer.numpy(), prepare, _noop, _noop, threads
        )
    raise ValueError(f"unknown connector {name!r}; known: {CONNECTORS}")


# ---------------------------------------------------------------------------- replay


@dataclass
class _StepInputs:
    """Everything a replay hands the connector, built before the timed loop."""

    metadata: dict[int, Any]
    batches: dict[int, Any]
    rejected: dict[int, Any]
    late: dict[int, tuple[np.ndarray, np.ndarray]]
    final: dict[int, tuple[np.ndarray, np.ndarray]]


def _build_inputs(recording: Any, metadata_types: tuple[type, type]) -> _StepInputs:
    import torch

    from sim.recording import BEGIN, ENQUEUE, PREPARE, build_metadata

    inputs = _StepInputs({}, {}, {}, {}, {})
    for event in recording.events:
        kind, step = event[0], event[1]
        if kind == BEGIN:
            inputs.metadata[step] = build_metadata(event[2], metadata_types)
        elif kind == PREPARE:
            call = event[2]
            qsl = call.query_start_loc.copy()
            # As the simulator hands them out (sim/request_indices.py): intp on the host,
            # an int64 tensor on the device.
            indices = call.idx_mapping.astype(np.intp)
            inputs.batches[step] = SimpleNamespace(
                req_ids=list(call.req_ids),
                num_reqs=len(call.req_ids),
                query_start_loc_np=qsl,
                num_computed_tokens_np=call.num_computed.copy(),
                query_start_loc=torch.from_numpy(qsl.copy()),
                positions=torch.from_numpy(call.positions.copy()),
                idx_mapping_np=indices,
                idx_mapping=torch.from_numpy(call.idx_mapping.astype(np.int64)),
            )
            inputs.rejected[step] = torch.from_numpy(call.num_rejected.copy())
        elif kind == ENQUEUE:
            call = event[2]
            size = len(call.num_sampled)
            batch = inputs.batches.get(step)
            if batch is not None:
                batch.num_draft_tokens = _num_draft_tokens(batch.query_start_loc_np, call)
            # vLLM hands over arrays its asynchronous copies fill in later.
            inputs.late[step] = (np.full(size, -1, np.int32), np.full(size, -1, np.int32))
            inputs.final[step] = (call.num_sampled, call.num_rejected)
    return inputs


def _num_draft_tokens(query_start_loc: np.ndarray, enqueue: Any) -> int:
    """The step's drafts, as MRV2's ``InputBatch.num_draft_tokens`` counts them: a request
    verifying ``d`` drafts is scheduled ``1 + d`` rows, every one of them sampled or
    rejected; a prefill chunk of ``n > 1`` rows samples at most one."""
    counts = np.diff(query_start_loc[: len(enqueue.num_sampled) + 1])
    verifying = (counts > 1) & (enqueue.num_sampled + enqueue.num_rejected == counts)
    return int((counts[verifying] - 1).sum())


@dataclass
class ReplayTimes:
    """One replay. ``calls``: int64 ``[4, steps, 2]``, per call (``CALLS`` order) and step,
    (wall, thread CPU) ns; ``background``: int64 ``[steps]`` background-thread CPU ns;
    ``digests``: ``(step, digest)`` per process_output; ``error``: ``(step, call, type)``."""

    calls: np.ndarray
    background: np.ndarray
    digests: list[tuple[int, str]]
    error: tuple[int, str, str] | None
    launches: int
    excluded_cpu_ns: int


class _NoExclusion:
    excluded_wall_ns = 0
    excluded_cpu_ns = 0
    launches = 0


class _Driver:
    """One connector driven through a recording's calls: its call for each event, and what
    it keeps between calls (the pending steps)."""

    def __init__(self, conn: _Connector, inputs: _StepInputs, rows: np.ndarray) -> None:
        self.conn = conn
        self.inputs = inputs
        self.rows = rows
        self.pending: dict[int, Any] = {}

    def call(self, event: tuple) -> tuple[Any, tuple, dict]:
        """``(fn, args, kwargs)`` of the event's call; untimed work before it is done here."""
        from sim.recording import BEGIN, ENQUEUE, PREPARE, PROCESS

        kind, step, conn, inputs = event[0], event[1], self.conn, self.inputs
        if kind == BEGIN:
            return conn.handle.worker.begin_step, (inputs.metadata[step],), {}
        if kind == PREPARE:
            call = event[2]
            n = call.num_rows
            conn.capture[:n] = self.rows[call.rows_offset : call.rows_offset + n]
            conn.stage(int(call.query_start_loc[len(call.req_ids)]))
            return conn.prepare, (inputs.batches[step], inputs.rejected[step]), {}
        if kind == ENQUEUE:
            late_sampled, late_rejected = inputs.late[step]
            kwargs = {"num_sampled": late_sampled, "num_rejected": late_rejected}
            return self.pending[step].enqueue_cpu_copy, (), kwargs
        if kind == PROCESS:
            for late, final in zip(inputs.late[step], inputs.final[step]):
                late[:] = final
            return self.pending.pop(step).process_output, (), {}
        raise ValueError(f"unknown recorded call {kind!r}")

    def keep(self, event: tuple, result: Any) -> None:
        """Keep what a prepare_output returned for the step's later calls."""
        from sim.recording import PREPARE

        if event[0] == PREPARE and result is not None:
            self.pending[event[1]] = result


def replay(
    recording: Any,
    connector: str,
    *,
    exclusion: Any = None,
    metadata_types: tuple[type, type] | None = None,
    max_events: int | None = None,
    shadow: bool = False,
) -> ReplayTimes:
    """Drive a fresh ``connector`` through ``recording``'s calls and time each one.

    ``exclusion``: a ``KernelStandIn`` already entered (r3capture), whose excluded time is
    subtracted from the call that launched the kernel. ``max_events``: stop early (warm-up).
    ``shadow``: the other connector makes every call too, untimed, just before this one's
    (the module docstring says why): each timed call then follows the same CPU work on
    both sides.
    """
    from sim.recording import PREPARE, PROCESS, digest_outputs, vllm_metadata_types

    exclusion = exclusion if exclusion is not None else _NoExclusion()
    settle = getattr(exclusion, "settle", _noop)
    inputs = _build_inputs(recording, metadata_types or vllm_metadata_types())
    conn = make_connector(connector, recording.sizing)
    timed = _Driver(conn, inputs, recording.rows)
    other = None
    if shadow:
        (name,) = (c for c in CONNECTORS if c != connector)
        other = _Driver(make_connector(name, recording.sizing), inputs, recording.rows)
    exclusions = (exclusion, *conn.exclusions)

    def excluded() -> tuple[int, int]:
        return (
            sum(e.excluded_wall_ns for e in exclusions),
            sum(e.excluded_cpu_ns for e in exclusions),
        )

    steps = recording.num_steps
    calls = np.zeros((len(CALLS), steps, 2), np.int64)
    background = np.zeros(steps, np.int64)
    digests: list[tuple[int, str]] = []
    error = None
    call_index = {name: i for i, name in enumerate(CALLS)}
    wall, cpu = time.perf_counter_ns, time.thread_time_ns
    launches0 = exclusion.launches
    excluded0 = exclusion.excluded_cpu_ns
    events = recording.events if max_events is None else recording.events[:max_events]
    bg_last = conn.background_cpu_ns()
    gc.collect()
    gc.freeze()
    try:
        for event in events:
            kind, step = event[0], event[1]
            if kind in (PREPARE, PROCESS):
                # Deferred launches read the rows about to be replaced; a step's results
                # are read after its copy event.
                settle()
            if other is not None:
                fn, args, kwargs = other.call(event)
                try:
                    other.keep(event, fn(*args, **kwargs))
                except Exception as exc:  # noqa: BLE001 - reported like the simulator does
                    error = (step, f"shadow {kind}", type(exc).__name__)
                    break
                other.conn.drain()
            fn, args, kwargs = timed.call(event)
            ex_wall, ex_cpu = excluded()
            try:
                w0, c0 = wall(), cpu()
                result = fn(*args, **kwargs)
                c1, w1 = cpu(), wall()
            except Exception as exc:  # noqa: BLE001 - reported like the simulator does
                error = (step, kind, type(exc).__name__)
                break
            ex_wall2, ex_cpu2 = excluded()
            slot = calls[call_index[kind], step]
            slot[0] += w1 - w0 - (ex_wall2 - ex_wall)
            slot[1] += c1 - c0 - (ex_cpu2 - ex_cpu)
            timed.keep(event, result)
            if kind == PROCESS:
                digests.append((step, digest_outputs(result)))
            del result
            conn.drain()
            bg_now = conn.background_cpu_ns()
            background[step] += bg_now - bg_last
            bg_last = bg_now
    finally:
        timed.pending.clear()
        try:
            conn.handle.close()
            if other is not None:
                other.pending.clear()
                other.conn.handle.close()
        finally:
            gc.unfreeze()
    return ReplayTimes(
        calls,
        background,
        digests,
        error,
        exclusion.launches - launches0
        if connector == "r3capture"
        else getattr(conn.snapshot, "launches", 0),
        exclusion.excluded_cpu_ns - excluded0 if connector == "r3capture" else 0,
    )


def timer_overhead_ns(calls: int = 5000) -> dict[str, float]:
    """Median wall and CPU ns the replay's clock reads add to an empty call."""
    wall, cpu = time.perf_counter_ns, time.thread_time_ns
    samples = np.empty((calls, 2), np.int64)
    for i in range(calls):
        w0, c0 = wall(), cpu()
        _noop()
        c1, w1 = cpu(), wall()
        samples[i] = (w1 - w0, c1 - c0)
    return {
        "wall_ns_p50": float(np.median(samples[:, 0])),
        "cpu_ns_p50": float(np.median(samples[:, 1])),
    }


# ---------------------------------------------------------------------------- commands


def _record_main(args: argparse.Namespace) -> int:
    dirs = []
    for family in args.families:
        t0 = time.perf_counter()
        directory = ensure_recording(
            Path(args.cache), family, args.model, args.depth, args.seed, args.max_num_seqs
        )
        print(
            f"  recorded {directory.name} ({time.perf_counter() - t0:.1f} s)",
            file=sys.stderr,
            flush=True,
        )
        dirs.append(str(directory))
    print(json.dumps(dirs))
    return 0


def _replay_main(args: argparse.Namespace) -> int:
    import torch

    from bench.common import machine_info
    from bench.stand_ins import FreeParts, KernelStandIn, measure
    from sim.recording import Recording, vllm_metadata_types

    # One thread for torch: thread CPU time then covers all of a call's torch work.
    torch.set_num_threads(1)
    metadata_types = vllm_metadata_types()
    shadow = not args.alone
    if args.inline_kernel and args.connector != "r3capture" and not shadow:
        raise SystemExit(f"--inline-kernel applies to r3capture only, not {args.connector}")
    # The stand-in also runs r3capture's kernel emulation when r3capture is the shadow.
    exclusion = (
        KernelStandIn(defer=not args.inline_kernel).__enter__()
        if args.connector == "r3capture" or shadow
        else None
    )
    free = args.free.split(",") if args.free else []
    if free and args.connector != "r3capture":
        raise SystemExit(f"--free applies to r3capture only, not {args.connector}")
    freed = FreeParts(exclusion, free).__enter__() if free else None
    out: dict[str, Any] = {
        "connector": args.connector,
        "machine": machine_info(),
        "stand_in": measure(),
        "timer": timer_overhead_ns(),
        "traces": {},
    }
    for index, directory in enumerate(args.dirs):
        recording = Recording.load(Path(directory))
        if index == 0:
            # Warm-up: first calls of every code path the traces take, thrown away.
            replay(
                recording,
                args.connector,
                exclusion=exclusion,
                metadata_types=metadata_types,
                max_events=WARMUP_EVENTS,
                shadow=shadow,
            )
            gc.collect()
        t0 = time.perf_counter()
        times = replay(
            recording,
            args.connector,
            exclusion=exclusion,
            metadata_types=metadata_types,
            shadow=shadow,
        )
        forward_steps = sum(1 for event in recording.events if event[0] == "prepare_output")
        if forward_steps and not times.launches:
            raise RuntimeError(
                f"{args.connector}: no stand-in launch in {forward_steps} forward steps: the "
                "kernel wrapper did not bind to the name the worker calls"
            )
        out["traces"][Path(directory).name] = {
            "calls": times.calls,
            "background": times.background,
            "digests": times.digests,
            "error": times.error,
            "launches": times.launches,
            "excluded_cpu_ns": times.excluded_cpu_ns,
            "seconds": time.perf_counter() - t0,
        }
        del recording, times
        gc.collect()
    if freed is not None:
        freed.__exit__(None, None, None)
    if exclusion is not None:
        exclusion.__exit__(None, None, None)
    with open(args.out, "wb") as f:
        pickle.dump(out, f, protocol=pickle.HIGHEST_PROTOCOL)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="record missing traces into the cache")
    rec.add_argument("--cache", required=True)
    rec.add_argument("--model", required=True)
    rec.add_argument("--depth", type=int, required=True)
    rec.add_argument("--seed", type=int, default=0)
    rec.add_argument("--max-num-seqs", type=int, default=None)
    rec.add_argument("families", nargs="+")
    rep = sub.add_parser("replay", help="replay recordings through one connector")
    rep.add_argument("--connector", required=True, choices=CONNECTORS)
    rep.add_argument("--out", required=True)
    rep.add_argument(
        "--free", default="", help="r3capture only: comma-separated ablations counted as free"
    )
    rep.add_argument(
        "--inline-kernel",
        action="store_true",
        help="r3capture's kernel emulation runs inside prepare_output, not where the host "
        "would next wait for the device",
    )
    rep.add_argument(
        "--alone",
        action="store_true",
        help="no shadow: the other connector makes no calls between this one's",
    )
    rep.add_argument("dirs", nargs="+")
    args = parser.parse_args(argv)
    return _record_main(args) if args.command == "record" else _replay_main(args)


if __name__ == "__main__":
    raise SystemExit(main())
