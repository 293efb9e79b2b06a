"""optimizer.capture(train_step): zero_grad + forward + backward + step as one CUDA graph.

The CPU tests cover the checks made before anything runs; the GPU tests (``requires_cuda``)
compare captured replays with eager flatopt and torch.optim over 20 steps with the lr changed
every step, and cover GradScaler, clipping, accumulation and the errors."""

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import HAS_CUDA, TRITON_SKIP, device_for, variant_tol
from torch import nn

import flatopt
from flatopt.capture import Snapshot, check_inputs

# ---------------------------------------------------------------------------------------- CPU


@pytest.mark.skipif(HAS_CUDA, reason="checks the error on a machine without a GPU; this one has one")
def test_capture_without_gpu_says_so():
    model = nn.Linear(4, 3)
    opt = flatopt.AdamW(model)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU; this machine has none"):
        opt.capture(lambda x: model(x).sum().backward(), torch.randn(2, 4))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(flat=False), r"flat=False\) cannot be captured"),
        (dict(in_backward=True), r"in_backward=True\) cannot be captured"),
    ],
)
def test_modes_that_cannot_be_captured_are_refused_before_running(kwargs, match):
    model = nn.Linear(4, 3)
    opt = flatopt.SGD(model, lr=0.1, **kwargs)
    calls = []
    with pytest.raises(RuntimeError, match=match):
        opt.capture(lambda x: calls.append(x), torch.randn(2, 4))
    assert not calls, "train_step must not run when capture is refused"


def test_new_inputs_are_checked_against_the_static_ones():
    static = [torch.zeros(2, 3), 5]
    check_inputs(static, [torch.ones(2, 3), 5])
    with pytest.raises(ValueError, match=r"input 0: .*recorded for shape \(2, 3\).*got shape \(4, 3\)"):
        check_inputs(static, [torch.ones(4, 3), 5])
    with pytest.raises(ValueError, match=r"input 0: .*torch.float32.*got .*torch.float64"):
        check_inputs(static, [torch.ones(2, 3, dtype=torch.float64), 5])
    with pytest.raises(ValueError, match="input 1: non-tensor inputs are recorded as constants"):
        check_inputs(static, [torch.ones(2, 3), 6])
    with pytest.raises(TypeError, match="takes 2 inputs, got 1"):
        check_inputs(static, [torch.ones(2, 3)])
    with pytest.raises(TypeError, match="input 0: .*recorded with a tensor, got list"):
        check_inputs(static, [[1.0], 5])
    for x in (torch.tensor(5), torch.tensor([5, 6])):  # never compared with ==: no host sync, no ambiguous bool
        with pytest.raises(TypeError, match=r"input 1: .*recorded with the constant 5 \(int\), got a tensor"):
            check_inputs(static, [torch.ones(2, 3), x])


def test_replay_copies_inputs_without_autograd_history():
    """__call__ copies new inputs into the static ones; an input that requires grad must not make the
    static input part of an autograd graph (the CUDA graph is replaced by a stand-in: no GPU needed)."""
    from flatopt.capture import CapturedStep

    model = nn.Linear(4, 3)
    opt = flatopt.SGD(model, lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    replays = []
    step = object.__new__(CapturedStep)
    step.opt, step.outputs = opt, "outputs"
    step.graph = type("Graph", (), {"replay": lambda self: replays.append(1)})()
    step.static = [torch.zeros(2, 4), 3]
    step.buffers, step.tables, step.layout = (
        list(flatopt.inspect(opt).buffers),
        dict(flatopt.inspect(opt).tables),
        step._layout(),
    )
    x = torch.randn(2, 4, requires_grad=True)
    assert step(x * 2, 3) == "outputs" and replays == [1]
    assert torch.equal(step.static[0], (x * 2).detach())
    assert not step.static[0].requires_grad and step.static[0].grad_fn is None
    step.static[0].requires_grad_()  # as train_step does for a gradient penalty on its input
    y = torch.randn(2, 4)
    step(y, 3)
    assert torch.equal(step.static[0].detach(), y) and step.static[0].grad_fn is None and replays == [1, 1]


def test_snapshot_restores_parameters_grads_states_steps_and_module_buffers():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.Linear(7, 2))
    opt = flatopt.AdamW(model, lr=1e-2)
    x = torch.randn(8, 5)
    model(x).square().mean().backward()
    opt.step()
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))
    bufs = flatopt.inspect(opt).buffers
    tracked = lambda: [t.clone() for t in (  # noqa: E731
        *[b.data for b in bufs], *[b.grad for b in bufs],
        *[s for b in bufs for s in b.states.values()], *[b.meta.steps for b in bufs],
        *model.buffers(), scaler._scale, scaler._growth_tracker,
    )]  # fmt: skip
    before = tracked()
    snap = Snapshot(opt, scaler, model)
    for _ in range(3):
        model(x).square().mean().backward()
        opt.step()
    scaler._scale.mul_(2)
    scaler._growth_tracker.add_(1)
    assert any(not torch.equal(a, b) for a, b in zip(before, tracked()))
    snap.restore()
    for a, b in zip(before, tracked()):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------- GPU

