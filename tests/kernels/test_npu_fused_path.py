"""The eager tower kernels' fused-norm path (``drama3_patches.kernels.npu_fused``), run on the CPU.

torch-npu's ``npu_rms_norm`` and ``npu_add_rms_norm`` are stood in for by two custom ops
(namespace ``drama3_test``) computing their formula in float32, each registered as one op, so
``support.launches`` counts one launch per fused op, as on the card. With the detection
monkeypatched to a backend built on them, the kernels take the path they take on an NPU:

(a) at the tower's published shapes (``support.tower_calls``), batch 1 and 64, every result agrees
    with the eager path's within bfloat16 tolerance, and the residual sums are the eager ones;
(b) the launches per call and per frame stay within ``support.fused_path`` (the budget the
    card is held to in tests/hardware/test_npu_fused_norms.py);
(c) the detection answers None for CPU tensors, for an ``npu`` device without torch-npu's ops
    and under ``DRAMA3_PATCHES_NPU_FUSED=0``, and never imports torch_npu for a CPU tensor;
(d) on the simulated ``npu`` device (``support.fake_npu``), the ops the detection finds prove
    themselves once per dtype before use: a correct pair passes and is used; a pair with one op of
    the wrong arity, the wrong shape, wrong values, or one that raises gives exactly one warning
    naming the op and the difference, and every norm kernel returns the eager path's result bit for
    bit. The self-check's reference is the eager gemma norm, bit for bit.

The CPU path itself is held bit for bit and launch for launch by test_kernels_fish_omni.py and
test_launch_budget.py.
"""

from __future__ import annotations

import importlib.abc
import logging
import sys
import types

import pytest

from support.tiers import TORCH_ABSENT

torch = pytest.importorskip("torch", reason=TORCH_ABSENT)

from drama3_patches import env  # noqa: E402
from drama3_patches.kernels import norms, npu_fused  # noqa: E402
from support.fused_path import (  # noqa: E402
    BATCHES, FUSED_KERNELS, PER_CALL, PER_FRAME, assert_bf16_close, budget, frame_launches)
from support.fused_standin import CONTRACT_FAULTS, FAULTS, STAND_IN, faulty  # noqa: E402
from support.launches import count  # noqa: E402
from support.logs import captured  # noqa: E402
from support.tower_calls import CALLS_PER_FRAME, tower_calls  # noqa: E402

# which fused ops each call makes on the fused path
FUSED_OPS = {
    "fused_qk_rmsnorm_rope_gate": {"fused_rms_norm": 2},
    "gemma_rms_norm": {"fused_rms_norm": 1},
    "gemma_rms_norm+residual": {"fused_add_rms_norm": 1},
    "gemma_rms_norm_table": {"fused_add_rms_norm": 1},
    "tower_mix_norm": {"fused_rms_norm": 2},
}
# the eager norm's own ops: none of them may run where a fused op replaced it
EAGER_NORM_OPS = {"pow", "mean", "rsqrt", "rsqrt_"}


def _with_stand_in(mp: pytest.MonkeyPatch) -> None:
    mp.setattr(npu_fused, "fused_norms", lambda device: STAND_IN)


def _outputs(result) -> tuple:
    return result if isinstance(result, tuple) else (result,)


# -- (a) results ---------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=BATCHES, ids=[f"batch{b}" for b in BATCHES])
def both_paths(request):
    """``(eager, fused)`` results of each fused-path kernel on the same arguments."""
    calls = tower_calls(request.param)
    eager = {name: _outputs(calls[name][0](*calls[name][1], **calls[name][2])) for name in FUSED_KERNELS}
    with pytest.MonkeyPatch.context() as mp:
        _with_stand_in(mp)
        fused = {name: _outputs(calls[name][0](*calls[name][1], **calls[name][2])) for name in FUSED_KERNELS}
    return eager, fused


