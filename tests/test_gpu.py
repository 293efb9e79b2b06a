"""GPU tests: each Triton kernel against the pure-torch reference at real sizes (12M elements, interleaved
param groups, non-uniform steps, an active mask, grad_scale/found_inf) in fp32, bf16 and fp16; a buffer of
more than 2**31 elements; step() replayed from a CUDA graph; flatopt against torch.optim's fused
optimizers over training steps (with a GradScaler); and the step benchmark's CUDA code path.

Every test needs a CUDA GPU; tests/conftest.py turns them into skips, with the reason, elsewhere.
"""

import copy
import dataclasses
import gc
import importlib
import json
import sys
import warnings
from pathlib import Path

import pytest
import torch
from conftest import TOL, param_groups
from torch import nn

import flatopt
from flatopt import kernels, reference
from flatopt.layout import ALIGN, FlatBuffer

pytestmark = pytest.mark.requires_cuda

ROOT = Path(__file__).resolve().parents[1]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
OPTIMIZERS = {"adamw": flatopt.AdamW, "sgd": flatopt.SGD, "lion": flatopt.Lion}
# Three param groups per optimizer, with every option that changes the math somewhere.
GROUPS = {
    "adamw": [
        dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1),
        dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0, maximize=True),
        dict(lr=1e-3, betas=(0.95, 0.9999), weight_decay=0.5),
    ],
    "sgd": [
        dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
        dict(lr=0.1, momentum=0.5, dampening=0.3, maximize=True),
        dict(lr=0.02, momentum=0.0, weight_decay=0.1),
    ],
    "lion": [
        dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1),
        dict(lr=3e-4, betas=(0.95, 0.98)),
        dict(lr=1e-4, betas=(0.5, 0.999), weight_decay=1.0),
    ],
}
# 12,229,954 elements; sizes that are not multiples of the block size or the alignment.
SHAPES = [(1000, 3001), (4096, 1024), (2_500_003,), (77,), (1536, 999), (1_000_001,), (3, 5, 7)]
# The buffer past 2**31 elements: a parameter that ends short of 2**31 (unaligned), then one across it
# that ends the buffer (no padding after it).
BOUNDARY = 2**31
BIG_A = BOUNDARY - 2**20 + 37
BIG_B = 2**21 + 3 * ALIGN


@pytest.fixture(autouse=True)
def free_cuda_memory():
    yield
    gc.collect()
    torch.cuda.empty_cache()


def kernel(name):
    return getattr(kernels, f"{name}_step")


def hparam_table(name, group_kwargs):
    """The [groups, NUM_HPARAMS] table, built by the optimizer class from complete param groups."""
    cls = OPTIMIZERS[name]
    dummies = [{"params": [torch.zeros(ALIGN, device="cuda", requires_grad=True)], **kw} for kw in group_kwargs]
    groups = cls(dummies).param_groups
    return torch.tensor([cls.rule.row(g) for g in groups], dtype=torch.float32, device="cuda")


def filled_buffer(name, shapes, dtype, group_ids, seed=0):
    """A FlatBuffer over new CUDA parameters, with random values, gradients and states (padding stays zero)."""
    params = [torch.empty(s, device="cuda", dtype=dtype) for s in shapes]
    buf = FlatBuffer(params, group_ids, OPTIMIZERS[name].rule.state_names)
    buf.adopt()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for i in range(len(params)):
        buf.data_views[i].normal_(generator=gen)
        buf.grad_views[i].normal_(generator=gen)
        for state, views in buf.state_views.items():
            views[i].normal_(0.0, 0.1, generator=gen)
            if state == "exp_avg_sq":
                views[i].mul_(0.1).square_()
    return buf


def tensors_of(buf):
    return {"param": buf.data, "grad": buf.grad, **buf.states}


