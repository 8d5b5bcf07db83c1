"""Malformed arguments to the worker's constructor and protocol calls: a named error, and a
worker that behaves afterwards exactly like a twin that never saw the call.

Protocol violations with well-formed input (vLLM's own assertions) are in
test_differential.py; this file is about input the worker cannot honour at all.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType, SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_worker import SIZES, K, L, batch_of, hashes, make_worker, meta, routes, run_step

from r3capture.aux_output.call_checks import EMIT_LIST_MAX, checked_emit_starts
from r3capture.aux_output.errors import AuxOutputProtocolError
from r3capture.aux_output.sizing import WorkerSizing
from r3capture.aux_output.types import PackedBlockHashes
from r3capture.aux_output.worker import TritonAuxOutputWorker
from r3capture.kernels import KernelArgumentError

SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

# --------------------------------------------------------------------- constructor

NOT_AN_INT = st.sampled_from([2.5, 3.0, True, False, None, "4", b"4", [4], np.float32(4)])
INT_FIELDS = [f for f in SIZES if f not in ("shape_per_token", "dtype")]


@SETTINGS
@given(field=st.sampled_from(INT_FIELDS), bad=st.one_of(NOT_AN_INT, st.integers(-5, 0)))
def test_sizing_refuses_anything_but_a_positive_int_naming_the_field(field, bad):
    with pytest.raises((TypeError, ValueError), match=f"^{field} must"):
        WorkerSizing(**dict(SIZES, **{field: bad}))


@SETTINGS
@given(index=st.sampled_from([0, 1]), bad=st.one_of(NOT_AN_INT, st.integers(-5, 0)))
def test_sizing_refuses_a_bad_row_shape_naming_the_dimension(index, bad):
    shape = [L, K]
    shape[index] = bad
    with pytest.raises((TypeError, ValueError), match=rf"^shape_per_token\[{index}\]"):
        WorkerSizing(**dict(SIZES, shape_per_token=tuple(shape)))


def _bad_capture_buffers() -> list:
    good = torch.zeros(32, L, K, dtype=torch.int32)
    return [
        good.float(),
        good.long(),
        good[:31],
        good[:, :, :1],
        good[:, 0],
        good.transpose(1, 2).contiguous().transpose(1, 2),
        good.to("meta"),
        good.numpy(),
        [[0]],
    ]


# Every refused constructor argument, each tried (a sample of them could miss one).
BAD_CONSTRUCTOR_ARGUMENTS = [
    *(("capture_buffer", bad) for bad in _bad_capture_buffers()),
    *(("kernel_impl", bad) for bad in ["cuda", "", "TRITON", 1]),
    *(("destination", bad) for bad in ["host", "", "DIRECT", 0]),
    *(("output_pool_bytes", bad) for bad in [-1, 2.5, "8", True]),
]


@pytest.mark.parametrize(
    "name, value",
    BAD_CONSTRUCTOR_ARGUMENTS,
    ids=[f"{name}-{i}" for i, (name, _) in enumerate(BAD_CONSTRUCTOR_ARGUMENTS)],
)
def test_worker_constructor_names_what_it_refuses(name, value):
    with pytest.raises((TypeError, ValueError), match=name):
        make_worker(**{name: value})


def test_worker_constructor_refuses_a_non_sizing():
    with pytest.raises(TypeError, match="sizing must be a WorkerSizing, got dict"):
        TritonAuxOutputWorker(SIZES)


# --------------------------------------------------------------------- protocol calls


def _as_namespace(metadata) -> SimpleNamespace:
    return SimpleNamespace(
        **{f.name: getattr(metadata, f.name) for f in dataclasses.fields(metadata)}
    )


def _first_step(worker):
    """a: a prefill of 6 rows with one keyed block; b: 3 rows, no block yet."""
    return run_step(
        worker,
        meta({"a": 0, "b": 0}, {"a": hashes(1, range(1))}),
        [("a", 1, 0, 6), ("b", 2, 0, 3)],
    )


def _second_step(worker):
    """a decodes past its second block's end (keyed now); b finishes; c is a prefix hit."""
    out = run_step(
        worker,
        meta({"a": 6, "c": 0}, {"a": hashes(1, range(1, 2)), "c": hashes(1, range(1))}),
        [("a", 1, 6, 2), ("c", 1, 4, 2)],
    )
    worker.begin_step(meta({}, finished=["a", "c"]))
    return out


