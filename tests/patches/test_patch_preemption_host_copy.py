"""preemption-host-copy on the published ``FishOmniModelState`` (vllm-omni 0.32.0rc1), simulated npu.

Each test that builds the state runs in a fork (pytest-forked), set up as an Ascend worker would be
as far as the model state can tell:

* ``fake_npu.vllm_on_npu()``: vLLM's platform is an out-of-tree ``npu`` platform without pinned memory (``is_uva_available()``
  is False, so the state's ``UvaBufferPool``s take vLLM's staged ``NonUvaBuffer`` fallback on
  ``current_platform.device_type``); vllm-omni resolves its own platform before ``torch.npu``
  exists, so it stays unspecified instead of importing vllm-ascend (not installed here);
* ``support.fake_npu``: tensors on ``npu`` that refuse to mix with host tensors;
* a real ``VllmConfig`` / ``ModelConfig`` built from a tiny ``FishOmniConfig`` (the published HF
  config class) whose architecture is :class:`SlotPoolModel`, registered with vLLM's registry.
  The published ``FishOmniForConditionalGeneration`` cannot be built here (a Qwen3.5 MoE
  backbone; its module does not even import without torchvision), so :class:`SlotPoolModel`
  holds exactly what the state reads from the model: the slot pools of ``FishOmniBuffers``
  (same names, shapes and dtypes), ``frame_width``, ``max_top_k``, ``build_frames``, and writes
  a sampled frame into its slot the way the model's forward does.

The state itself is the real class, built by its real ``__init__`` (vLLM's ``MambaHybridModelState``
and vllm-omni's ``OmniModelState`` / ``EagerMTPState`` / ``OmniIntermediateBuffer`` included), and
driven the way vllm-omni's MRv2 runner drives it: ``on_request_preempted`` then
``remove_request``, another request in the freed slot, then ``add_request`` of the resumed request
(its generated main tokens appended to ``prefill_token_ids``) in another slot.
"""

from __future__ import annotations

import inspect
import weakref
from types import SimpleNamespace

import pytest

from support.replicas import ASCEND_HOST_ENV, apply_checked, apply_on_npu, needs_fish_omni
from support.subproc import call
from support.tiers import TORCH_ABSENT

torch = pytest.importorskip("torch", reason=TORCH_ABSENT)
import numpy as np  # noqa: E402  (a torch dependency)

from drama3_patches.patches import preemption_host_copy as php  # noqa: E402
from drama3_patches.patchlib import NotNeeded, PatchContext  # noqa: E402
from support import fake_npu  # noqa: E402

MODULE = "vllm_omni.model_executor.models.fish_omni.model_state"
TARGET = f"{MODULE}:FishOmniModelState.on_request_preempted"
ARCH = "Drama3SlotPoolModel"
SLOTS, MAX_LEN, CODEBOOKS = 4, 48, 10
A_PROMPT, B_PROMPT = list(range(100, 105)), list(range(200, 204))


class SlotPoolModel(torch.nn.Module):
    """The part of ``FishOmniForConditionalGeneration`` that ``FishOmniModelState`` reads."""

    have_multimodal_outputs = True  # as the published model: the Omni lifecycle applies

    def __init__(self, vllm_config, device, prompts: dict, stream_decoder=None) -> None:
        super().__init__()
        from vllm_omni.model_executor.models.fish_omni.sampling import EMPTY_RAS_SLOT, RAS_WINDOW_FRAMES

        codebooks = vllm_config.model_config.hf_config.audio_decoder_config.num_codebooks
        seqs = vllm_config.scheduler_config.max_num_seqs
        tokens = vllm_config.scheduler_config.max_num_batched_tokens
        long = dict(dtype=torch.int64, device=device)
        flag = dict(dtype=torch.bool, device=device)
        self.frame_width = 1 + codebooks
        self.max_top_k = 64
        self.num_sample_rows = None
        # FishOmniBuffers: per-step token and sample rows, then the slot pools (the last slot
        # absorbs padding rows); the sampler's noise is (rows, draws, max_top_k) float32.
        self.buffers = SimpleNamespace(
            max_num_tokens=tokens,
            max_num_seqs=seqs,
            dummy_slot=seqs,
            frames=torch.zeros((tokens, 1 + codebooks), **long),
            labels=torch.zeros((tokens, 1 + codebooks), **long),
            token_slots=torch.full((tokens,), seqs, **long),
            token_from_slot=torch.ones(tokens, **flag),
            sample_token_rows=torch.ones(tokens, **flag),
            token_sample_index=torch.zeros(tokens, **long),
            sample_rows=torch.zeros(seqs, **long),
            sample_valid=torch.zeros(seqs, **flag),
            sample_slots=torch.full((seqs,), seqs, **long),
            noise=torch.zeros((seqs, codebooks + 1, self.max_top_k), dtype=torch.float32, device=device),
            slot_ras=torch.full((seqs + 1, RAS_WINDOW_FRAMES), EMPTY_RAS_SLOT, **long),
            slot_temperature=torch.ones(seqs + 1, dtype=torch.float32, device=device),
            slot_top_k=torch.ones(seqs + 1, **long),
            slot_top_p=torch.ones(seqs + 1, dtype=torch.float32, device=device),
            slot_history=torch.zeros((seqs + 1, vllm_config.model_config.max_model_len, codebooks),
                                     dtype=torch.int16, device=device),
            slot_generated=torch.zeros(seqs + 1, **long),
        )
        self.prompts = prompts
        if stream_decoder is not None:
            self.stream_decoder = stream_decoder

    def build_frames(self, info, device):
        return self.prompts[info["req_id"]].clone()  # CPU int64 [prompt_len, frame_width]

    def sample(self, slot: int, frame: torch.Tensor) -> None:
        """One sampled frame of the request in ``slot``, written as the forward writes it."""
        history, generated = self.buffers.slot_history, self.buffers.slot_generated
        slots = torch.tensor([slot], device=history.device)
        count = generated[slots]
        index = count.clamp(max=history.shape[1] - 1)
        history[slots, index] = frame[1:].to(torch.int16).to(history.device).unsqueeze(0)
        generated[slots] = count + 1


