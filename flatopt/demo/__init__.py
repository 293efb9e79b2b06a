"""``flatopt demo``: flatopt.AdamW against torch.optim.AdamW on a small real training run.

A character-level transformer learns to write Python from the source files of this Python's own
standard library (found with ``sysconfig``, read in sorted order, so the data is on every machine
and needs no download). Two copies of one initialisation train on the same batches, one with
``flatopt.AdamW`` and one with ``torch.optim.AdamW``, both under the same warm-up + cosine
``LambdaLR`` schedule; the two runs are interleaved step by step so that both see the same machine
conditions. Both models are evaluated on the same held-out batches every tenth of the run
(``--eval-every``) and after the last step.

The demo prints a progress line naming each run's latest training and validation loss, then the
final losses, the mean and median time of the optimizer step alone and of the whole training step,
their ratio flatopt / torch.optim (below 1 when flatopt is faster), the backend flatopt stepped with
(as its optimizer object reports it), and how far apart the loss curves are. It writes a plot
(matplotlib, the ``demo`` extra: training loss raw and smoothed, validation loss, and the runs'
differences) and a results JSON into the output folder.

flatopt steps with the backend it chooses for the device (its Triton kernels on CUDA, its CPU
backend, torch's fused CPU kernels over the flat buffers, on the CPU); on CUDA the clock is read
after a synchronisation.
"""

import json
import sys
import time
from pathlib import Path

import torch

from flatopt.demo.config import DemoConfig, DemoError
from flatopt.demo.data import CharData, load_stdlib_text
from flatopt.demo.measure import CpuThreads, device_name, resolve_device
from flatopt.demo.model import CharTransformer, lm_loss
from flatopt.demo.report import PLOT_NAME, RESULTS_NAME, plot, report, summarize
from flatopt.demo.training import RUNS, TORCH_IMPLS, Run, train

__all__ = [
    "DemoConfig",
    "DemoError",
    "run",
    "CharTransformer",
    "CharData",
    "CpuThreads",
    "Run",
    "TORCH_IMPLS",
    "RUNS",
    "lm_loss",
]


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
        runs, n_params, warmup, eval_steps = train(config, data, device, threads, log)
    finally:
        threads.close()
    results = summarize(config, device, threads, source, data, runs, n_params, warmup, eval_steps)
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