def _same_outputs(left: dict, right: dict) -> bool:
    return left.keys() == right.keys() and all(
        left[r].token_start == right[r].token_start
        and left[r].rows.dtype == right[r].rows.dtype
        and left[r].rows.tobytes() == right[r].rows.tobytes()
        for r in left
    )


PACKED_OK = PackedBlockHashes(bytes(8), 8)


class _OneShotIds:
    """A one-shot iterator of request ids with a stable repr (a test id must not hold an
    address)."""

    def __init__(self, ids: list[str]) -> None:
        self._ids = iter(ids)

    def __iter__(self):
        return self

    def __next__(self) -> str:
        return next(self._ids)

    def __repr__(self) -> str:
        return "_OneShotIds(...)"


# field -> [(bad value, the error it must raise)]
METADATA_CORRUPTIONS = {
    "generation": [
        (1.5, TypeError),
        (True, TypeError),
        ("0", TypeError),
        (None, TypeError),
        (-1, ValueError),
    ],
    "requests": [
        (None, TypeError),
        ([("b", 3)], TypeError),
        ({"b": 1.5}, TypeError),
        ({"b": "3"}, TypeError),
        ({"b": -1}, ValueError),
        ({"b": np.int32(-1)}, ValueError),
        ({"b": None}, TypeError),
        ({"b": True}, TypeError),
        ({"b": 2**63}, ValueError),
        ({"b": np.uint64(2**63)}, ValueError),
        ({"b": -(2**63) - 1}, ValueError),
        ({"b": 2**64}, ValueError),
        ({"b": np.float64(3.0)}, TypeError),
        ({"b": 3, "c": 2.5}, TypeError),
    ],
    "block_hashes": [
        (None, TypeError),
        ({"zz": PACKED_OK}, KeyError),
        ({"b": b"raw bytes"}, TypeError),
        ({"b": PackedBlockHashes(b"123", 2)}, ValueError),
        ({"b": PackedBlockHashes(b"", 0)}, ValueError),
        ({"b": PackedBlockHashes(b"xx", -2)}, ValueError),
        ({"b": PackedBlockHashes(b"xx", 2.0)}, TypeError),
        ({"b": PackedBlockHashes(b"xx", True)}, TypeError),
        ({"b": SimpleNamespace(data="not bytes", item_size=1)}, TypeError),
        ({"b": SimpleNamespace(data=b"xx", item_size=[2])}, TypeError),
        ({"b": PACKED_OK, "zz": PACKED_OK}, KeyError),
        ({"b": PACKED_OK, "a": PackedBlockHashes(b"x" * 12, 8)}, ValueError),
    ],
    "finished_requests": [
        ("b", TypeError),
        (None, TypeError),
        (7, TypeError),
        (("zz",), KeyError),
        (("b", "zz"), KeyError),
        (["zz"], KeyError),
        (_OneShotIds(["b"]), TypeError),
    ],
    "retained_block_hashes": [(b"xx", TypeError), (PackedBlockHashes(b"abc", 2), ValueError)],
    "released_block_hashes": [(PackedBlockHashes(b"abc", 0), ValueError)],
}


@pytest.mark.parametrize(
    "field, value, error",
    [(f, v, e) for f, cases in METADATA_CORRUPTIONS.items() for v, e in cases],
    ids=repr,
)
def test_malformed_metadata_is_named_and_changes_nothing(field, value, error):
    worker, twin = make_worker(), make_worker()
    assert _same_outputs(_first_step(worker), _first_step(twin))
    bad = _as_namespace(meta({"b": 3}))
    setattr(bad, field, value)
    with pytest.raises((TypeError, ValueError, KeyError)) as info:
        worker.begin_step(bad)
    assert type(info.value) is error, info.value
    assert f"metadata.{field}" in str(info.value.args[0])
    assert _same_outputs(_second_step(worker), _second_step(twin))
    assert len(worker.store) == len(twin.store) and worker.store.eviction_order() == (
        twin.store.eviction_order()
    )


def test_block_hashes_of_two_item_sizes_pass_the_checks():
    """Valid but unusual: one step's hashes in two item sizes pass the metadata checks; an
    unknown request beside them still fails."""
    two_sizes = {"a": PackedBlockHashes(bytes(16), 8), "b": PackedBlockHashes(bytes(32), 16)}
    known = {"b"}.__contains__
    assert checked_emit_starts(meta({"a": 1}, two_sizes), known, 0) == [1]
    with pytest.raises(KeyError, match="metadata.block_hashes names unknown request 'zz'"):
        checked_emit_starts(meta({"a": 1}, {**two_sizes, "zz": PACKED_OK}), known, 0)