class StreamDecoderDouble:
    """A streaming codec with per-slot state, for the parent chain's own park (EagerMTPState).

    ``save_slot`` returns device clones: whatever the parent chain parks must come back as it
    made it, on the device or not.
    """

    def __init__(self, device) -> None:
        self.state = torch.zeros((SLOTS, 6), dtype=torch.float32, device=device)
        self.saved: list[torch.Tensor] | None = None

    def save_slot(self, slot: int) -> list[torch.Tensor]:
        self.saved = [self.state[slot].clone()]
        return self.saved

    def restore_slot(self, slot: int, state: list[torch.Tensor]) -> None:
        self.state[slot].copy_(state[0])


# ----------------------------------------------------------------------------------------------
# Set-up (forked tests: fake_npu.vllm_on_npu() first)
# ----------------------------------------------------------------------------------------------


def _vllm_config(tmp_path):
    from vllm import ModelRegistry
    from vllm.config import DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm_omni.model_executor.models.fish_omni.configuration_fish_omni import FishOmniConfig

    ModelRegistry.register_model(ARCH, SlotPoolModel)
    hf = FishOmniConfig(
        text_config=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=32, vocab_size=512),
        audio_decoder_config=dict(num_codebooks=CODEBOOKS),
    )
    hf.architectures = [ARCH]
    hf.save_pretrained(tmp_path)
    model_config = ModelConfig(model=str(tmp_path), skip_tokenizer_init=True, dtype="float32", max_model_len=MAX_LEN)
    return VllmConfig(
        model_config=model_config,
        scheduler_config=SchedulerConfig(max_num_seqs=SLOTS, max_num_batched_tokens=64, max_model_len=MAX_LEN,
                                         is_encoder_decoder=False),
        device_config=DeviceConfig(device="npu"),
    )


def _prompt_rows(ids: list[int], seed: int) -> torch.Tensor:
    rows = torch.zeros((len(ids), 1 + CODEBOOKS), dtype=torch.int64)
    rows[:, 0] = torch.tensor(ids)
    rows[:, 1:] = torch.randint(0, 4096, (len(ids), CODEBOOKS), generator=torch.Generator().manual_seed(seed))
    return rows


def _build(vllm_config, device: str, decoder=None, cls=None):
    """A model state (the published class, or ``cls``) over the slot-pool stand-in model."""
    if cls is None:
        from vllm_omni.model_executor.models.fish_omni.model_state import FishOmniModelState as cls

    prompts = {"A": _prompt_rows(A_PROMPT, 1), "B": _prompt_rows(B_PROMPT, 2), "C": _prompt_rows(B_PROMPT, 3)}
    model = SlotPoolModel(vllm_config, torch.device(device), prompts, decoder)
    return cls(vllm_config, model, None, torch.device(device)), model


def _request(req_id: str, prompt: list[int], generated: list[int] = ()):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.output import NewRequestData

    return NewRequestData(
        req_id=req_id, prompt_token_ids=list(prompt), mm_features=[],
        sampling_params=SamplingParams(temperature=0.8, top_k=30, top_p=0.9), pooling_params=None,
        block_ids=([],), num_computed_tokens=0, lora_request=None, prefill_token_ids=list(prompt) + list(generated),
    )


