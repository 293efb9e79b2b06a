"""step() replays its kernel launches from a CUDA graph once a configuration has run: the result
must be bit-identical to launching directly, through lr changes, a state buffer added later
and GradScaler steps (whose grad_scale / found_inf addresses are part of the key)."""

import copy
import warnings

import pytest
import torch
from torch import nn

import flatopt
from flatopt.step_graph import StepGraph


def test_step_graph_is_not_used_off_cuda():
    model = nn.Linear(4, 3)
    opt = flatopt.AdamW(model)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    assert not StepGraph.usable(opt.use_step_graph, opt.backend, flatopt.inspect(opt).engine.devices)
    assert flatopt.inspect(opt).step_graph.graph is None


def test_key_holds_the_grad_scaler_tensors():
    """A replay reads grad_scale and found_inf where the graph was recorded: a step with other
    tensors (or without them) must not replay that graph."""
    model = nn.Linear(4, 3)
    opt = flatopt.AdamW(model)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    scale, inf, other = torch.ones(1), torch.zeros(1), torch.zeros(1)
    look = flatopt.inspect(opt)

    def key(*amp):
        return StepGraph.key_of(look.buffers, look.tables[torch.device("cpu")], *amp)

    keys = {
        "none": key(),
        "both": key(scale, inf),
        "other found_inf": key(scale, other),
        "no grad_scale": key(None, inf),
        "int32 view of found_inf": key(scale, inf.view(torch.int32)),  # same address
    }
    assert len(set(keys.values())) == len(keys), keys
    assert key(scale, inf) == keys["both"]  # the same tensors: the same key


def two_optimizers(make, seed=0):
    torch.manual_seed(seed)
    a = nn.Sequential(nn.Linear(33, 70), nn.Tanh(), nn.Linear(70, 5)).cuda()
    b = copy.deepcopy(a)
    oa, ob = make(a), make(b)
    ob.use_step_graph = False
    return (a, oa), (b, ob)


def step_both(pairs, x, scaler=None):
    for model, opt in pairs:
        opt.zero_grad()
        loss = model(x).square().mean()
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler[id(opt)].scale(loss).backward()
            scaler[id(opt)].step(opt)
            scaler[id(opt)].update()


def assert_identical(pairs, step):
    (a, oa), (b, ob) = pairs
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q), f"step {step}: parameters differ"
        for key, value in ob.state[q].items():
            assert torch.equal(oa.state[p][key], value), f"step {step}: {key} differs"


@pytest.mark.requires_cuda
@pytest.mark.parametrize(
    "make",
    [
        lambda m: flatopt.AdamW(m, lr=1e-2, weight_decay=0.1),
        lambda m: flatopt.SGD(m, lr=1e-2, momentum=0.9, nesterov=True),
        lambda m: flatopt.Lion(m, lr=1e-3, weight_decay=0.1),
    ],
    ids=["adamw", "sgd", "lion"],
)
def test_replayed_step_is_bit_identical_to_direct_launches(make):
    pairs = two_optimizers(make)
    x = torch.randn(16, 33, device="cuda")
    for step in range(1, 11):
        for _, opt in pairs:
            for g in opt.param_groups:
                g["lr"] = 1e-2 / step  # a scheduler changing lr every step
        step_both(pairs, x)
        assert_identical(pairs, step)
    assert flatopt.inspect(pairs[0][1]).step_graph.graph is not None, "the graph was not used"
    assert flatopt.inspect(pairs[1][1]).step_graph.graph is None


@pytest.mark.requires_cuda
def test_state_added_later_records_a_new_graph():
    pairs = two_optimizers(lambda m: flatopt.SGD(m, lr=1e-2))
    x = torch.randn(16, 33, device="cuda")
    for _ in range(3):
        step_both(pairs, x)
    first = flatopt.inspect(pairs[0][1]).step_graph.key
    for _, opt in pairs:
        opt.param_groups[0]["momentum"] = 0.9  # allocates the momentum buffer
    for step in range(4, 9):
        step_both(pairs, x)
        assert_identical(pairs, step)
    assert flatopt.inspect(pairs[0][1]).step_graph.key != first