@pytest.mark.parametrize("name", FUSED_KERNELS)
def test_fused_path_agrees_with_the_eager_path_within_bfloat16_tolerance(both_paths, name):
    eager, fused = both_paths
    assert len(fused[name]) == len(eager[name])
    # the normalised rows: the first output (q, k as well for the fused QK kernel)
    normalised = 2 if name == "fused_qk_rmsnorm_rope_gate" else 1
    for got, want in zip(fused[name][:normalised], eager[name][:normalised]):
        assert_bf16_close(got, want)


@pytest.mark.parametrize("name", ["gemma_rms_norm+residual", "gemma_rms_norm_table"])
def test_fused_residual_variants_return_the_eager_sum(both_paths, name):
    # x + residual (or + the masked code row) rounded once to x's dtype, as the eager path returns it
    eager, fused = both_paths
    assert len(fused[name]) == 2
    assert torch.equal(fused[name][1], eager[name][1])


def test_fused_qk_copies_the_raw_gate_as_the_eager_path_does(both_paths):
    eager, fused = both_paths
    assert torch.equal(fused["fused_qk_rmsnorm_rope_gate"][2], eager["fused_qk_rmsnorm_rope_gate"][2])


def test_tolerance_tells_a_wrong_gamma_apart():
    """The fused path's gamma is ``1 + w``: a gamma of ``w`` alone fails the comparison above."""
    x, w = tower_calls(1)["gemma_rms_norm"][1][:2]
    want = norms.gemma_rms_norm(x, w, 1e-6)
    assert_bf16_close(STAND_IN.rms_norm(x, norms.fused_gamma(w, x.dtype), 1e-6), want)
    with pytest.raises(AssertionError):
        assert_bf16_close(STAND_IN.rms_norm(x, w, 1e-6), want)


def test_fused_gamma_follows_in_place_weight_changes(monkeypatch):
    """The ``1 + w`` prepared in the activation dtype is rebuilt when the weight changes in place."""
    _with_stand_in(monkeypatch)
    x, w = torch.randn(3, 16).to(torch.bfloat16), torch.zeros(16, dtype=torch.bfloat16)
    first = norms.gemma_rms_norm(x, w, 1e-6)
    w.add_(1.0)  # 1 + w doubles, exactly
    assert torch.equal(norms.gemma_rms_norm(x, w, 1e-6), first * 2)


# -- (b) launches --------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=BATCHES, ids=[f"batch{b}" for b in BATCHES])
def counted(request):
    batch = request.param
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        _with_stand_in(mp)
        for name, (kernel, args, kwargs) in tower_calls(batch).items():
            kernel(*args, **kwargs)  # first call: prepares the gammas
            out[name] = count(kernel, *args, **kwargs)
    return batch, out


def test_every_tower_call_has_a_fused_path_budget():
    assert set(PER_CALL) == set(CALLS_PER_FRAME) == set(tower_calls(1))
    assert set(FUSED_KERNELS) < set(PER_CALL)


@pytest.mark.parametrize("name", sorted(PER_CALL))
def test_fused_path_launches_per_call_within_budget(counted, name):
    batch, counts = counted
    assert counts[name].launches <= budget(name, batch), (batch, name, dict(counts[name].by_op))


def test_fused_path_launches_per_frame_within_budget(counted):
    batch, counts = counted
    frame = frame_launches(counts)
    assert frame <= PER_FRAME[batch], frame


@pytest.mark.parametrize("name", FUSED_KERNELS)
def test_each_norm_is_one_fused_op(counted, name):
    _, counts = counted
    ops = counts[name].by_op
    assert {op: n for op, n in ops.items() if op.startswith("fused_")} == FUSED_OPS[name]
    assert not EAGER_NORM_OPS & set(ops), dict(ops)


def test_fused_path_has_no_host_sync(counted):
    _, counts = counted
    assert {name: c.sync_ops for name, c in counts.items() if c.syncs} == {}


