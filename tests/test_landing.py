"""Gradients born in the flat gradient buffer (flatopt.landing).

Each covered layer's backward writes its parameters' gradients into their slots: the gradients must be
torch's to the bit (float32), lie in the buffer (same storage, right offset) with no copy or add into the
buffer beyond what torch itself does (recorded with tests/bytecount.py), and every case where the slot
cannot be written (a .grad of the caller's, tensor hooks, create_graph, autograd.grad, torch.compile, an
uncovered class) must fall back to torch's own gradient. zero_grad() releases the buffer's storage and the
first gradient brings it back, padding zeroed.
"""

import copy
import io
import pickle
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from torch.utils.checkpoint import checkpoint

from flatopt.landing import COVERED, DEFAULT_CLASSES, LandingSlots
from flatopt.layout import FlatBuffer

sys.path.insert(0, str(Path(__file__).parent))
from bytecount import StorageWrites  # noqa: E402

SAME = dict(rtol=0.0, atol=0.0)


def land(model, classes=tuple(COVERED), **kwargs):
    """Flat buffers (one per dtype) over ``model``'s trainable parameters, their slots installed on
    ``model`` (every coverable class), zero_grad() done: what an optimizer does."""
    by_dtype = {}
    for p in model.parameters():
        if p.requires_grad:
            by_dtype.setdefault(p.dtype, []).append(p)
    bufs = []
    for params in by_dtype.values():
        buf = FlatBuffer(params, [0] * len(params))
        buf.adopt()
        bufs.append(buf)
    slots = LandingSlots(bufs, **kwargs)
    covered = slots.install(model, classes)
    slots.zero_grad()
    return slots, bufs, covered


def assert_in_slot(p, slots, what):
    buf, _, start = slots.slot(p)
    assert p.grad is not None, f"{what}: .grad is None"
    assert p.grad.untyped_storage().data_ptr() == buf.grad.untyped_storage().data_ptr(), f"{what}: not in the buffer"
    assert p.grad.storage_offset() == buf.grad.storage_offset() + start, f"{what}: at the wrong place"
    assert p.grad.stride() == p.stride(), f"{what}: strides {p.grad.stride()}, parameter {p.stride()}"
    assert slots.owns_grad(p), f"{what}: not the slot's tensor"


def assert_grads(model, ref, what, exact=True, **tol):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.grad is None:
            assert p.grad is None, f"{what}, {name}: torch has no gradient"
            continue
        kw = SAME if exact else tol
        torch.testing.assert_close(p.grad, q.grad, **kw, msg=lambda m: f"{what}, {name}: {m}")


def param_bytes(*params):
    return sum(p.numel() * p.element_size() for p in params)


def padding_bytes(slots, b=0):
    buf = slots.buffers[b]
    return (buf.numel - sum(p.numel() for p in buf.params)) * buf.grad.element_size()


def padding_runs(slots, b=0):
    """The runs of padding elements of buffer ``b`` (between parameters and after the last)."""
    buf = slots.buffers[b]
    ends = [e for _, e in buf.index.values()]
    starts = [s for s, _ in buf.index.values()] + [buf.numel]
    return sum(1 for e in ends if e not in starts)


# ------------------------------------------------------------------------------------------------- Linear


def linear_input(kind, gen):
    if kind == "2d":
        return torch.randn(7, 12, generator=gen)
    if kind == "3d":
        return torch.randn(3, 5, 12, generator=gen)
    if kind == "3d-noncontiguous":  # torch takes matmul + add_ here, not addmm
        return torch.randn(5, 3, 12, generator=gen).transpose(0, 1)
    if kind == "column-major":  # mm_mat1_backward's other order
        return torch.randn(12, 7, generator=gen).t()
    raise AssertionError(kind)


def output_weights(y, layout, gen):
    """Weights for the loss ``(y * w).sum()``: the output gradient is ``w``, contiguous or not."""
    if layout == "contiguous":
        return torch.randn(y.shape, generator=gen)
    return torch.randn(tuple(reversed(y.shape)), generator=gen).permute(*reversed(range(y.dim())))