def test_numpy_integer_emit_starts_are_ints():
    """Emit starts that are numpy integers are valid input: the same outputs and store as
    with Python ints."""
    worker, twin = make_worker(), make_worker()
    assert _same_outputs(_first_step(worker), _first_step(twin))
    step = meta({"a": 6, "c": 0}, {"a": hashes(1, range(1, 2)), "c": hashes(1, range(1))})
    numpy_step = _as_namespace(step)
    numpy_step.requests = {r: np.int64(v) for r, v in step.requests.items()}
    batch = [("a", 1, 6, 2), ("c", 1, 4, 2)]
    assert _same_outputs(run_step(worker, numpy_step, batch), run_step(twin, step, batch))
    assert worker.store.eviction_order() == twin.store.eviction_order()


def test_numpy_generation_and_a_read_only_mapping_of_requests_are_valid():
    """Any integral generation and any mapping of requests pass, as the checks promise; the
    worker then behaves as with vLLM's own int and dict."""
    worker, twin = make_worker(), make_worker()
    assert _same_outputs(_first_step(worker), _first_step(twin))
    step = meta({"a": 6, "c": 0}, {"a": hashes(1, range(1, 2)), "c": hashes(1, range(1))})
    unusual = _as_namespace(step)
    unusual.generation = np.int64(step.generation)
    unusual.requests = MappingProxyType(dict(step.requests))
    unusual.block_hashes = MappingProxyType(dict(step.block_hashes))
    batch = [("a", 1, 6, 2), ("c", 1, 4, 2)]
    assert _same_outputs(run_step(worker, unusual, batch), run_step(twin, step, batch))
    assert worker.store.eviction_order() == twin.store.eviction_order()


def _padded(requests: dict, to: int) -> dict:
    """``requests`` after valid requests ``p0``, ``p1``, ... up to ``to`` entries."""
    return {**{f"p{i}": i for i in range(to - len(requests))}, **requests}


# Emit starts come back as Python ints up to EMIT_LIST_MAX requests, else as an array.
EMIT_FORMS = {"list": EMIT_LIST_MAX, "array": EMIT_LIST_MAX + 1}


@pytest.mark.parametrize("form", EMIT_FORMS)
def test_uint64_emit_starts_that_fit_int64_are_kept(form):
    known = {"a"}.__contains__
    for start in (5, 2**63 - 1):
        requests = _padded({"a": np.uint64(start)}, EMIT_FORMS[form])
        starts = checked_emit_starts(meta(requests), known, 0)
        if form == "list":
            assert type(starts) is list and all(type(v) is int for v in starts)
        else:
            assert starts.dtype == np.int64
        assert list(starts) == list(range(len(requests) - 1)) + [start]


@pytest.mark.parametrize("value, error", METADATA_CORRUPTIONS["requests"][2:], ids=repr)
def test_both_forms_of_emit_starts_refuse_the_same_values(value, error):
    """A bad emit start is refused with the same error however many requests the step
    schedules, first or last among them."""
    messages = set()
    for size in EMIT_FORMS.values():
        for requests in (_padded(value, size), {**value, **_padded({}, size - len(value))}):
            with pytest.raises(error) as info:
                checked_emit_starts(meta(requests), set(requests).__contains__, 0)
            messages.add(str(info.value).split(":")[0])
    assert len(messages) == 1, messages