def clone_meta(meta):
    tensors = {f.name: getattr(meta, f.name) for f in dataclasses.fields(meta)}
    return dataclasses.replace(meta, **{k: v.clone() for k, v in tensors.items() if isinstance(v, torch.Tensor)})


def call(fn, name, t, hp, meta, grad_scale=None, found_inf=None):
    states = [t.get(n) for n in OPTIMIZERS[name].rule.state_names]
    fn(t["param"], t["grad"], *states, hparams=hp, meta=meta, grad_scale=grad_scale, found_inf=found_inf)


def element_hparams(hp, meta, numel):
    """[numel, NUM_HPARAMS]: each element's row of the hyper-parameter table."""
    owner = torch.repeat_interleave(meta.param_of_granule.long(), ALIGN)[:numel]
    return hp[meta.param_group.long()[owner]]


def lion_ambiguous(t, h, grad_scale):
    """Elements whose Lion update direction c = beta1 * m + (1 - beta1) * g is within rounding of zero:
    a fused multiply-add may give its sign either way there (the update then differs by 2 * lr)."""
    g = t["grad"].float() if grad_scale is None else t["grad"].float() / grad_scale.float()
    a = t["exp_avg"].float() * h[:, kernels.lion.BETA1.value]
    b = h[:, kernels.lion.ONE_MINUS_BETA1.value] * g
    size = a.abs() + b.abs()
    return ((a + b).abs() <= 1e-6 * size) & (size > 0)  # padding (all zeros) is unambiguous