@pytest.mark.parametrize("micro", [1, 3])
@pytest.mark.parametrize("grad_layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("kind", ["2d", "3d", "3d-noncontiguous", "column-major"])
def test_linear_gradients_are_torchs_and_born_in_the_buffer(kind, bias, grad_layout, micro):
    """fp32: weight, bias and input gradients equal torch's bit for bit over ``micro`` micro-batches, for the
    inputs that take torch's addmm path and its matmul path, with a contiguous or a transposed output gradient;
    the first backward writes the slots with mm / sum (and zeroes the padding when it brings the storage back),
    the next ones are torch's own in-place add of the gradient, one per parameter."""
    torch.manual_seed(0)
    model = nn.Linear(12, 10, bias=bias)
    ref = copy.deepcopy(model)
    slots, bufs, covered = land(model)
    assert covered == [""]
    gen = torch.Generator().manual_seed(1)
    for i in range(micro):
        x = linear_input(kind, gen).requires_grad_()
        xr = x.detach().clone().requires_grad_()
        with StorageWrites(bufs[0].grad) as writes:
            y = model(x)
            w = output_weights(y, grad_layout, gen)
            (y * w).sum().backward()
        (ref(xr) * w).sum().backward()
        assert_grads(model, ref, f"micro-batch {i}")
        torch.testing.assert_close(x.grad, xr.grad, **SAME, msg=lambda m: f"input gradient: {m}")
        for name, p in model.named_parameters():
            assert_in_slot(p, slots, f"micro-batch {i}, {name}")
        if i == 0:
            expected = {"mm": 1, "sum": 1} if bias else {"mm": 1}
            assert writes.ops() == {**expected, "_foreach_zero_": padding_runs(slots)}, writes.writes
            assert writes.bytes("_foreach_zero_") == padding_bytes(slots)
            assert writes.bytes() - writes.bytes("_foreach_zero_") == param_bytes(*model.parameters())
        else:
            assert writes.ops() == {"add_": 2 if bias else 1}, writes.writes
            assert writes.bytes() == param_bytes(*model.parameters())
    assert slots.all_landed() and slots.landed_count(0) == len(bufs[0].params)


def test_fused_accumulation_adds_inside_the_gemm():
    """fuse_accumulation=True: later micro-batches accumulate the weight gradient with addmm_ (beta=1) into
    the slot, no temporary and no add_ of the weight; one rounding instead of two, so close to torch and to a
    float64 reference, not bit-identical."""
    torch.manual_seed(0)
    model = nn.Linear(64, 48)
    ref = copy.deepcopy(model).double()
    slots, bufs, _ = land(model, fuse_accumulation=True)
    gen = torch.Generator().manual_seed(1)
    for i in range(4):
        x = torch.randn(32, 64, generator=gen)
        with StorageWrites(bufs[0].grad) as writes:
            model(x).square().sum().backward()
        ref(x.double()).square().sum().backward()
        if i:
            assert writes.ops() == {"addmm_": 1, "add_": 1}, writes.writes  # the bias: torch's add
            assert writes.bytes("addmm_") == param_bytes(model.weight)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_in_slot(p, slots, "fused")
        torch.testing.assert_close(p.grad, q.grad.float(), rtol=1e-5, atol=1e-4)


def test_linear_under_bf16_autocast_matches_torch_on_the_cpu():
    """bf16 autocast, fp32 parameters, on the CPU: torch makes a bf16 weight gradient and casts it; so does
    the landing, the cast writing into the slot (copy_ is the producing op: no second copy). Bit-identical
    to torch, and within bf16 rounding of a float64 reference."""
    torch.manual_seed(0)
    model = nn.Linear(32, 16)
    ref = copy.deepcopy(model)
    ref64 = copy.deepcopy(model).double()
    slots, bufs, _ = land(model)
    gen = torch.Generator().manual_seed(1)
    for i in range(3):
        x = torch.randn(4, 6, 32, generator=gen)
        with StorageWrites(bufs[0].grad) as writes:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = model(x)
            y.float().square().sum().backward()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            yr = ref(x)
        yr.float().square().sum().backward()
        ref64(x.double()).square().sum().backward()
        assert y.dtype == yr.dtype == torch.bfloat16
        assert torch.equal(y, yr)
        assert_grads(model, ref, f"autocast micro-batch {i}")
        if i == 0:
            assert {k: v for k, v in writes.ops().items() if k != "_foreach_zero_"} == {"copy_": 2}, writes.writes
    for p, q in zip(model.parameters(), ref64.parameters()):
        assert_in_slot(p, slots, "autocast")
        torch.testing.assert_close(p.grad, q.grad.float(), rtol=2e-2, atol=2e-2 * q.grad.abs().max().item())


@pytest.mark.requires_cuda
def test_linear_under_bf16_autocast_on_cuda_writes_the_fp32_accumulator():
    """CUDA: the bf16 GEMM writes an fp32 result into the slot (mm with out_dtype=float32): closer to a float64
    reference than torch's bf16-rounded gradient, and within bf16 rounding of torch's."""
    torch.manual_seed(0)
    model = nn.Linear(256, 128).cuda()
    ref = copy.deepcopy(model)
    ref64 = copy.deepcopy(model).double()
    slots, bufs, _ = land(model)
    x = torch.randn(64, 256, device="cuda")
    with StorageWrites(bufs[0].grad) as writes:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            model(x).float().square().sum().backward()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref(x).float().square().sum().backward()
    ref64(x.double()).square().sum().backward()
    assert writes.ops()["mm"] == 1 and "copy_" not in writes.ops(), writes.writes
    assert_in_slot(model.weight, slots, "cuda autocast")
    exact = ref64.weight.grad.float()
    ours, torchs = (model.weight.grad - exact).abs().max(), (ref.weight.grad - exact).abs().max()
    assert ours <= torchs, f"fp32 accumulator error {ours} above torch's bf16-rounded {torchs}"
    torch.testing.assert_close(model.weight.grad, ref.weight.grad, rtol=1e-2, atol=1e-2 * exact.abs().max().item())


@pytest.mark.requires_cuda
@pytest.mark.parametrize("fuse", [False, True])
def test_cuda_gradients_land_and_match_torch(fuse):
    """On CUDA, float32: Linear's mm/sum write the slots, torch's gradients to the bit; the embedding gradient is
    torch's kernel's, copied in (bit-identical). With fuse_accumulation=True: index_add_ (atomics) and addmm_,
    close to torch."""
    torch.manual_seed(0)
    model = TiedLM(vocab=1000, dim=64).cuda()
    ref = copy.deepcopy(model)
    slots, bufs, _ = land(model, fuse_accumulation=fuse)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for i in range(3):
        idx = torch.randint(0, 1000, (8, 128), device="cuda", generator=gen)
        with StorageWrites(bufs[0].grad) as writes:
            model(idx).backward()
        ref(idx).backward()
        if i == 0:
            assert writes.ops()["mm"] == 2, writes.writes
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert_in_slot(p, slots, f"micro-batch {i}, {name}")
            exact = dict(rtol=1e-5, atol=1e-6) if fuse else SAME  # fused: addmm_ and atomics, another rounding
            torch.testing.assert_close(p.grad, q.grad, **exact, msg=lambda m: f"micro-batch {i}, {name}: {m}")


# ---------------------------------------------------------------------------------------------- Embedding


@pytest.mark.parametrize("micro", [1, 3])
@pytest.mark.parametrize("padding_idx", [None, 3])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_embedding_gradients_are_torchs_and_born_in_the_buffer(padding_idx, index_dtype, micro):
    """Dense embedding gradient with repeated indices (the row adds' order matters) and a padding row:
    torch's bit for bit; written with zero_ + index_add_ into the slot (the padding row zeroed again)."""
    torch.manual_seed(0)
    model = nn.Embedding(50, 24, padding_idx=padding_idx)
    ref = copy.deepcopy(model)
    slots, bufs, _ = land(model)
    gen = torch.Generator().manual_seed(1)
    for i in range(micro):
        idx = torch.randint(0, 12, (6, 40), generator=gen).to(index_dtype)  # many repeats, the padding row
        with StorageWrites(bufs[0].grad) as writes:
            model(idx).sin().sum().backward()
        ref(idx).sin().sum().backward()
        assert_grads(model, ref, f"micro-batch {i}")
        assert_in_slot(model.weight, slots, f"micro-batch {i}")
        ops = {k: v for k, v in writes.ops().items() if k != "_foreach_zero_"}
        if i == 0:
            assert ops == {"zero_": 1 + (padding_idx is not None), "index_add_": 1}, writes.writes
        else:
            assert ops == {"add_": 1}, writes.writes


def test_embedding_with_many_indices_matches_torch():
    """Past the sizes where CPU kernels split their work across threads: still torch's sums to the bit."""
    torch.manual_seed(0)
    model = nn.Embedding(3000, 64)
    ref = copy.deepcopy(model)
    slots, _, _ = land(model)
    idx = torch.randint(0, 3000, (64, 512))
    idx[:, ::3] = 7  # a hot row
    model(idx).cos().sum().backward()
    ref(idx).cos().sum().backward()
    assert_grads(model, ref, "large")
    assert_in_slot(model.weight, slots, "large")


@pytest.mark.parametrize(
    "options", [dict(max_norm=1.0), dict(sparse=True), dict(scale_grad_by_freq=True)], ids=lambda o: next(iter(o))
)
def test_embedding_options_torch_handles_differently_fall_back(options):
    """max_norm (renormalises in forward), sparse=True, scale_grad_by_freq: torch's own forward and backward;
    the gradient is a tensor of its own (the optimizer copies it in, or refuses a sparse one)."""
    torch.manual_seed(0)
    model = nn.Embedding(20, 8, **options)
    ref = copy.deepcopy(model)
    slots, _, _ = land(model)
    idx = torch.randint(0, 20, (4, 9))
    model(idx).sum().backward()
    ref(idx).sum().backward()
    assert not slots.owns_grad(model.weight)
    assert slots.landed_count(0) == 0
    if options.get("sparse"):
        assert model.weight.grad.is_sparse
        assert torch.equal(model.weight.grad.to_dense(), ref.weight.grad.to_dense())
    else:
        assert torch.equal(model.weight.grad, ref.weight.grad)
        assert torch.equal(model.weight, ref.weight)  # max_norm renormalised both alike


# ------------------------------------------------------------------------------------------------- norms


@pytest.mark.parametrize("micro", [1, 3])
@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.LayerNorm(20),
        lambda: nn.LayerNorm((4, 5)),
        lambda: nn.LayerNorm(20, bias=False),
        lambda: nn.RMSNorm(20),
        lambda: nn.RMSNorm((4, 5), eps=1e-3),
    ],
    ids=["layernorm", "layernorm-2d-shape", "layernorm-no-bias", "rmsnorm", "rmsnorm-2d-shape"],
)
def test_norm_gradients_are_torchs_and_land_in_the_buffer(make, micro):
    """LayerNorm: torch's native_layer_norm_backward, its weight and bias gradients copied into the slots
    (no aten variant writes them in place: the copy is the only write, one per parameter). RMSNorm (float32,
    CPU): the weight's gradient summed straight into its slot."""
    torch.manual_seed(0)
    model = make()
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(0.5, 1.5)
    ref = copy.deepcopy(model)
    slots, bufs, covered = land(model)
    assert covered == [""]
    gen = torch.Generator().manual_seed(1)
    shape = (3, 7) + tuple(model.normalized_shape)
    for i in range(micro):
        x = (torch.randn(shape, generator=gen) * 3 + 1).requires_grad_()
        xr = x.detach().clone().requires_grad_()
        with StorageWrites(bufs[0].grad) as writes:
            (model(x) * torch.arange(x.numel()).view(shape).cos()).sum().backward()
        (ref(xr) * torch.arange(x.numel()).view(shape).cos()).sum().backward()
        assert_grads(model, ref, f"micro-batch {i}")
        torch.testing.assert_close(x.grad, xr.grad, **SAME)
        ops = {k: v for k, v in writes.ops().items() if k != "_foreach_zero_"}
        n = len(list(model.parameters()))
        produce = "copy_" if isinstance(model, nn.LayerNorm) else "sum"
        assert ops == ({produce: n} if i == 0 else {"add_": n}), writes.writes
        for name, p in model.named_parameters():
            assert_in_slot(p, slots, f"micro-batch {i}, {name}")


