"""Question: per training step (zero_grad + forward + backward + AdamW step, bf16 autocast), how fast is flatopt's
``opt.capture`` against torch's eager fused AdamW, a hand-captured CUDA graph of torch's capturable fused AdamW and
``torch.compile(mode="reduce-overhead")``, on a launch-bound and on a compute-bound model?

Models (written here: token + position embeddings, pre-LN blocks with F.scaled_dot_product_attention(is_causal=True),
MLP 4x with GELU, head tied to the token embedding; fp32 parameters, bf16 autocast in the forward):

    small   2 layers, d=256, 4 heads, vocab 4096, batch 8 x 128 tokens (launch-bound)
    gpt2    GPT-2 small: 12 layers, d=768, 12 heads, vocab 50257, batch 8 x 512 tokens

Implementations (each on a fresh model from the same seed, trained on the same batches):

    torch-fused                  torch.optim.AdamW(fused=True), eager, zero_grad(set_to_none=True)
    torch-fused-graph            the whole step hand-captured in one CUDA graph: AdamW(fused=True, capturable=True),
                                 zero_grad(set_to_none=False) inside the graph, static inputs, side-stream warm-up
    torch-fused-graph-none       the same with zero_grad(set_to_none=True), as torch's CUDA-graph docs capture a
                                 whole network: .grad allocated from the graph's pool, written by backward directly
    torch-compile-ro             torch.compile(model, mode="reduce-overhead"), eager fused AdamW step
    flatopt                      flatopt.AdamW, eager: zero_grad() (.grad None, hooks copy the new gradients in)
    flatopt-keep-grads           the same with zero_grad(set_to_none=False): buffer zeroed, autograd adds into views
    flatopt-capture              flatopt.AdamW, opt.capture(train_step, x, y)
    flatopt-capture-compiled     flatopt.AdamW, opt.capture around torch.compile(model) (default mode)

Every implementation runs the same number of training steps (warm-up + timed) from the same initial parameters on
the same cycle of batches; a captured step's warm-up is undone before its first replay (flatopt does that itself; for
torch's hand-captured graph the parameters are put back and the AdamW states zeroed, which is AdamW's initial
state). Two timings per implementation. The main figure: median ms per step (20th-80th percentile) from CUDA events
around each step, synchronised after each, so it includes the launch latency and host overhead before the first
kernel (the GPU is idle when each step starts). Then back-to-back: 5 rounds (B2B_ROUNDS) of max(5, iters // 4)
steps with one CUDA event before and one after each round and no synchronisation inside a round (a synchronisation
between rounds), cycling through the same batches: the median (20th-80th percentile) over rounds of round time /
steps is the training loop's throughput with the host running ahead of the device (perf_counter on the CPU,
likewise). The first and the final loss (reported, not asserted: bf16 autocast differs slightly between
implementations) are those of the warm-up + timed steps, read before the back-to-back rounds, which train on. The
torch.compile cases run after the others (then the paired timing), each in a subprocess with a timeout taken from
what is left of --budget-s (a case without time is recorded as skipped, with the reason).

flatopt's targets (reported with margins, not asserted): flatopt-capture <= torch-fused-graph on both models and the
fastest of all on the small model; flatopt-capture-compiled faster than torch-compile-ro on GPT-2 small; and, beside
those, flatopt-capture <= torch-fused-graph-none on both models. Each is evaluated on the synchronised time and
again, as a target whose name ends in " (back-to-back)", on the back-to-back time.

Paired (skipped with --no-paired): torch-fused-graph, torch-fused-graph-none and flatopt-capture are built side by
side on fresh models and, after the warm-up, timed alternately for --iters rounds (every one once per round, in an
order that changes from round to round and never runs a step right after itself: harness.round_orders; each step
synchronised as in the main figure, with the host time from the call to its return), so that the drift between
cases run one after the other does not decide a difference of a few percent. An implementation that fails to build
is recorded and the others are still timed; only a failure of flatopt-capture counts as flatopt's. Reported: each one's
median, and the median over rounds of flatopt-capture's time / each other's; the targets "flatopt-capture <= X
(paired)" compare the medians.
Exit status 1 when a flatopt case failed.

GPU run from the repository root (about 1 minute, plus up to 4 compilations within --budget-s, default 200 s):

    PYTHONPATH=. python3 benchmarks/bench_capture.py [--no-compile] [--json PATH] [--markdown PATH]

CPU smoke run (tiny models; the CUDA-graph and compile cases are recorded as skipped; measures nothing):

    PYTHONPATH=. python3 benchmarks/bench_capture.py --device cpu --smoke --out /tmp/flatopt-smoke

Markdown table of a stored result: ``python3 benchmarks/bench_capture.py --report RESULT.json``.
"""