OPTS = {
    "adamw": lambda ps, **kw: flatopt.AdamW(ps, lr=3e-3, weight_decay=0.1, **kw),
    "sgd": lambda ps, **kw: flatopt.SGD(ps, lr=3e-2, momentum=0.9, nesterov=True, weight_decay=1e-3, **kw),
    "lion": lambda ps, **kw: flatopt.Lion(ps, lr=3e-4, weight_decay=0.1, **kw),
}
TORCH_OPTS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.1),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=3e-2, momentum=0.9, nesterov=True, weight_decay=1e-3),
}
SAME = dict(atol=1e-6, rtol=1e-6)  # fp32; captured vs eager flatopt: a rounding apart at most (variant_tol)
NEAR_TORCH = dict(atol=1e-6, rtol=1e-5)  # fp32; torch.optim rounds a few operations differently


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        self.fc1 = nn.Linear(32, 96)
        self.fc2 = nn.Linear(96, 50)

    def forward(self, tokens):
        return self.fc2(torch.tanh(self.fc1(self.emb(tokens).mean(1))))


def lion_reference_step(params, lr, beta1=0.9, beta2=0.99, wd=0.1, state=None):
    for p in params:
        m = state.setdefault(p, torch.zeros_like(p))
        p.mul_(1 - lr * wd)
        p.add_((m * beta1 + p.grad * (1 - beta1)).sign(), alpha=-lr)
        m.mul_(beta2).add_(p.grad, alpha=1 - beta2)


def batches(n, seed=0, batch=16):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, 50, (batch, 7), generator=g).cuda(), torch.randint(0, 50, (batch,), generator=g).cuda())
        for _ in range(n)
    ]


def lr_at(step):
    return 3e-3 * (0.5 + 0.5 * ((step * 7) % 10) / 10)  # changes every step