def _frames(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    frames = torch.randint(0, 4096, (n, 1 + CODEBOOKS), dtype=torch.int64, generator=g)
    frames[:, 0] += 300  # main tokens (semantic band)
    return frames


def _generate(state, model, slot: int, frames: torch.Tensor) -> None:
    for frame in frames:
        model.sample(slot, frame)


def _admit(state, slot: int, req) -> None:
    state.add_request(slot, req)
    state._flush_slot_writes()  # the next step's preprocess uploads the slot writes


def _preempt(state, req_id: str, slot: int) -> None:
    """What vllm-omni's MRv2 runner does for a preempted request."""
    state.on_request_preempted(req_id, slot)
    state.remove_request(slot)


def _scenario(state, model):
    """A generates in slot 1 and is preempted; B reuses slot 1; A resumes in slot 3."""
    _admit(state, 1, _request("A", A_PROMPT))
    a_frames = _frames(6, seed=3)
    _generate(state, model, 1, a_frames)
    _preempt(state, "A", 1)
    _admit(state, 1, _request("B", B_PROMPT))
    b_frames = _frames(9, seed=8)
    _generate(state, model, 1, b_frames)
    _admit(state, 3, _request("A", A_PROMPT, a_frames[:, 0].tolist()))
    return a_frames, b_frames


def _check_resumed(state, model, a_frames, b_frames) -> None:
    n, p = a_frames.shape[0], len(A_PROMPT)
    # The resumed prompt: A's own rows, then its generated frames (main tokens + parked codes).
    assert state.prompt_len[3] == p + n and state.base_prompt_len[3] == p
    assert np.array_equal(state.prompts[3][:p], model.prompts["A"].numpy())
    assert np.array_equal(state.prompts[3][p:], a_frames.numpy())
    history, generated = model.buffers.slot_history.cpu(), model.buffers.slot_generated.cpu()
    # On the device: slot 3 holds A's codes bit for bit and counts on from them; B is intact in 1.
    assert int(generated[3]) == n and torch.equal(history[3, :n], a_frames[:, 1:].to(torch.int16))
    assert int(generated[1]) == b_frames.shape[0]
    assert torch.equal(history[1, : b_frames.shape[0]], b_frames[:, 1:].to(torch.int16))
    more = _frames(2, seed=11)
    _generate(state, model, 3, more)
    history = model.buffers.slot_history.cpu()
    assert torch.equal(history[3, : n + 2], torch.cat((a_frames, more))[:, 1:].to(torch.int16))
    assert "A" not in state._suspended


def _check_feature_detection() -> None:
    """plan() on the published method, on one that parks on the host, on one that parks nothing."""
    from vllm_omni.model_executor.models.fish_omni import model_state as ms

    published = ms.FishOmniModelState.__dict__["on_request_preempted"]

    def ctx_for(method):
        return PatchContext("preemption-host-copy", (TARGET,), "npu", {}, php.logger, _resolve=lambda t: method)

    assert php.parks_off_host(published) is True
    new = php.plan(ctx_for(published))[TARGET]
    assert new.__wrapped__ is published and new.__qualname__ == published.__qualname__
    assert inspect.signature(new) == inspect.signature(published)

    class ParksOnHost(ms.FishOmniModelState):
        def on_request_preempted(self, req_id, req_index):
            super().on_request_preempted(req_id, req_index)
            history = self.buffers.slot_history[req_index]
            count = self.buffers.slot_generated[req_index : req_index + 1]
            if history.is_cuda:
                raise AssertionError("not probed on CUDA")
            host = [t.to("cpu", copy=True) for t in (history, count)]
            self._suspended[req_id] = ms._SuspendedRequest(*host, None)

    class ParksNothing(ms.FishOmniModelState):
        def on_request_preempted(self, req_id, req_index):
            super().on_request_preempted(req_id, req_index)

    with pytest.raises(NotNeeded, match="already copies the parked history and count to the host"):
        php.plan(ctx_for(ParksOnHost.__dict__["on_request_preempted"]))
    with pytest.raises(RuntimeError, match="parks no history/count"):
        php.plan(ctx_for(ParksNothing.__dict__["on_request_preempted"]))


# ----------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------


@pytest.mark.vllm
@needs_fish_omni
@pytest.mark.forked
def test_resume_after_preemption_fails_unpatched_and_is_bit_exact_patched(tmp_path, monkeypatch):
    fake_npu.vllm_on_npu()
    _check_feature_detection()
    vllm_config = _vllm_config(tmp_path)

    # The published method on the simulated npu: the park stays on the device, resume fails.
    state, model = _build(vllm_config, "npu")
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device") as failure:
        _scenario(state, model)
    print(f"unpatched: {failure.value}")

    from vllm_omni.model_executor.models.fish_omni.model_state import FishOmniModelState

    drama3_patches = apply_on_npu(monkeypatch, "preemption-host-copy")
    assert FishOmniModelState.on_request_preempted.__wrapped__ is drama3_patches.get_original(TARGET)

    state, model = _build(vllm_config, "npu")
    _admit(state, 1, _request("A", A_PROMPT))
    a_frames = _frames(6, seed=3)
    _generate(state, model, 1, a_frames)
    with fake_npu.record_transfers() as log:
        state.on_request_preempted("A", 1)
    # history and count left the device with blocking copies, before the method returned
    assert list(log) == [("d2h", False), ("d2h", False)]
    parked = state._suspended["A"]
    assert parked.event is None
    assert all(type(t) is torch.Tensor and t.device.type == "cpu" for t in (parked.history, parked.count))
    assert int(parked.count) == 6 and torch.equal(parked.history[:6], a_frames[:, 1:].to(torch.int16))
    refs = [weakref.ref(parked.history), weakref.ref(parked.count)]
    parked = None
    state.remove_request(1)
    _admit(state, 1, _request("B", B_PROMPT))
    b_frames = _frames(9, seed=8)
    _generate(state, model, 1, b_frames)
    _admit(state, 3, _request("A", A_PROMPT, a_frames[:, 0].tolist()))
    print(f"patched: park copies {list(log)}; A resumed in slot 3 with "
          f"{int(model.buffers.slot_generated.cpu()[3])} generated frames, codes equal: "
          f"{torch.equal(torch.from_numpy(state.prompts[3][len(A_PROMPT):]), a_frames)}")
    _check_resumed(state, model, a_frames, b_frames)

    # The resume consumed the park; a request finished while parked drops its host copy.
    state.on_requests_finished({"A"})
    state.remove_request(3)
    assert all(r() is None for r in refs)
    _admit(state, 2, _request("C", B_PROMPT))
    _generate(state, model, 2, _frames(2, seed=5))
    state.on_request_preempted("C", 2)
    ref = weakref.ref(state._suspended["C"].history)
    state.on_requests_finished({"C"})
    assert "C" not in state._suspended and ref() is None

    # A CPU run keeps its independent snapshots: no transfer, no shared storage.
    cpu_state, cpu_model = _build(vllm_config, "cpu")
    _admit(cpu_state, 0, _request("A", A_PROMPT))
    _generate(cpu_state, cpu_model, 0, a_frames)
    with fake_npu.record_transfers() as log:
        cpu_state.on_request_preempted("A", 0)
    parked = cpu_state._suspended["A"]
    assert log == []
    assert parked.history.data_ptr() != cpu_model.buffers.slot_history[0].data_ptr()
    cpu_model.buffers.slot_history[0].fill_(-7)
    cpu_model.buffers.slot_generated[0] = 99
    assert int(parked.count) == 6 and torch.equal(parked.history[:6], a_frames[:, 1:].to(torch.int16))

    drama3_patches.unapply(["preemption-host-copy"])
    assert "__wrapped__" not in vars(FishOmniModelState.on_request_preempted)
    with pytest.raises(RuntimeError, match="same device"):
        _scenario(*_build(vllm_config, "npu"))


@pytest.mark.vllm
@needs_fish_omni
@pytest.mark.forked
def test_the_parent_chains_own_park_resumes_as_upstream_keeps_it(tmp_path):
    """OmniModelState -> EagerMTPState.suspend_audio parks a stream decoder's slot state (Drama 3's
    model has no stream decoder, other Omni models do): the patch must not touch it."""
    fake_npu.vllm_on_npu()
    from vllm_omni.model_executor.models.fish_omni.model_state import FishOmniModelState
    from vllm_omni.worker_v2.model_states.eager_mtp import TalkerInputs

    FishOmniModelState.on_request_preempted = php.build(FishOmniModelState.on_request_preempted)
    decoder = StreamDecoderDouble("npu")
    state, model = _build(_vllm_config(tmp_path), "npu", decoder)
    eager = state._eager_state
    eager.embeds = torch.zeros((SLOTS, 8), device="npu")
    # On an Ascend host the side stream is an NPU stream; the simulated one stands in for it.
    eager._side_stream = torch.npu.Stream()

    _admit(state, 1, _request("A", A_PROMPT))
    a_frames = _frames(4, seed=3)
    _generate(state, model, 1, a_frames)
    decoder.state[1] = torch.arange(6, dtype=torch.float32).to("npu")
    eager.embeds[1] = torch.full((8,), 0.5).to("npu")
    eager.stream_pos["A"] = 4
    # (host embeds: the simulated device's wrapper tensors have no data pointer to record)
    eager._talker_inputs["A"] = TalkerInputs(embeds=torch.ones((5, 8)), length=4)

    _preempt(state, "A", 1)
    audio = eager._suspended_audio["A"]
    # Exactly what the decoder saved, where it saved it: not moved by this patch.
    assert audio.decoder_state is decoder.saved and fake_npu.is_fake_npu(audio.decoder_state[0])
    assert state._suspended["A"].history.device.type == "cpu"  # this patch's own state did move

    _admit(state, 1, _request("B", B_PROMPT))
    decoder.state[1] = torch.full((6,), -1.0).to("npu")
    eager.embeds[1] = torch.zeros(8).to("npu")
    _generate(state, model, 1, _frames(5, seed=8))

    _admit(state, 3, _request("A", A_PROMPT, a_frames[:, 0].tolist()))
    assert eager.stream_pos["A"] == 4 and eager.ready[3] == "A"
    assert torch.equal(eager.embeds[3].cpu(), torch.full((8,), 0.5))
    saved = eager._restore_audio.pop("A")
    assert saved is audio.decoder_state
    decoder.restore_slot(3, saved)  # the runner's replay of the resumed request
    assert torch.equal(decoder.state[3].cpu(), torch.arange(6, dtype=torch.float32))
    assert torch.equal(torch.from_numpy(state.prompts[3][len(A_PROMPT):]), a_frames)


@pytest.mark.vllm
@needs_fish_omni
@pytest.mark.forked
def test_without_uva_every_staged_upload_reaches_the_npu(tmp_path):
    """The state's four UvaBufferPools on an npu platform without pinned memory: vLLM's
    NonUvaBuffer keeps a host staging tensor and a device tensor on the platform's device_type,
    and each step's upload is an explicit host-to-device copy (no UVA view, no host sync)."""
    fake_npu.vllm_on_npu()
    from vllm.v1.worker.gpu.buffer_utils import NonUvaBuffer

    state, model = _build(_vllm_config(tmp_path), "npu")
    pools = (state._slot_pool, state._token_pool, state._decode_pool, state._sample_pool)
    for pool in pools:
        assert all(type(buf) is NonUvaBuffer and fake_npu.is_fake_npu(buf._uva) for buf in pool._uva_bufs)
    buffers = model.buffers
    state.add_request(1, _request("A", A_PROMPT))  # run_preprocess flushes the slot writes itself
    state.add_request(2, _request("B", B_PROMPT))

    def batch(computed, scheduled, padded):
        starts = np.concatenate(([0], np.cumsum(scheduled))).astype(np.int32)
        return SimpleNamespace(
            num_reqs=2, req_ids=["A", "B"], idx_mapping_np=np.array([1, 2], dtype=np.int32),
            num_scheduled_tokens=np.array(scheduled, dtype=np.int32),
            num_computed_tokens_np=np.array(computed, dtype=np.int32),
            num_tokens=int(sum(scheduled)), num_tokens_after_padding=padded, query_start_loc_np=starts,
        )

    def _uploads_only(log):
        # Host data goes up through the staging copies; nothing waits on the device.
        assert [t for t in log if t.direction == "h2d"] and all(t.direction != "d2h" for t in log), log
        assert all(t.non_blocking for t in log if t.direction == "h2d"), log

    # Step 1, both prompts (mixed path: token and sample pools, after the slot pool's flush).
    with fake_npu.record_transfers() as log:
        state.run_preprocess(batch([0, 0], [5, 4], 12), {})
    _uploads_only(log)
    dummy = buffers.dummy_slot
    assert torch.equal(buffers.slot_temperature.cpu()[1:3], torch.tensor([0.8, 0.8]))
    assert torch.equal(buffers.slot_top_p.cpu()[1:3], torch.tensor([0.9, 0.9]))
    assert buffers.slot_top_k.cpu()[1:3].tolist() == [30, 30] and buffers.slot_generated.cpu()[1:3].tolist() == [0, 0]
    assert buffers.slot_ras.cpu()[1].tolist() == [-1] * 11 + A_PROMPT
    prompt_rows = torch.cat((model.prompts["A"], model.prompts["B"]))
    assert torch.equal(buffers.frames.cpu()[:9], prompt_rows)
    assert torch.equal(buffers.labels.cpu()[:4], model.prompts["A"][1:])
    assert buffers.token_slots.cpu()[:12].tolist() == [1] * 5 + [2] * 4 + [dummy] * 3
    assert buffers.sample_rows.cpu()[:2].tolist() == [4, 8] and buffers.sample_slots.cpu()[:2].tolist() == [1, 2]
    assert buffers.sample_valid.cpu()[:2].tolist() == [True, True]

    # Step 2, pure decode (the decode pool): every row reads its slot.
    with fake_npu.record_transfers() as log:
        state.run_preprocess(batch([5, 4], [1, 1], 4), {})
    _uploads_only(log)
    assert buffers.token_slots.cpu()[:4].tolist() == [1, 2, dummy, dummy]
    assert buffers.sample_slots.cpu()[:2].tolist() == [1, 2]
    assert buffers.sample_token_rows.cpu()[:4].tolist() == [True, True, False, False]
    assert buffers.token_from_slot.cpu()[:4].all() and model.num_sample_rows == 2


class _CudaLike(torch.Tensor):
    """Reports a CUDA device (no CUDA here): what the published CUDA branch would park."""

    @staticmethod
    def __new__(cls, data):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=data.dtype, device=torch.device("cuda", 0))

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise AssertionError(f"a CUDA park must not be touched ({func})")