import argparse
import itertools
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable (after any installed flatopt)
    sys.path.append(str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F
from torch import nn

import flatopt
from benchmarks import harness
from benchmarks.harness import num

HPARAMS = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
N_BATCHES = 4  # the steps cycle through this many fixed batches
MIN_COMPILE_S = 20.0  # a compile case is not started with less time than this left
B2B_ROUNDS = 5  # back-to-back timing: rounds of harness.b2b_steps_per_round(iters) steps each
B2B_SUFFIX = " (back-to-back)"  # the targets evaluated on the back-to-back time
PAIRED = ("torch-fused-graph", "torch-fused-graph-none", "flatopt-capture")  # built side by side, timed alternately
PAIRED_SUFFIX = " (paired)"  # the target evaluated on the paired time


@dataclass(frozen=True)
class GPTConfig:
    layers: int
    dim: int
    heads: int
    vocab: int
    batch: int
    tokens: int


MODELS = {
    "small": GPTConfig(layers=2, dim=256, heads=4, vocab=4096, batch=8, tokens=128),
    "gpt2": GPTConfig(layers=12, dim=768, heads=12, vocab=50257, batch=8, tokens=512),
}
SMOKE_MODELS = {
    "small": GPTConfig(layers=2, dim=32, heads=2, vocab=64, batch=2, tokens=16),
    "gpt2": GPTConfig(layers=2, dim=48, heads=3, vocab=97, batch=2, tokens=16),
}


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.fc_proj = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(c, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """A GPT with a tied head; ``forward(idx, targets)`` returns the mean cross-entropy loss (fp32)."""

    def __init__(self, cfg):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab, cfg.dim)
        self.wpe = nn.Embedding(cfg.tokens, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg.dim, cfg.heads) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        for m in self.modules():  # GPT-2's initialisation
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)

    def forward(self, idx, targets):
        # cache_enabled=False: autocast's weight cast cache must be off inside a CUDA graph capture
        with torch.autocast(idx.device.type, dtype=torch.bfloat16, cache_enabled=False):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
            for block in self.blocks:
                x = block(x)
            logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def gpt_numel(cfg):
    """Parameters of GPT(cfg): embeddings, per block 2 LayerNorms and 4 Linears, the final LayerNorm (head tied)."""
    d = cfg.dim
    block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d)
    return cfg.vocab * d + cfg.tokens * d + cfg.layers * block + 2 * d


def make_batches(cfg, device, seed):
    """``N_BATCHES`` fixed (tokens, next tokens) pairs of random token sequences."""
    gen = torch.Generator(device="cpu").manual_seed(seed + 1)
    out = []
    for _ in range(N_BATCHES):
        x = torch.randint(0, cfg.vocab, (cfg.batch, cfg.tokens + 1), generator=gen)
        out.append((x[:, :-1].contiguous().to(device), x[:, 1:].contiguous().to(device)))
    return out


def make_model(cfg, device, seed):
    torch.manual_seed(seed)
    return GPT(cfg).to(device)


# ----------------------------------------------------------------------------------- implementations
@dataclass(frozen=True)
class Impl:
    name: str
    note: str
    ours: bool = False
    needs_cuda: bool = False
    compiled: bool = False  # torch.compile: runs after the others (before the paired timing), in a subprocess