def test_layer_norm_under_cpu_autocast_takes_the_bf16_input_as_torch_does():
    """Under CPU autocast a bf16 activation reaches LayerNorm's fp32 parameters (autocast leaves layer_norm
    alone on the CPU): torch's mixed-dtype kernel, the gradients torch's and in the buffer."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    ref = copy.deepcopy(model)
    slots, _, covered = land(model)
    assert covered == ["0", "1", "2"]
    x = torch.randn(5, 16)
    for m in (model, ref):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = m(x)
        y.float().sum().backward()
    assert_grads(model, ref, "autocast")
    for name, p in model.named_parameters():
        assert_in_slot(p, slots, name)


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
def test_rms_norm_under_autocast_or_in_bf16_falls_back():
    """RMSNorm outside the float32 CPU composition (autocast on, bf16 input): torch's own path, a gradient of
    its own, which adopt() (the optimizer's hook) copies into the slot."""
    torch.manual_seed(0)
    model = nn.RMSNorm(16)
    ref = copy.deepcopy(model)
    slots, _, _ = land(model)
    x = torch.randn(4, 16)
    for m in (model, ref):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            m(x.bfloat16()).float().sum().backward()
    assert_grads(model, ref, "bf16 input")
    assert not slots.owns_grad(model.weight) and slots.landed_count(0) == 0
    assert slots.adopt(model.weight)
    assert_in_slot(model.weight, slots, "adopted")
    assert torch.equal(model.weight.grad, ref.weight.grad) and slots.all_landed()


# ------------------------------------------------------------------------------------------ tied weights


class TiedLM(nn.Module):
    """An embedding tied to the output Linear (one parameter, two covered uses in one backward)."""

    def __init__(self, vocab=30, dim=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.mid = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        h = self.norm(torch.tanh(self.mid(self.emb(idx))))
        return F.cross_entropy(self.head(h).flatten(0, 1), idx.flatten())


@pytest.mark.parametrize("micro", [1, 4])
def test_tied_weights_sum_both_uses_once(micro):
    """The head's use writes the slot first and makes .grad a view of it; the embedding's use then finds
    .grad defined and returns its gradient, which AccumulateGrad adds in place: the sum torch makes, bit for
    bit, no use counted twice or lost, over one or several micro-batches."""
    torch.manual_seed(0)
    model = TiedLM()
    ref = copy.deepcopy(model)
    slots, bufs, covered = land(model)
    assert set(covered) == {"emb", "mid", "norm", "head"}
    gen = torch.Generator().manual_seed(1)
    for i in range(micro):
        idx = torch.randint(0, 30, (4, 9), generator=gen)
        model(idx).backward()
        ref(idx).backward()
        assert_grads(model, ref, f"micro-batch {i}")
        for name, p in model.named_parameters():
            assert_in_slot(p, slots, f"micro-batch {i}, {name}")
    # the two uses apart (an untied copy): the tied gradient of the last micro-batch is their sum, not either
    untied = copy.deepcopy(ref)
    untied.head.weight = nn.Parameter(ref.emb.weight.detach().clone())
    slots.zero_grad()
    model(idx).backward()
    untied(idx).backward()
    emb_part, head_part = untied.emb.weight.grad, untied.head.weight.grad
    assert emb_part.norm() > 0.1 * head_part.norm() > 0
    torch.testing.assert_close(model.emb.weight.grad, emb_part + head_part, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("micro", [1, 3])
def test_a_covered_and_an_uncovered_use_in_one_pass_land_in_the_slot(micro):
    """A covered Linear and a functional use of its weight (uncovered) in one pass: the covered use writes the
    slot and makes .grad a view of it, so AccumulateGrad adds the uncovered use's gradient into the slot in
    place (a gradient returned to autograd would have been summed out of place, leaving the buffer): torch's
    sum to the bit. With three uses, two covered and one not (the tied embedding below), the uncovered one is
    added last: the same sum, another rounding order."""
    torch.manual_seed(0)
    model = TiedLM()
    ref = copy.deepcopy(model)
    slots, _, _ = land(model)
    gen = torch.Generator().manual_seed(1)
    for i in range(micro):
        idx = torch.randint(0, 30, (4, 9), generator=gen)
        for m in (model, ref):
            h = m.norm(m.mid(m.emb(idx)))
            extra = F.linear(h, m.mid.weight).square().mean() + (h @ m.emb.weight.t()).square().mean()
            (m.head(h).logsumexp(-1).mean() + extra).backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert_in_slot(p, slots, f"micro-batch {i}, {name}")
            exact = SAME if name != "emb.weight" else dict(rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(p.grad, q.grad, **exact, msg=lambda m: f"micro-batch {i}, {name}: {m}")


def test_a_grad_set_to_none_behind_zero_grad_is_written_afresh():
    """model.zero_grad() (every .grad None, the LandingSlots not told): the next forward notices it and starts a
    new accumulation (the storage released), so the next backward writes the slots afresh rather than adding to
    the stale values, as torch starts from nothing."""
    torch.manual_seed(0)
    model = TiedLM()
    ref = copy.deepcopy(model)
    slots, _, _ = land(model)
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        idx = torch.randint(0, 30, (4, 9), generator=gen)
        epoch = slots.epoch
        loss = model(idx)
        if step > 0:
            assert slots.epoch == epoch + 1 and slots.released(0), f"step {step}: model.zero_grad() not noticed"
        loss.backward()
        ref(idx).backward()
        assert_grads(model, ref, f"step {step}")
        model.zero_grad()
        ref.zero_grad()


def test_zero_grad_set_to_none_false_accumulates_into_the_zeroed_slots():
    """zero_grad(set_to_none=False): the buffer zeroed (storage back if it was released), every .grad a view of
    its slot, backward accumulates there: torch's gradients (torch zeroing its own) bit for bit."""
    torch.manual_seed(0)
    model = TiedLM()
    ref = copy.deepcopy(model)
    slots, bufs, _ = land(model)
    assert slots.released(0)
    for p in ref.parameters():
        p.grad = torch.zeros_like(p)
    gen = torch.Generator().manual_seed(1)
    for step in range(2):
        slots.zero_grad(set_to_none=False)
        ref.zero_grad(set_to_none=False)
        assert not slots.released(0) and slots.all_landed()
        for name, p in model.named_parameters():
            assert_in_slot(p, slots, name)
            assert not p.grad.any()
        for _ in range(2):
            idx = torch.randint(0, 30, (4, 9), generator=gen)
            model(idx).backward()
            ref(idx).backward()
        assert_grads(model, ref, f"step {step}")
        for name, p in model.named_parameters():
            assert_in_slot(p, slots, name)


# ------------------------------------------------------------------------------------------ fallbacks


def test_a_grad_of_the_callers_own_is_added_into_as_torch_does():
    """p.grad = a tensor of the caller's: the layer returns its gradient and AccumulateGrad adds into that
    tensor (torch's behaviour); the slot is not counted as landed, and adopt() copies the tensor in."""
    torch.manual_seed(0)
    model = nn.Linear(6, 5)
    ref = copy.deepcopy(model)
    slots, bufs, _ = land(model)
    mine = torch.full_like(model.weight, 0.5)
    model.weight.grad = mine
    ref.weight.grad = mine.clone()
    x = torch.randn(3, 6)
    model(x).sum().backward()
    ref(x).sum().backward()
    assert model.weight.grad is mine
    assert_grads(model, ref, "own .grad")
    assert slots.owns_grad(model.bias) and not slots.owns_grad(model.weight)
    assert slots.unlanded(0) == [0] and not slots.all_landed()
    assert slots.adopt(model.weight)
    assert_in_slot(model.weight, slots, "adopted")
    assert torch.equal(model.weight.grad, ref.weight.grad) and slots.all_landed()


def test_tensor_hooks_on_a_parameter_see_its_gradient():
    """A hook registered on the parameter (p.register_hook) must see and may replace the gradient: that
    parameter falls back to torch's path, the others land."""
    torch.manual_seed(0)
    model = nn.Linear(6, 5)
    ref = copy.deepcopy(model)
    slots, _, _ = land(model)
    seen = []
    for m in (model, ref):
        m.weight.register_hook(lambda g: seen.append(g.clone()) or g * 2)
    x = torch.randn(3, 6)
    model(x).sum().backward()
    ref(x).sum().backward()
    assert len(seen) == 2 and torch.equal(seen[0], seen[1])
    assert_grads(model, ref, "hooked")
    assert slots.owns_grad(model.bias) and not slots.owns_grad(model.weight)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_create_graph_and_double_backward_use_torchs_computation():
    """backward with create_graph=True (a gradient penalty): the layers compute their gradients with
    differentiable ops and return them; .grad carries history, so it is not the slot; the second-order
    gradients match torch's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.LayerNorm(8), nn.Linear(8, 1))
    ref = copy.deepcopy(model)
    slots, _, _ = land(model)
    x = torch.randn(5, 6)
    results = []
    for m in (model, ref):
        grads = torch.autograd.grad(m(x).square().sum(), list(m.parameters()), create_graph=True)
        penalty = sum(g.square().sum() for g in grads)
        results.append(torch.autograd.grad(penalty, list(m.parameters())))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    model(x).sum().backward(create_graph=True)
    ref(x).sum().backward(create_graph=True)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.grad.requires_grad == q.grad.requires_grad and not slots.owns_grad(p)
        torch.testing.assert_close(p.grad, q.grad, **SAME)
    assert slots.landed_count(0) == 0


def test_autograd_grad_and_backward_inputs_leave_grad_and_buffer_alone():
    """torch.autograd.grad() returns the gradients and leaves .grad alone; backward(inputs=[x]) accumulates
    into x only: no parameter's .grad set, nothing written into the buffer."""
    torch.manual_seed(0)
    model = TiedLM()
    ref = copy.deepcopy(model)
    slots, bufs, _ = land(model)
    idx = torch.randint(0, 30, (4, 9))
    with StorageWrites(bufs[0].grad) as writes:
        ours = torch.autograd.grad(model(idx), list(model.parameters()))
    theirs = torch.autograd.grad(ref(idx), list(ref.parameters()))
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
    assert writes.writes == [] and all(p.grad is None for p in model.parameters())
    x = torch.randn(3, 16, requires_grad=True)
    with StorageWrites(bufs[0].grad) as writes:
        model.mid(x).sum().backward(inputs=[x])
    assert x.grad is not None and writes.writes == []
    assert all(p.grad is None for p in model.parameters()) and slots.landed_count(0) == 0


def test_forward_hooks_and_uncovered_classes_run_torchs_forward():
    """A module with forward hooks runs its own forward (hooks see what they expect); a Linear subclass, a
    parametrized Linear and a Conv2d are not covered. All train as torch does; their gradients are tensors
    of their own until adopt() copies them in."""

    class MyLinear(nn.Linear):
        pass

    class Sym(nn.Module):
        def forward(self, w):
            return (w + w.t()) / 2

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), MyLinear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6))
    parametrize.register_parametrization(model[2], "weight", Sym())
    ref = copy.deepcopy(model)
    slots, bufs, covered = land(model)
    assert covered == ["0", "3"]
    calls = []
    model[3].register_forward_pre_hook(lambda m, args: calls.append(1) or (args[0] * 2,))
    ref[3].register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    x = torch.randn(4, 6)
    model(x).sum().backward()
    ref(x).sum().backward()
    assert calls == [1]
    assert_grads(model, ref, "uncovered")
    assert slots.owns_grad(model[0].weight) and not slots.owns_grad(model[1].weight)
    assert not slots.owns_grad(model[3].weight)  # hooked: torch's forward
    for p in model.parameters():
        slots.adopt(p)
    assert slots.all_landed()
    for name, p in model.named_parameters():
        assert_in_slot(p, slots, name)
    assert_grads(model, ref, "adopted")


def test_linear_and_embedding_are_covered_by_default():
    """install() without classes covers Linear and Embedding; norms on request; other classes are refused."""
    model = TiedLM()
    slots, _, covered = land(model, classes=None)
    assert DEFAULT_CLASSES == (nn.Linear, nn.Embedding)
    assert covered == ["emb", "mid", "head"]
    assert slots.covered == {model.emb.weight, model.mid.weight, model.mid.bias}
    assert slots.install(model, [nn.LayerNorm]) == ["norm"]
    assert slots.covered == set(model.parameters())
    with pytest.raises(ValueError, match="cannot cover Conv2d: the covered classes are Linear, Embedding"):
        slots.install(model, [nn.Conv2d])


def test_a_model_cast_after_install_trains_as_torch():
    """model.double() after install: the parameters no longer match their slots' dtype; the layers run torch's
    forward and the gradients are torch's (the optimizer's own checks report the moved parameters)."""
    torch.manual_seed(0)
    model = TiedLM()
    slots, _, _ = land(model)
    model.double()
    ref = copy.deepcopy(model)
    idx = torch.randint(0, 30, (2, 5))
    model(idx).backward()
    ref(idx).backward()
    assert_grads(model, ref, "float64")
    assert slots.landed_count(0) == 0


def test_frozen_parameters_and_slots_built_without_grad():
    """A parameter that does not require grad may sit in a buffer; LandingSlots built under no_grad() works; a
    Linear with a frozen weight runs torch's forward (its bias lands by adopt())."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[1].weight.requires_grad_(False)
    ref = copy.deepcopy(model)
    params = list(model.parameters())
    buf = FlatBuffer(params, [0] * len(params))
    buf.adopt()
    with torch.no_grad():
        slots = LandingSlots([buf])
    assert slots.install(model) == ["0"]
    slots.zero_grad()
    x = torch.randn(3, 4)
    model(x).sum().backward()
    ref(x).sum().backward()
    assert_grads(model, ref, "frozen")
    assert slots.owns_grad(model[0].weight) and not slots.owns_grad(model[1].bias)
    assert slots.unlanded(0) == [2, 3]
    model[1].weight.requires_grad_(True)  # unfrozen: the next install covers it, its slot works
    assert slots.install(model) == ["0", "1"]
    slots.zero_grad()
    ref.zero_grad()
    ref[1].weight.requires_grad_(True)
    model(x).sum().backward()
    ref(x).sum().backward()
    assert_grads(model, ref, "unfrozen")
    assert slots.all_landed()


def test_conv_is_not_covered():
    assert nn.Conv2d not in COVERED and nn.Conv1d not in COVERED
    model = nn.Sequential(nn.Conv1d(2, 3, 3), nn.Flatten(), nn.Linear(12, 2))
    slots, _, covered = land(model)
    assert covered == ["2"]


def test_no_grad_and_inference_run_torchs_forward():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    ref = copy.deepcopy(model)
    slots, _, _ = land(model)
    x = torch.randn(2, 4)
    with torch.no_grad():
        y = model(x)
    assert y.grad_fn is None and torch.equal(y, ref(x).detach())
    with torch.inference_mode():
        assert torch.equal(model(x), ref(x))


# ---------------------------------------------------------------------------------------- checkpointing


class Blocks(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        self.reentrant = reentrant
        self.emb = nn.Embedding(20, 12)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(12), nn.Linear(12, 12), nn.Tanh()) for _ in range(3))
        self.shared = nn.Linear(12, 12)  # used inside every checkpointed block and outside them
        self.head = nn.Linear(12, 20, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        h = self.shared(self.emb(idx))
        for block in self.blocks:
            h = checkpoint(lambda t, b=block: self.shared(b(t)), h, use_reentrant=self.reentrant)
        return self.head(h).logsumexp(-1).mean()


@pytest.mark.parametrize("micro", [1, 2])
@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing(reentrant, micro):
    """torch.utils.checkpoint, reentrant (each block's backward is a nested backward pass) or not, with a
    layer used inside every block and outside: torch's gradients bit for bit, all in the buffer."""
    torch.manual_seed(0)
    model = Blocks(reentrant)
    ref = copy.deepcopy(model)
    slots, _, _ = land(model)
    gen = torch.Generator().manual_seed(1)
    for i in range(micro):
        idx = torch.randint(0, 20, (3, 5), generator=gen)
        model(idx).backward()
        ref(idx).backward()
        assert_grads(model, ref, f"micro-batch {i}")
        for name, p in model.named_parameters():
            assert_in_slot(p, slots, f"micro-batch {i}, {name}")
    assert slots.all_landed()


# --------------------------------------------------------------------------------------- post-accumulate


def test_post_accumulate_grad_hooks_fire_once_per_backward():
    """The layer returns None for a parameter whose slot it wrote: AccumulateGrad still runs, so a
    post-accumulate-grad hook fires once per backward per parameter (tied: once), seeing the slot."""
    torch.manual_seed(0)
    model = TiedLM()
    slots, _, _ = land(model)
    fired = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, n=name: fired.append((n, slots.owns_grad(p))))
    for step in range(2):
        fired.clear()
        model(torch.randint(0, 30, (2, 4))).backward()
        assert sorted(fired) == sorted((n, True) for n, _ in model.named_parameters()), f"step {step}"


# ---------------------------------------------------------------------------------------------- compile


def test_torch_compile_uses_the_original_forward():
    """Under torch.compile the patch steps aside (no custom Function in the traced graph): gradients are
    torch's, tensors of their own (the copy is not elided there), which adopt() brings into the slots.
    backend="aot_eager": dynamo and AOTAutograd trace the module calls as inductor's would (inductor changes
    only the code generated afterwards, and takes a C++ build per graph on the CPU)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 8), nn.LayerNorm(8), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    ref = copy.deepcopy(model)
    slots, _, covered = land(model)
    assert len(covered) == 4
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, backend="aot_eager")
        idx = torch.randint(0, 10, (4, 5))
        compiled(idx).square().sum().backward()
        ref(idx).square().sum().backward()
        assert_grads(model, ref, "compiled", exact=False, rtol=1e-6, atol=1e-6)
        assert slots.landed_count(0) == 0
        for p in model.parameters():
            assert slots.adopt(p)
        assert slots.all_landed()
        model.zero_grad()
        model(idx).square().sum().backward()  # eager again: the patch is still in place
        assert slots.all_landed() and all(slots.owns_grad(p) for p in model.parameters())
    finally:
        torch._dynamo.reset()


def test_compiled_autograd_gets_the_gradients_returned():
    """Compiled autograd traces the backward into a graph that does not replay a .grad set inside a Function's
    backward: the layers return their gradients there (torch's way), and the eager model then lands them again.
    Where the returned gradient ends in .grad depends on torch: torch 2.13's graph puts tensors of its own there,
    torch 2.11's the very tensor the layer returned, its slot's; either way the slots' record says which."""
    from torch._dynamo import compiled_autograd

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    ref = copy.deepcopy(model)
    slots, _, _ = land(model)
    x = torch.randn(4, 8)
    torch._dynamo.reset()
    try:
        with compiled_autograd._enable(torch.compile(backend="aot_eager")):
            model(x).sum().backward()
        ref(x).sum().backward()
        assert_grads(model, ref, "compiled autograd")
        owned = [slots.owns_grad(p) for p in model.parameters()]
        assert len(set(owned)) == 1 and slots.landed_count(0) == sum(owned), (owned, slots.landed_count(0))
    finally:
        torch._dynamo.reset()
    slots.zero_grad()
    model(x).sum().backward()
    assert slots.all_landed()
    assert_grads(model, ref, "eager after compiled autograd")


@pytest.mark.filterwarnings("ignore:.*received no gradient before the first step")
@pytest.mark.parametrize("how", ["swap_load", "set_", "parametrize_removed", "tied_parametrized"])
def test_a_parameter_given_a_new_autograd_node_after_the_optimizer_still_trains(how):
    """torch gives a parameter a new AccumulateGrad node when its tensor is swapped (load_state_dict under
    torch.__future__'s swap_module_params_on_conversion), set_() or parametrized; its data stays at its address in
    the buffer. The covered layers land its gradient as before, as torch.optim trains it (not skipped as if
    backward(inputs=...) had left it out)."""
    import flatopt

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 6), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 10))
    if how == "tied_parametrized":
        model[3].weight = model[0].weight
    ref = copy.deepcopy(model)
    opt = flatopt.SGD(model, lr=0.1, momentum=0.9, direct_grads=True)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    if how == "swap_load":
        torch.__future__.set_swap_module_params_on_conversion(True)
        try:
            model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})
        finally:
            torch.__future__.set_swap_module_params_on_conversion(False)
    elif how == "set_":
        with torch.no_grad():
            model[1].weight.set_(model[1].weight.detach())
    elif how == "parametrize_removed":
        for m in (model, ref):
            parametrize.register_parametrization(m[1], "weight", nn.Identity())
            parametrize.remove_parametrizations(m[1], "weight", leave_parametrized=False)
    else:  # the head's use of the tied weight goes through a parametrization, the embedding's does not
        for m in (model, ref):
            parametrize.register_parametrization(m[3], "weight", nn.Identity(), unsafe=True)
    for step in range(3):
        idx = torch.randint(0, 10, (4, 5), generator=torch.Generator().manual_seed(step))
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            m(idx).square().sum().backward()
            o.step()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m: f"step {step}, {name}: {m}")