def test_park_on_host_leaves_cuda_parks_and_host_tensors_alone():
    cpu = torch.arange(4)
    meta = torch.empty(4, device="meta")
    cuda = _CudaLike(torch.arange(4))
    assert cuda.is_cuda and not php.needs_host_copy(cuda)
    assert not php.needs_host_copy(cpu) and not php.needs_host_copy(meta) and not php.needs_host_copy(3)
    event = object()
    cuda_park = SimpleNamespace(history=cuda, count=cuda, event=event)  # the CUDA branch's record
    host_park = SimpleNamespace(history=cpu, count=cpu[:1], event=None)
    state = SimpleNamespace(_suspended={"cuda": cuda_park, "host": host_park})
    assert php.park_on_host(state, "cuda") == 0 and cuda_park.history is cuda and cuda_park.event is event
    assert php.park_on_host(state, "host") == 0 and host_park.history is cpu
    assert php.park_on_host(state, "absent") == 0


@pytest.mark.vllm
@needs_fish_omni
@pytest.mark.npu
def test_on_a_real_npu_resume_after_preemption_is_bit_exact(tmp_path):
    """Ascend host only (vllm-ascend installed): the patch applied by the engine to the published
    state, the preemption scenario on torch_npu tensors. A fresh interpreter: the device runtime
    must not start in a fork, and the start-up hook applies the patches as in a deployment."""
    out = call(resume_on_the_npu, str(tmp_path), env=ASCEND_HOST_ENV, timeout=900)
    assert out["wrapped_original"] is True
    assert out["parked_on"] == ["cpu", "cpu"]
    assert out["history_device"] == "npu"