@pytest.mark.requires_cuda
@pytest.mark.parametrize("name", list(OPTS))
def test_captured_matches_eager_and_torch_over_20_replays(name):
    torch.manual_seed(0)
    base = MLP().cuda()
    models = [copy.deepcopy(base) for _ in range(3)]
    captured_model, eager_model, torch_model = models
    opt_c, opt_e = OPTS[name](captured_model), OPTS[name](eager_model)
    scale = {"adamw": 1.0, "sgd": 10.0, "lion": 0.1}[name]
    if name in TORCH_OPTS:
        opt_t = TORCH_OPTS[name](torch_model.parameters())
    for q in torch_model.parameters():
        q.grad = torch.zeros_like(q)
    lion_state = {}

    def train_step(tokens, target):
        loss = F.cross_entropy(captured_model(tokens), target)
        loss.backward()
        return loss

    data = batches(21)
    step = opt_c.capture(train_step, *data[0])
    buf = flatopt.inspect(opt_c).buffers[0]  # the step reads the gradients where backward left them in the graph's pool
    assert all(a != v.data_ptr() for a, v in zip(step.recorded[buf], buf.grad_views))
    assert step.sources[buf].src.tolist() == step.recorded[buf]
    for i, (tokens, target) in enumerate(data[1:], start=1):
        lr = lr_at(i) * scale
        for o in (opt_c, opt_e):
            for g in o.param_groups:
                g["lr"] = lr
        loss_c = step(tokens, target).clone()
        opt_e.zero_grad()
        loss_e = F.cross_entropy(eager_model(tokens), target)
        loss_e.backward()
        opt_e.step()
        torch_loss = F.cross_entropy(torch_model(tokens), target)
        for q in torch_model.parameters():
            q.grad.zero_()
        torch_loss.backward()
        if name in TORCH_OPTS:
            for g in opt_t.param_groups:
                g["lr"] = lr
            opt_t.step()
        else:
            with torch.no_grad():
                lion_reference_step(list(torch_model.parameters()), lr, state=lion_state)
        torch.testing.assert_close(loss_c, loss_e.detach(), **SAME, msg=lambda m: f"replay {i}, loss: {m}")
        for (n, p), q, r in zip(captured_model.named_parameters(), eager_model.parameters(), torch_model.parameters()):
            torch.testing.assert_close(p, q, **SAME, msg=lambda m: f"replay {i}, {n} vs eager flatopt: {m}")
            torch.testing.assert_close(p, r, **NEAR_TORCH, msg=lambda m: f"replay {i}, {n} vs reference: {m}")
        for p, q in zip(captured_model.parameters(), eager_model.parameters()):
            for key, value in opt_e.state[q].items():
                torch.testing.assert_close(opt_c.state[p][key], value, **SAME, msg=lambda m: f"replay {i}, {key}: {m}")
    opt_c.check_bindings(full=True)  # every .grad and parameter still a view into its buffer
    for p, (data_ptr, grad_ptr) in zip(buf.params, buf.expected):
        assert p.data_ptr() == data_ptr and p.grad.data_ptr() == grad_ptr


@pytest.mark.requires_cuda
def test_capture_leaves_everything_as_it_was():
    torch.manual_seed(0)
    model = MLP().cuda()
    opt = flatopt.AdamW(model, lr=1e-2)
    data = batches(2)
    model(data[0][0]).sum().backward()
    opt.step()
    before = [
        t.clone() for b in flatopt.inspect(opt).buffers for t in (b.data, b.grad, *b.states.values(), b.meta.steps)
    ]

    def train_step(tokens, target):
        F.cross_entropy(model(tokens), target).backward()

    opt.capture(train_step, *data[1], warmup=4)
    after = [t for b in flatopt.inspect(opt).buffers for t in (b.data, b.grad, *b.states.values(), b.meta.steps)]
    for a, b in zip(after, before):
        assert torch.equal(a, b)


@pytest.mark.requires_cuda
def test_grad_scaler_inside_the_graph_skips_the_step_on_inf():
    torch.manual_seed(0)
    model = MLP().cuda()
    opt = flatopt.AdamW(model, lr=1e-2)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**12)

    def train_step(tokens, target, poison):
        loss = F.cross_entropy(model(tokens), target)
        scaler.scale(loss).backward()
        model.fc1.weight.grad[0, 0] += poison  # 0, or inf to inject an overflow
        scaler.step(opt)
        scaler.update()
        return loss

    data = batches(6)
    zero, inf = torch.zeros((), device="cuda"), torch.full((), float("inf"), device="cuda")
    step = opt.capture(train_step, *data[0], zero, scaler=scaler)
    assert scaler.get_scale() == 2.0**12, "warm-up must leave the scale as it was"
    step(*data[1], zero)
    bufs = flatopt.inspect(opt).buffers
    state = lambda: [t.clone() for b in bufs for t in (b.data, *b.states.values(), b.meta.steps)]  # noqa: E731
    before, scale = state(), scaler.get_scale()
    step(*data[2], inf)
    for a, b in zip(state(), before):
        assert torch.equal(a, b), "a step with an inf gradient must change no parameter, state or step count"
    assert scaler.get_scale() == scale / 2
    step(*data[3], zero)
    assert float(opt.state[model.fc1.weight]["step"]) == 2.0


