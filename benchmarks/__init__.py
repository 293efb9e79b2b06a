"""flatopt's GPU benchmarks: one shared harness (``harness.py``) and one script per question.

* ``bench_step.py``: per optimizer step, alone and as a training loop pays for it (zero_grad + gradient landing +
  step), each implementation's time as a fraction of the memory-bandwidth floor, and the host-side cost of
  ``step()``; one and two param groups.
* ``bench_eager.py``: whole eager training steps, flatopt.AdamW against torch.optim.AdamW fused and foreach, time and
  peak memory, on five models (on the CPU: flatopt.demo's model).
* ``bench_memory.py``: in-backward mode's peak memory, step time and launches on a ~1B-parameter model, against
  torch.optim fused and torch's optimizer-in-backward recipe.
* ``bench_capture.py``: a whole training step captured with ``optimizer.capture`` against torch's eager,
  hand-captured and ``torch.compile(mode="reduce-overhead")`` steps.
* ``convergence.py``: the final loss of each precision mode (master weights, stochastic rounding, 8-bit states) on
  flatopt.demo's model, 3 seeds, against float32 AdamW's seed-to-seed spread, with its curves.
* ``profile_step.py``, ``profile_capture.py``: where the time of a step and of a captured training step goes.
* ``plot.py``: draws a PNG and prints the markdown tables of a stored result JSON.
* ``report.py``: generates docs/performance.md from the stored results.
* ``run_gpu.sh``: the command for a GPU machine (sections in four calls, plots, summary).

The scripts run as ``python3 benchmarks/<script>.py`` or ``python3 -m benchmarks.<script>`` from the repository root;
tests import them as ``benchmarks.<script>``. Every script takes ``--device cpu --smoke``: a code-path check at tiny
sizes whose output is not a result.
"""