# -- (c) detection -------------------------------------------------------------------------------


class _ImportRecorder(importlib.abc.MetaPathFinder):
    """Notes every lookup of ``torch_npu`` (and its submodules); finds nothing itself."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torch_npu":
            self.seen.append(name)
        return None


class _Untouchable(types.ModuleType):
    """A ``torch_npu`` that fails any attribute read: the detection must not look at it."""

    def __getattr__(self, name):
        raise AssertionError(f"torch_npu.{name} read for a CPU tensor")


def test_detection_is_none_for_cpu_tensors_without_importing_torch_npu(monkeypatch):
    recorder = _ImportRecorder()
    monkeypatch.setattr(sys, "meta_path", [recorder, *sys.meta_path])
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    monkeypatch.setattr(npu_fused, "_BACKENDS", {})
    assert npu_fused.fused_norms(torch.device("cpu")) is None
    for name, (kernel, args, kwargs) in tower_calls(1).items():
        kernel(*args, **kwargs)
    assert recorder.seen == [] and "torch_npu" not in sys.modules
    # an imported torch_npu is not consulted for a CPU tensor either
    monkeypatch.setitem(sys.modules, "torch_npu", _Untouchable("torch_npu"))
    x = torch.ones(2, 8, dtype=torch.bfloat16)
    assert npu_fused.fused_norms(x.device) is None and npu_fused.for_tensor(x) is None
    assert npu_fused._BACKENDS == {}


@pytest.mark.parametrize("raw, on", [(None, True), ("", True), ("1", True), ("on", True), ("0", False),
                                     ("off", False), ("false", False)])
def test_opt_out_variable_reads_as_the_contract_says(monkeypatch, raw, on):
    if raw is not None:
        monkeypatch.setenv(env.NPU_FUSED, raw)
    assert env.npu_fused() is on


def test_opt_out_variable_with_a_bad_value_warns_and_keeps_the_eager_path(monkeypatch, capsys):
    monkeypatch.setenv(env.NPU_FUSED, "fast")
    monkeypatch.setattr(env, "_warned", set())
    assert env.npu_fused() is False
    assert env.NPU_FUSED in capsys.readouterr().err


def _fake_torch_npu(*names: str, **replaced) -> tuple[types.ModuleType, list]:
    """A ``torch_npu`` module holding the stand-in ops under torch-npu's names (``replaced``: other
    callables under some of them); calls are noted."""
    module, calls = types.ModuleType("torch_npu"), []
    ops = {"npu_rms_norm": torch.ops.drama3_test.fused_rms_norm,
           "npu_add_rms_norm": torch.ops.drama3_test.fused_add_rms_norm, **replaced}

    def noting(name):
        def op(*args):
            calls.append(name)
            return ops[name](*args)
        return op

    for name in names:
        setattr(module, name, noting(name))
    return module, calls


@pytest.fixture
def npu_device(monkeypatch):
    """The simulated ``npu`` device (process-wide: the tests using it fork), a fresh detection cache."""
    from support import fake_npu

    fake_npu.enable()
    monkeypatch.setattr(npu_fused, "_BACKENDS", {})
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    return fake_npu


@pytest.mark.forked
def test_on_an_npu_device_the_kernels_use_the_imported_torch_npu_ops(npu_device, monkeypatch):
    module, calls = _fake_torch_npu("npu_rms_norm", "npu_add_rms_norm")
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    device = torch.device("npu")
    backend = npu_fused.fused_norms(device)
    assert isinstance(backend, npu_fused.FusedNorms)
    assert npu_fused.fused_norms(device) is backend  # found once per device type
    x, w, eps = tower_calls(4)["gemma_rms_norm"][1]
    r = tower_calls(4)["gemma_rms_norm+residual"][2]["residual"]
    got = norms.gemma_rms_norm(npu_device.to_npu(x), npu_device.to_npu(w), eps)
    got_y, got_sum = norms.gemma_rms_norm(npu_device.to_npu(x), npu_device.to_npu(w), eps, npu_device.to_npu(r))
    # the self-check's two calls, then the kernels'
    assert calls == ["npu_rms_norm", "npu_add_rms_norm", "npu_rms_norm", "npu_add_rms_norm"]
    assert got.device.type == "npu"
    assert_bf16_close(got.cpu(), norms.gemma_rms_norm(x, w, eps))
    want_y, want_sum = norms.gemma_rms_norm(x, w, eps, r)
    assert_bf16_close(got_y.cpu(), want_y)
    assert torch.equal(got_sum.cpu(), want_sum)


@pytest.mark.forked
def test_on_an_npu_device_the_opt_out_keeps_the_eager_path(npu_device, monkeypatch):
    module, calls = _fake_torch_npu("npu_rms_norm", "npu_add_rms_norm")
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    monkeypatch.setenv(env.NPU_FUSED, "0")
    assert npu_fused.fused_norms(torch.device("npu")) is None
    x, w, eps = tower_calls(4)["gemma_rms_norm"][1]
    got = norms.gemma_rms_norm(npu_device.to_npu(x), npu_device.to_npu(w), eps)
    assert calls == []
    assert torch.equal(got.cpu(), norms.gemma_rms_norm(x, w, eps))  # the eager path, bit for bit


@pytest.mark.forked
@pytest.mark.parametrize("ops", [(), ("npu_rms_norm",), ("npu_add_rms_norm",)],
                         ids=["no-torch_npu", "without-add_rms_norm", "without-rms_norm"])
def test_on_an_npu_device_without_both_ops_the_detection_is_none(npu_device, monkeypatch, ops):
    if ops:
        monkeypatch.setitem(sys.modules, "torch_npu", _fake_torch_npu(*ops)[0])
    assert npu_fused.fused_norms(torch.device("npu")) is None
    x, w, eps = tower_calls(4)["gemma_rms_norm"][1]
    assert torch.equal(norms.gemma_rms_norm(npu_device.to_npu(x), npu_device.to_npu(w), eps).cpu(),
                       norms.gemma_rms_norm(x, w, eps))


# -- (d) the self-check --------------------------------------------------------------------------

_NPU_FUSED_LOGGER = npu_fused.logger.name
# what the warning says for each fault (after the op's name)
_FAULT_WORDS = {"arity": "expected a tuple of", "shape": "of shape (1, ", "values": "differs from",
                "raises": "raised RuntimeError: ", "layernorm": "differs from the eager gemma norm",
                "whole-row": "differs from the eager gemma norm", "epsilon": "differs from the eager gemma norm"}


def test_self_check_tolerance_in_bfloat16_is_the_path_tests_relative_tolerance():
    """Two bfloat16 eps relative to each value: what the path tests allow relative to each value."""
    from support import fused_path

    assert npu_fused.tolerance(torch.bfloat16) == fused_path.TOLERANCE == 2.0 ** -6
    assert npu_fused.tolerance(torch.float16) == 2.0 ** -9 and npu_fused.tolerance(torch.float32) == 2.0 ** -19


def _worst(fused, dtype) -> dict:
    """The largest relative difference from the probe's expected ``y`` of each op of ``fused``."""
    inputs, wants = npu_fused.probe(dtype)
    gamma = (inputs["weight"].to(torch.float32) + 1).to(dtype)
    got = {"rms_norm": fused._rms_norm(inputs["x3"], gamma, 1e-6)[0],
           "add_rms_norm": fused._add_rms_norm(inputs["x2"], inputs["residual"], gamma, 1e-6)[0]}
    out = {}
    for op, y in got.items():
        want = (wants[op][0] if op == "add_rms_norm" else wants[op]).to(torch.float32)
        off = (y.to(torch.float32) - want).abs()
        out[op] = (off / want.abs().clamp_min(torch.finfo(torch.float32).tiny)).max().item()
    return out