@pytest.mark.requires_cuda
def test_max_grad_norm_matches_torch_clip_grad_norm():
    torch.manual_seed(0)
    model = MLP().cuda()
    ref = copy.deepcopy(model)
    opt = flatopt.SGD(model, lr=0.5)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5)

    def train_step(tokens, target):
        F.cross_entropy(model(tokens), target).backward()

    data = batches(6)
    step = opt.capture(train_step, *data[0], max_grad_norm=0.05)
    assert step.sources is None  # clipped before the step: the gradients are copied into the buffer first
    for i, (tokens, target) in enumerate(data[1:], start=1):
        step(tokens, target)
        opt_ref.zero_grad()
        F.cross_entropy(ref(tokens), target).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        opt_ref.step()
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5, msg=lambda m: f"replay {i}, {n}: {m}")


class TiedLate(nn.Module):
    """A head tied to the embedding, a layer only the second micro-batch uses, and one never used."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        self.mid = nn.Linear(32, 32)
        self.late = nn.Linear(32, 32)
        self.unused = nn.Linear(32, 32)

    def forward(self, tokens, late):
        h = torch.tanh(self.mid(self.emb(tokens).mean(1)))
        if late:
            h = torch.tanh(self.late(h))
        return h @ self.emb.weight.t()


def tied_late_step(m, o, sc):
    """Two micro-batches (the second also through ``m.late``), an injectable inf, GradScaler's unscale_,
    clipping and the scaler's step, all inside train_step."""

    def train_step(tokens, target, poison):
        for k in range(2):
            sc.scale(F.cross_entropy(m(tokens[k], late=k == 1), target[k]) / 2).backward()
        m.mid.weight.grad[0, 0] += poison
        sc.unscale_(o)
        o.clip_grad_norm_(0.5)
        sc.step(o)
        sc.update()

    return train_step


@pytest.mark.filterwarnings("ignore:.*received no gradient")
def test_recorded_body_run_eagerly_matches_eager_flatopt():
    """What capture() records (RecordedBody.run: gradients copied in, unused views zeroed, then
    train_step's own unscale_, clipping and step), run eagerly on the CPU, against eager flatopt with
    zero_grad: the same parameters, gradients and states over 6 steps, one with an inf."""
    from flatopt.capture import RecordedBody

    torch.manual_seed(0)
    model = TiedLate()
    ref = copy.deepcopy(model)
    opt, opt_ref = flatopt.AdamW(model, lr=1e-2, weight_decay=0.1), flatopt.AdamW(ref, lr=1e-2, weight_decay=0.1)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3) for _ in range(2)]
    for m in (model, ref):  # stale gradients in the never-used layer: the recorded step must zero them
        m.unused.weight.grad = torch.ones_like(m.unused.weight)
    body = RecordedBody(opt, tied_late_step(model, opt, scalers[0]), [])
    eager = tied_late_step(ref, opt_ref, scalers[1])
    g = torch.Generator().manual_seed(0)
    for i in range(1, 7):
        tokens, target = torch.randint(0, 50, (2, 16, 7), generator=g), torch.randint(0, 50, (2, 16), generator=g)
        poison = torch.tensor(float("inf") if i == 3 else 0.0)
        body.static[:] = [tokens, target, poison]
        opt.engine.refresh_hparams()  # as each replay's call does before the graph runs
        body.run()
        opt_ref.zero_grad()
        eager(tokens, target, poison)
        assert scalers[0].get_scale() == scalers[1].get_scale(), f"step {i}: loss scales differ"
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, **SAME, msg=lambda m: f"step {i}, {n}: {m}")
            if q.grad is None:  # never used: not stepped, as torch.optim leaves a parameter whose .grad is None
                assert p.grad is None, f"step {i}, {n}: a .grad where eager flatopt has none"
                continue
            torch.testing.assert_close(  # at the inf step: the same inf/nan where the inf was injected
                p.grad, q.grad, **SAME, equal_nan=True, msg=lambda m: f"step {i}, {n}.grad: {m}"
            )
        for b, c in zip(flatopt.inspect(opt).buffers, flatopt.inspect(opt_ref).buffers):
            for key, value in c.states.items():
                torch.testing.assert_close(b.states[key], value, **SAME, msg=lambda m: f"step {i}, {key}: {m}")
    assert model.unused.weight.grad is None
    assert float(opt.state[model.unused.weight]["step"]) == 0.0  # never stepped, as in torch.optim
    assert float(opt.state[model.late.weight]["step"]) == 5.0  # 6 steps, one skipped for the inf
    opt.check_bindings(full=True)