def test_a_swap_tensors_load_does_not_make_the_first_step_warn_of_parameters_the_covered_layers_reached():
    """A swap-tensors load (torch.__future__'s swap_module_params_on_conversion) moves the hook that records the
    first pass to the swapped-out tensor objects; the covered layers' slots still say which parameters were
    reached, so the first step names none of them as having received no gradient."""
    import flatopt

    torch.manual_seed(0)
    net = nn.Sequential(nn.Embedding(10, 6), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 10))
    model = nn.ModuleDict({"net": net, "unused": nn.Linear(2, 2)})
    opt = flatopt.SGD(model, lr=0.1, momentum=0.9, direct_grads=True)
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)
    opt.zero_grad()
    net(torch.randint(0, 10, (4, 5))).square().sum().backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    unused = [str(w.message) for w in caught if "received no gradient" in str(w.message)]
    assert len(unused) == 1 and "2 parameter(s)" in unused[0], unused
    assert "'unused.weight', 'unused.bias'" in unused[0], unused


def _swap_pair(mode):
    """An Embedding/Linear/LayerNorm model with a flatopt AdamW in ``mode``, and a copy with torch.optim's."""
    import flatopt

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 6), nn.Linear(6, 6), nn.LayerNorm(6), nn.Linear(6, 10))
    ref = copy.deepcopy(model)
    kwargs = {"in_backward": True} if mode == "in_backward" else {"direct_grads": mode == "direct_grads"}
    return model, flatopt.AdamW(model, lr=0.1, **kwargs), ref, torch.optim.AdamW(ref.parameters(), lr=0.1)