@pytest.mark.parametrize("dtype", npu_fused.FUSED_DTYPES, ids=str)
def test_the_probe_passes_the_right_ops_and_misses_each_look_alike_by_far_more_than_the_tolerance(dtype):
    """LayerNorm, the whole row instead of each head (for 2-D rows: the whole batch), another eps: each
    look-alike misses the probe by more than 10 times the tolerance in both ops; the right ops stay
    within it."""
    tol = npu_fused.tolerance(dtype)
    right = _worst(STAND_IN, dtype)
    assert max(right.values()) <= tol, right
    for fault in CONTRACT_FAULTS:
        worst = _worst(npu_fused.FusedNorms(faulty("npu_rms_norm", fault), faulty("npu_add_rms_norm", fault)),
                       dtype)
        for op in ("rms_norm", "add_rms_norm"):
            assert worst[op] > 10 * tol, (fault, op, worst)


@pytest.mark.parametrize("dtype", npu_fused.FUSED_DTYPES, ids=str)
def test_self_check_reference_is_the_eager_gemma_norm_bit_for_bit(dtype):
    """What the probe expects is what the CPU's eager kernels return for its inputs, and its rows
    differ, so a result taken from one row (or broadcast) cannot match."""
    inputs, wants = npu_fused.probe(dtype)
    x3, x2, r, w = inputs["x3"], inputs["x2"], inputs["residual"], inputs["weight"]
    assert x3.dtype == x2.dtype == r.dtype == w.dtype == dtype
    assert torch.equal(wants["rms_norm"], norms.gemma_rms_norm(x3, w, 1e-6))
    want_y, want_sum = norms.gemma_rms_norm(x2, w, 1e-6, r)
    assert torch.equal(wants["add_rms_norm"][0], want_y) and torch.equal(wants["add_rms_norm"][1], want_sum)
    assert torch.equal(want_sum.to(torch.float32), x2.to(torch.float32) + r.to(torch.float32))  # exact sums
    for rows in (x3, x2, wants["rms_norm"], want_y):
        assert all(not torch.equal(rows[0], rows[i]) for i in range(1, rows.shape[0]))