def gathering_step(m, transpose=None):
    """Two micro-batches (the second also through ``m.late``), nothing stepped: capture() steps after it.
    ``transpose="view"``: mid.weight's gradient is replaced by its transpose as a view of the same
    memory (the gradient backward left in the pool, with other strides: the step cannot read it in place
    and it is copied in instead); ``"copy"``: by the same values in a tensor of their own (the reference)."""

    def train_step(tokens, target):
        for k in range(2):
            (F.cross_entropy(m(tokens[k], late=k == 1), target[k]) / 2).backward()
        if transpose == "view":
            m.mid.weight.grad = m.mid.weight.grad.t()
        elif transpose == "copy":
            m.mid.weight.grad = m.mid.weight.grad.t().contiguous()

    return train_step


def halve_grads(opt, args, kwargs):
    """A step pre-hook that changes the gradients the step reads."""
    for group in opt.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                p.grad.mul_(0.5)


@TRITON_SKIP
@pytest.mark.filterwarnings("ignore:.*received no gradient")
@pytest.mark.parametrize("direct", [False, "gather"], ids=["hooks", "gather"])
@pytest.mark.parametrize("name", list(OPTS))
def test_recorded_gathering_step_run_eagerly_matches_eager_flatopt(name, direct):
    """What capture() records when train_step does not step (RecordedBody.run(gather=True): the
    kernel reads each new gradient where backward left it and stores it into its view as it steps),
    run eagerly with the Triton kernels (on the CPU under the interpreter), against eager flatopt: the
    same parameters, gradients and states over 4 steps (bit for bit under the interpreter, within
    variant_tol on a GPU), with a tied head, a parameter whose first gradient
    comes in the second micro-batch, one never used (its stale view must be zeroed) and one gradient
    that cannot be read in place (copied in instead). With the copying hooks, which leave the gradients in the
    graph's pool, and with direct_grads="gather", which has none."""
    from flatopt.capture import RecordedBody

    device = device_for("triton")
    tol = variant_tol(torch.float32, device)
    torch.manual_seed(0)
    model = TiedLate().to(device)
    ref = copy.deepcopy(model)
    # no covered layer, so that backward leaves gradients to gather (covered layers write into the views instead)
    kw = dict(backend="triton", direct_grads=direct)
    opt, opt_ref = OPTS[name](model, **kw), OPTS[name](ref, **kw)
    for m in (model, ref):
        m.unused.weight.grad = torch.ones_like(m.unused.weight)
    body = RecordedBody(opt, gathering_step(model, "view"), [])
    assert body.sources is not None
    eager = gathering_step(ref, "copy")
    buf = flatopt.inspect(opt).buffers[0]
    g = torch.Generator().manual_seed(0)
    for i in range(1, 5):
        tokens = torch.randint(0, 50, (2, 16, 7), generator=g).to(device)
        target = torch.randint(0, 50, (2, 16), generator=g).to(device)
        body.static[:] = [tokens, target]
        opt.engine.refresh_hparams()  # as each replay's call does before the graph runs
        body.run(gather=True)
        opt_ref.zero_grad()
        eager(tokens, target)
        opt_ref.step()
        src = dict(zip(buf.params, buf.grad_views))
        read = dict(zip(buf.params, body.sources[buf].src.tolist()))
        for p in (model.emb.weight, model.late.weight, model.mid.bias):  # gathered from where backward left them
            assert read[p] != src[p].data_ptr()
        for p in (model.unused.weight, model.mid.weight):  # zeroed, or copied in: read from the view
            assert read[p] == src[p].data_ptr()
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, **tol, msg=lambda m: f"step {i}, {n}: {m}")
            if n.startswith("unused."):  # no gradient: .grad stays None and the parameter is not stepped
                assert p.grad is None and q.grad is None, f"step {i}, {n}: a .grad where none was made"
                continue
            view = src[p]  # .grad is a view of the parameter's place in the buffer (a tensor object of its own)
            assert p.grad is not None, f"step {i}, {n}: .grad is None"
            same = (p.grad.data_ptr(), p.grad.stride()) == (view.data_ptr(), view.stride())
            assert same, f"step {i}, {n}: .grad is not its view"
            torch.testing.assert_close(p.grad, q.grad, **tol, msg=lambda m: f"step {i}, {n}.grad: {m}")
        for b, c in zip(flatopt.inspect(opt).buffers, flatopt.inspect(opt_ref).buffers):
            for key, value in c.states.items():
                torch.testing.assert_close(b.states[key], value, **tol, msg=lambda m: f"step {i}, {key}: {m}")
            torch.testing.assert_close(b.meta.steps, c.meta.steps, atol=0, rtol=0)
    assert model.unused.weight.grad is None
    opt.check_bindings(full=True)