def resume_on_the_npu(tmp: str) -> dict:
    """The child of the test above; raises where the scenario goes wrong."""
    from pathlib import Path

    import torch_npu  # noqa: F401
    from vllm_omni.model_executor.models.fish_omni.model_state import FishOmniModelState

    d3p = apply_checked("preemption-host-copy")
    out = {"wrapped_original": FishOmniModelState.on_request_preempted.__wrapped__ is d3p.get_original(TARGET)}
    state, model = _build(_vllm_config(Path(tmp)), "npu")
    _admit(state, 1, _request("A", A_PROMPT))
    a_frames = _frames(6, seed=3)
    _generate(state, model, 1, a_frames)
    state.on_request_preempted("A", 1)
    parked = state._suspended["A"]
    out["parked_on"] = [parked.history.device.type, parked.count.device.type]
    out["history_device"] = model.buffers.slot_history.device.type
    state.remove_request(1)
    _admit(state, 1, _request("B", B_PROMPT))
    b_frames = _frames(9, seed=8)
    _generate(state, model, 1, b_frames)
    _admit(state, 3, _request("A", A_PROMPT, a_frames[:, 0].tolist()))
    torch.npu.synchronize()
    _check_resumed(state, model, a_frames, b_frames)
    return out


def _resume_counts() -> dict:
    from drama3_patches.engine import state as engine_state

    counters = engine_state.counters()
    return {k: counters.get(k, 0) for k in ("preemptions", "resumes", "resumes_verified")}