IMPLS = (
    Impl("torch-fused", "torch.optim.AdamW(fused=True), eager, zero_grad(set_to_none=True)"),
    Impl(
        "torch-fused-graph",
        "zero_grad(set_to_none=False) + forward + backward + AdamW(fused=True, capturable=True).step() hand-captured "
        "in one CUDA graph (side-stream warm-up, static inputs)",
        needs_cuda=True,
    ),
    Impl(
        "torch-fused-graph-none",
        "as torch-fused-graph, with zero_grad(set_to_none=True): the gradients live in the graph's pool and "
        "backward writes them there (torch's documented whole-network capture)",
        needs_cuda=True,
    ),
    Impl(
        "flatopt",
        "flatopt.AdamW(model), eager: zero_grad(), forward, backward, step(); hooks copy each new gradient into the "
        "flat buffer",
        ours=True,
    ),
    Impl(
        "flatopt-keep-grads",
        "as flatopt, with zero_grad(set_to_none=False): the buffer is zeroed and autograd adds into the views",
        ours=True,
    ),
    Impl("flatopt-capture", "flatopt.AdamW(model); opt.capture(train_step, x, y)", ours=True, needs_cuda=True),
    Impl(
        "torch-compile-ro",
        'torch.compile(model, mode="reduce-overhead"), eager torch.optim.AdamW(fused=True) step',
        needs_cuda=True,
        compiled=True,
    ),
    Impl(
        "flatopt-capture-compiled",
        "flatopt.AdamW(model); opt.capture(train_step, x, y) with train_step calling torch.compile(model)",
        ours=True,
        needs_cuda=True,
        compiled=True,
    ),
)
IMPL_BY_NAME = {i.name: i for i in IMPLS}


def _eager(model, opt, zero):
    def step(x, y):
        zero()
        loss = model(x, y)
        loss.backward()
        opt.step()
        return loss

    return step


def build(name, model, batches, device, compile_backend):
    """``name`` on ``model``; returns (step(x, y) -> loss tensor, objects to keep alive, release function)."""
    x0, y0 = batches[0]
    if name == "torch-fused":
        opt = torch.optim.AdamW(model.parameters(), **HPARAMS, fused=True)
        return _eager(model, opt, lambda: opt.zero_grad(set_to_none=True)), [opt], None
    if name in ("torch-fused-graph", "torch-fused-graph-none"):
        opt = torch.optim.AdamW(model.parameters(), **HPARAMS, fused=True, capturable=True)
        sx, sy = x0.clone(), y0.clone()
        out = {}
        set_to_none = name == "torch-fused-graph-none"

        def body():
            # set_to_none=True records no kernel: backward allocates the .grad tensors from the graph's pool and
            # every replay writes the new gradients there (torch's documented whole-network capture)
            opt.zero_grad(set_to_none=set_to_none)
            out["loss"] = model(sx, sy)
            out["loss"].backward()
            opt.step()

        initial = [p.detach().clone() for p in model.parameters()]
        graph = harness.capture_cuda_graph(body, warmup=3)
        with torch.no_grad():  # undo the warm-up: initial parameters, AdamW's initial (zero) states
            for p, p0 in zip(model.parameters(), initial, strict=True):
                p.copy_(p0)
            for state in opt.state.values():
                for t in state.values():
                    if isinstance(t, torch.Tensor):
                        t.zero_()
        del initial

        def step(x, y):
            sx.copy_(x)
            sy.copy_(y)
            graph.replay()
            return out["loss"]

        return step, [opt, graph], None
    if name == "torch-compile-ro":
        opt = torch.optim.AdamW(model.parameters(), **HPARAMS, fused=True)
        compiled = torch.compile(model, mode="reduce-overhead", backend=compile_backend)
        eager = _eager(compiled, opt, lambda: opt.zero_grad(set_to_none=True))

        def step(x, y):
            torch.compiler.cudagraph_mark_step_begin()
            return eager(x, y)

        return step, [opt, compiled], None
    backend = "triton" if device.type == "cuda" else "torch"
    opt = flatopt.AdamW(model, **HPARAMS, backend=backend)
    if name == "flatopt":
        return _eager(model, opt, opt.zero_grad), [opt], None
    if name == "flatopt-keep-grads":
        return _eager(model, opt, lambda: opt.zero_grad(set_to_none=False)), [opt], None
    fwd = model if name == "flatopt-capture" else torch.compile(model, backend=compile_backend)

    def train_step(x, y):
        loss = fwd(x, y)
        loss.backward()
        return loss

    captured = opt.capture(train_step, x0, y0)
    return captured, [opt, fwd], captured.release