def assert_step_matches(name, ours, ref, meta_ours, meta_ref, dtype, step, lion_amb=None, lr=None):
    tol = TOL[dtype]
    for key in ours:
        a, b = ours[key], ref[key]
        if key == "param" and lion_amb is not None:
            diff = (a.float() - b.float()).abs()
            bound = tol["atol"] + tol["rtol"] * b.float().abs()
            bad = ~((diff <= bound) | (lion_amb & (diff <= 2 * lr + bound)))
            assert not bad.any(), f"step {step}, {name} param: {int(bad.sum())} elements differ from the reference"
            # The mask must stay narrow, or the check above could not fail. How many inputs cancel to within
            # rounding depends on the data's precision: 16-bit values sit on a coarse grid, so exact cancellations
            # of beta1 * m and (1 - beta1) * g are about 100x more frequent than in float32 (seen on an H100:
            # 135 to 1229 of 12.2M elements in bf16/fp16 at the first step).
            cap = max(16, a.numel() // (10**5 if dtype == torch.float32 else 10**3))
            assert int(lion_amb.sum()) <= cap, f"step {step}: too many ambiguous signs"
        else:
            torch.testing.assert_close(a, b, **tol, msg=lambda m, k=key: f"step {step}, {name} {k}: {m}")
    assert torch.equal(meta_ours.steps, meta_ref.steps), f"step {step}: step counts differ"


def resync(ours, ref, meta_ours, meta_ref):
    """Start the next step of the reference from the kernel's state, so each step is compared on its own."""
    for key in ours:
        ref[key].copy_(ours[key])
    meta_ref.steps.copy_(meta_ours.steps)


# "groups": three interleaved param groups, non-uniform steps, an active mask, grad_scale and found_inf;
# "uniform": one group, equal steps (the kernels' scalar path), grad_scale. Each combination compiles kernels.
KERNEL_CASES = [
    (name, dtype, layout)
    for name in OPTIMIZERS
    for dtype in DTYPES
    for layout in ("groups", "uniform")
    if not (layout == "uniform" and dtype == torch.float16)
]


@pytest.mark.parametrize("name,dtype,layout", KERNEL_CASES, ids=lambda x: str(x).replace("torch.", ""))
def test_kernel_matches_reference_at_real_size(name, dtype, layout):
    n_groups = 3 if layout == "groups" else 1
    hp = hparam_table(name, GROUPS[name][:n_groups])
    buf = filled_buffer(name, SHAPES, dtype, [i % n_groups for i in range(len(SHAPES))])  # interleaved groups
    meta = buf.meta
    n_params = len(SHAPES)
    if layout == "groups":
        steps = torch.tensor([0, 3, 1, 7, 0, 2, 5], dtype=torch.float32)
        meta.steps.copy_(steps[:n_params])
        meta.uniform = False
    else:
        assert meta.uniform  # one group, equal steps: the kernels' scalar path
    ours, meta_ours = tensors_of(buf), meta
    ref, meta_ref = {k: v.clone() for k, v in ours.items()}, clone_meta(meta)
    scale = torch.full((1,), 1024.0, device="cuda")
    no_inf, inf = torch.zeros(1, device="cuda"), torch.ones(1, device="cuda")
    plan = [dict(), dict(grad_scale=scale, found_inf=no_inf)]
    if layout == "groups":
        plan = [dict(active=True)] + plan + [dict(grad_scale=scale, found_inf=inf)]
    h = element_hparams(hp, meta, buf.numel) if name == "lion" else None
    for step, kw in enumerate(plan, 1):
        active = kw.pop("active", False)
        for m in (meta_ours, meta_ref):
            m.active = torch.tensor([1, 0, 1, 1, 0, 1, 1], dtype=torch.uint8, device="cuda") if active else None
        before = {k: v.clone() for k, v in ours.items()}
        amb = lion_ambiguous(ref, h, kw.get("grad_scale")) if name == "lion" else None
        call(kernel(name), name, ours, hp, meta_ours, **kw)
        call(getattr(reference, f"{name}_step"), name, ref, hp, meta_ref, **kw)
        lr = None if h is None else h[:, kernels.lion.LR.value]
        assert_step_matches(name, ours, ref, meta_ours, meta_ref, dtype, step, amb, lr)
        if kw.get("found_inf") is inf:  # a skipped step changes nothing, not even the gradients
            for key in ours:
                assert torch.equal(ours[key], before[key]), f"step {step} (found_inf): {key} changed"
        else:
            assert not torch.equal(ours["param"], before["param"]), f"step {step}: parameters did not change"
        resync(ours, ref, meta_ours, meta_ref)


def _region_reference(name, dtype, group, saved, hp, steps_before, state_names):
    """The reference step on a copy of one slice of the big buffer (all of it inside one parameter)."""
    n = saved["param"].numel()
    fb = FlatBuffer([torch.empty(n, device="cuda", dtype=dtype)], [group], state_names)
    t = tensors_of(fb)
    for key in t:
        t[key].copy_(saved[key])
    fb.meta.steps.fill_(steps_before)
    call(getattr(reference, f"{name}_step"), name, t, hp, fb.meta)
    return t, fb.meta


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_buffer_past_2_31_elements(name):
    dtype = torch.bfloat16
    n_a, n_b = BIG_A, BIG_B
    groups = [GROUPS[name][0], {**GROUPS[name][1], "momentum": 0.0} if name == "sgd" else GROUPS[name][1]]
    if name == "sgd":
        groups[0] = {**groups[0], "momentum": 0.0, "nesterov": False}  # p and g only: 2 buffers
    state_names = () if name == "sgd" else OPTIMIZERS[name].rule.state_names
    n_buffers = 2 + len(state_names)
    need = (n_buffers + 1) * (n_a + n_b) * 2 + 2 * 2**30
    free, _ = torch.cuda.mem_get_info()
    if free < need:
        pytest.skip(f"needs {need / 2**30:.1f} GiB of free GPU memory ({n_buffers} bf16 buffers of 2**31+ elements)")
    hp = hparam_table(name, groups)
    buf = FlatBuffer([torch.empty(n_a, device="cuda", dtype=dtype), torch.empty(n_b, device="cuda", dtype=dtype)],
                     [0, 1], state_names)  # fmt: skip
    buf.adopt()
    assert buf.numel > BOUNDARY and buf.starts[1] + n_b == buf.numel
    gen = torch.Generator(device="cuda").manual_seed(0)
    t = tensors_of(buf)
    for key, x in t.items():
        for i in range(2):
            v = buf.view(x, i)
            v.normal_(0.0, 1.0 if key in ("param", "grad") else 0.1, generator=gen)
            if key == "exp_avg_sq":
                v.square_()
    meta = buf.meta
    meta.uniform = False
    end = buf.numel
    regions = [(0, 8192, 0), (BOUNDARY - 4096, BOUNDARY + 4096, 1), (end - 8192, end, 1)]  # (start, stop, group)
    saved = [{k: x[a:b].clone() for k, x in t.items()} for a, b, _ in regions]
    call(kernel(name), name, t, hp, meta)  # SGD: no momentum buffer, t has none
    torch.cuda.synchronize()
    assert meta.steps.tolist() == [1.0, 1.0]
    for (a, b, group), before in zip(regions, saved, strict=True):
        expected, _ = _region_reference(name, dtype, group, before, hp, 0.0, state_names)
        amb = lr = None
        if name == "lion":
            h = hp[group].expand(b - a, -1)
            amb, lr = lion_ambiguous(before, h, None), h[:, kernels.lion.LR.value]
        got = {k: x[a:b] for k, x in t.items()}
        where = f"elements [{a}, {b})"
        tol = TOL[dtype]
        for key in got:
            if key == "param" and amb is not None:
                diff = (got[key].float() - expected[key].float()).abs()
                bound = tol["atol"] + tol["rtol"] * expected[key].float().abs()
                assert ((diff <= bound) | (amb & (diff <= 2 * lr + bound))).all(), f"{where}: param differs"
            else:
                torch.testing.assert_close(
                    got[key], expected[key], **tol, msg=lambda m, k=key, w=where: f"{w}, {k}: {m}"
                )
        assert not torch.equal(got["param"], before["param"]), f"{where}: not updated"
    del t, buf, saved


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(37, 129)
        self.norm = nn.LayerNorm(129)
        self.out = nn.Linear(129, 11)

    def forward(self, x):
        return self.out(nn.functional.gelu(self.norm(self.inp(x))))


class LionReference(torch.optim.Optimizer):
    """Lion per parameter, as written in Chen et al. 2023 (decoupled weight decay as lion-pytorch)."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            lr, (beta1, beta2), wd = group["lr"], group["betas"], group["weight_decay"]
            for p in group["params"]:
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                p.mul_(1 - lr * wd)
                p.add_((m * beta1 + p.grad * (1 - beta1)).sign(), alpha=-lr)
                m.mul_(beta2).add_(p.grad, alpha=1 - beta2)


def train_pair(make_ours, make_theirs, steps=12, scaler=False, inf_step=None):
    torch.manual_seed(0)
    model = MLP().cuda()
    ref = copy.deepcopy(model)
    ours, theirs = make_ours(model), make_theirs(ref)
    scalers = [torch.amp.GradScaler("cuda", init_scale=2.0**12, growth_interval=3) for _ in range(2)] if scaler else []
    gen = torch.Generator(device="cuda").manual_seed(1)
    for step in range(1, steps + 1):
        x = torch.randn(64, 37, device="cuda", generator=gen)
        y = torch.randint(0, 11, (64,), device="cuda", generator=gen)
        for i, (m, opt) in enumerate(((model, ours), (ref, theirs))):
            loss = nn.functional.cross_entropy(m(x), y)
            if scaler:
                scalers[i].scale(loss).backward()
                if step == inf_step:
                    m.inp.weight.grad[0, 0] = float("inf")
                scalers[i].step(opt)
                scalers[i].update()
            else:
                loss.backward()
                opt.step()
            opt.zero_grad()
        for (pname, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, q, **TOL[torch.float32], msg=lambda m, n=pname, s=step: f"step {s}, {n}: {m}")
            for key, value in theirs.state[q].items():
                mine = ours.state[p][key]
                if key == "step":
                    assert float(mine) == float(value), (
                        f"step {step}, {pname}: step count {float(mine)} != {float(value)}"
                    )
                else:
                    torch.testing.assert_close(
                        mine,
                        value,
                        **TOL[torch.float32],
                        msg=lambda m, n=f"{pname}.{key}", s=step: f"step {s}, {n}: {m}",
                    )
        if scaler:
            assert scalers[0].get_scale() == scalers[1].get_scale(), f"step {step}: loss scales differ"
    return ours


def test_adamw_matches_torch_fused():
    kw = dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.1)
    ours = train_pair(
        lambda m: flatopt.AdamW(param_groups(m, **kw)), lambda m: torch.optim.AdamW(param_groups(m, **kw), fused=True)
    )
    assert ours.backend == "triton"


def test_adamw_with_grad_scaler_matches_torch_fused():
    kw = dict(lr=1e-2, weight_decay=0.1)
    train_pair(
        lambda m: flatopt.AdamW(param_groups(m, **kw)),
        lambda m: torch.optim.AdamW(param_groups(m, **kw), fused=True),
        scaler=True,
        inf_step=4,
    )


def test_gathered_gradients_match_torch_fused_and_the_buffer_stays_released():
    """direct_grads="gather" on CUDA: the kernel reads autograd's gradients through a table of their addresses and
    stores none (its flat gradient buffer, released, is passed as a null pointer), with GradScaler and a skipped
    step; right after a step the storage is still released and every .grad is autograd's tensor."""
    kw = dict(lr=1e-2, weight_decay=0.1)
    ours = train_pair(
        lambda m: flatopt.AdamW(param_groups(m, **kw), direct_grads="gather"),
        lambda m: torch.optim.AdamW(param_groups(m, **kw), fused=True),
        scaler=True,
        inf_step=4,
    )
    model = MLP().cuda()
    opt = flatopt.AdamW(model, direct_grads="gather", **kw)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(64, 37, device="cuda")).square().mean().backward()
        grads = [p.grad for p in model.parameters()]
        opt.step()
        torch.cuda.synchronize()
        assert all(buf.grad.untyped_storage().nbytes() == 0 for buf in flatopt.inspect(opt).buffers)
        assert all(p.grad is g for p, g in zip(model.parameters(), grads))
    assert ours.backend == "triton"