@pytest.mark.vllm
@needs_fish_omni
@pytest.mark.forked
def test_resume_check_verifies_the_resumed_history_and_names_a_corrupted_one(tmp_path, monkeypatch):
    """DRAMA3_PATCHES_RESUME_CHECK=1: the published scenario (A preempted after 6 frames, B reuses
    its slot, A resumes elsewhere) counts one preemption, one resume and one verified resume; with
    the test-only fault that alters the parked frames, the resume raises naming the request and the
    frame; without the check, preemptions and resumes are counted and nothing is verified."""
    fake_npu.vllm_on_npu()
    vllm_config = _vllm_config(tmp_path)
    import vllm_omni.model_executor.models.fish_omni.model_state  # noqa: F401  (the target module)

    apply_on_npu(monkeypatch, "preemption-host-copy")
    monkeypatch.setenv("DRAMA3_PATCHES_RESUME_CHECK", "1")
    state, model = _build(vllm_config, "npu")
    a_frames, b_frames = _scenario(state, model)
    _check_resumed(state, model, a_frames, b_frames)
    assert _resume_counts() == {"preemptions": 1, "resumes": 1, "resumes_verified": 1}
    assert not state._suspended  # the reference went with the park the resume consumed

    monkeypatch.setenv("DRAMA3_PATCHES_FAULT", "parked-history")
    state, model = _build(vllm_config, "npu")
    with pytest.raises(php.ResumedHistoryMismatch, match=r"request A: resumed with 6 frames .* from frame 5 on"):
        _scenario(state, model)
    assert _resume_counts() == {"preemptions": 2, "resumes": 2, "resumes_verified": 1}

    monkeypatch.delenv("DRAMA3_PATCHES_FAULT")
    monkeypatch.delenv("DRAMA3_PATCHES_RESUME_CHECK")
    state, model = _build(vllm_config, "npu")
    _admit(state, 1, _request("A", A_PROMPT))
    _generate(state, model, 1, _frames(6, seed=3))
    _preempt(state, "A", 1)
    assert php.SlotReference.of(state._suspended["A"]) is None  # nothing kept without the check
    _admit(state, 1, _request("B", B_PROMPT))
    b_frames = _frames(9, seed=8)
    _generate(state, model, 1, b_frames)
    _admit(state, 3, _request("A", A_PROMPT, _frames(6, seed=3)[:, 0].tolist()))
    _check_resumed(state, model, _frames(6, seed=3), b_frames)
    assert _resume_counts() == {"preemptions": 3, "resumes": 3, "resumes_verified": 1}


def _wrong_slot_state_class():
    """The published state whose park is the published method called with ``req_index + 1``: it
    parks the next slot's history under the request's id (the bug the resume check must catch)."""
    from vllm_omni.model_executor.models.fish_omni.model_state import FishOmniModelState

    published = FishOmniModelState.__dict__["on_request_preempted"]

    class WrongSlotPark(FishOmniModelState):
        def on_request_preempted(self, req_id, req_index):
            published(self, req_id, req_index + 1)

    WrongSlotPark.on_request_preempted = php.build(WrongSlotPark.__dict__["on_request_preempted"])
    WrongSlotPark.add_request = php.build_resume(FishOmniModelState.__dict__["add_request"])
    return WrongSlotPark


def _wrong_slot_scenario(state, model):
    """A generates in slot 1 beside C in slot 2 (the slot a wrong park reads); A is preempted and
    resumes in slot 3."""
    _admit(state, 1, _request("A", A_PROMPT))
    _admit(state, 2, _request("C", B_PROMPT))
    a_frames = _frames(6, seed=3)
    _generate(state, model, 1, a_frames)
    _generate(state, model, 2, _frames(7, seed=4))
    _preempt(state, "A", 1)
    _admit(state, 3, _request("A", A_PROMPT, a_frames[:, 0].tolist()))
    return a_frames