@pytest.mark.requires_cuda
@pytest.mark.parametrize(
    "make",
    [
        lambda m: flatopt.AdamW(m, lr=1e-2, weight_decay=0.1),
        lambda m: flatopt.SGD(m, lr=1e-2, momentum=0.9),
        lambda m: flatopt.Lion(m, lr=1e-3, weight_decay=0.1),
    ],
    ids=["adamw", "sgd", "lion"],
)
def test_grad_scaler_steps_replay_and_agree(make):
    """GradScaler steps replay a graph and equal direct launches bit for bit, through an injected
    inf (a skipped step, then a smaller scale), growth of the scale, and steps after unscale_."""
    pairs = two_optimizers(make)
    scaler = {id(o): torch.amp.GradScaler("cuda", init_scale=2.0**10, growth_interval=4) for _, o in pairs}
    x = torch.randn(16, 33, device="cuda")
    for step in range(1, 21):
        for model, opt in pairs:
            for g in opt.param_groups:
                g["lr"] *= 0.95  # a scheduler changing lr every step
            opt.zero_grad()
            sc = scaler[id(opt)]
            sc.scale(model(x).square().mean()).backward()
            if step == 7:
                model[0].weight.grad[0, 0] = float("inf")
            if step >= 15:
                sc.unscale_(opt)  # as before clipping: the step gets found_inf and no grad_scale
            sc.step(opt)
            sc.update()
        assert_identical(pairs, step)
        assert scaler[id(pairs[0][1])].get_scale() == scaler[id(pairs[1][1])].get_scale()
    graph = flatopt.inspect(pairs[0][1]).step_graph
    assert graph.reused > 0 and not graph.failed, "GradScaler steps did not replay a graph"
    assert flatopt.inspect(pairs[1][1]).step_graph.graph is None


class FakeGraph:
    def __init__(self):
        self.replays = 0

    def replay(self):
        self.replays += 1


def test_run_launches_first_then_records_then_replays(monkeypatch):
    """The state machine, without a GPU: the first step of a configuration launches directly (it
    compiles), the second records and replays, later ones replay; a new configuration starts over,
    and a configuration whose graph is still kept replays it."""
    graph = StepGraph()
    keys = iter(["a", "a", "a", "b", "b", "a"])
    monkeypatch.setattr(StepGraph, "key_of", staticmethod(lambda *args: next(keys)))
    recorded = []

    def record(launch):
        recorded.append(FakeGraph())
        return recorded[-1]

    monkeypatch.setattr(graph, "_record", record)
    launches = []
    for _ in range(6):
        graph.run_keyed(StepGraph.key_of(), lambda: launches.append(1))
    assert len(launches) == 2  # the first step of "a" and of "b"
    assert [g.replays for g in recorded] == [3, 1]  # "a" twice, then again after "b"; "b" once
    assert graph.key == "a" and graph.graph is recorded[0]


def test_graphs_kept_are_bounded_and_least_recently_replayed_go_first(monkeypatch):
    """In-backward mode keys a bucket's graph on its gradient's address, which may change: the graphs
    (and the keys seen once) kept are bounded, the least recently used dropped first."""
    from flatopt.step_graph import MAX_GRAPHS, MAX_SEEN

    graph = StepGraph()
    monkeypatch.setattr(graph, "_record", lambda launch: FakeGraph())
    launches = []
    for key in range(MAX_GRAPHS + 2):
        for _ in range(2):  # launched, then recorded
            graph.run_keyed(key, lambda: launches.append(1))
    assert list(graph.graphs) == list(range(2, MAX_GRAPHS + 2))
    assert len(launches) == MAX_GRAPHS + 2
    graph.run_keyed(0, lambda: launches.append(1))  # dropped, but seen before: recorded again at once
    assert len(launches) == MAX_GRAPHS + 2
    assert list(graph.graphs) == [*range(3, MAX_GRAPHS + 2), 0]
    for key in range(100, 100 + 2 * MAX_SEEN):
        graph.run_keyed(key, lambda: None)
    assert len(graph.seen) == MAX_SEEN


@pytest.mark.requires_cuda
@pytest.mark.parametrize("bucket_size", [64, None], ids=["many-buckets", "one-bucket"])
def test_in_backward_buckets_replay_graphs_bit_identical_to_direct_launches(bucket_size):
    pairs = two_optimizers(
        lambda m: flatopt.AdamW(m, lr=1e-2, weight_decay=0.1, in_backward=True, bucket_size=bucket_size)
    )
    x = torch.randn(16, 33, device="cuda")
    for step in range(1, 9):
        for _, opt in pairs:
            opt.param_groups[0]["lr"] = 1e-2 / step
        step_both(pairs, x)
        assert_identical(pairs, step)
    buckets = flatopt.inspect(pairs[0][1]).engine.buckets
    replayed = sum(b.graph.graph is not None for b in buckets)
    assert replayed == len(buckets), f"{replayed} of {len(buckets)} buckets replayed a graph at the last step"
    assert all(b.graph.graph is None for b in flatopt.inspect(pairs[1][1]).engine.buckets)


