"""The join of the solvers with torch: :func:`solver.optimize` and what it runs.

Capture (``graphs``), the torch-free schedules of :mod:`solver`, the rewrite and the
allocator's judgement meet here and nowhere else: :mod:`solver.join.optimize_model`
(the entry point), :mod:`~solver.join.planning` (one plan per input signature),
:mod:`~solver.join.checks` (the self-checks and the measured fit),
:mod:`~solver.join.watch` (real steps judged and replanned),
:mod:`~solver.join.verification`, :mod:`~solver.join.families` (one plan for a family
of shapes), :mod:`~solver.join.offloading`, :mod:`~solver.join.data_parallel` and
:mod:`~solver.join.models` (the real modules the trainer policies capture or change).
Everything else under :mod:`solver` imports without torch.
"""