@pytest.mark.vllm
@needs_fish_omni
@pytest.mark.forked
def test_a_park_that_reads_the_wrong_slot_fails_the_resume_check(tmp_path, monkeypatch):
    """The reference is read from the request's own slot before the published park runs, so a park
    of the next slot's history (the published method called with ``req_index + 1``) raises
    ResumedHistoryMismatch at resume, as does the test-only fault ``wrong-slot`` on the real class;
    the published park, checked the same way, passes."""
    fake_npu.vllm_on_npu()
    vllm_config = _vllm_config(tmp_path)
    monkeypatch.setenv("DRAMA3_PATCHES_RESUME_CHECK", "1")

    state, model = _build(vllm_config, "npu", cls=_wrong_slot_state_class())
    with pytest.raises(php.ResumedHistoryMismatch, match=r"request A: resumed with 6 frames .* from frame 0 on"):
        _wrong_slot_scenario(state, model)
    assert _resume_counts() == {"preemptions": 1, "resumes": 1, "resumes_verified": 0}

    from vllm_omni.model_executor.models.fish_omni.model_state import FishOmniModelState

    apply_on_npu(monkeypatch, "preemption-host-copy")
    state, model = _build(vllm_config, "npu")
    a_frames = _wrong_slot_scenario(state, model)
    assert torch.equal(torch.from_numpy(state.prompts[3][len(A_PROMPT):]), a_frames)
    assert _resume_counts() == {"preemptions": 2, "resumes": 2, "resumes_verified": 1}

    monkeypatch.setenv("DRAMA3_PATCHES_FAULT", "wrong-slot")
    state, model = _build(vllm_config, "npu")
    with pytest.raises(php.ResumedHistoryMismatch, match=r"request A: .* from frame 0 on"):
        _wrong_slot_scenario(state, model)
    assert FishOmniModelState.on_request_preempted.__wrapped__ is not None  # the real class's, patched


@pytest.mark.vllm
@needs_fish_omni
@pytest.mark.forked
def test_references_of_requests_finished_or_aborted_while_parked_are_dropped_with_the_park(tmp_path, monkeypatch):
    """Three requests preempted, then finished or aborted while parked (the runner calls
    on_requests_finished for both): no host copy of theirs is left anywhere the state holds."""
    fake_npu.vllm_on_npu()
    vllm_config = _vllm_config(tmp_path)
    import vllm_omni.model_executor.models.fish_omni.model_state  # noqa: F401  (the target module)

    apply_on_npu(monkeypatch, "preemption-host-copy")
    monkeypatch.setenv("DRAMA3_PATCHES_RESUME_CHECK", "1")
    state, model = _build(vllm_config, "npu")
    refs = []
    for slot, req in ((0, "A"), (1, "B"), (2, "C")):
        _admit(state, slot, _request(req, A_PROMPT if req == "A" else B_PROMPT))
        _generate(state, model, slot, _frames(3 + slot, seed=slot))
        _preempt(state, req, slot)
        reference = php.SlotReference.of(state._suspended[req])
        assert reference is not None and reference.shape[0] == 3 + slot
        refs.append(weakref.ref(reference))
        reference = None
    state.on_requests_finished({"A"})  # finished
    state.on_requests_finished({"B", "C"})  # aborted: the runner reports them the same way
    assert state._suspended == {}
    assert all(r() is None for r in refs)
    assert not [k for k in vars(state) if "drama3" in k]


# ----------------------------------------------------------------------------------------------
# The resume check's length rule
# ----------------------------------------------------------------------------------------------


def _async_config(tmp_path):
    """The test config with async scheduling on: one pipeline stage, so two concurrent batches
    (``VllmConfig.max_concurrent_batches``), one step in flight when the scheduler preempts."""
    vllm_config = _vllm_config(tmp_path)
    vllm_config.scheduler_config.async_scheduling = True
    assert vllm_config.max_concurrent_batches == 2  # set-up, not the check
    return vllm_config


def _preempted_after_six(state, model):
    """A generates 6 frames in slot 1 and is preempted: its slot held 6 frames."""
    _admit(state, 1, _request("A", A_PROMPT))
    a_frames = _frames(6, seed=3)
    _generate(state, model, 1, a_frames)
    _preempt(state, "A", 1)
    return a_frames


def _resume_counted_at(state, a_frames, counted: int) -> None:
    """A resumes in slot 3 with ``counted`` generated main tokens: what the scheduler counts."""
    _admit(state, 3, _request("A", A_PROMPT, a_frames[:counted, 0].tolist()))