@pytest.mark.filterwarnings("ignore:.*received no gradient before the first step")
@pytest.mark.parametrize("steps_before", [0, 1])
@pytest.mark.parametrize("mode", ["default", "direct_grads", "in_backward"])
def test_swap_tensors_loads_and_conversions_train_as_torch(mode, steps_before):
    """torch.utils.swap_tensors refuses a tensor that has a weak reference; load_state_dict and model.to() swap
    every parameter under torch.__future__.set_swap_module_params_on_conversion(True). The optimizer's hooks hold
    none, so the load (the usual resume order: model, optimizer, load, before any step) and a no-op .to() work, and
    training goes on as torch.optim's does."""
    model, opt, ref, ref_opt = _swap_pair(mode)

    def train(step):
        idx = torch.randint(0, 10, (4, 5), generator=torch.Generator().manual_seed(step))
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            m(idx).square().mean().backward()
            o.step()

    for step in range(steps_before):
        train(step)
    ckpt = {k: v + 0.1 for k, v in ref.state_dict().items()}
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        for m in (model, ref):
            m.load_state_dict(ckpt)
            m.to("cpu")
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)
    for step in range(steps_before, steps_before + 3):
        train(step)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m: f"step {step}, {name}: {m}")


@pytest.mark.parametrize("mode", ["default", "direct_grads", "in_backward"])
def test_parameters_swapped_out_and_back_with_swap_tensors_train_as_torch(mode):
    """Evaluating with an EMA copy by torch.utils.swap_tensors, then swapping back: swap_tensors poisons an
    AccumulateGrad node it finds alive, and the swap back returns it to the parameter. The optimizer keeps no
    parameter's node alive between passes (as torch.optim keeps none), so the next backward runs."""
    model, opt, ref, ref_opt = _swap_pair(mode)
    emas = [copy.deepcopy(m) for m in (model, ref)]
    for step in range(3):
        idx = torch.randint(0, 10, (4, 5), generator=torch.Generator().manual_seed(step))
        for m, o, ema in zip((model, ref), (opt, ref_opt), emas):
            o.zero_grad()
            m(idx).square().mean().backward()
            o.step()
            for _ in range(2):  # evaluate with the EMA weights, then back
                for p, q in zip(m.parameters(), ema.parameters()):
                    torch.utils.swap_tensors(p, q)
                with torch.no_grad():
                    m(idx)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m: f"step {step}, {name}: {m}")