def test_run_falls_back_to_launching_when_recording_fails(monkeypatch):
    graph = StepGraph()
    monkeypatch.setattr(StepGraph, "key_of", staticmethod(lambda *args: "a"))
    monkeypatch.setattr(graph, "_record", lambda launch: None)
    launches = []
    for _ in range(3):
        graph.run_keyed(StepGraph.key_of(), lambda: launches.append(1))
    assert len(launches) == 3


def test_keys_that_never_repeat_stop_the_recording(monkeypatch):
    """A bucket whose gradient lands at a new address every pass would record a graph per pass, each
    replayed once: after 2 * MAX_GRAPHS recordings none of which was replayed again, launch directly."""
    from flatopt.step_graph import MAX_GRAPHS

    graph = StepGraph()
    recorded = []
    monkeypatch.setattr(graph, "_record", lambda launch: recorded.append(FakeGraph()) or recorded[-1])
    launches = []
    for key in range(4 * MAX_GRAPHS):
        for _ in range(2):  # seen, then recorded (until recording stops)
            graph.run_keyed(key, lambda: launches.append(1))
    assert len(recorded) == 2 * MAX_GRAPHS and graph.failed
    assert len(launches) == 2 * (4 * MAX_GRAPHS) - 2 * MAX_GRAPHS


def test_reused_graphs_keep_recording_going(monkeypatch):
    from flatopt.step_graph import MAX_GRAPHS

    graph = StepGraph()
    monkeypatch.setattr(graph, "_record", lambda launch: FakeGraph())
    for key in range(4 * MAX_GRAPHS):
        for _ in range(4):  # seen, recorded, then replayed twice
            graph.run_keyed(key, lambda: None)
    assert not graph.failed and graph.recorded == 4 * MAX_GRAPHS


@pytest.mark.requires_cuda
def test_masked_steps_replay_and_agree_with_torch():
    """Parameters whose .grad is None are left out through a mask kept per pattern, whose address is part of
    the graph's key, and a buffer none of whose parameters has a gradient is not launched (also part of the
    key): patterns that come and go replay their own graphs, and every step matches direct launches bit for
    bit, and steps the parameters torch.optim steps."""
    torch.manual_seed(0)
    a = nn.ModuleList([nn.Linear(33, 70), nn.Linear(70, 5), nn.Linear(5, 5).half()]).cuda()
    b, c = copy.deepcopy(a), copy.deepcopy(a)
    oa = flatopt.AdamW(a, lr=1e-2, weight_decay=0.1)
    ob = flatopt.AdamW(b, lr=1e-2, weight_decay=0.1)
    ob.use_step_graph = False
    oc = torch.optim.AdamW(c.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    x = torch.randn(16, 33, device="cuda")
    patterns = ["all", "no head", "no half", "all", "no head", "no half"] * 3  # each seen several times
    for step, pattern in enumerate(patterns, start=1):
        for m, o in ((a, oa), (b, ob), (c, oc)):
            o.zero_grad()
            h = m[1](torch.tanh(m[0](x))) if pattern != "no head" else m[0](x)
            loss = h.float().square().mean()
            if pattern != "no half" and pattern != "no head":
                loss = loss + m[2](h[:, :5].half()).float().square().mean()
            loss.backward()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                o.step()
        for p, q, r in zip(a.parameters(), b.parameters(), c.parameters()):
            assert torch.equal(p, q), f"step {step} ({pattern}): replayed and direct launches differ"
            assert all(torch.equal(oa.state[p][k], v) for k, v in ob.state[q].items()), f"step {step}: states"
            # which parameters were stepped: torch.optim's step counts (its float16 math differs from flatopt's
            # float32 math, compared in test_dtypes.py, and so do the values downstream of the float16 layer)
            assert float(oa.state[p]["step"]) == float(oc.state[r]["step"]) if r in oc.state else p.grad is None
    assert flatopt.inspect(oa).step_graph.reused > 0, "the step graph was not replayed"