@pytest.mark.vllm
@needs_fish_omni
@pytest.mark.forked
def test_the_reference_may_exceed_the_schedulers_count_by_the_frames_in_flight_and_no_more(tmp_path, monkeypatch):
    """A's slot held 6 frames at preemption. With async scheduling at one stage (slack 1), a resume
    the scheduler counts at 6 (exactly) or 5 (count + slack) generated frames is verified and fed
    those frames; at 4 it raises naming 6, 4 and 1. Without async scheduling (slack 0), 5 raises."""
    fake_npu.vllm_on_npu()
    vllm_config = _async_config(tmp_path)
    import vllm_omni.model_executor.models.fish_omni.model_state  # noqa: F401  (the target module)

    apply_on_npu(monkeypatch, "preemption-host-copy")
    monkeypatch.setenv("DRAMA3_PATCHES_RESUME_CHECK", "1")
    for counted, verified in ((6, 1), (5, 2)):
        state, model = _build(vllm_config, "npu")
        a_frames = _preempted_after_six(state, model)
        _resume_counted_at(state, a_frames, counted)
        assert torch.equal(torch.from_numpy(state.prompts[3][len(A_PROMPT):]), a_frames[:counted])
        assert _resume_counts() == {"preemptions": verified, "resumes": verified, "resumes_verified": verified}

    state, model = _build(vllm_config, "npu")
    a_frames = _preempted_after_six(state, model)
    with pytest.raises(php.ResumedHistoryMismatch,
                       match=r"request A: its slot held 6 frames at preemption, more than the 4 the scheduler "
                             r"counts as generated plus 1 that async scheduling can have in flight"):
        _resume_counted_at(state, a_frames, 4)
    assert _resume_counts() == {"preemptions": 3, "resumes": 3, "resumes_verified": 2}

    vllm_config.scheduler_config.async_scheduling = False
    state, model = _build(vllm_config, "npu")
    a_frames = _preempted_after_six(state, model)
    with pytest.raises(php.ResumedHistoryMismatch, match=r"held 6 frames .* more than the 5 .* plus 0 "):
        _resume_counted_at(state, a_frames, 5)
    assert _resume_counts() == {"preemptions": 4, "resumes": 4, "resumes_verified": 2}


def _fed_state_class(change: int):
    """The published state whose ``add_request`` then changes the history queued for the resumed
    slot by ``change`` frames (drops its last, or repeats it): a resume fed another length than
    the scheduler counts."""
    from vllm_omni.model_executor.models.fish_omni.model_state import FishOmniModelState

    published = FishOmniModelState.__dict__["add_request"]

    class OtherLengthFeed(FishOmniModelState):
        def add_request(self, req_index, new_req_data):
            published(self, req_index, new_req_data)
            fed = self._pending_history.get(req_index)
            if fed is not None:
                self._pending_history[req_index] = fed[:change] if change < 0 else torch.cat((fed, fed[-change:]))

    OtherLengthFeed.on_request_preempted = php.build(FishOmniModelState.__dict__["on_request_preempted"])
    OtherLengthFeed.add_request = php.build_resume(OtherLengthFeed.__dict__["add_request"])
    return OtherLengthFeed


@pytest.mark.vllm
@needs_fish_omni
@pytest.mark.forked
@pytest.mark.parametrize(("change", "fed"), [(-1, 5), (1, 7)], ids=["one-frame-too-few", "one-frame-too-many"])
def test_a_resumed_slot_fed_another_length_than_the_scheduler_counts_fails_the_resume_check(
        tmp_path, monkeypatch, change, fed):
    """Fed frames must equal the scheduler's count exactly: a state that feeds A's resumed slot
    one frame fewer (or more) than the 6 counted raises naming both numbers, though the fed
    frames are the reference's own; the published state, checked the same way, is verified."""
    fake_npu.vllm_on_npu()
    vllm_config = _async_config(tmp_path)
    monkeypatch.setenv("DRAMA3_PATCHES_RESUME_CHECK", "1")

    state, model = _build(vllm_config, "npu", cls=_fed_state_class(change))
    a_frames = _preempted_after_six(state, model)
    with pytest.raises(php.ResumedHistoryMismatch,
                       match=rf"request A: resumed with {fed} frames of history, but the scheduler counts 6 generated"):
        _resume_counted_at(state, a_frames, 6)
    assert _resume_counts() == {"preemptions": 1, "resumes": 1, "resumes_verified": 0}

    apply_on_npu(monkeypatch, "preemption-host-copy")
    state, model = _build(vllm_config, "npu")
    a_frames = _preempted_after_six(state, model)
    _resume_counted_at(state, a_frames, 6)
    assert _resume_counts() == {"preemptions": 2, "resumes": 2, "resumes_verified": 1}


@pytest.mark.vllm
@needs_fish_omni
@pytest.mark.forked
def test_a_resume_whose_slack_cannot_be_read_stays_unverified(tmp_path, monkeypatch):
    """A model state without ``vllm_config`` (no ``max_concurrent_batches`` to bound the reference
    by): the resume is counted and left unverified, and the reason is logged; with it, verified."""
    fake_npu.vllm_on_npu()
    vllm_config = _async_config(tmp_path)
    import vllm_omni.model_executor.models.fish_omni.model_state  # noqa: F401  (the target module)

    apply_on_npu(monkeypatch, "preemption-host-copy")
    monkeypatch.setenv("DRAMA3_PATCHES_RESUME_CHECK", "1")
    state, model = _build(vllm_config, "npu")
    a_frames = _preempted_after_six(state, model)
    del state.vllm_config
    warnings = []
    monkeypatch.setattr(php.logger, "warning", lambda msg, *args: warnings.append(msg % args))
    _resume_counted_at(state, a_frames, 6)
    assert _resume_counts() == {"preemptions": 1, "resumes": 1, "resumes_verified": 0}
    assert any("max_concurrent_batches" in w and "not verified" in w for w in warnings), warnings

    state, model = _build(vllm_config, "npu")
    a_frames = _preempted_after_six(state, model)
    _resume_counted_at(state, a_frames, 6)
    assert _resume_counts() == {"preemptions": 2, "resumes": 2, "resumes_verified": 1}