@pytest.mark.parametrize("form", EMIT_FORMS)
def test_an_emit_cursor_ahead_is_refused_in_either_form(form):
    """The scheduler's emit start ahead of the worker's cursor for one request of many,
    with no step in flight to explain it, is a protocol violation (vLLM's assertion)."""
    size = EMIT_FORMS[form]
    worker = make_worker(max_num_seqs=size, max_num_batched_tokens=2 * size)
    ids = [f"r{i}" for i in range(size)]
    run_step(worker, meta(dict.fromkeys(ids, 0)), [(r, i, 0, 2) for i, r in enumerate(ids)])
    assert run_step(worker, meta(dict.fromkeys(ids, 2)), [(r, i, 2, 1) for i, r in enumerate(ids)])
    ahead = dict.fromkeys(ids, 3)
    ahead[ids[size // 2]] = 4
    with pytest.raises(AuxOutputProtocolError, match="emit cursor moved ahead"):
        worker.begin_step(meta(ahead))
    worker.close()


def test_a_step_without_requests_has_int64_emit_starts_that_nothing_can_write():
    """Steps that schedule nothing (only finishes, or an empty step) still check everything
    else, and hand on an empty int64 array shared between them, so it must be read-only."""
    known = {"a"}.__contains__
    starts = checked_emit_starts(meta({}), known, 0)
    assert starts.dtype == np.int64 and starts.shape == (0,)
    assert not starts.flags.writeable
    assert checked_emit_starts(meta({}), known, 0) is starts
    with pytest.raises(KeyError, match="metadata.block_hashes names unknown request 'zz'"):
        checked_emit_starts(meta({}, {"zz": PACKED_OK}), known, 0)
    finished = _as_namespace(meta({}))
    finished.finished_requests = ("zz",)
    with pytest.raises(KeyError, match="metadata.finished_requests names unknown request 'zz'"):
        checked_emit_starts(finished, known, 0)


@pytest.mark.parametrize("missing", ["generation", "requests", "block_hashes", "finished_requests"])
def test_metadata_missing_a_field_names_that_field(missing):
    fields = dict(generation=0, requests={}, block_hashes={}, finished_requests=())
    del fields[missing]
    with pytest.raises(TypeError, match=f"SimpleNamespace without {missing}$"):
        checked_emit_starts(SimpleNamespace(**fields), {"a"}.__contains__, 0)


@pytest.mark.parametrize("emit_start", [2**63, np.uint64(2**64 - 1)], ids=repr)
def test_emit_start_beyond_int64_is_refused(emit_start):
    # numpy reads these as uint64; cast to the int64 cursors they became negative.
    worker, twin = make_worker(), make_worker()
    assert _same_outputs(_first_step(worker), _first_step(twin))
    bad = _as_namespace(meta({"b": 3}))
    bad.requests = {"b": emit_start}
    with pytest.raises(ValueError, match="metadata.requests has an emit start beyond int64"):
        worker.begin_step(bad)
    assert _same_outputs(_second_step(worker), _second_step(twin))


@pytest.mark.parametrize("bad", [None, {"requests": {}}, "metadata", 3], ids=repr)
def test_metadata_of_the_wrong_type_is_named(bad):
    worker = make_worker()
    if bad is None:  # vLLM's warmup steps: no metadata is valid
        worker.begin_step(bad)
        return
    with pytest.raises(TypeError, match="metadata must be an AuxOutputConnectorMetadata"):
        worker.begin_step(bad)


def test_block_hashes_of_a_request_a_reset_clears_are_refused_before_anything_changes():
    """A generation bump clears every request first, as in vLLM: block hashes naming a
    request of the old generation that is not scheduled again are a KeyError naming the
    field, raised before the reset is applied."""
    worker, twin = make_worker(), make_worker()
    assert _same_outputs(_first_step(worker), _first_step(twin))
    with pytest.raises(KeyError, match="metadata.block_hashes names unknown request 'a'"):
        worker.begin_step(meta({"b": 3}, {"a": hashes(1, range(1, 2))}, generation=1))
    assert _same_outputs(_second_step(worker), _second_step(twin))


@pytest.mark.parametrize("field", ["finished_requests", "block_hashes"])
def test_a_request_whose_teardown_is_recorded_is_unknown(field):
    """b finishes with no step in flight: as in vLLM, whose teardown is immediate, b is gone
    although its teardown waits for the output thread. A later step naming b again is a
    KeyError naming the field, raised before anything changes."""
    worker, twin = make_worker(), make_worker()
    assert _same_outputs(_first_step(worker), _first_step(twin))
    for w in (worker, twin):
        w.begin_step(meta({}, finished=["b"]))
    again = meta({}, finished=["b"]) if field == "finished_requests" else meta({}, {"b": PACKED_OK})
    with pytest.raises(KeyError, match=f"metadata.{field} names unknown request 'b'"):
        worker.begin_step(again)
    assert _same_outputs(_second_step(worker), _second_step(twin))


def test_a_batch_naming_a_request_whose_teardown_is_recorded_is_refused():
    """As in vLLM, whose finished request has no state left: the batch's ``req_ids`` may not
    name b once its teardown is recorded (a KeyError naming b, nothing in flight)."""
    worker, twin = make_worker(), make_worker()
    assert _same_outputs(_first_step(worker), _first_step(twin))
    for w in (worker, twin):
        w.begin_step(meta({}, finished=["b"]))
        w.begin_step(meta({"a": 6}))
    with pytest.raises(KeyError, match="'b'"):
        worker.prepare_output(batch_of(worker, **_batch_fields()))
    assert _same_outputs(_second_step(worker), _second_step(twin))


def _batch_fields():
    return dict(
        req_ids=["b"],
        query_start_loc_np=np.array([0, 1], np.int32),
        num_computed_tokens_np=np.array([3], np.int32),
        positions=torch.tensor([3]),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
    )


BATCH_CORRUPTIONS = {
    "query_start_loc_np": [
        np.array([0]),
        np.array([0.0, 1.0]),
        np.array([], np.int32),
        np.array([0, SIZES["max_num_batched_tokens"] + 1], np.int32),  # one row too many
        np.array([0, -1], np.int32),  # fewer than no rows
    ],
    "num_computed_tokens_np": [np.array([], np.int32)],
    "positions": [
        None,
        torch.zeros(1),
        torch.zeros(1, 1, dtype=torch.int64),
        np.array([3]),
        torch.tensor([3, 9, 4, 9])[::2],  # strided: the kernel would read the wrong entries
    ],
    "query_start_loc": [
        None,
        torch.tensor([0.0, 1.0]),
        torch.tensor([0]),
        np.array([0, 1]),
        torch.tensor([0, 9, 1, 9], dtype=torch.int32)[::2],
    ],
    # MRV2's request indices: missing, not a tensor, floats, strided, too few.
    "idx_mapping": [
        None,
        np.array([2]),
        torch.tensor([2.0]),
        torch.tensor([2, 9, 2, 9])[::2],
        torch.zeros(0, dtype=torch.int64),
    ],
    # A request twice; one request more than max_num_seqs (distinct ids, and twice).
    "req_ids": [["b", "b"], ["b"] + [f"x{i}" for i in range(SIZES["max_num_seqs"])], ["b"] * 5],
}


@pytest.mark.parametrize(
    "field, value",
    [(field, value) for field, values in BATCH_CORRUPTIONS.items() for value in values],
    ids=[f"{field}-{i}" for field, values in BATCH_CORRUPTIONS.items() for i in range(len(values))],
)
def test_malformed_input_batch_is_named_and_changes_nothing(field, value):
    worker, twin = make_worker(), make_worker()
    _first_step(worker), _first_step(twin)
    worker.begin_step(meta({"b": 3}))
    fields = dict(_batch_fields(), **{field: value})
    if field == "req_ids" and len(value) > 1:
        fields["query_start_loc_np"] = np.arange(len(value) + 1, dtype=np.int32)
        fields["num_computed_tokens_np"] = np.full(len(value), 3, np.int32)
    if field not in ("idx_mapping", "req_ids"):
        fields = vars(batch_of(worker, **fields))
    with pytest.raises(ValueError) as info:
        worker.prepare_output(SimpleNamespace(**fields))
    message = str(info.value)
    assert f"input_batch.{field}" in message or "input_batch has" in message, message
    # The refused batch left nothing in flight.
    _assert_b_runs_as_on_the_twin(worker, twin)


# The step's device rejected counts (``set_step_num_rejected``, from the plugin, not from the
# batch): the kernel's own error, naming ``num_rejected``.
DEVICE_REJECTED_CORRUPTIONS = [
    torch.zeros(1),
    torch.zeros(1, 1, dtype=torch.int32),
    torch.zeros(0, dtype=torch.int32),
    torch.zeros(4, dtype=torch.int32)[::2],  # strided: the kernel would read entry 2
    np.zeros(1, np.int32),
]


@pytest.mark.parametrize(
    "value", DEVICE_REJECTED_CORRUPTIONS, ids=range(len(DEVICE_REJECTED_CORRUPTIONS))
)
def test_malformed_device_rejected_counts_are_named_and_change_nothing(value):
    worker, twin = make_worker(), make_worker()
    _first_step(worker), _first_step(twin)
    worker.begin_step(meta({"b": 3}))
    worker.set_step_num_rejected(value)
    with pytest.raises(KernelArgumentError, match="^gather_alloc: num_rejected ") as info:
        worker.prepare_output(batch_of(worker, **_batch_fields()))
    assert info.value.argument == "num_rejected"
    # The counts were for that call only, and the refused call left nothing in flight.
    _assert_b_runs_as_on_the_twin(worker, twin)


def _assert_b_runs_as_on_the_twin(worker, twin) -> None:
    """After a refused ``prepare_output`` of b's step on ``worker`` (whose ``begin_step`` ran),
    b's step and the next one give the same outputs as on ``twin``, which never saw it."""
    outputs = []
    for w in (worker, twin):
        if w is twin:
            w.begin_step(meta({"b": 3}))
        w.capture_buffer[:1] = torch.from_numpy(routes(2, 3, 1))
        pending = w.prepare_output(batch_of(w, **_batch_fields()))
        pending.enqueue_cpu_copy(np.ones(1, np.int32), np.zeros(1, np.int32))
        outputs.append(pending.process_output())
    assert _same_outputs(*outputs)
    assert _same_outputs(_second_step(worker), _second_step(twin))


COUNT_CORRUPTIONS = [
    None,
    [1],
    np.ones(0, np.int32),
    np.ones(1, np.float32),
    np.ones((1, 1), np.int32),
    torch.ones(1, dtype=torch.int32),
]


@pytest.mark.parametrize("which", ["num_sampled", "num_rejected"])
@pytest.mark.parametrize("value", COUNT_CORRUPTIONS, ids=range(len(COUNT_CORRUPTIONS)))
def test_malformed_host_counts_fail_the_step_like_any_failed_commit(which, value):
    """The counts are read (and so checked) by ``process_output`` on the output thread, not
    by ``enqueue_cpu_copy`` on the main thread: a malformed array fails its step there, named,
    and the worker goes on exactly like a twin whose step failed vLLM's own count check."""
    worker, twin = make_worker(), make_worker()
    _first_step(worker), _first_step(twin)
    for w in (worker, twin):
        w.begin_step(meta({"b": 3}))
        w.capture_buffer[:1] = torch.from_numpy(routes(2, 3, 1))
        pending = w.prepare_output(batch_of(w, **_batch_fields()))
        counts = dict(num_sampled=np.ones(1, np.int32), num_rejected=np.full(1, 5, np.int32))
        if w is worker:
            counts = dict(num_sampled=np.ones(1, np.int32), num_rejected=np.zeros(1, np.int32))
            counts[which] = value
        pending.enqueue_cpu_copy(**counts)
        if w is worker:
            with pytest.raises(ValueError, match=f"^{which} must be a 1-D integer numpy array"):
                pending.process_output()
        else:
            with pytest.raises(AssertionError, match="rejected-token count is invalid"):
                pending.process_output()
    assert _same_outputs(_second_step(worker), _second_step(twin))


def test_step_outputs_of_the_scenario_are_what_the_twins_compare():
    """The scenario the properties replay is not vacuous: it emits, publishes and hits."""
    worker = make_worker()
    first = _first_step(worker)
    assert np.array_equal(first["a"].rows, routes(1, 0, 6).astype(np.uint8))
    assert np.array_equal(first["b"].rows, routes(2, 0, 3).astype(np.uint8))
    second = _second_step(worker)
    assert np.array_equal(second["a"].rows, routes(1, 6, 2).astype(np.uint8))
    # c hit a's first block: rows 0..3 come from the store, 4..5 from its own step.
    assert second["c"].token_start == 0
    assert np.array_equal(second["c"].rows, routes(1, 0, 6).astype(np.uint8))
    assert len(worker.store) == 2


def test_results_of_a_step_whose_copy_was_not_started_are_refused():
    """The commit never reads the host buffers in place of a copy that was not started."""
    worker = make_worker()
    _first_step(worker)
    worker.begin_step(meta({"b": 3}))
    pending = worker.prepare_output(batch_of(worker, **_batch_fields()))
    with pytest.raises(AssertionError, match="CPU copy was not enqueued"):
        worker.device_side.host_results(pending.launched)
    pending.enqueue_cpu_copy(np.ones(1, np.int32), np.zeros(1, np.int32))
    step_info, staged = worker.device_side.host_results(pending.launched)
    assert step_info.shape == (1, 4) and staged is None
    # start 3, one row written, status OK; block 0 already had its slot
    assert tuple(step_info[0]) == (3, 1, 0, 0)
    assert pending.process_output()["b"].token_start == 3


def test_unusual_but_valid_step_input_behaves_like_the_usual():
    """What vLLM's worker also reads: finish events as a list, hashes in a bytearray with a
    numpy item size, and host batch arrays longer than the step (it reads the first
    ``num_reqs`` entries). Same outputs and store as a twin given the usual types."""
    worker, twin = make_worker(), make_worker()
    assert _same_outputs(_first_step(worker), _first_step(twin))
    step = meta({"a": 6, "c": 0}, {"a": hashes(1, range(1, 2)), "c": hashes(1, range(1))})
    unusual = _as_namespace(step)
    unusual.block_hashes = {
        r: PackedBlockHashes(bytearray(p.data), np.int64(p.item_size))
        for r, p in step.block_hashes.items()
    }
    batch = [("a", 1, 6, 2), ("c", 1, 4, 2)]
    assert _same_outputs(run_step(worker, unusual, batch, padding=3), run_step(twin, step, batch))
    done = _as_namespace(meta({"d": 0}))
    done.finished_requests = ["a", "c"]
    next_step = [("d", 3, 0, 2)]
    assert _same_outputs(
        run_step(worker, done, next_step),
        run_step(twin, meta({"d": 0}, finished=("a", "c")), next_step),
    )
    # The finished requests' keys were released: unreferenced now, in vLLM's order.
    assert len(worker.store.eviction_order()) == 2
    assert worker.store.eviction_order() == twin.store.eviction_order()


# ------------------------------------------------ request indices and launch serials
# Inputs Model Runner V2 never sends, which the kernel fails by status (docs/errors.md): the
# step raises before any of its rows is returned, and no later step returns a wrong row.

KERNELS = [
    pytest.param(dict(kernel_impl="reference", destination="direct"), id="reference-direct"),
    pytest.param(dict(kernel_impl="triton", destination="direct"), id="triton-direct"),
    pytest.param(dict(kernel_impl="triton", destination="staging"), id="triton-staging"),
]


def _rows(seed: int, start: int, count: int) -> np.ndarray:
    return routes(seed, start, count).astype(np.uint8)


def _returned(out: dict, request_id: str, seed: int, start: int, count: int) -> bool:
    return out[request_id].token_start == start and np.array_equal(
        out[request_id].rows, _rows(seed, start, count)
    )


@pytest.mark.parametrize("options", KERNELS)
def test_two_requests_of_a_step_on_one_index_fail_it_and_every_later_step_on_that_index(
    options,
):
    """a holds index 0 and b index 1; a step gives index 0 to a and to a new request c too.
    The step raises naming both (b's rows in it are not returned either); a alone on index 0
    raises again, b goes on with the right rows, and a request new to index 0 takes it."""
    worker = make_worker(**options)
    out = run_step(worker, meta({"a": 0, "b": 0}), [("a", 1, 0, 6), ("b", 2, 0, 3)], indices=[0, 1])
    assert _returned(out, "a", 1, 0, 6) and _returned(out, "b", 2, 0, 3)
    shared = "status=7 \\(SHARED_INDEX\\).*input_batch.idx_mapping"
    with pytest.raises(AuxOutputProtocolError, match=f"request=a, {shared}.*\\['a', 'c'\\]"):
        run_step(
            worker,
            meta({"a": 6, "b": 3, "c": 0}),
            [("a", 1, 6, 2), ("b", 2, 3, 2), ("c", 3, 0, 5)],
            indices=[0, 1, 0],
        )
    with pytest.raises(AuxOutputProtocolError, match=f"request=a, {shared}"):
        run_step(worker, meta({"a": 6}), [("a", 1, 6, 2)], indices=[0])
    out = run_step(worker, meta({"b": 3}), [("b", 2, 3, 2)], indices=[1])
    assert _returned(out, "b", 2, 3, 2)
    worker.begin_step(meta({}, finished=["a", "c"]))
    out = run_step(worker, meta({"b": 5, "d": 0}), [("b", 2, 5, 4), ("d", 4, 0, 6)], indices=[1, 0])
    assert _returned(out, "b", 2, 5, 4) and _returned(out, "d", 4, 0, 6)
    worker.close()


@pytest.mark.parametrize("options", KERNELS)
def test_a_request_given_another_ones_index_for_one_step_keeps_its_own_blocks(options):
    """b (index 1) is given a's index 0 for one step, in which its rows reach a block a does
    not hold: the kernel takes a queue entry for it all the same. That slot goes back to the
    store, not to b's ring, so b's next step, on its own index, finds its blocks where the
    device put them."""
    worker = make_worker(**options)
    run_step(worker, meta({"a": 0, "b": 0}), [("a", 1, 0, 6), ("b", 2, 0, 3)], indices=[0, 1])
    with pytest.raises(AuxOutputProtocolError, match="request=a, status=7 \\(SHARED_INDEX\\)"):
        run_step(worker, meta({"a": 6, "b": 3}), [("a", 1, 6, 2), ("b", 2, 3, 6)], indices=[0, 0])
    out = run_step(worker, meta({"b": 3}), [("b", 2, 3, 6)], indices=[1])
    assert _returned(out, "b", 2, 3, 6)
    out = run_step(worker, meta({"b": 9}), [("b", 2, 9, 4)], indices=[1])
    assert _returned(out, "b", 2, 9, 4)
    worker.close()


@pytest.mark.parametrize("options", KERNELS)
def test_a_request_index_out_of_range_fails_the_step_naming_idx_mapping(options):
    worker = make_worker(**options)
    with pytest.raises(
        AuxOutputProtocolError,
        match="request=a, status=4 \\(BAD_INDEX\\).*input_batch.idx_mapping gives it a request "
        "index outside \\[0, max_num_seqs\\)",
    ):
        run_step(worker, meta({"a": 0}), [("a", 1, 0, 3)], indices=[SIZES["max_num_seqs"]])
    worker.close()


@pytest.mark.parametrize("options", KERNELS)
def test_a_launch_serial_off_by_one_fails_that_step_and_every_later_one(options):
    """A caller that counts a step without requests as a launch (the kernel launches nothing
    for it) passes serial 3 after launch 1: the step would read the queue head launch 1
    read, and give b a's slot. Every request of it fails, and so does every later step."""
    worker = make_worker(**options)
    out = run_step(worker, meta({"a": 0}), [("a", 1, 0, 4)])
    assert _returned(out, "a", 1, 0, 4)
    worker._book.launcher._launches += 1
    for step in range(2):
        with pytest.raises(
            AuxOutputProtocolError,
            match="request=b, status=6 \\(BAD_LAUNCH\\).*launch serial is not the last",
        ):
            run_step(worker, meta({"b": 0} if step else {"a": 4, "b": 0}), [("b", 2, 0, 4)])
    worker.close()


def test_a_kernel_whose_buffers_do_not_cover_the_sizing_is_refused(monkeypatch):
    """The launch checks only the batch's tensors, trusting its counts to the sizing's
    limits: attaching a kernel whose buffers hold fewer rows than max_num_batched_tokens
    is refused by name."""
    from dataclasses import replace

    from r3capture.aux_output.device_side import DeviceSide

    static = DeviceSide.static
    monkeypatch.setattr(
        DeviceSide,
        "static",
        property(
            lambda side: replace(
                static.fget(side), capture_rows=SIZES["max_num_batched_tokens"] - 1
            )
        ),
    )
    with pytest.raises(ValueError, match="must cover max_num_seqs .* and max_num_batched_tokens"):
        make_worker()


class _PositionsTensor(torch.Tensor):
    """A tensor subclass: valid input the launch's one-expression check does not take."""


def test_a_tensor_subclass_of_positions_launches_like_a_tensor():
    """The launch's quick check refuses what is not exactly a torch.Tensor; the full check
    then accepts a valid subclass and the step returns the twin's rows."""
    worker, twin = make_worker(), make_worker()
    _first_step(worker), _first_step(twin)
    outputs = []
    for w in (worker, twin):
        w.begin_step(meta({"b": 3}))
        w.capture_buffer[:1] = torch.from_numpy(routes(2, 3, 1))
        fields = _batch_fields()
        if w is worker:
            fields["positions"] = fields["positions"].as_subclass(_PositionsTensor)
            assert type(fields["positions"]) is _PositionsTensor
        pending = w.prepare_output(batch_of(w, **fields))
        pending.enqueue_cpu_copy(np.ones(1, np.int32), np.zeros(1, np.int32))
        outputs.append(pending.process_output())
    assert _same_outputs(*outputs) and outputs[0]
    assert _same_outputs(_second_step(worker), _second_step(twin))
