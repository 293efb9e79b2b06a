"""flatopt's GPU benchmarks: one shared harness (``harness.py``) and one script per question.

* ``bench_step.py``: per optimizer step, each implementation's time as a fraction of the
  memory-bandwidth floor, and the host-side cost of ``step()``.
* ``bench_memory.py``: in-backward mode's peak memory, step time and launches on a ~1B-parameter
  model, against torch.optim fused and torch's optimizer-in-backward recipe.
* ``bench_capture.py``: a whole training step captured with ``optimizer.capture`` against torch's
  eager, hand-captured and ``torch.compile(mode="reduce-overhead")`` steps.
* ``plot.py``: draws a PNG and prints a markdown table from a stored step-result JSON.
* ``run_gpu.sh``: the command for a GPU machine (the tests and the three benchmarks in two calls, plot, summary).

The scripts run as ``python3 benchmarks/<script>.py`` or ``python3 -m benchmarks.<script>`` from the
repository root; tests import them as ``benchmarks.<script>``.
"""