def _noted(*ops) -> tuple[npu_fused.FusedNorms, list]:
    calls = []

    def noting(name, op):
        def call(*args):
            calls.append(name)
            return op(*args)
        return call

    return npu_fused.FusedNorms(*(noting(n, op) for n, op in zip(("rms_norm", "add_rms_norm"), ops))), calls


def test_while_tracing_no_probe_runs_and_no_verdict_is_kept(monkeypatch):
    fused, calls = _noted(torch.ops.drama3_test.fused_rms_norm, torch.ops.drama3_test.fused_add_rms_norm)
    cpu = torch.device("cpu")
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert fused.proven(cpu, torch.bfloat16) is False and calls == []
    monkeypatch.undo()
    assert fused.proven(cpu, torch.bfloat16) is True and calls == ["rms_norm", "add_rms_norm"]


def test_a_self_check_that_cannot_run_warns_once_and_keeps_the_eager_path(monkeypatch):
    def no_probe(dtype):
        raise RuntimeError("no memory for the probe")

    monkeypatch.setattr(npu_fused, "probe", no_probe)
    fused, calls = _noted(torch.ops.drama3_test.fused_rms_norm, torch.ops.drama3_test.fused_add_rms_norm)
    with captured(_NPU_FUSED_LOGGER, logging.WARNING) as lines:
        assert fused.proven(torch.device("cpu"), torch.bfloat16) is False
        assert fused.proven(torch.device("cpu"), torch.bfloat16) is False
    assert calls == [] and len(lines) == 1, lines
    assert "could not run (RuntimeError: no memory for the probe)" in lines[0]


