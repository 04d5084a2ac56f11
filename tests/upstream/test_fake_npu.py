"""The simulated npu device (tests/support/fake_npu.py) behaves like a separate device."""

from __future__ import annotations

import pytest

from support.subproc import TESTS, run_pytest
from support.tiers import TORCH_ABSENT

torch = pytest.importorskip("torch", reason=TORCH_ABSENT)
from support import fake_npu  # noqa: E402  (imports torch)


@pytest.mark.forked
def test_device_identity_and_explicit_copies():
    assert not hasattr(torch, "npu")  # nothing registered before enable()
    fake_npu.enable()
    fake_npu.enable()  # idempotent
    host = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    dev = host.to("npu")
    assert fake_npu.is_fake_npu(dev) and not fake_npu.is_fake_npu(host)
    assert dev.device.type == "npu" and dev.device.index == 0
    assert dev.is_cuda is False and dev.is_npu is True and dev.is_cpu is False
    for made in (torch.zeros(2, 3, device="npu"), torch.full((2,), 7, device="npu"),
                 torch.arange(5, device="npu"), torch.tensor([1, 2], device="npu"),
                 torch.empty_like(dev), dev.new_zeros(4), host.npu(), fake_npu.to_npu(host)):
        assert made.device.type == "npu", made
    assert torch.empty_like(dev, device="cpu").device.type == "cpu"
    back = dev.to("cpu")
    assert type(back) is torch.Tensor and back.device.type == "cpu" and torch.equal(back, host)
    assert torch.equal(dev.cpu(), host) and dev.tolist() == host.tolist()
    # Copies are independent of the source on both sides.
    host[0, 0] = 100
    assert dev.cpu()[0, 0].item() == 0
    back[0, 1] = 100
    assert dev.cpu()[0, 1].item() == 1
    # Device-side ops stay on the device; views and in-place ops keep sharing.
    clone = dev.clone()
    assert clone.device.type == "npu"
    clone[0] = -1
    assert dev.cpu()[0, 0].item() == 0
    row = dev[1]
    same = row.add_(10)
    assert same is row and dev.cpu()[1].tolist() == [14, 15, 16, 17]
    assert torch.cat([dev, dev]).device.type == "npu"
    assert (dev * 2).sum().item() == 2 * dev.cpu().sum().item()
    assert dev.to(torch.bfloat16).device.type == "npu" and dev.float().dtype == torch.float32
    # The device module a CUDA-style code path reaches through torch.npu.
    assert torch.npu.is_available() and torch.npu.device_count() == 1 and torch.npu.current_device() == 0
    event = torch.npu.Event()
    event.record()
    event.synchronize()
    assert event.query() and torch.npu.current_stream().query()
    with torch.npu.stream(torch.npu.Stream()):
        torch.npu.synchronize()


@pytest.mark.forked
def test_mixing_with_cpu_tensors_raises_like_a_device():
    fake_npu.enable()
    dev = torch.arange(6.0).reshape(2, 3).to("npu")
    host = torch.ones(2, 3)
    attempts = {
        "cat": lambda: torch.cat([dev, host]),
        "stack": lambda: torch.stack([dev, host]),
        "add": lambda: dev + host,
        "mul_": lambda: host.mul_(dev),
        "equal": lambda: torch.equal(dev, host),
        "index_copy_": lambda: torch.zeros(4, 3, device="npu").index_copy_(0, torch.tensor([0, 1]), host),
        "index_copy_ cpu index": lambda: torch.zeros(4, 3, device="npu").index_copy_(0, torch.tensor([0, 1]), dev),
        "where": lambda: torch.where(dev > 1, dev, host),
    }
    for name, attempt in attempts.items():
        with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
            attempt()
            pytest.fail(f"{name} mixed devices without an error")
    # What a real device accepts: 0-dim CPU scalars, CPU index tensors, explicit copies.
    assert (dev * torch.tensor(2.0)).device.type == "npu"
    assert torch.equal(dev[torch.tensor([1])].cpu(), torch.tensor([[3.0, 4.0, 5.0]]))
    target = torch.zeros(4, 3, device="npu")
    target[torch.tensor([3])] = dev[:1]
    assert target.cpu()[3].tolist() == [0.0, 1.0, 2.0]
    host.copy_(dev)
    assert torch.equal(host, dev.cpu())
    index = torch.tensor([0, 2]).to("npu")
    assert torch.zeros(4, 3, device="npu").index_copy_(0, index, dev).cpu()[2].tolist() == [3.0, 4.0, 5.0]


@pytest.mark.forked
def test_parameter_data_assignment_follows_the_new_tensor():
    fake_npu.enable()
    param = torch.nn.Parameter(torch.zeros(3).to("npu"), requires_grad=False)
    assert isinstance(param, torch.nn.Parameter) and param.device.type == "npu"
    param.data = torch.arange(6.0).reshape(2, 3).to("npu")  # what weight post-processing does
    assert param.shape == (2, 3) and param.cpu().tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    param.data.mul_(2)  # .data is an alias on the device
    assert param.cpu()[1, 2].item() == 10.0 and param.data.device.type == "npu"
    with pytest.raises(RuntimeError, match="simulated npu"):
        param.data = torch.zeros(2, 3)


@pytest.mark.forked
def test_transfers_are_recorded_with_their_blocking_flag():
    fake_npu.enable()
    dev = torch.ones(4).to("npu")
    with fake_npu.record_transfers() as log:
        dev.to("cpu", non_blocking=False, copy=True)
        torch.empty(4).copy_(dev, non_blocking=True)
        torch.zeros(4).to("npu")
        dev.clone()
    assert [(t.direction, t.non_blocking) for t in log] == [("d2h", False), ("d2h", True), ("h2d", False)]


@pytest.mark.forked
def test_reproduces_the_port_bug_a_cloned_history_stays_on_the_device():
    """The original port parked frame history with clone() off CUDA; resume mixed it with CPU data."""
    fake_npu.enable()
    history = torch.randint(0, 1024, (8, 4), dtype=torch.int32).to("npu")
    parked = history.clone()  # what the port did when not history.is_cuda
    assert parked.device.type == "npu"
    new_frames = torch.randint(0, 1024, (2, 4), dtype=torch.int32)  # host-side input on resume
    with pytest.raises(RuntimeError, match="same device"):
        torch.cat([parked, new_frames])
    # A host copy resumes fine.
    resumed = torch.cat([history.to("cpu"), new_frames])
    assert resumed.shape == (10, 4) and torch.equal(resumed[:8], history.cpu())


FORKED_PROBE = """
import pytest
import torch
from support import fake_npu


@pytest.mark.forked
def test_enables_the_device_in_its_fork():
    fake_npu.enable()
    assert torch.zeros(1, device="npu").device.type == "npu"


@pytest.mark.forked
def test_fails_in_its_fork():
    assert 1 == 2, "the fork saw the failure"


def test_parent_never_saw_the_device():
    assert torch._C._get_privateuse1_backend_name() == "privateuseone"
    assert not hasattr(torch, "npu")
"""


def test_forked_tests_report_failures_and_leave_the_parent_untouched(tmp_path):
    # What the simulated device relies on: pytest-forked (as pinned with pytest) runs a marked
    # test in a fork, reports its failure as one, and keeps its irreversible set-up out of the
    # test process.
    probe = tmp_path / "test_forked_probe.py"
    probe.write_text(FORKED_PROBE)
    proc = run_pytest("-q", str(probe), pythonpath=[TESTS])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "the fork saw the failure" in out, out
    assert "1 failed, 2 passed" in out, out