def test_compiled_autograd_past_dynamos_recompile_limit_keeps_every_gradient():
    """Compiled autograd recompiles the layers' backward once per parameter; past dynamo's recompile limit the
    backward runs eagerly inside the compiled graph, where a .grad set there is not kept either: the layers return
    their gradients there too (12 covered layers: 24 parameters, more than the limit of 8)."""
    import flatopt

    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(12) for m in (nn.Linear(8, 8), nn.Tanh())])
    ref = copy.deepcopy(model)
    opt = flatopt.SGD(model, lr=0.1, momentum=0.9, direct_grads=True)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    torch._dynamo.reset()
    try:
        for step in range(2):
            x = torch.randn(5, 8, generator=torch.Generator().manual_seed(step))
            for m, o in ((model, opt), (ref, ref_opt)):
                o.zero_grad()
                loss = m(x).square().mean()
                with torch._dynamo.compiled_autograd._enable(torch.compile(backend="eager")):
                    loss.backward()
            missing = [n for n, p in model.named_parameters() if p.grad is None]
            assert not missing, f"step {step}: no gradient for {missing}"
            opt.step()
            ref_opt.step()
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m: f"step {step}, {name}: {m}")
    finally:
        torch._dynamo.reset()


# ------------------------------------------------------------------------------------ copies and removal


