"""``flatopt demo``: flatopt.AdamW against torch.optim.AdamW on a small real training run.

A character-level transformer learns to write Python from the source files of this Python's own
standard library (found with ``sysconfig``, read in sorted order, so the data is on every machine
and needs no download). Two copies of one initialisation train on the same batches, one with
``flatopt.AdamW`` and one with ``torch.optim.AdamW``, both under the same warm-up + cosine
``LambdaLR`` schedule; the two runs are interleaved step by step so that both see the same machine
conditions. The demo prints the final train and validation losses, the mean time of the optimizer
step alone and of the whole training step, and how far apart the two loss curves are, then writes
a plot of the curves (matplotlib, the ``demo`` extra) and a results JSON into the output folder.

On a CUDA device flatopt steps with its Triton kernels and the clock is read after a
synchronisation; on the CPU it uses its pure-torch backend.
"""

import copy
import json
import math
import os
import platform
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

import flatopt

PLOT_NAME = "loss_curves.png"
RESULTS_NAME = "results.json"
RUNS = ("flatopt.AdamW", "torch.optim.AdamW")
TORCH_IMPLS = {"default": {}, "for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


class DemoError(Exception):
    """Options the demo cannot run with, or data it cannot find; the message says what to change."""


@dataclass
class DemoConfig:
    """Options of the demo; the defaults take about two minutes on a 2-core CPU.

    Args:
        steps (int): training steps per optimizer (default: 800)
        batch_size (int): sequences per batch (default: 16)
        seq_len (int): characters per sequence (default: 128)
        dim (int): model width (default: 128)
        layers (int): transformer blocks (default: 2)
        heads (int): attention heads, dividing ``dim`` (default: 4)
        lr (float): peak learning rate (default: 3e-3)
        weight_decay (float): decoupled weight decay (default: 0.1)
        data_mb (float): megabytes of standard-library source to read (default: 3.0)
        val_fraction (float): the tail of the text held out for validation (default: 0.1)
        eval_batches (int): batches of held-out text for the final validation loss (default: 8)
        device (str or torch.device, optional): default ``"cuda"`` when available, else ``"cpu"``
        threads (int, optional): torch's CPU threads while the demo runs; restored afterwards
            (default: as many as other work leaves idle, measured again as training goes: :class:`CpuThreads`)
        torch_impl (str): the torch.optim.AdamW implementation compared against: ``"default"``
            (what ``torch.optim.AdamW(params)`` picks: for-loop on the CPU, foreach on CUDA),
            ``"foreach"``, ``"fused"`` or ``"for-loop"`` (default: ``"default"``)
        out (str): folder for the plot and the results JSON (default: ``"demo_out"``)
        seed (int): seed of the initialisation and the data order (default: 0)
        quiet (bool): no progress bar (default: False)
    """

    steps: int = 800
    batch_size: int = 16
    seq_len: int = 128
    dim: int = 128
    layers: int = 2
    heads: int = 4
    lr: float = 3e-3
    weight_decay: float = 0.1
    data_mb: float = 3.0
    val_fraction: float = 0.1
    eval_batches: int = 8
    device: str | torch.device | None = None
    threads: int | None = None
    torch_impl: str = "default"
    out: str = "demo_out"
    seed: int = 0
    quiet: bool = False


# ---------------------------------------------------------------------------------------------- data
def load_stdlib_text(max_bytes):
    """Bytes of the standard library's top-level ``.py`` files, in sorted order, up to ``max_bytes``.

    Returns:
        (bytes, dict): the text and where it came from (folder, number of files).
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    if not files:
        raise DemoError(
            f"found no .py files in the standard library folder {root}; the demo trains on them "
            "(this Python may ship its standard library zipped)"
        )
    chunks, total, used = [], 0, 0
    for path in files:
        if total >= max_bytes:
            break
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        used += 1
    return b"".join(chunks)[:max_bytes], {"source": str(root), "files": used}


class CharData:
    """A byte-level vocabulary over ``text`` (the bytes that occur), a train / validation split
    and random windows of it.

    Args:
        text (bytes): the corpus
        val_fraction (float): the tail of the corpus held out for validation
        seq_len (int): characters per sequence; each window has one more for the target
    """

    def __init__(self, text, val_fraction, seq_len):
        raw = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
        present = torch.bincount(raw, minlength=256) > 0
        self.vocab = present.nonzero().flatten()  # token id -> byte
        lookup = torch.full((256,), -1, dtype=torch.long)
        lookup[self.vocab] = torch.arange(len(self.vocab))
        tokens = lookup[raw]
        n_val = int(len(tokens) * val_fraction)
        self.train, self.val = tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val :]
        self.seq_len = seq_len
        for name, split in (("training", self.train), ("validation", self.val)):
            if len(split) < seq_len + 2:
                raise DemoError(
                    f"the {name} text has {len(split)} characters, fewer than --seq-len + 2 = {seq_len + 2}; "
                    "read more data (--data-mb) or use a shorter --seq-len"
                )

    @property
    def vocab_size(self):
        return len(self.vocab)

    def batch(self, split, batch_size, generator):
        """``batch_size`` random windows of ``split``: inputs and next-character targets, int64 [B, T]."""
        starts = torch.randint(len(split) - self.seq_len - 1, (batch_size, 1), generator=generator)
        windows = split[starts + torch.arange(self.seq_len + 1)]
        return windows[:, :-1], windows[:, 1:]


# --------------------------------------------------------------------------------------------- model
class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a 4x GELU MLP."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.norm2(x))))


class CharTransformer(nn.Module):
    """A small GPT over characters: token and learned position embeddings, ``layers`` blocks, a
    final LayerNorm and an output head tied to the token embedding. Every parameter receives a
    gradient at every step (no dropout, every position is used).

    Args:
        vocab_size (int): number of tokens
        seq_len (int): longest sequence (positions with a learned embedding)
        dim (int): model width
        layers (int): transformer blocks
        heads (int): attention heads, dividing ``dim``
    """

    def __init__(self, vocab_size, seq_len, dim, layers, heads):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, dim)
        self.pos = nn.Parameter(torch.zeros(seq_len, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        self.head.weight = self.tok.weight
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() >= 2:
                # GPT-2's initialisation: residual output projections scaled down with depth
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def lm_loss(model, x, y):
    """Mean next-character cross-entropy of ``model`` on inputs ``x`` and targets ``y``."""
    logits = model(x)
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), y.reshape(-1))


def warmup_cosine(steps, warmup, final_fraction=0.1):
    """LambdaLR multiplier: linear warm-up over ``warmup`` steps, then cosine to ``final_fraction``."""

    def factor(step):
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        return final_fraction + (1.0 - final_fraction) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


# ------------------------------------------------------------------------------------------ training
class Progress:
    """A progress bar on ``stream``: on a terminal one line redrawn with ``\\r`` at most ten times a
    second; elsewhere (a log file, a pipe) one line per tenth of the work."""

    def __init__(self, total, enabled=True, stream=None, width=28):
        self.total, self.enabled, self.width = total, enabled, width
        self.stream = sys.stderr if stream is None else stream
        self.tty = enabled and getattr(self.stream, "isatty", lambda: False)()
        self.start = time.perf_counter()
        self.last, self.tenths = -math.inf, 0

    def update(self, done, text=""):
        now = time.perf_counter()
        if not self.enabled:
            return
        if self.tty and done < self.total and now - self.last < 0.1:
            return
        if not self.tty and 10 * done // self.total == self.tenths:
            return
        self.last, self.tenths = now, 10 * done // self.total
        filled = self.width * done // self.total
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = now - self.start
        eta = elapsed / done * (self.total - done) if done else 0.0
        line = f"training [{bar}] {done}/{self.total} {text} {elapsed:5.1f}s elapsed, {eta:5.1f}s left "
        self.stream.write(f"\r{line}" if self.tty else f"{line}\n")
        self.stream.flush()

    def close(self):
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


class Run:
    """One model, its optimizer and scheduler, and what it measured."""

    def __init__(self, name, model, optimizer, scheduler):
        self.name, self.model, self.optimizer, self.scheduler = name, model, optimizer, scheduler
        self.losses, self.step_s, self.train_step_s = [], [], []
        self.val_loss = None

    def train_step(self, x, y, clock):
        t0 = clock()
        self.optimizer.zero_grad()
        loss = lm_loss(self.model, x, y)
        loss.backward()
        t1 = clock()
        self.optimizer.step()
        t2 = clock()
        self.scheduler.step()
        t3 = clock()
        self.step_s.append(t2 - t1)
        self.train_step_s.append(t3 - t0)
        self.losses.append(loss.item())

    @torch.no_grad()
    def evaluate(self, batches):
        self.model.eval()
        self.val_loss = sum(lm_loss(self.model, x, y).item() for x, y in batches) / len(batches)
        self.model.train()


def make_clock(device):
    """``time.perf_counter`` that first waits for the device's queued work."""
    if device.type == "cuda":

        def clock():
            torch.cuda.synchronize(device)
            return time.perf_counter()

        return clock
    return time.perf_counter


def timed_steps(steps):
    """Steps counted in the mean step times: the first ones (lazy state, kernel compilation,
    autotuning, allocator warm-up) are left out."""
    skip = min(10, max(1, steps // 10)) if steps > 1 else 0
    return slice(skip, steps)


class CpuThreads:
    """torch's CPU threads while the demo runs, restored by :meth:`close`: ``fixed`` if given, else
    the CPUs this process may use that other work leaves idle, measured from ``/proc/stat`` (less
    this process's own CPU time) and measured again every ``interval_s`` seconds of training.

    torch's threads wait for each other at every operation, so with more threads than idle cores a
    step gets several times slower (seen on 2 cores: 50 ms alone, 120-210 ms beside one busy
    process, against 80 ms with one thread). Without ``/proc/stat`` the count is the CPUs this
    process may use.

    Args:
        fixed (int, optional): the thread count, never changed (default: None)
        interval_s (float, optional): seconds between measurements (default: 2.0)
    """

    def __init__(self, fixed=None, interval_s=2.0):
        self.cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        self.fixed, self.interval_s = fixed, interval_s
        self.previous = torch.get_num_threads()
        self.threads, self.changes = None, []  # changes: [step, threads] from that step on
        self.last = None if fixed is not None else self._read()
        if self.last is not None:
            time.sleep(0.25)
        self.update(0, force=True)

    @staticmethod
    def _read():
        """(clock, busy CPU-seconds of the machine, elapsed CPU-seconds of the machine, this process's
        CPU-seconds), or None where there is no ``/proc/stat``."""
        try:
            with open("/proc/stat") as f:
                ticks = [int(v) for v in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
            hz = os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, AttributeError):
            return None
        total, idle = sum(ticks) / hz, (ticks[3] + ticks[4]) / hz
        return time.perf_counter(), total - idle, total, time.process_time()

    def update(self, step, force=False):
        """Measure again if ``interval_s`` has passed (or ``force``) and set the thread count."""
        if self.fixed is not None:
            n = self.fixed
        elif self.last is None:
            n = self.cpus
        else:
            if not force and time.perf_counter() - self.last[0] < self.interval_s:
                return
            now = self._read()
            elapsed = max((now[2] - self.last[2]) / (os.cpu_count() or self.cpus), 1e-9)  # wall seconds
            others = (now[1] - self.last[1] - (now[3] - self.last[3])) / elapsed  # CPUs other work kept busy
            self.last = now
            n = max(1, min(self.cpus, self.cpus - round(others)))
        if n != self.threads:
            torch.set_num_threads(n)
            self.threads = n
            self.changes.append([step, n])

    def close(self):
        torch.set_num_threads(self.previous)


def resolve_device(device):
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def versions():
    found = {"python": platform.python_version(), "torch": torch.__version__, "flatopt": flatopt.__version__}
    for name in ("triton", "numpy", "matplotlib"):
        try:
            found[name] = __import__(name).__version__
        except ImportError:
            found[name] = None
    return found


def device_name(device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def train(config, data, device, threads, log):
    """Train both copies interleaved; returns the two runs, the number of parameters and of warm-up steps."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        base = CharTransformer(data.vocab_size, config.seq_len, config.dim, config.layers, config.heads).to(device)
    warmup = max(1, min(100, config.steps // 10))
    runs = []
    for name in RUNS:
        model = copy.deepcopy(base)
        hparams = dict(lr=config.lr, betas=(0.9, 0.99), weight_decay=config.weight_decay)
        if name == "flatopt.AdamW":
            optimizer = flatopt.AdamW(model, **hparams)
        else:
            optimizer = torch.optim.AdamW(model.parameters(), **hparams, **TORCH_IMPLS[config.torch_impl])
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(config.steps, warmup))
        runs.append(Run(name, model, optimizer, scheduler))
    n_params = sum(p.numel() for p in base.parameters())
    log(
        f"model: {n_params / 1e6:.2f}M parameters ({config.layers} blocks, width {config.dim}, {config.heads} heads, "
        f"vocabulary {data.vocab_size}); {config.steps} steps of {config.batch_size} x {config.seq_len} characters, "
        f"lr {config.lr:g} (warm-up {warmup} steps, then cosine), weight decay {config.weight_decay:g}; "
        f"flatopt backend: {runs[0].optimizer.backend}, torch.optim.AdamW implementation: {config.torch_impl}"
    )

    clock = make_clock(device)
    generator = torch.Generator().manual_seed(config.seed)
    progress = Progress(config.steps, enabled=not config.quiet)
    for step in range(config.steps):
        threads.update(step)
        x, y = (t.to(device, non_blocking=True) for t in data.batch(data.train, config.batch_size, generator))
        order = runs if step % 2 == 0 else runs[::-1]  # alternate who goes first: no cache or clock bias
        for run in order:
            run.train_step(x, y, clock)
        progress.update(
            step + 1, f"loss {runs[0].losses[-1]:.3f} / {runs[1].losses[-1]:.3f}, {threads.threads} threads"
        )
    progress.close()

    val_gen = torch.Generator().manual_seed(config.seed + 1)
    batches = [
        tuple(t.to(device) for t in data.batch(data.val, config.batch_size, val_gen))
        for _ in range(config.eval_batches)
    ]
    for run in runs:
        run.evaluate(batches)
    return runs, n_params, warmup


# ------------------------------------------------------------------------------------------- outputs
def plot(path, results, title):
    """Write the two loss curves and their difference to ``path``; returns False when matplotlib is missing."""
    try:
        from matplotlib.figure import Figure  # the object API: no pyplot, no global backend change
    except ImportError:
        return False
    (name_a, a), (name_b, b) = results["runs"].items()
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    ax_loss, ax_diff = fig.subplots(1, 2, width_ratios=[3, 2])
    steps = range(1, len(a["train_losses"]) + 1)
    for name, r, style in ((name_a, a, dict(lw=2.0)), (name_b, b, dict(lw=1.0, ls="--"))):
        label = f"{name}: train {r['final_train_loss']:.3f}, val {r['val_loss']:.3f}"
        ax_loss.plot(steps, r["train_losses"], label=label, **style)
    ax_loss.set(xlabel="step", ylabel="training loss (nats per character)")
    ax_loss.set_title(title, fontsize=9)
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    diff = [abs(x - y) for x, y in zip(a["train_losses"], b["train_losses"], strict=True)]
    floor = min([d for d in diff if d > 0], default=1e-7) / 4
    differ = [(i + 1, d) for i, d in enumerate(diff) if d > 0]
    same = [i + 1 for i, d in enumerate(diff) if d == 0]
    if differ:
        ax_diff.scatter(*zip(*differ, strict=True), s=4, color="tab:green", label="|difference|")
    if same:
        ax_diff.scatter(same, [floor] * len(same), s=4, color="tab:gray", label=f"equal ({len(same)} steps)")
    ax_diff.set(yscale="log", xlabel="step", ylabel="|flatopt loss - torch.optim loss|")
    ax_diff.legend(loc="lower right", fontsize=8)
    ax_diff.set_title(
        f"max difference {results['max_abs_loss_difference']:.2e}; median optimizer step\n"
        f"{name_a} {a['median_optimizer_step_ms']:.2f} ms, {name_b} {b['median_optimizer_step_ms']:.2f} ms",
        fontsize=9,
    )
    ax_diff.grid(alpha=0.3, which="both")
    fig.savefig(path, dpi=120)
    return True


def _ms(seconds):
    """Mean and median of a list of durations, in milliseconds."""
    if not seconds:
        return float("nan"), float("nan")
    ordered = sorted(seconds)
    mid = len(ordered) // 2
    median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    return 1e3 * sum(ordered) / len(ordered), 1e3 * median


def summarize(config, device, threads, source, data, runs, n_params, warmup):
    """Everything the demo measured, as written to ``results.json``."""
    window = timed_steps(config.steps)
    summary = {}
    for r in runs:
        step_mean, step_median = _ms(r.step_s[window])
        train_mean, train_median = _ms(r.train_step_s[window])
        summary[r.name] = {
            "backend": getattr(r.optimizer, "backend", None) or f"torch.optim ({config.torch_impl})",
            "train_losses": r.losses,
            "final_train_loss": r.losses[-1],
            "val_loss": r.val_loss,
            "mean_optimizer_step_ms": step_mean,
            "median_optimizer_step_ms": step_median,
            "mean_train_step_ms": train_mean,
            "median_train_step_ms": train_median,
            "optimizer_step_ms": [1e3 * t for t in r.step_s],
            "train_step_ms": [1e3 * t for t in r.train_step_s],
        }
    return {
        "device": str(device),
        "device_name": device_name(device),
        "cpu_threads": threads.changes,  # [step, threads] from that step on
        "platform": platform.platform(),
        "versions": versions(),
        "config": {**asdict(config), "device": str(device), "threads": config.threads, "warmup_steps": warmup},
        "data": {
            **source,
            "characters": len(data.train) + len(data.val),
            "train_characters": len(data.train),
            "val_characters": len(data.val),
            "vocab_size": data.vocab_size,
        },
        "model": {"parameters": n_params, "layers": config.layers, "dim": config.dim, "heads": config.heads},
        "timed_steps": {"first": window.start + 1, "last": config.steps, "count": len(range(config.steps)[window])},
        "runs": summary,
        "max_abs_loss_difference": max(abs(a - b) for a, b in zip(runs[0].losses, runs[1].losses, strict=True)),
        "val_loss_difference": abs(runs[0].val_loss - runs[1].val_loss),
    }


def report(results, log):
    """Print the comparison table and the closing lines."""
    log("")
    log(f"{'':18} {'first':>7} {'final train':>11} {'val':>7}   {'optimizer step (ms)':>19}   {'train step (ms)':>17}")
    log(f"{'':18} {'loss':>7} {'loss':>11} {'loss':>7}   {'mean':>9} {'median':>9}   {'mean':>8} {'median':>8}")
    for name, r in results["runs"].items():
        log(
            f"{name:18} {r['train_losses'][0]:7.4f} {r['final_train_loss']:11.4f} {r['val_loss']:7.4f}   "
            f"{r['mean_optimizer_step_ms']:9.3f} {r['median_optimizer_step_ms']:9.3f}   "
            f"{r['mean_train_step_ms']:8.2f} {r['median_train_step_ms']:8.2f}"
        )
    timed = results["timed_steps"]
    left_out = timed["first"] - 1
    plural = "s" if left_out != 1 else ""
    log(
        f"step times over steps {timed['first']}-{timed['last']} ({left_out} warm-up step{plural} left out); "
        "a train step is zero_grad + forward + backward + optimizer step + scheduler step"
    )
    ours, theirs = results["runs"].values()
    if timed["count"]:
        ratios = [theirs[f"{k}_optimizer_step_ms"] / ours[f"{k}_optimizer_step_ms"] for k in ("median", "mean")]
        log(f"optimizer step time, torch.optim.AdamW / flatopt.AdamW: {ratios[0]:.2f}x median, {ratios[1]:.2f}x mean")
    log(
        f"flatopt.AdamW vs torch.optim.AdamW: max |training loss difference| over {timed['last']} steps "
        f"{results['max_abs_loss_difference']:.3e}, validation loss difference {results['val_loss_difference']:.3e}"
    )
    if len(results["cpu_threads"]) > 1:
        changes = ", ".join(f"{n} from step {step + 1}" for step, n in results["cpu_threads"])
        log(f"CPU threads followed the other work on this machine: {changes}")
    if results["max_abs_loss_difference"] > 1e-3:
        log(
            "(float32 rounding differences grow as training goes on; on CUDA, torch's own backward kernels are not all "
            "bit-reproducible, and two torch.optim.AdamW runs of a larger model drift apart about as much)"
        )


def run(config, stdout=None, stderr=None):
    """Run the demo: train, print the comparison, write the plot and the results JSON.

    Args:
        config (DemoConfig): the options
        stdout, stderr (file, optional): where results and messages go (default: ``sys.stdout``,
            ``sys.stderr``); the progress bar goes to ``sys.stderr``

    Returns:
        dict: the results, as written to ``results.json``
    """
    stdout = sys.stdout if stdout is None else stdout
    stderr = sys.stderr if stderr is None else stderr
    started = time.perf_counter()

    def log(message):
        print(message, file=stdout, flush=True)

    if config.dim % config.heads:
        raise DemoError(f"--heads must divide --dim ({config.dim}), got {config.heads}")
    if config.torch_impl not in TORCH_IMPLS:
        raise DemoError(f"--torch-impl must be one of {', '.join(TORCH_IMPLS)}, got {config.torch_impl!r}")
    device = resolve_device(config.device)
    text, source = load_stdlib_text(int(config.data_mb * 1e6))
    data = CharData(text, config.val_fraction, config.seq_len)
    log(
        f"flatopt demo: {len(data.train) + len(data.val):,} characters of Python from {source['files']} standard "
        f"library files ({source['source']}), {len(data.val):,} held out"
    )
    threads = CpuThreads(config.threads)
    try:
        how = "as set" if config.threads else "as many as other work leaves idle, measured every 2 s"
        setup = f"torch {torch.__version__}, {threads.threads} CPU threads ({how})"
        log(f"device: {device} ({device_name(device)}), {setup}")
        runs, n_params, warmup = train(config, data, device, threads, log)
    finally:
        threads.close()
    results = summarize(config, device, threads, source, data, runs, n_params, warmup)
    report(results, log)

    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    title = (
        f"char-level transformer ({n_params / 1e6:.2f}M params) on Python stdlib source, {device}, "
        f"{config.steps} steps of {config.batch_size}x{config.seq_len}"
    )
    written = []
    if plot(out / PLOT_NAME, results, title):
        written.append(out / PLOT_NAME)
        results["plot"] = PLOT_NAME
    else:
        print(
            "matplotlib is not installed, so no plot was written (the results above and the JSON are complete); "
            "install it with `pip install 'flatopt[demo]'` or `pip install matplotlib`",
            file=stderr,
            flush=True,
        )
        results["plot"] = None
    results["wall_time_s"] = time.perf_counter() - started
    (out / RESULTS_NAME).write_text(json.dumps(results, indent=1) + "\n")
    written.append(out / RESULTS_NAME)
    log(f"wrote {' and '.join(map(str, written))}")
    return results