def run_paired(model_name, cfg, device, args, names=PAIRED):
    """The implementations ``names`` (the last one flatopt's, the others compared with it) built side by side, each
    on a fresh model from the same seed, ``args.warmup`` steps each, then ``args.iters`` rounds of
    harness.time_paired. Never raises: an implementation that fails to build is recorded under "failed" and the others
    are timed; ``ours`` says whether flatopt's failed (to build, or while the steps were timed together)."""
    row = dict(model=model_name, impls=list(names), status=None, ours=False)
    if device.type != "cuda" and any(IMPL_BY_NAME[n].needs_cuda for n in names):
        row.update(status="skipped", reason="CUDA graphs need a CUDA device")
        return row
    t0 = time.perf_counter()
    baseline = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    built, releases, failed = {}, [], {}
    try:
        for name in names:
            try:
                batches = make_batches(cfg, device, args.seed)
                model = make_model(cfg, device, args.seed)
                step, keep, release = build(name, model, batches, device, args.compile_backend)
            except Exception as e:
                failed[name] = f"{type(e).__name__}: {e}"[:1000]
                continue
            if release is not None:
                releases.append(release)
            counter = itertools.count()
            built[name] = (lambda s=step, b=batches, c=counter: s(*b[next(c) % N_BATCHES])), (keep, model)
        mine = names[-1]
        if failed:
            row["failed"] = failed
        if mine not in built or len(built) < 2:
            row.update(status="failed", ours=mine in failed,
                       reason="; ".join(f"{n}: {why}" for n, why in failed.items()))  # fmt: skip
        else:
            for one, _ in built.values():
                for _ in range(args.warmup):
                    one()
            timed = harness.time_paired({n: one for n, (one, _) in built.items()}, device, args.iters)
            for name, (ms, us) in timed.items():
                med, q20, q80 = harness.quantiles(ms)
                hmed, h20, h80 = harness.quantiles(us)
                row[name] = dict(median_ms=med, q20_ms=q20, q80_ms=q80, host_median_us=hmed, host_q20_us=h20,
                                 host_q80_us=h80)  # fmt: skip
            row["ratios"] = {}  # per other implementation: flatopt's time / its time, round by round
            for other in [n for n in names[:-1] if n in timed]:
                med, q20, q80 = harness.quantiles([a / b for a, b in zip(timed[mine][0], timed[other][0])])
                row["ratios"][other] = dict(median=med, q20=q20, q80=q80)
            row.update(rounds=args.iters, status="ok")
    except Exception as e:  # while the steps ran together: flatopt's cannot be told apart from the others'
        row.update(status="failed", ours=True, reason=f"{type(e).__name__}: {e}"[:2000],
                   traceback=traceback.format_exc()[-4000:])  # fmt: skip
    finally:
        for release in releases:
            release()
        built = releases = step = keep = release = batches = model = one = timed = None  # noqa: F841 (freed here)
        try:
            harness.free_memory(device, baseline)
        except Exception as e:
            row["cleanup_error"] = f"{type(e).__name__}: {e}"[:500]
    row["seconds"] = round(time.perf_counter() - t0, 2)
    return row