def test_deepcopy_and_torch_save_give_plain_modules():
    """copy.deepcopy(), pickle and torch.save()/torch.load() of a covered model work and give plain modules
    (the patch is not part of a module's state); the original stays covered; uninstall() restores it."""
    torch.manual_seed(0)
    model = TiedLM()
    slots, _, covered = land(model)
    assert type(model.head) is nn.Linear and "forward" not in model.head.__dict__
    stream = io.BytesIO()
    torch.save(model, stream)
    stream.seek(0)
    copies = [copy.deepcopy(model), pickle.loads(pickle.dumps(model)), torch.load(stream, weights_only=False)]
    idx = torch.randint(0, 30, (2, 5))
    for c in copies:
        for m in c.modules():
            assert "_compiled_call_impl" not in m.__dict__
        c(idx).backward()
        assert all(p.grad is not None and p.grad.untyped_storage().nbytes() > 0 for p in c.parameters())
    model(idx).backward()
    assert all(slots.owns_grad(p) for p in model.parameters())
    for c in copies:
        assert_grads(c, model, "copy")
    slots.uninstall()
    for name in covered:
        assert "_compiled_call_impl" not in model.get_submodule(name).__dict__
    slots.zero_grad()
    model(idx).backward()
    assert not any(slots.owns_grad(p) for p in model.parameters())
    assert_grads(model, copies[0], "after uninstall")


def test_slots_gone_leave_the_model_plain():
    model = nn.Linear(3, 2)
    slots, _, _ = land(model)
    assert "_compiled_call_impl" in model.__dict__
    del slots
    import gc

    gc.collect()
    assert "_compiled_call_impl" not in model.__dict__


def test_a_module_compiled_by_the_caller_is_left_alone():
    model = nn.Sequential(nn.Linear(3, 2))
    marker = object()
    model[0]._compiled_call_impl = marker
    slots, _, covered = land(model)
    assert covered == [] and model[0]._compiled_call_impl is marker


# --------------------------------------------------------------------------------- release and acquire


def test_zero_grad_releases_the_storage_and_backward_brings_it_back():
    """zero_grad(): 0 bytes. Backward: the storage back, every slot holding its gradient, the padding zero
    (made NaN before the release: the new memory is likely the old block). Views made before the release
    are valid afterwards and see the new memory; the address is reported by data_ptr()."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3), nn.Linear(3, 3))  # the last one unused
    ref = copy.deepcopy(model)
    slots, bufs, _ = land(model)
    buf = bufs[0]
    x = torch.randn(4, 5)
    for step in range(3):
        assert slots.released(0) and buf.grad.untyped_storage().nbytes() == 0 and slots.data_ptr(0) == 0
        assert slots.landed_count(0) == 0 and slots.unlanded(0) == list(range(6))
        model[2](model[1](model[0](x))).sum().backward()
        ref[2](ref[1](ref[0](x))).sum().backward()
        assert not slots.released(0) and buf.grad.untyped_storage().nbytes() == buf.numel * 4
        assert slots.data_ptr(0) == buf.grad.data_ptr()
        assert slots.landed_count(0) == 4 and slots.unlanded(0) == [4, 5] and not slots.all_landed()
        assert_grads(nn.Sequential(*model[:3]), nn.Sequential(*ref[:3]), f"step {step}")
        for p, view in zip(buf.params[:4], buf.grad_views):
            assert torch.equal(view, p.grad)
        mask = torch.ones(buf.numel, dtype=torch.bool)
        for p in buf.params:
            s, e = buf.index[p]
            mask[s:e] = False
        assert not buf.grad[mask].any(), f"step {step}: padding not zero"
        views = list(buf.grad_views)
        buf.grad[mask] = float("nan")
        slots.zero_grad()
        ref.zero_grad()
    slots.acquire(0)
    views[0].fill_(3.0)
    s, e = buf.index[buf.params[0]]
    assert (buf.grad[s:e] == 3.0).all()


def test_a_gradient_kept_by_the_caller_keeps_the_storage():
    """A .grad kept past zero_grad() (logging its norm later, as torch allows): the storage is not released
    while it is referenced, and the kept tensor still reads its values."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    slots, bufs, _ = land(model)
    model(torch.randn(2, 4)).sum().backward()
    kept = model.weight.grad
    expected = kept.clone()
    slots.zero_grad()
    assert not slots.released(0) and slots.release_blocked(0)
    assert torch.equal(kept, expected)
    del kept
    slots.zero_grad()
    assert slots.released(0)