@TRITON_SKIP
@pytest.mark.filterwarnings("ignore:.*received no gradient")
def test_a_step_pre_hook_sees_the_gradients_in_a_recorded_step():
    """A step pre-hook reads (here: halves) the .grad views before the kernel runs, so a recorded step
    with one copies the gradients in instead of gathering them: the same as eager flatopt with the hook."""
    from flatopt.capture import RecordedBody

    device = device_for("triton")
    torch.manual_seed(0)
    model = TiedLate().to(device)
    ref = copy.deepcopy(model)
    opt, opt_ref = flatopt.SGD(model, lr=0.1, backend="triton"), flatopt.SGD(ref, lr=0.1, backend="triton")
    for o in (opt, opt_ref):
        o.register_step_pre_hook(halve_grads)
    body = RecordedBody(opt, gathering_step(model), [])
    buf = flatopt.inspect(opt).buffers[0]
    views = [v.data_ptr() for v in buf.grad_views]
    g = torch.Generator().manual_seed(0)
    for i in range(1, 4):
        tokens = torch.randint(0, 50, (2, 16, 7), generator=g).to(device)
        target = torch.randint(0, 50, (2, 16), generator=g).to(device)
        body.static[:] = [tokens, target]
        opt.engine.refresh_hparams()
        body.run(gather=True)
        opt_ref.zero_grad()
        gathering_step(ref)(tokens, target)
        opt_ref.step()
        assert body.sources[buf].src.tolist() == views, "with a step pre-hook nothing may be gathered"
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, atol=0, rtol=0, msg=lambda m: f"step {i}, {n}: {m}")
            torch.testing.assert_close(p.grad, q.grad, atol=0, rtol=0, msg=lambda m: f"step {i}, {n}.grad: {m}")