def train(step, batches, device, args, row):
    """``args.warmup`` steps (the first loss read after the first), then ``args.iters`` timed steps, then the
    back-to-back rounds; the batches cycle. Fills the row with losses (the final one before the back-to-back rounds),
    warm-up seconds and both timings."""
    counter = itertools.count()
    last = [None]

    def one():
        i = next(counter)
        last[0] = step(*batches[i % N_BATCHES])

    t1 = time.perf_counter()
    one()
    row["first_loss"] = last[0].item()
    for _ in range(args.warmup - 1):
        one()
    harness.sync(device)
    row["warmup_s"] = round(time.perf_counter() - t1, 2)
    times = harness.time_steps(one, device, args.iters)
    row["final_loss"] = last[0].item()
    row["steps"] = next(counter)
    row.update(harness.timing_fields(times), iters=len(times))
    per_round = harness.b2b_steps_per_round(args.iters)
    b2b = harness.time_back_to_back(one, device, B2B_ROUNDS, per_round)
    row.update(harness.timing_fields(b2b, "b2b_"), b2b_rounds=len(b2b), b2b_steps_per_round=per_round, status="ok")


def run_impl(model_name, impl, cfg, device, args):
    """Build, train and time one implementation; never raises (failures are recorded in the row)."""
    row = dict(model=model_name, impl=impl.name, ours=impl.ours, status=None)
    if impl.needs_cuda and device.type != "cuda":
        reason = "CUDA graphs and torch.compile's reduce-overhead mode need a CUDA device"
        row.update(status="skipped", reason=reason if impl.compiled else "CUDA graphs need a CUDA device")
        return row

    def body(row):
        t0 = time.perf_counter()
        batches = make_batches(cfg, device, args.seed)
        model = make_model(cfg, device, args.seed)
        step, keep, release = build(impl.name, model, batches, device, args.compile_backend)
        try:
            row["build_s"] = round(time.perf_counter() - t0, 2)
            train(step, batches, device, args, row)
        finally:
            if release is not None:
                release()

    return harness.run_guarded(row, device, body)


# ------------------------------------------------------------------------------ compile subprocesses
def worker_command(args, model_name, impl_name):
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--worker-model", model_name]
    cmd += ["--worker-impl", impl_name, "--device", args.device, "--seed", str(args.seed)]
    cmd += ["--warmup", str(args.warmup), "--iters", str(args.iters), "--compile-backend", args.compile_backend]
    return cmd + (["--smoke"] if args.smoke else [])


def worker(args):
    """Subprocess entry: run one implementation on one model; print one result line."""
    device = torch.device(args.device)
    cfg = (SMOKE_MODELS if args.smoke else MODELS)[args.worker_model]
    harness.print_result(run_impl(args.worker_model, IMPL_BY_NAME[args.worker_impl], cfg, device, args))
    return 0


def run_compiled(args, model_name, impl, deadline):
    row = dict(model=model_name, impl=impl.name, ours=impl.ours, status=None)
    left = deadline - time.monotonic()
    if args.no_compile:
        row.update(status="skipped", reason="--no-compile")
    elif impl.needs_cuda and torch.device(args.device).type != "cuda":
        row.update(status="skipped", reason="CUDA graphs and torch.compile's reduce-overhead mode need a CUDA device")
    elif left < MIN_COMPILE_S:
        row.update(status="skipped", reason=f"time budget (--budget-s {args.budget_s:g}) spent before this case")
    else:
        t0 = time.perf_counter()
        timeout = min(args.compile_timeout_s, left)
        row.update(harness.run_worker(worker_command(args, model_name, impl.name), timeout))
        row["seconds"] = round(time.perf_counter() - t0, 2)
    return row


# ------------------------------------------------------------------------------------------- targets
def _target(what, model, value, threshold, why_missing):
    """Milliseconds, lower is better; margin > 0: met by that much."""
    return harness.target(what, value, threshold, "ms", note=why_missing, model=model)