@pytest.mark.cpu_gradient_policy
def test_on_the_cpu_zero_grad_keeps_the_storage_and_gradients_land_in_it_again():
    """The CPU's default (LandingSlots.release_on_cpu off): zero_grad() sets every .grad to None but keeps the
    storage at its address, so a backward writes into memory already mapped; gradients are torch's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    ref = copy.deepcopy(model)
    slots, bufs, _ = land(model)
    buf = bufs[0]
    address = buf.grad.data_ptr()
    x = torch.randn(4, 5)
    for step in range(3):
        model(x).sum().backward()
        ref(x).sum().backward()
        assert_grads(model, ref, f"step {step}")
        slots.zero_grad()
        ref.zero_grad()
        assert all(p.grad is None for p in model.parameters())
        assert not slots.released(0) and slots.data_ptr(0) == address
        assert buf.grad.untyped_storage().nbytes() == buf.numel * 4


@pytest.mark.cpu_gradient_policy
def test_an_optimizer_on_the_cpu_steps_as_torch_with_the_storage_kept(backend):
    """The optimizer's loop over the kept storage (each backward writes over the last one's gradients) steps
    as torch.optim does."""
    import flatopt

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    ref = copy.deepcopy(model)
    ours = flatopt.AdamW(model, lr=1e-2, weight_decay=0.1, backend=backend, direct_grads=True)  # on the CPU too
    theirs = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    address = None
    for step in range(4):
        x = torch.randn(4, 5)
        for m, o in ((model, ours), (ref, theirs)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
        grad_ptr = model[0].weight.grad.untyped_storage().data_ptr()
        assert address in (None, grad_ptr), f"step {step}: the gradient storage moved"
        address = grad_ptr
        for (n, a), b in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"step {step}, {n}")


def test_model_zero_grad_releases_the_storage_at_the_next_forward(backend):
    """Hugging Face's Trainer ends each step with model.zero_grad(), not the optimizer's: every .grad becomes None
    without the optimizer knowing. The next forward of a covered layer sees it and releases the storage, so it is
    not held through the forward pass; training goes on as torch.optim's."""
    import flatopt

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    ref = copy.deepcopy(model)
    ours = flatopt.AdamW(model, lr=1e-2, weight_decay=0.1, backend=backend)
    theirs = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    slots = flatopt.inspect(ours).landing.slots
    for step in range(4):
        x = torch.randn(4, 5)
        for m, o in ((model, ours), (ref, theirs)):
            m(x).square().mean().backward()
            o.step()
            m.zero_grad()
        for (n, a), b in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"step {step}, {n}")
    assert not slots.released(0), "model.zero_grad() alone releases nothing"
    model(torch.randn(4, 5))
    assert slots.released(0), "the next forward did not release the storage"


def test_a_gradient_left_in_place_keeps_the_storage_through_forward():
    """Accumulation (a forward after backward with the gradients in place), or a single .grad set to None by hand:
    the storage stays, and the next backward adds into the gradients that are there, as torch does."""
    import flatopt

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    ref = copy.deepcopy(model)
    opt = flatopt.AdamW(model, lr=1e-2)
    slots = flatopt.inspect(opt).landing.slots
    x1, x2 = torch.randn(4, 5), torch.randn(4, 5)
    for m in (model, ref):
        m(x1).sum().backward()
    model[2].bias.grad = None
    ref[2].bias.grad = None
    for m in (model, ref):
        m(x2).sum().backward()
    assert not slots.released(0)
    assert_grads(model, ref, "accumulated over two passes, one .grad reset in between")


def test_stale_lists_a_grad_replaced_after_landing():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    slots, _, _ = land(model)
    model(torch.randn(2, 4)).sum().backward()
    assert slots.all_landed() and slots.stale(0) == []
    model.bias.grad = model.bias.grad.clone()
    assert slots.all_landed() and slots.stale(0) == [1]
    model.weight.grad = None
    assert slots.stale(0) == [0, 1]


def test_a_view_put_back_into_a_released_buffer_is_refused():
    """The buffer's own view put back into .grad while the storage is released (without acquire()): backward
    raises and says what to call, rather than accumulating into memory that is not there."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    slots, bufs, _ = land(model)
    assert slots.released(0)
    model.weight.grad = bufs[0].grad_views[0]
    with pytest.raises(RuntimeError, match=r"released flat gradient buffer: call LandingSlots.acquire\(\)"):
        model(torch.randn(2, 4)).sum().backward()


def test_hold_keeps_the_address():
    """hold(): zero_grad() keeps the storage (a CUDA graph's recorded addresses stay valid); hold(False)
    lets it go again."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    ref = copy.deepcopy(model)
    slots, bufs, _ = land(model)
    slots.hold()
    address = slots.data_ptr(0)
    assert address != 0
    x = torch.randn(2, 4)
    for _ in range(3):
        slots.zero_grad()
        ref.zero_grad()
        assert not slots.released(0)
        model(x).sum().backward()
        ref(x).sum().backward()
        assert slots.data_ptr(0) == address
        assert_grads(model, ref, "held")
    slots.hold(False)
    slots.zero_grad()
    assert slots.released(0)


def test_mixed_dtypes_use_one_buffer_each():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2).to(torch.bfloat16))
    slots, bufs, covered = land(model)
    assert len(bufs) == 2 and covered == ["0", "1"]
    x = torch.randn(3, 4)
    model[1](model[0](x).bfloat16()).float().sum().backward()
    assert slots.all_landed()
    for p in model.parameters():
        assert_in_slot(p, slots, str(p.dtype))


# ------------------------------------------------------------------------------------------ bad input


def test_bad_buffers_are_refused():
    a = nn.Parameter(torch.randn(3))
    assert LandingSlots([]).buffers == []  # no trainable parameter yet: no slots, and nothing refused
    with pytest.raises(ValueError, match="grad=True"):
        LandingSlots([FlatBuffer([a], [0], grad=False)])
    with pytest.raises(ValueError, match="in two buffers"):
        LandingSlots([FlatBuffer([a], [0]), FlatBuffer([a], [0])])
    with pytest.raises(TypeError):
        LandingSlots([FlatBuffer([a], [0])], fused=True)
    with pytest.raises(TypeError, match="takes FlatBuffer objects, got Tensor at index 0"):
        LandingSlots([torch.zeros(3)])