@pytest.mark.requires_cuda
@pytest.mark.filterwarnings("ignore:.*received no gradient")
@pytest.mark.parametrize("name", list(OPTS))
def test_captured_gathering_step_with_tied_late_and_unused_parameters(name):
    """The captured step that reads the gradients where backward left them, replayed 8 times with the lr
    changed at every replay, against eager flatopt: a tied head, a parameter whose first gradient comes in
    the second micro-batch, one never used, one whose gradient is left in the pool with other strides
    (copied in instead). Parameters, gradients and states within SAME (the kernels differ by a rounding)."""
    torch.manual_seed(0)
    model = TiedLate().cuda()
    ref = copy.deepcopy(model)
    opt, opt_ref = OPTS[name](model), OPTS[name](ref)
    for m in (model, ref):
        m.unused.weight.grad = torch.ones_like(m.unused.weight)
    data = [(torch.stack([a[0], b[0]]), torch.stack([a[1], b[1]])) for a, b in zip(batches(9), batches(9, seed=1))]
    step = opt.capture(gathering_step(model, "view"), *data[0])
    buf = flatopt.inspect(opt).buffers[0]
    index = {p: i for i, p in enumerate(buf.params)}
    views = [v.data_ptr() for v in buf.grad_views]
    recorded = step.recorded[buf]
    for p in (model.emb.weight, model.late.weight, model.mid.bias):  # read where backward left them
        assert recorded[index[p]] != views[index[p]]
    for p in (model.unused.weight, model.mid.weight):  # zeroed, or copied in: read from the view
        assert recorded[index[p]] == views[index[p]]
    eager = gathering_step(ref, "copy")
    scale = {"adamw": 1.0, "sgd": 10.0, "lion": 0.1}[name]
    for i, (tokens, target) in enumerate(data[1:], start=1):
        for o in (opt, opt_ref):
            for group in o.param_groups:
                group["lr"] = lr_at(i) * scale
        step(tokens, target)
        opt_ref.zero_grad()
        eager(tokens, target)
        opt_ref.step()
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, **SAME, msg=lambda m: f"replay {i}, {n}: {m}")
            torch.testing.assert_close(p.grad, q.grad, **SAME, msg=lambda m: f"replay {i}, {n}.grad: {m}")
        for b, c in zip(flatopt.inspect(opt).buffers, flatopt.inspect(opt_ref).buffers):
            for key, value in c.states.items():
                torch.testing.assert_close(b.states[key], value, **SAME, msg=lambda m: f"replay {i}, {key}: {m}")
            assert torch.equal(b.meta.steps, c.meta.steps)
    assert not model.unused.weight.grad.any()
    opt.check_bindings(full=True)


@pytest.mark.requires_cuda
@pytest.mark.filterwarnings("ignore:.*received no gradient")
def test_captured_gradients_with_tied_late_and_unused_parameters_unscale_and_clip():
    """What the captured step does instead of zero_grad (each first gradient copied into its view; unused
    parameters' views zeroed before the step) against eager flatopt: a tied head, a parameter whose first
    gradient comes in the second micro-batch, one that never gets one, GradScaler's unscale_ then clipping
    inside train_step, over 8 replays with an inf injected at one of them."""
    torch.manual_seed(0)
    model = TiedLate().cuda()
    ref = copy.deepcopy(model)
    opt, opt_ref = flatopt.AdamW(model, lr=1e-2, weight_decay=0.1), flatopt.AdamW(ref, lr=1e-2, weight_decay=0.1)
    scalers = [torch.amp.GradScaler("cuda", init_scale=2.0**10, growth_interval=3) for _ in range(2)]

    data = [(torch.stack([a[0], b[0]]), torch.stack([a[1], b[1]])) for a, b in zip(batches(9), batches(9, seed=1))]
    zero, inf = torch.zeros((), device="cuda"), torch.full((), float("inf"), device="cuda")
    for m in (model, ref):  # stale gradients in the never-used layer: the recorded step must zero them
        m.unused.weight.grad = torch.ones_like(m.unused.weight)
    step = opt.capture(tied_late_step(model, opt, scalers[0]), *data[0], zero, scaler=scalers[0])
    eager = tied_late_step(ref, opt_ref, scalers[1])
    for i, (tokens, target) in enumerate(data[1:], start=1):
        poison = inf if i == 4 else zero
        step(tokens, target, poison)
        opt_ref.zero_grad()
        eager(tokens, target, poison)
        assert scalers[0].get_scale() == scalers[1].get_scale(), f"replay {i}: loss scales differ"
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, **SAME, msg=lambda m: f"replay {i}, {n}: {m}")
            torch.testing.assert_close(
                p.grad, q.grad, **SAME, equal_nan=True, msg=lambda m: f"replay {i}, {n}.grad: {m}"
            )
        for b, c in zip(flatopt.inspect(opt).buffers, flatopt.inspect(opt_ref).buffers):
            for key, value in c.states.items():
                torch.testing.assert_close(b.states[key], value, **SAME, msg=lambda m: f"replay {i}, {key}: {m}")
    assert not model.unused.weight.grad.any(), "an unused parameter's gradient view must be zero"
    assert float(opt.state[model.late.weight]["step"]) == 7.0  # 8 replays, one skipped for the inf
    opt.check_bindings(full=True)