def evaluate_targets(rows, models, paired=()):
    """flatopt's targets on the synchronised time (median_ms), then the same on the back-to-back time, then
    flatopt-capture <= each other implementation timed with it, on the paired time of each model in ``paired``."""
    out = _evaluate_targets(rows, models, "median_ms", "") + _evaluate_targets(
        rows, models, "b2b_median_ms", B2B_SUFFIX
    )
    for p in paired:
        mine = p["impls"][-1]
        for theirs in p["impls"][:-1]:
            ok = p["status"] == "ok" and theirs in p
            why = None if ok else f"{theirs} failed: {p['failed'][theirs]}" if theirs in p.get("failed", {}) else (
                f"{p['status']}: {p.get('reason', '')}")  # fmt: skip
            out.append(_target(f"{mine} <= {theirs}{PAIRED_SUFFIX}", p["model"], p[mine]["median_ms"] if ok else None,
                               p[theirs]["median_ms"] if ok else None, why))  # fmt: skip
    return out


def _evaluate_targets(rows, models, key, suffix):
    ms = {(r["model"], r["impl"]): r[key] for r in rows if r["status"] == "ok" and r.get(key) is not None}
    why = {(r["model"], r["impl"]): f"{r['status']}: {r.get('reason', '')}" for r in rows if r["status"] != "ok"}
    why.update(
        {(r["model"], r["impl"]): f"ok, but no {key}" for r in rows if r["status"] == "ok" and r.get(key) is None}
    )

    def missing(*keys):
        return "; ".join(f"{k[1]} {why.get(k, 'not run')}" for k in keys if k not in ms) or None

    out = []
    for m in models:
        mine, theirs = (m, "flatopt-capture"), (m, "torch-fused-graph")
        out.append(_target("flatopt-capture <= torch-fused-graph" + suffix, m, ms.get(mine), ms.get(theirs),
                           missing(mine, theirs)))  # fmt: skip
    if "small" in models:
        others = [v for (m, i), v in ms.items() if m == "small" and i != "flatopt-capture"]
        best = min(others) if others else None
        mine = ("small", "flatopt-capture")
        out.append(_target("flatopt-capture fastest of all (small)" + suffix, "small", ms.get(mine), best,
                           missing(mine) or "no other implementation ran"))  # fmt: skip
    if "gpt2" in models:
        mine, theirs = ("gpt2", "flatopt-capture-compiled"), ("gpt2", "torch-compile-ro")
        out.append(_target("flatopt-capture-compiled <= torch-compile-ro" + suffix, "gpt2", ms.get(mine),
                           ms.get(theirs), missing(mine, theirs)))  # fmt: skip
    # torch's documented whole-network capture (set_to_none=True): results written before it was added have no row
    for m in [m for m in models if any(r["model"] == m and r["impl"] == "torch-fused-graph-none" for r in rows)]:
        mine, theirs = (m, "flatopt-capture"), (m, "torch-fused-graph-none")
        out.append(_target("flatopt-capture <= torch-fused-graph-none" + suffix, m, ms.get(mine), ms.get(theirs),
                           missing(mine, theirs)))  # fmt: skip
    return out


def loss_agreement(rows):
    """Final loss of each implementation minus torch-fused's, per model (same steps, init and data)."""
    ref = {r["model"]: r["final_loss"] for r in rows if r["impl"] == "torch-fused" and r["status"] == "ok"}
    for r in rows:
        if r["status"] == "ok" and r["model"] in ref:
            r["final_loss_minus_torch_fused"] = r["final_loss"] - ref[r["model"]]
    return ref