def test_sgd_matches_torch_fused():
    kw = dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)
    train_pair(
        lambda m: flatopt.SGD(param_groups(m, **kw), **kw),
        lambda m: torch.optim.SGD(param_groups(m, **kw), **kw, fused=True),
    )


def test_lion_matches_paper_reference():
    kw = dict(lr=3e-3, betas=(0.9, 0.99), weight_decay=0.5)
    train_pair(
        lambda m: flatopt.Lion(param_groups(m, **kw), **kw), lambda m: LionReference(param_groups(m, **kw), **kw)
    )


def test_lr_changed_every_step_while_the_host_runs_ahead():
    """An LR schedule reaches every step when the host runs many steps ahead of the device: a staged
    hyper-parameter table is not written again before the copy that reads it has run."""
    from flatopt.staging import MAX_SLOTS

    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(1000,), (37,), (64, 64)]
    ours_p = [nn.Parameter(torch.randn(s, device="cuda", generator=gen)) for s in shapes]
    ref_p = [nn.Parameter(p.detach().clone()) for p in ours_p]
    grads = [[torch.randn(s, device="cuda", generator=gen) for s in shapes] for _ in range(3 * MAX_SLOTS)]
    ours = flatopt.AdamW(ours_p, lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(ref_p, lr=1e-2, weight_decay=0.1, fused=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about 1 s of device time: every step below (and a first compile) waits
    for step, gs in enumerate(grads):
        lr = 1e-2 * 0.8**step
        for opt, ps in ((ours, ours_p), (ref, ref_p)):
            opt.param_groups[0]["lr"] = lr
            for p, g in zip(ps, gs, strict=True):
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.copy_(g)
            opt.step()
    assert len(ours.hparams.staging[torch.device("cuda", torch.cuda.current_device())].slots) == MAX_SLOTS, (
        "the host did not run ahead of the device: the test did not reach the case it is for"
    )
    torch.cuda.synchronize()
    for i, (p, q) in enumerate(zip(ours_p, ref_p, strict=True)):
        torch.testing.assert_close(p, q, **TOL[torch.float32], msg=lambda m, i=i: f"parameter {i}: {m}")


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_step_replayed_from_cuda_graph_matches_eager(name):
    shapes = [(1000, 37), (4097,), (64, 64), (3,)]
    gen = torch.Generator(device="cuda").manual_seed(0)
    values = [
        (torch.randn(s, device="cuda", generator=gen), torch.randn(s, device="cuda", generator=gen)) for s in shapes
    ]

    def make():
        params = []
        for v, g in values:
            p = nn.Parameter(v.clone())
            p.grad = g.clone()
            params.append(p)
        groups = [{"params": params[:2], **GROUPS[name][0]}, {"params": params[2:], **GROUPS[name][1]}]
        return params, OPTIMIZERS[name](groups)

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*received no gradient.*")  # grads set by hand
        eager_params, eager = make()
        for _ in range(5):
            eager.step()
        graph_params, opt = make()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                opt.step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            opt.step()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    for i, (p, q) in enumerate(zip(graph_params, eager_params, strict=True)):
        assert torch.equal(p, q), f"param {i} after 2 eager steps + 3 replays differs from 5 eager steps"
        for key, value in eager.state[q].items():
            assert torch.equal(torch.as_tensor(opt.state[p][key]), torch.as_tensor(value)), f"param {i}, {key}"


def import_benchmark(name):
    """``benchmarks.<name>``, with the repository root on sys.path only while importing it."""
    added = str(ROOT) not in sys.path
    if added:
        sys.path.append(str(ROOT))
    try:
        return importlib.import_module(f"benchmarks.{name}")
    finally:
        if added:
            sys.path.remove(str(ROOT))


def test_benchmark_smoke_run_on_cuda(tmp_path):
    bench = import_benchmark("bench_step")
    path = tmp_path / "smoke.json"
    assert bench.main(["--device", "cuda", "--smoke", "--json", str(path)]) == 0
    record = json.loads(path.read_text())
    assert record["kind"] == "smoke" and record["env"]["device_name"] == torch.cuda.get_device_name()
    must_run = {"torch-foreach", "torch-fused", "torch-fused-graph", "foreach-lion", "flatopt", "flatopt-graph"}
    for r in record["results"]:
        if r["impl"] in must_run:
            assert r["status"] == "ok", r
    compiled = [r for r in record["results"] if r["impl"] == "torch-compile"]
    assert compiled[0]["status"] == "ok", compiled[0]  # eager backend in a subprocess
    assert all(r["status"] == "skipped" for r in compiled[1:])


def test_fsdp_benchmark_smoke_run_on_one_nccl_rank(tmp_path):
    """bench_fsdp.py on the GPU (one NCCL rank): every case runs, with a peak measured, before the fsdp section of
    benchmarks/run_gpu.sh spends its time on the full sizes."""
    bench = import_benchmark("bench_fsdp")
    path = tmp_path / "fsdp.json"
    assert bench.main(["--device", "cuda", "--smoke", "--ranks", "1", "--json", str(path)]) == 0
    record = json.loads(path.read_text())
    assert record["kind"] == "smoke" and record["settings"]["backend"] == "nccl", record["settings"]
    (world,) = record["worlds"]
    assert world["status"] == "ok", world
    for r in record["results"]:
        assert r["status"] == "ok" and r["peak_bytes"] > 0, r