@pytest.mark.requires_cuda
def test_gradient_accumulation_and_a_train_step_that_steps_itself():
    """Two micro-batches per step inside train_step, which calls opt.step() itself: no double step."""
    torch.manual_seed(0)
    model = MLP().cuda()
    ref = copy.deepcopy(model)
    opt, opt_ref = flatopt.AdamW(model, lr=1e-2), flatopt.AdamW(ref, lr=1e-2)

    def train_step(tokens, target):
        for k in range(2):
            (F.cross_entropy(model(tokens[k]), target[k]) / 2).backward()
        opt.step()

    data = [(torch.stack([a[0], b[0]]), torch.stack([a[1], b[1]])) for a, b in zip(batches(6), batches(6, seed=1))]
    step = opt.capture(train_step, *data[0])
    for i, (tokens, target) in enumerate(data[1:], start=1):
        step(tokens, target)
        opt_ref.zero_grad()
        for k in range(2):
            (F.cross_entropy(ref(tokens[k]), target[k]) / 2).backward()
        opt_ref.step()
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, **SAME, msg=lambda m: f"replay {i}, {n}: {m}")
    assert float(opt.state[model.fc1.weight]["step"]) == 5.0


@pytest.mark.requires_cuda
def test_host_sync_in_train_step_is_named_and_changes_nothing():
    torch.manual_seed(0)
    model = MLP().cuda()
    opt = flatopt.AdamW(model, lr=1e-2)
    before = [b.data.clone() for b in flatopt.inspect(opt).buffers]

    def train_step(tokens, target):
        loss = F.cross_entropy(model(tokens), target)
        loss.backward()
        return loss.item()

    with pytest.raises(RuntimeError, match=r"synchronised the host with the GPU.*\.item\(\)"):
        opt.capture(train_step, *batches(1)[0])
    for a, b in zip(flatopt.inspect(opt).buffers, before):
        assert torch.equal(a.data, b)


@pytest.mark.requires_cuda
def test_replay_refuses_other_shapes_and_rebound_parameters():
    torch.manual_seed(0)
    model = MLP().cuda()
    opt = flatopt.AdamW(model, lr=1e-2)

    def train_step(tokens, target):
        F.cross_entropy(model(tokens), target).backward()

    tokens, target = batches(1)[0]
    step = opt.capture(train_step, tokens, target)
    assert step.signature is not None  # every input a CUDA tensor: the quick check runs first
    with pytest.raises(ValueError, match="recorded for shape"):
        step(*batches(1, batch=8)[0])
    with pytest.raises(ValueError, match=r"input 1: .*torch.int64 on cuda:0, got shape \(16,\), torch.int32 on cuda"):
        step(tokens, target.int())
    with pytest.raises(ValueError, match=r"input 0: .*on cuda:0, got shape \(16, 7\), torch.int64 on cpu"):
        step(tokens.cpu(), target)
    with pytest.raises(TypeError, match="takes 2 inputs, got 1"):
        step(tokens)
    step(tokens, target)  # what the checks refused changed nothing: a replay still runs
    model.double()  # rebinds every parameter; replays check the first and last of each buffer
    with pytest.raises(RuntimeError, match="no longer lives in the optimizer's flat buffer"):
        step(*batches(1)[0])
    step.release()
    with pytest.raises(RuntimeError, match="released"):
        step(*batches(1)[0])