# ------------------------------------------------------------------------------------------- output
def markdown(record):
    lines = harness.smoke_banner(record)
    lines += [
        f"Capture benchmark (AdamW, bf16 autocast, one training step): {harness.env_line(record)}. "
        f"{record['steps']} steps per implementation from the same init on the same batches.",
        "",
        f"Command: `{record.get('command')}`",
        "",
    ]
    head = ["model", "implementation", "median ms (p20-p80)", "back-to-back ms (p20-p80)", "first loss", "final loss",
            "final - torch-fused", "note"]  # fmt: skip
    rows = []
    for r in record["results"]:
        if r["status"] != "ok":
            rows.append([r["model"], r["impl"], "-", "-", "-", "-", "-",
                         f"{r['status']}: {harness.first_line(r.get('reason'))}"])  # fmt: skip
            continue
        note = f"warm-up {r.get('warmup_s', 0):.1f} s" + (f", build {r['build_s']:.1f} s" if r.get("build_s") else "")
        losses = [num(r["first_loss"], ".4f"), num(r["final_loss"], ".4f")]
        rows.append([r["model"], r["impl"], harness.spread(r), harness.spread(r, "b2b_"), *losses,
                     num(r.get("final_loss_minus_torch_fused"), "+.2e"), note])  # fmt: skip
    lines += harness.md_table(head, rows)
    lines += [
        "",
        "Back-to-back: rounds of steps with no synchronisation inside a round (the host ahead of the device); "
        "the main figure is the synchronised median.",
    ]
    paired = record.get("paired") or []  # results written before the paired timing have none
    if paired:
        lines += [
            "",
            f"Paired: {', '.join(paired[0]['impls'])} built side by side and timed alternately, each step "
            f"synchronised (ms; host: from the call to its return; ratio: {paired[0]['impls'][-1]}'s time / this "
            "one's, round by round).",
            "",
        ]
        rows = []
        for p in paired:
            if p["status"] != "ok":
                rows.append([p["model"], ", ".join(p["impls"]), "-", "-",
                             f"{p['status']}: {harness.first_line(p.get('reason'))}"])  # fmt: skip
                continue
            for name in [n for n in p["impls"] if n in p]:
                r, q = p[name], p["ratios"].get(name)
                ratio = f"{q['median']:.4f} ({q['q20']:.4f}-{q['q80']:.4f})" if q else ""
                host = f"{r['host_median_us']:.1f} ({r['host_q20_us']:.1f}-{r['host_q80_us']:.1f})"
                rows.append([p["model"], name, harness.spread(r), host, ratio])
        lines += harness.md_table(["model", "implementation", "median ms (p20-p80)", "host us (p20-p80)",
                                   "ratio (p20-p80)"], rows)  # fmt: skip
    lines += [""] + harness.targets_markdown(record["targets"], ("model",))
    return "\n".join(lines) + "\n"


def print_row(r):
    if r["status"] == "ok":
        detail = (
            f"{r['median_ms']:9.3f} ms [{r['q20_ms']:.3f}-{r['q80_ms']:.3f}]  back-to-back "
            f"{num(r.get('b2b_median_ms'), '.3f')} ms  loss {r['first_loss']:.4f} -> "
            f"{r['final_loss']:.4f}  (warm-up {r.get('warmup_s', 0):.1f} s)"
        )
    else:
        detail = f"{r['status'].upper()}: {r.get('reason', '')}"
    print(f"  {r['model']:5} {r['impl']:25} {detail}", flush=True)


def print_paired(p):
    if p["status"] == "ok":
        detail = (
            "  ".join(
                f"{n} {p[n]['median_ms']:.3f} ms (host {p[n]['host_median_us']:.1f} us)" for n in p["impls"] if n in p
            )
            + f"  {p['impls'][-1]} / "
            + ", ".join(f"{n} {q['median']:.4f}" for n, q in p["ratios"].items())
        )
    else:
        detail = f"{p['status'].upper()}: {p.get('reason', '')}"
    print(f"  {p['model']:5} paired: {detail}", flush=True)