@pytest.mark.forked
@pytest.mark.parametrize("dtype", npu_fused.FUSED_DTYPES, ids=str)
def test_on_an_npu_device_correct_ops_pass_the_self_check_once_per_dtype_and_are_used(npu_device, monkeypatch,
                                                                                        dtype):
    module, calls = _fake_torch_npu("npu_rms_norm", "npu_add_rms_norm")
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    x, w, eps = tower_calls(4, dtype=dtype)["gemma_rms_norm"][1]
    with captured(_NPU_FUSED_LOGGER, logging.INFO) as lines:
        for _ in range(3):
            got = norms.gemma_rms_norm(npu_device.to_npu(x), npu_device.to_npu(w), eps)
    # the self-check (both ops, once), then one fused call per kernel call
    assert calls == ["npu_rms_norm", "npu_add_rms_norm"] + ["npu_rms_norm"] * 3
    assert_bf16_close(got.cpu(), norms.gemma_rms_norm(x, w, eps))
    assert len(lines) == 1 and "passed their self-check on npu" in lines[0], lines
    # another dtype is checked on its own, at its first use
    other = torch.float32 if dtype != torch.float32 else torch.bfloat16
    norms.gemma_rms_norm(npu_device.to_npu(x.to(other)), npu_device.to_npu(w), eps)
    assert calls[5:] == ["npu_rms_norm", "npu_add_rms_norm", "npu_rms_norm"]


def _eager_on_cpu(batch: int) -> dict:
    calls = tower_calls(batch)
    return {name: _outputs(calls[name][0](*calls[name][1], **calls[name][2])) for name in FUSED_KERNELS}


@pytest.mark.forked
@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("op", ["npu_rms_norm", "npu_add_rms_norm"])
def test_on_an_npu_device_a_faulty_op_fails_the_self_check_with_one_warning_and_the_eager_path_is_used(
        npu_device, monkeypatch, op, fault):
    module, calls = _fake_torch_npu("npu_rms_norm", "npu_add_rms_norm", **{op: faulty(op, fault)})
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    want = _eager_on_cpu(4)
    on_npu = tower_calls(4, device="npu")
    with captured(_NPU_FUSED_LOGGER, logging.WARNING) as lines:
        for _ in range(2):
            got = {name: _outputs(on_npu[name][0](*on_npu[name][1], **on_npu[name][2])) for name in FUSED_KERNELS}
    assert len(lines) == 1, lines
    assert f"{op} " in lines[0] or f"{op}'s " in lines[0], lines[0]
    assert _FAULT_WORDS[fault] in lines[0].split(op, 1)[1], lines[0]
    assert "keep the eager torch path" in lines[0]
    assert calls == ["npu_rms_norm", "npu_add_rms_norm"]  # the self-check's calls; none since
    for name in FUSED_KERNELS:
        assert len(got[name]) == len(want[name])
        for g, e in zip(got[name], want[name]):
            assert g.device.type == "npu" and torch.equal(g.cpu(), e), name


def _imports(module) -> set[str]:
    """Every module ``module``'s source imports, those inside functions too (relative ones resolved)."""
    import ast
    import inspect

    found = set()
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(module.__name__.split(".")[:-node.level] + ([base] if base else []))
            found.update(f"{base}.{a.name}" if not node.module else base for a in node.names)
    return found


def test_the_fused_self_check_and_the_kernels_share_a_leaf_reference_not_a_circle():
    """norms imports npu_fused; npu_fused takes the eager reference from the leaf norm_reference,
    which imports nothing of the package."""
    from drama3_patches.kernels import norm_reference

    assert "drama3_patches.kernels.npu_fused" in _imports(norms)
    mine = _imports(npu_fused)
    assert "drama3_patches.kernels.norm_reference" in mine
    assert not any(m.startswith("drama3_patches.kernels.norms") for m in mine), mine
    assert _imports(norm_reference) == {"__future__", "torch"}
    assert norms.gemma_rows_f32 is npu_fused.gemma_rows_f32 is norm_reference.gemma_rows_f32