# ---------------------------------------------------------------------------------------------- main
def parse_args(argv=None):
    p = harness.parser(__doc__, budget_s=200.0)
    add = p.add_argument
    add("--models", type=harness.csv_list(tuple(MODELS)), default=list(MODELS), help="default: small,gpt2")
    add("--impls", type=harness.csv_list(tuple(IMPL_BY_NAME)), default=list(IMPL_BY_NAME), help="default: all")
    add("--warmup", type=int, default=None, help="steps before timing, counted in the training (default 10; smoke 2)")
    add("--iters", type=int, default=None, help="timed steps (default 40; smoke 3)")
    add("--no-compile", action="store_true", help="skip the torch.compile cases")
    add("--no-paired", action="store_true", help="skip the paired timing of " + " and ".join(PAIRED))
    add("--compile-timeout-s", type=float, default=120.0, help="per torch.compile case (default: 120)")
    add("--compile-backend", default="inductor", help="torch.compile backend (default: inductor)")
    add("--worker", action="store_true", help=argparse.SUPPRESS)
    add("--worker-model", help=argparse.SUPPRESS)
    add("--worker-impl", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    harness.check_device(p, args)
    args.warmup = max(1, args.warmup if args.warmup is not None else (2 if args.smoke else 10))
    args.iters = max(1, args.iters if args.iters is not None else (3 if args.smoke else 40))
    return args


def main(argv=None):
    return harness.main(argv, parse_args, run, markdown)


def run(args, argv):
    if args.worker:
        return worker(args)
    start = time.monotonic()
    deadline = start + args.budget_s
    device = torch.device(args.device)
    configs = SMOKE_MODELS if args.smoke else MODELS
    path = harness.output_path(args, "capture")
    record = harness.new_record(
        "capture",
        "per training step (AdamW, bf16 autocast): eager, CUDA-graph captured and torch.compile'd, torch.optim "
        "against flatopt",
        "bench_capture", args, argv, device,
        settings=dict(warmup=args.warmup, iters=args.iters, budget_s=args.budget_s, seed=args.seed,
                      compile_backend=args.compile_backend, compile_timeout_s=args.compile_timeout_s,
                      no_compile=args.no_compile, no_paired=args.no_paired, batches=N_BATCHES, b2b_rounds=B2B_ROUNDS,
                      b2b_steps_per_round=harness.b2b_steps_per_round(args.iters)),
        steps=args.warmup + args.iters,
        hparams=HPARAMS,
        models={m: dict(asdict(configs[m]), params=gpt_numel(configs[m])) for m in args.models},
        impls={i.name: i.note for i in IMPLS},
        results=[],
        paired=[],
        targets=[],
    )  # fmt: skip
    harness.announce(record, path)
    rows = record["results"]
    chosen = [i for i in IMPLS if i.name in args.impls]

    def run_all(impls):
        for impl in impls:
            for m in args.models:
                if impl.compiled:
                    row = run_compiled(args, m, impl, deadline)
                elif time.monotonic() > deadline:
                    row = harness.budget_spent(dict(model=m, impl=impl.name, ours=impl.ours), args)
                else:
                    row = run_impl(m, impl, configs[m], device, args)
                rows.append(row)
                print_row(row)
                harness.write_json(path, record)

    run_all([i for i in chosen if not i.compiled])
    run_all([i for i in chosen if i.compiled])  # before the paired timing: their targets were the ones left unmeasured
    paired = [n for n in PAIRED if n in args.impls]
    if not args.no_paired and paired[-1:] == [PAIRED[-1]] and len(paired) >= 2:
        for m in args.models:
            if time.monotonic() > deadline:
                p = harness.budget_spent(dict(model=m, impls=paired), args)
            else:
                p = run_paired(m, configs[m], device, args, names=paired)
            record["paired"].append(p)
            print_paired(p)
            harness.write_json(path, record)
    rows.sort(key=lambda r: (list(MODELS).index(r["model"]), list(IMPL_BY_NAME).index(r["impl"])))
    record["reference_final_loss"] = loss_agreement(rows)
    record["targets"] = evaluate_targets(rows, args.models, record["paired"])
    failed = [r for r in rows + record["paired"] if r.get("ours") and r["status"] == "failed"]
    return harness.finish(record, path, args, markdown, failed, start)


if __name__ == "__main__":
    sys.exit(main())
