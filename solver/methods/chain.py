"""Optimal checkpointing of a heterogeneous chain: a rotor-style dynamic program.

Beaumont, Eyraud-Dubois, Herrmann, Joly, Shilova (2019), "Optimal checkpointing for
heterogeneous chains: how to train deep neural networks with limited memory"
(arXiv:1911.13214). The graph's stages (:func:`solver.plans.forward_stages`) form the
chain. To run the backward of stages ``s..t`` from the stored input of stage ``s``, a
schedule either

* runs stage ``s`` keeping what its backward reads, solves ``s+1..t``, then runs the
  backward of ``s``; or
* runs stages ``s..s'-1`` keeping only the boundary of ``s'-1``, solves ``s'..t`` from
  it, then solves ``s..s'-1`` -- either recomputing the boundary of ``s'-1`` or keeping
  it until the backward of ``s'-1`` reads it (useful when a stage's backward reads its
  own output, as autograd's does); or
* (non-persistent checkpoints) runs stages ``s..s'-1`` keeping the boundary of
  ``s'-1``, uses it for the backward of ``t..k`` only (``k > s'``), drops it on the
  way (possibly leaving the boundary of ``k-1`` resident), and solves ``s..k-1`` from
  the input of ``s`` again. Inside such a part the bottom checkpoint is itself dropped
  once its last sweep has read it, and the parts nest. These are the schedules of the
  Checkmate stage space that the persistent rotor family misses on heterogeneous
  chains: a cheap checkpoint that is too costly to hold through a later backward.
* (hoisted recomputation) in any split, the part below may start its recomputation
  sweep before the last backward of the part above (the backward of ``s'``) and run
  that backward between two of its stages. Worth it when that backward's gradient is
  larger than what it frees: the sweep's transient peak then falls before the gradient
  is made.

Memory is exact per stage (each stage's peaks come from a local replay of the
simulator's rules) and is discretised in slots of ``ceil(budget / slots)`` bytes,
rounded conservatively: costs and needs only grow, so no schedule the program accepts
is over the budget in its own model. The sequence it emits is then graded by
:func:`solver.simulate`; where the model misses something (values that cross stages
outside the chain's interface), a lower internal limit is tried until the simulated
schedule fits. With one byte per slot (small graphs) the program is exact over its
family. On training chains of up to five layers it equals exhaustive search of the
Checkmate stage space (:func:`solver.methods.bruteforce.brute_force_fixed`) at every
budget (checked in the tests). It is not proven exact on longer ones: its family
leaves out a recomputation hoisted above two or more backward steps at once.

The non-persistent program costs O(S^5 x slots) (four variants of each table: with or
without the bottom stage's backward, with or without a pending backward above) and
runs for chains of at most :data:`FULL_PROGRAM_STAGES` stages; longer chains get the
persistent program, which has neither non-persistent checkpoints nor hoisting.

Complexity: O(S^3 x slots) time and O(S^2 x slots) memory for S stages with the
persistent program, O(S^5 x slots) time and O(S^3 x slots) memory with the
non-persistent one (numpy over the slot axis).
"""

from __future__ import annotations

import logging
import math
import time as _time
from dataclasses import dataclass
from typing import Hashable, Iterable, Sequence

import numpy as np

from graphs import ComputeGraph
from solver.deadline import Deadline, OutOfTime
from solver.errors import NoScheduleFound
from solver.methods.contract import chain_stages, room_of, store_all_fallback
from solver.plans import Stage, forced_keep, forward_stages
from solver.registry import register
from solver.schedule import Schedule
from solver.simulate import simulate

__all__ = ["ChainModel", "chain_model", "chain_dp"]

log = logging.getLogger(__name__)

#: Chains of at most this many stages get the program with non-persistent checkpoints
#: (O(S^5) candidate rows); longer ones the persistent rotor program (O(S^3)).
FULL_PROGRAM_STAGES = 12
#: With a time limit, the share of the time left that the persistent program may take;
#: past it, the chain is merged into fewer, longer stages (the program is O(S^2)
#: entries) and the program runs again.
PROGRAM_SHARE = 0.4
#: With a time limit, the share of the time left for measuring the stages (O(stages x
#: backward values)); past it, the chain is merged into half as many stages as were
#: measured in it.
MODEL_SHARE = 0.3


def local_peak(graph: ComputeGraph, ops: Sequence[Hashable], pre: Iterable[Hashable],
               keep_after: set) -> int:
    """Peak bytes of running ``ops`` with only ``pre`` live at the start, under the
    simulator's rules restricted to these values: a value is live until its last reader
    in ``ops``, or to the end when it is in ``keep_after``."""
    nodes = graph.nx.nodes
    last: dict = {}
    pre = list(pre)
    for v in pre:
        last[v] = -1
    for t, v in enumerate(ops):
        last[v] = t
        for u in graph.op_preds(v):
            if u in last:
                last[u] = t
    end = len(ops)
    for v in keep_after:
        if v in last:
            last[v] = end
    delta = [0] * (end + 2)
    start = {v: 0 for v in pre}
    for t, v in enumerate(ops):
        start[v] = t
    for v, s in start.items():
        b = int(nodes[v]["bytes"])
        e = last[v]
        if e < s:
            e = s if v not in pre else -1
        if e >= s:
            delta[s] += b
            delta[e + 1] -= b
    peak, cur = 0, 0
    for t in range(end):
        cur += delta[t]
        w = int(nodes[ops[t]].get("workspace", 0))
        peak = max(peak, cur + w)
    return peak




@dataclass
class ChainModel:
    """Per-stage costs and memory of the stage chain (bytes, time units).

    Attributes
    ----------
    stages : list of Stage
    fwd, fwd_nb, bwd : numpy.ndarray
        Forward time of each stage, the same without its boundary op, backward time.
    wx : numpy.ndarray
        Bytes of each stage's boundary (its checkpoint).
    xbar, xbar_nb : numpy.ndarray
        Bytes a stage keeps for its backward (boundary included / excluded).
    pn, pn_in : numpy.ndarray
        Peak of a forward run that keeps only the boundary, without / with the stage's
        input counted.
    pa, pa_nb : numpy.ndarray
        Peak of a forward run that keeps what the backward reads (boundary recomputed /
        already held).
    pb : numpy.ndarray
        Peak of the stage's backward, the stage's kept values and incoming gradients
        included.
    grad : numpy.ndarray
        ``grad[i]``: bytes of backward values made by stages >= i and still needed
        (read by stages < i, or step outputs); ``grad[S] = 0``.
    """

    stages: list
    fwd: np.ndarray
    fwd_nb: np.ndarray
    bwd: np.ndarray
    wx: np.ndarray
    xbar: np.ndarray
    xbar_nb: np.ndarray
    pn: np.ndarray
    pn_in: np.ndarray
    pa: np.ndarray
    pa_nb: np.ndarray
    pb: np.ndarray
    grad: np.ndarray


def chain_model(graph: ComputeGraph, stages: list[Stage] | None = None, *,
                deadline: Deadline | None = None) -> ChainModel:
    """Measure each stage of the chain for the dynamic program (with a ``deadline``,
    checked at each stage: O(stages x backward values) in all).

    Examples
    --------
    >>> from solver.synthetic import training_chain
    >>> m = chain_model(training_chain(3, fwd_bytes=[1, 2, 3]))
    >>> m.wx.tolist(), m.xbar.tolist()
    ([1, 2, 1], [1, 2, 4])
    """
    stages = forward_stages(graph) if stages is None else stages
    nodes = graph.nx.nodes
    L = len(stages)
    stage_of_b = {b: st.index for st in stages for b in st.backward}

    def arr():
        return np.zeros(L, dtype=np.int64)

    fwd, fwd_nb, bwd = np.zeros(L), np.zeros(L), np.zeros(L)
    wx, xbar, xbar_nb, pn, pn_in, pa, pa_nb, pb = (arr() for _ in range(8))
    grad = np.zeros(L + 1, dtype=np.int64)
    # backward values crossing each interface
    for b, i in stage_of_b.items():
        readers = [stage_of_b.get(w, -1) for w in graph.op_succs(b)]
        lowest = min(readers, default=i)
        if nodes[b].get("output", False):
            lowest = -1
        # alive from the end of stage i's backward until stage `lowest`'s backward
        for j in range(lowest + 1, i + 1):
            grad[j] += int(nodes[b]["bytes"])
    for st in stages:
        if deadline is not None and deadline.expired():
            raise _Unfinished(st.index)
        i = st.index
        F, B = st.forward, st.backward
        x = st.boundary
        bset = set(B)
        keepb = {v for v in F if any(w in bset for w in graph.op_succs(v))} | {x}
        fwd[i] = sum(nodes[v]["time"] for v in F)
        fwd_nb[i] = fwd[i] - nodes[x]["time"]
        bwd[i] = sum(nodes[v]["time"] for v in B)
        wx[i] = int(nodes[x]["bytes"])
        xbar[i] = sum(int(nodes[v]["bytes"]) for v in keepb)
        xbar_nb[i] = xbar[i] - wx[i]
        pn[i] = local_peak(graph, F, [], {x})
        prev = [stages[i - 1].boundary] if i > 0 else []
        pn_in[i] = local_peak(graph, F, prev, {x})
        pa[i] = local_peak(graph, F, [], keepb)
        pa_nb[i] = local_peak(graph, F[:-1], [], keepb - {x})
        # incoming gradients: backward values of later stages still alive at stage i
        incoming = [b for b, j in stage_of_b.items() if j > i and _alive_at(graph, b, i, stage_of_b)]
        out_b = {b for b in B if nodes[b].get("output", False)
                 or any(stage_of_b.get(w, -1) < i for w in graph.op_succs(b))}
        keep_in = {b for b in incoming if _read_below(graph, b, i, stage_of_b) or nodes[b].get("output", False)}
        pb[i] = local_peak(graph, B, list(keepb) + incoming, out_b | keep_in)
    return ChainModel(stages, fwd, fwd_nb, bwd, wx, xbar, xbar_nb, pn, pn_in, pa, pa_nb, pb, grad)


def _alive_at(graph, b, i, stage_of_b) -> bool:
    if graph[b].get("output", False):
        return True
    return any(stage_of_b.get(w, -1) <= i for w in graph.op_succs(b))


def _read_below(graph, b, i, stage_of_b) -> bool:
    return any(stage_of_b.get(w, -1) < i for w in graph.op_succs(b))


class _Unfinished(OutOfTime):
    """The time ran out after ``pairs`` of the program's ``(s, t)`` entries (of the
    stages measured, in :func:`chain_model`)."""

    def __init__(self, pairs: int) -> None:
        super().__init__(f"the time limit passed while filling the chain program ({pairs} entries)")
        self.pairs = pairs


class _Program:
    """The table of the dynamic program: ``cost[s, t, f, m]`` is the least time to run
    the backward of stages ``s..t`` from the stored input of ``s`` within ``m`` slots
    above what is live outside (``f = 1``: the boundary of ``t`` is already computed and
    held; the subproblem counts it until the backward of ``t`` has read it)."""

    def __init__(self, model: ChainModel, unit: int, slots: int, deadline: Deadline | None = None) -> None:
        self.model = model
        self.unit = unit
        self.slots = slots
        self.deadline = deadline
        self.pairs = 0  # (s, t) entries filled so far
        L = len(model.stages)
        M = slots + 1
        # column 0: "below zero", always inf; each entry is written as it is filled (a table
        # of a long chain is large, and filling it whole up front would spend the time limit
        # before the first deadline check)
        self.cost = np.empty((L, L, 2, M + 1))
        self.choice = np.zeros((L, L, 2, M + 1), dtype=np.int32)
        self._run()

    def need(self, b) -> np.ndarray:
        """Slots needed to hold ``b`` bytes (conservative: up for positive, down for negative)."""
        return np.ceil(np.asarray(b, dtype=float) / self.unit).astype(np.int64)

    def _run(self) -> None:
        md = self.model
        L = len(md.stages)
        M = self.slots + 1
        cols = np.arange(M)  # slot counts 0..slots, stored at column c + 1
        C, K = self.cost, self.choice
        fcum = np.concatenate([[0.0], np.cumsum(md.fwd)])
        # chain peak of running stages s..s'-1 keeping only boundaries
        for d in range(L):
            for s in range(L - d):
                if self.deadline is not None and s & 15 == 0 and self.deadline.expired():
                    raise _Unfinished(self.pairs)
                self.pairs += 1
                t = s + d
                for f in (0, 1):
                    best = np.full(M, np.inf)
                    arg = np.zeros(M, dtype=np.int32)
                    # option A: forward s keeping its backward's values
                    held = md.wx[t] if f else 0  # x_t, held outside until B(t) reads it
                    if d == 0:
                        fc = md.fwd_nb[s] if f else md.fwd[s]
                        pk = max(held + md.pa_nb[s] if f else md.pa[s], md.pb[s] - md.grad[s + 1])
                        ok = cols >= self.need(pk)
                        best = np.where(ok, fc + md.bwd[s], np.inf)
                    else:
                        sub = self._shift(C[s + 1, t, f], self.need(md.xbar[s]))
                        req = self.need(max(md.pa[s] + held, md.pb[s] - md.grad[t + 1]))
                        val = md.fwd[s] + md.bwd[s] + sub
                        best = np.where(cols >= req, val, np.inf)
                    # option B: split at s' in s+1..t, keeping (k=1) or recomputing (k=0) x_{s'-1}
                    if d > 0:
                        sp = np.arange(s + 1, t + 1)
                        pin = md.pn_in[s + 1:t + 1]
                        chainpk = np.maximum.accumulate(np.concatenate([[md.pn[s]], pin]))[:-1] + held
                        req = self.need(chainpk)[:, None]
                        fcost = (fcum[sp] - fcum[s])[:, None]
                        t1 = self._shift_rows(C[s + 1:t + 1, t, f], self.need(md.wx[sp - 1]))
                        for k in (0, 1):
                            shift = self.need(md.grad[sp] - md.grad[t + 1])
                            t2 = self._shift_rows(C[s, s:t, k], shift)
                            val = fcost + t1 + t2
                            val = np.where(cols[None, :] >= req, val, np.inf)
                            j = np.argmin(val, axis=0)
                            v = val[j, cols]
                            better = v < best
                            best = np.where(better, v, best)
                            arg = np.where(better, 1 + 2 * j + k, arg)
                    C[s, t, f, 0] = np.inf
                    C[s, t, f, 1:] = best
                    K[s, t, f, 1:] = arg

    def _shift(self, row: np.ndarray, by) -> np.ndarray:
        """``row`` (with the inf column 0) read at slot ``m - by`` for every m."""
        M = self.slots + 1
        idx = np.clip(np.arange(M) - int(by), -1, M - 1) + 1
        return row[idx]

    def _shift_rows(self, rows: np.ndarray, by: np.ndarray) -> np.ndarray:
        M = self.slots + 1
        idx = np.clip(np.arange(M)[None, :] - by[:, None], -1, M - 1) + 1
        return np.take_along_axis(rows, idx, axis=1)

    def emit(self, m: int) -> list:
        """The op sequence of the table's choice with ``m`` slots at the top level."""
        md = self.model
        st = md.stages
        L = len(st)
        seq: list = []
        stack: list = [("solve", 0, L - 1, 0, m)]
        while stack:
            item = stack.pop()
            if item[0] == "ops":
                seq.extend(item[1])
                continue
            _, s, t, f, mm = item
            mm = min(max(mm, 0), self.slots)
            c = int(self.choice[s, t, f, mm + 1])
            if c == 0:
                fwd_ops = st[s].forward[:-1] if (f and s == t) else st[s].forward
                seq.extend(fwd_ops)
                if s < t:
                    stack.append(("ops", st[s].backward))
                    stack.append(("solve", s + 1, t, f, mm - int(self.need(md.xbar[s]))))
                else:
                    seq.extend(st[s].backward)
            else:
                j, k = divmod(c - 1, 2)
                sp = s + 1 + j
                for i in range(s, sp):
                    seq.extend(st[i].forward)
                shift = int(self.need(md.grad[sp] - md.grad[t + 1]))
                stack.append(("solve", s, sp - 1, k, mm - shift))
                stack.append(("solve", sp, t, f, mm - int(self.need(md.wx[sp - 1]))))
        return seq


class _FullProgram:
    """The program with non-persistent checkpoints and hoisted recomputation (see the
    module docstring).

    ``P[prime, pend, s, t, f]`` (an array over slot counts): least time to run the
    backward of stages ``t..s`` while the input ``x_{s-1}`` of stage ``s`` is held by the
    caller (not counted); ``f = 1``: the boundary ``x_t`` is already resident and counted
    until the backward of ``t`` reads it. ``N[prime, pend, s, t, k, f, e]``: the same for
    stages ``t..k`` (``s < k <= t``) when ``x_{s-1}`` is counted here and dropped on the
    way; ``e = 1``: the boundary ``x_{k-1}`` is left resident for the caller.

    ``prime``: the part stops before the backward of its bottom stage (``s`` for ``P``,
    ``k`` for ``N``), leaving that stage's kept values and gradient resident; the caller
    runs that backward inside the part below it. ``pend``: the backward of stage ``t + 1``
    has not run yet (its kept values, its incoming gradient and ``x_t`` are resident);
    it runs at the start of any sub-part, so the recomputation sweep of the stages below
    can run before it (worth it when that backward's gradient is larger than what it
    frees). All four variants share the caller's memory baseline, so ``P[0, ...] = P[1,
    ...] + backward`` where the backward fits.
    """

    def __init__(self, model: ChainModel, unit: int, slots: int) -> None:
        self.model = model
        self.unit = unit
        self.slots = slots
        self.P: dict = {}
        self.N: dict = {}
        self.PC: dict = {}
        self.NC: dict = {}
        self._codes: dict = {}
        self._run()

    def need(self, b) -> int:
        return int(math.ceil(float(b) / self.unit))

    def _shift(self, row: np.ndarray, by: int) -> np.ndarray:
        if by <= 0:
            if by == 0:
                return row
            out = np.empty_like(row)
            out[:by] = row[-by:]
            out[by:] = row[-1]
            return out
        out = np.full_like(row, np.inf)
        if by <= self.slots:
            out[by:] = row[:-by] if by else row
        return out

    def _cap(self, row: np.ndarray, req: int) -> np.ndarray:
        if req <= 0:
            return row
        out = row.copy()
        out[:min(req, len(out))] = np.inf
        return out

    def _held(self, t: int, f: int, pend: bool) -> int:
        """Bytes resident on top of a part's baseline during its first sweep."""
        md = self.model
        if pend:  # x_t, the kept values of stage t+1 and its incoming gradient
            return int(md.wx[t] + md.xbar[t + 1] + md.grad[t + 2] - md.grad[t + 1])
        return int(md.wx[t]) if f else 0

    def _run(self) -> None:
        md = self.model
        L = len(md.stages)
        self.fc = np.concatenate([[0.0], np.cumsum(md.fwd)])
        self.chain_pk = {}  # (s, j) -> peak of running stages s..j, x_{s-1} held outside
        self.chain_in = {}  # (s, j) -> the same with x_{s-1} counted and dropped in stage s
        for s in range(L):
            a = int(md.pn[s])
            b = int(md.pn_in[s])
            for j in range(s, L):
                if j > s:
                    a = max(a, int(md.pn_in[j]))
                    b = max(b, int(md.pn_in[j]))
                self.chain_pk[s, j] = a
                self.chain_in[s, j] = b
        for d in range(L):
            for s in range(L - d):
                t = s + d
                pends = (False, True) if t < L - 1 else (False,)
                for pend in pends:
                    for prime in (False, True):
                        for f in (0, 1):
                            key = (prime, pend, s, t, f)
                            self._store(self.P, self.PC, key, self._p_cands(*key))
                if s == 0:  # N parts start above a checkpoint: s >= 1
                    continue
                for pend in pends:
                    # N3 tops for every (sp, kp, e2), shifted by x_{s-1}, per f
                    tops = [self._n3_tops(pend, s, t, f) for f in (0, 1)]
                    for prime in (False, True):
                        for k in range(s + 1, t + 1):
                            for e in (0, 1):
                                lows = self._n3_lows(prime, s, t, k, e)
                                for f in (0, 1):
                                    key = (prime, pend, s, t, k, f, e)
                                    self._store(self.N, self.NC, key, self._n_cands(*key, tops[f], lows))

    def _p_cands(self, prime: bool, pend: bool, s: int, t: int, f: int) -> list:
        md, need, P, N = self.model, self.need, self.P, self.N
        held = self._held(t, f, pend)
        full = np.full(self.slots + 1, 0.0)
        cands = []
        if pend:  # run the pending backward of t+1 now
            req = need(md.pb[t + 1] - md.grad[t + 1] + md.wx[t])
            cands.append((self._cap(P[prime, False, s, t, f] + md.bwd[t + 1], req), ("now",)))
        # A: run stage s keeping what its backward reads
        if s == t:
            if pend:  # x_t is resident for the pending backward
                c = md.fwd_nb[s] + md.bwd[t + 1]
                pks = [held + md.pa_nb[s], md.pb[t + 1] - md.grad[t + 1] + md.wx[t] + md.xbar_nb[s]]
            else:
                c = md.fwd_nb[s] if f else md.fwd[s]
                pks = [held + md.pa_nb[s] if f else md.pa[s]]
            if not prime:
                c += md.bwd[s]
                pks.append(md.pb[s] - md.grad[s + 1])
            cands.append((self._cap(full + c, need(max(pks))), ("A",)))
        else:
            sub = self._shift(P[False, pend, s + 1, t, f], need(md.xbar[s]))
            pks = [md.pa[s] + held]
            c = md.fwd[s]
            if not prime:
                c += md.bwd[s]
                pks.append(md.pb[s] - md.grad[t + 1])
            cands.append((self._cap(sub + c, need(max(pks))), ("A",)))
        for sp in range(s + 1, t + 1):
            req = need(self.chain_pk[s, sp - 1] + held)
            fcost = self.fc[sp] - self.fc[s]
            # B: x_{sp-1} persistent; the part below may start before the backward of sp
            top = self._shift(P[True, pend, sp, t, f], need(md.wx[sp - 1]))
            for kf in (0, 1):
                low = self._shift(P[prime, True, s, sp - 1, kf], need(md.grad[sp] - md.grad[t + 1]))
                cands.append((self._cap(top + low + fcost, req), ("B", sp, kf)))
            # C: x_{sp-1} dropped once stages t..kp are done
            for kp in range(sp + 1, t + 1):
                for e in (0, 1):
                    top = N[True, pend, sp, t, kp, f, e]
                    low = self._shift(P[prime, True, s, kp - 1, e], need(md.grad[kp] - md.grad[t + 1]))
                    cands.append((self._cap(top + low + fcost, req), ("C", sp, kp, e)))
        return cands

    def _shift_block(self, block: np.ndarray, by: int) -> np.ndarray:
        """:meth:`_shift` along the last axis of an array of rows."""
        if by == 0:
            return block
        out = np.full_like(block, np.inf)
        if by < 0:
            out[..., :by] = block[..., -by:]
            out[..., by:] = block[..., -1:]
        elif by <= self.slots:
            out[..., by:] = block[..., :-by]
        return out

    def _n3_tops(self, pend: bool, s: int, t: int, f: int) -> np.ndarray:
        """``[sp - s - 1, kp - s - 1, e2]``: the top part of an N3 split (inf where
        ``kp <= sp``), shifted by ``x_{s-1}``."""
        A = t - s
        block = np.full((A, A, 2, self.slots + 1), np.inf)
        for sp in range(s + 1, t + 1):
            for kp in range(sp + 1, t + 1):
                for e2 in (0, 1):
                    block[sp - s - 1, kp - s - 1, e2] = self.N[True, pend, sp, t, kp, f, e2]
        return self._shift_block(block, self.need(self.model.wx[s - 1]))

    def _n3_lows(self, prime: bool, s: int, t: int, k: int, e: int) -> np.ndarray:
        """``[kp - s - 1, e2]``: the part below an N3 split (inf where ``kp <= k``)."""
        md = self.model
        A = t - s
        block = np.full((A, 2, self.slots + 1), np.inf)
        for kp in range(k + 1, t + 1):
            by = self.need(md.grad[kp] - md.grad[t + 1])
            for e2 in (0, 1):
                block[kp - s - 1, e2] = self._shift(self.N[prime, True, s, kp - 1, k, e2, e], by)
        return block

    def _n3_codes(self, s: int, t: int) -> list:
        key = (s, t)
        if key not in self._codes:
            self._codes[key] = [("N3", sp, kp, e2) for sp in range(s + 1, t + 1)
                                for kp in range(s + 1, t + 1) for e2 in (0, 1)]
        return self._codes[key]

    def _n_cands(self, prime: bool, pend: bool, s: int, t: int, k: int, f: int, e: int,
                 tops: np.ndarray, lows: np.ndarray) -> list:
        md, need, P, N = self.model, self.need, self.P, self.N
        held = self._held(t, f, pend)
        cands = []
        if pend:
            req = need(md.pb[t + 1] - md.grad[t + 1] + md.wx[t] + md.wx[s - 1])
            cands.append((self._cap(N[prime, False, s, t, k, f, e] + md.bwd[t + 1], req), ("now",)))
        for sp in range(s + 1, k + 1):
            fcost = self.fc[sp] - self.fc[s]
            # N1: x_{s-1} dropped in this sweep
            req = need(self.chain_in[s, sp - 1] + held)
            if sp == k:
                top = self._shift(P[prime, pend, sp, t, f], need(md.wx[sp - 1]))
            else:
                top = N[prime, pend, sp, t, k, f, e]
            cands.append((self._cap(top + fcost, req), ("N1", sp)))
        bottom = need(md.wx[s - 1])
        reqs = np.empty(t - s, dtype=np.int64)
        for sp in range(s + 1, t + 1):
            fcost = self.fc[sp] - self.fc[s]
            req = need(self.chain_pk[s, sp - 1] + int(md.wx[s - 1]) + held)
            reqs[sp - s - 1] = req
            # N2, x_{sp-1} persistent
            if sp - 1 >= k:
                top = self._shift(P[True, pend, sp, t, f], bottom + need(md.wx[sp - 1]))
                for kf in (0, 1):
                    low = self._shift(N[prime, True, s, sp - 1, k, kf, e], need(md.grad[sp] - md.grad[t + 1]))
                    cands.append((self._cap(top + low + fcost, req), ("N2", sp, kf)))
        # N3, x_{sp-1} dropped too, once stages t..kp are done (all sp, kp, e2 at once)
        if k < t:
            fcost = (self.fc[s + 1:t + 1] - self.fc[s])[:, None, None, None]
            vals = tops + lows[None] + fcost
            cols = np.arange(self.slots + 1)
            vals = np.where(cols[None, None, None, :] < reqs[:, None, None, None], np.inf, vals)
            cands.append((vals.reshape(-1, self.slots + 1), self._n3_codes(s, t)))
        return cands

    def _store(self, table, choices, key, cands) -> None:
        """Keep the cheapest candidate per slot count. A candidate is one row with its
        code, or a block of rows with a list of codes."""
        rows, codes = [], []
        for vals, code in cands:
            if vals.ndim == 1:
                rows.append(vals[None])
                codes.append(code)
            else:
                rows.append(vals)
                codes.extend(code)
        vals = np.concatenate(rows)
        j = np.argmin(vals, axis=0)
        table[key] = vals[j, np.arange(vals.shape[1])]
        choices[key] = (codes, j)

    def row(self) -> np.ndarray:
        """Least cost of the whole chain at every slot count."""
        return self.P[False, False, 0, len(self.model.stages) - 1, 0]

    def emit(self, m: int) -> list:
        """The op sequence of the table's choice with ``m`` slots at the top level."""
        md = self.model
        st = md.stages
        L = len(st)
        need = self.need
        seq: list = []
        stack: list = [("P", (False, False, 0, L - 1, 0), m)]

        def fwd(a, b):
            for i in range(a, b):
                seq.extend(st[i].forward)

        def gshift(a, t):
            return need(md.grad[a] - md.grad[t + 1])

        while stack:
            kind, key, mm = stack.pop()
            if kind == "ops":
                seq.extend(key)
                continue
            mm = min(mm, self.slots)
            if kind == "P":
                prime, pend, s, t, f = key
                codes, j = self.PC[key]
                code = codes[j[mm]]
                if code[0] == "now":
                    seq.extend(st[t + 1].backward)
                    stack.append(("P", (prime, False, s, t, f), mm))
                elif code[0] == "A":
                    if s == t:
                        seq.extend(st[s].forward[:-1] if (f or pend) else st[s].forward)
                        if pend:
                            seq.extend(st[t + 1].backward)
                        if not prime:
                            seq.extend(st[s].backward)
                    else:
                        seq.extend(st[s].forward)
                        if not prime:
                            stack.append(("ops", st[s].backward, 0))
                        stack.append(("P", (False, pend, s + 1, t, f), mm - need(md.xbar[s])))
                elif code[0] == "B":
                    _, sp, kf = code
                    fwd(s, sp)
                    stack.append(("P", (prime, True, s, sp - 1, kf), mm - gshift(sp, t)))
                    stack.append(("P", (True, pend, sp, t, f), mm - need(md.wx[sp - 1])))
                else:
                    _, sp, kp, e = code
                    fwd(s, sp)
                    stack.append(("P", (prime, True, s, kp - 1, e), mm - gshift(kp, t)))
                    stack.append(("N", (True, pend, sp, t, kp, f, e), mm))
            else:
                prime, pend, s, t, k, f, e = key
                codes, j = self.NC[key]
                code = codes[j[mm]]
                if code[0] == "now":
                    seq.extend(st[t + 1].backward)
                    stack.append(("N", (prime, False, s, t, k, f, e), mm))
                elif code[0] == "N1":
                    sp = code[1]
                    fwd(s, sp)
                    if sp == k:
                        stack.append(("P", (prime, pend, sp, t, f), mm - need(md.wx[sp - 1])))
                    else:
                        stack.append(("N", (prime, pend, sp, t, k, f, e), mm))
                elif code[0] == "N2":
                    _, sp, kf = code
                    fwd(s, sp)
                    stack.append(("N", (prime, True, s, sp - 1, k, kf, e), mm - gshift(sp, t)))
                    stack.append(("P", (True, pend, sp, t, f), mm - need(md.wx[s - 1]) - need(md.wx[sp - 1])))
                else:
                    _, sp, kp, e2 = code
                    fwd(s, sp)
                    stack.append(("N", (prime, True, s, kp - 1, k, e2, e), mm - gshift(kp, t)))
                    stack.append(("N", (True, pend, sp, t, kp, f, e2), mm - need(md.wx[s - 1])))
        return seq


def _drop_forced_repeats(graph: ComputeGraph, seq: list) -> list:
    forced = forced_keep(graph)
    if not forced:
        return seq
    seen: set = set()
    out = []
    for v in seq:
        if v in forced and v in seen:
            continue
        seen.add(v)
        out.append(v)
    return out


def merge_stages(graph: ComputeGraph, stages: list[Stage], size: int) -> list[Stage]:
    """The chain with each run of ``size`` consecutive stages made one stage (its
    boundary is the run's last one: still the only value that crosses the cut).

    Examples
    --------
    >>> from solver.synthetic import training_chain
    >>> g = training_chain(3)
    >>> [(s.forward, s.backward) for s in merge_stages(g, forward_stages(g), 2)]
    [(['f0', 'f1'], ['b1', 'b0']), (['f2', 'loss'], ['b2'])]
    """
    size = max(1, int(size))
    pos = {v: i for i, v in enumerate(graph.order)}
    out = []
    for k in range(0, len(stages), size):
        run = stages[k:k + size]
        out.append(Stage(index=len(out), forward=[v for st in run for v in st.forward],
                         backward=sorted((v for st in run for v in st.backward), key=pos.__getitem__)))
    return out


@register("chain_dp", family="chain", order="fixed")
def chain_dp(
    graph: ComputeGraph,
    budget_bytes: int,
    *,
    time_limit=None,
    slots: int | None = None,
    nonpersistent: bool | None = None,
) -> Schedule:
    """Optimal rotor-style checkpointing of the graph's stage chain.

    Parameters
    ----------
    graph : ComputeGraph
    budget_bytes : int
    time_limit : float, optional
        Seconds. The persistent program (O(S^2) entries of O(S x slots) each) may take
        :data:`PROGRAM_SHARE` of the time left; when it runs out, the chain's
        neighbouring stages are merged into as many stages as a program at the rate
        measured fills in that share of what is left (at least about sqrt(S)), and it
        runs again
        (``info["merged"]``: stages per merged stage). The grading of its settings
        stops at the limit with the best that fits.
    slots : int, optional
        Memory resolution: the budget above the fixed bytes is cut into this many slots
        (one byte per slot when it has fewer bytes, which makes the program exact).
        Default: 400, fewer for long chains (about 10^7 / S^3 x 6, at least 32) so that
        the program answers in about a second; 400 for the non-persistent program.
    nonpersistent : bool, optional
        Use the program with non-persistent checkpoints and hoisted recomputation
        (default: when the chain has at most :data:`FULL_PROGRAM_STAGES` stages);
        ``False`` gives the persistent rotor family.

    Returns
    -------
    Schedule
        ``info["model_cost"]``: the program's own cost; ``info["slots_used"]``.

    Raises
    ------
    NoScheduleFound
        No schedule of the family fits (or the graph has no backward and store-all does
        not fit).

    Examples
    --------
    >>> from solver.synthetic import training_chain
    >>> import solver
    >>> g = training_chain(6)
    >>> solver.solve(g, 7, method="chain_dp").cost > solver.solve(g, 100, method="chain_dp").cost
    True
    """
    stages = chain_stages(graph)
    if stages is None:
        return store_all_fallback(graph, budget_bytes, method="chain_dp")
    deadline = Deadline(time_limit)
    avail = room_of(graph, budget_bytes, method="chain_dp", at_least=1)
    chain, prog, row, unit, top = _chain_program(graph, stages, avail, deadline, time_limit, slots=slots,
                                                 nonpersistent=nonpersistent)
    finite = np.flatnonzero(np.isfinite(row))
    if finite.size == 0:
        merged = "" if chain is stages else (
            f" ({len(chain)} stages merged from {len(stages)} to keep the time limit of "
            f"{time_limit:g} s; a longer one merges less)")
        raise NoScheduleFound(
            f"chain_dp: no schedule of the chain family{merged} fits even with every slot; "
            "use a general method such as 'eviction' or 'checkmate_milp'", best_peak=None)
    best, tried, best_peak, timed_out = _graded_levels(graph, budget_bytes, prog, row, top,
                                                       None if time_limit is None else deadline)
    if best is None:
        raise NoScheduleFound(
            f"chain_dp: no schedule of the chain family fits {budget_bytes} B"
            + (" among those it graded before the time limit passed" if timed_out else "")
            + (f" (its smallest simulated peak is {best_peak} B)" if best_peak is not None else "")
            + "; use a general method such as 'eviction' or 'checkmate_milp'", best_peak=best_peak)
    seq, r, m = best
    return Schedule(sequence=seq, method="chain_dp",
                    info={"order": "fixed", "plan": "chain_dp", "stages": len(stages),
                          "model_cost": float(row[m]), "slots_used": int(m), "slot_bytes": unit,
                          "candidates": len(tried), "merged": math.ceil(len(stages) / len(chain))})


def _chain_program(graph: ComputeGraph, stages: list, avail: int, deadline: Deadline, time_limit, *,
                   slots: int | None, nonpersistent: bool | None):
    """Phase 1 of :func:`chain_dp`: the chain's model and its program, stages merged where
    either would not finish in time; returns ``(chain, program, row, unit, top)``, ``row``
    the program's cost at each slot count at the top level."""
    chain = stages
    while True:
        L = len(chain)
        started = _time.perf_counter()
        try:
            model = chain_model(graph, chain, deadline=None if time_limit is None
                                else deadline.within(MODEL_SHARE * deadline.left()))
        except _Unfinished as exc:
            # measuring each stage scans the backward values: fewer, longer stages
            fit = exc.pairs // 2
            if fit < 2 or deadline.expired():
                raise NoScheduleFound(
                    f"chain_dp: measuring its {L} stages took the time limit ({time_limit:g} s); give a "
                    "longer time_limit or use a general method such as 'eviction'") from None
            chain = merge_stages(graph, stages, math.ceil(len(stages) / fit))
            continue
        # (a merged chain gets the persistent program: the other is O(S^5))
        full = (L <= FULL_PROGRAM_STAGES and chain is stages) if nonpersistent is None else bool(nonpersistent)
        m_slots = slots
        if m_slots is None and full:
            m_slots = 400
        elif m_slots is None:
            m_slots = int(min(400, max(32, 6e6 / max(1, L**3 / 6 * 4))))
        unit = max(1, math.ceil(avail / max(1, int(m_slots))))
        top = avail // unit
        total = int(model.xbar.sum() + model.grad.max() + model.pb.max() + model.pa.max())
        span = max(top, min(total // unit + 1, top + top // 8))
        if full:
            prog = _FullProgram(model, unit, span)
            row = prog.row()
            break
        started = _time.perf_counter()
        share = None if time_limit is None else deadline.within(PROGRAM_SHARE * deadline.left())
        try:
            prog = _Program(model, unit, span, deadline=share)
        except _Unfinished as exc:
            # the program grows with the square of the stages: merge neighbours so that
            # a program at the rate measured fits the share of the time left
            # (halved: the entries filled so far are the cheap ones of short spans)
            rate = max(1, exc.pairs) / max(1e-3, _time.perf_counter() - started)
            fit = int(math.sqrt(2 * rate * PROGRAM_SHARE * max(0.0, deadline.left()))) // 2
            # never fewer than about sqrt(S) stages: a program over them takes milliseconds,
            # while a chain of a few long stages may fit no budget at all (the rate measured
            # on a loaded machine can be a tenth of the usual)
            fit = max(fit, math.isqrt(len(stages)))
            if fit < 2 or deadline.expired():
                raise NoScheduleFound(
                    f"chain_dp: its program over {L} stages did not finish before the time limit "
                    f"({time_limit:g} s); give a longer time_limit or use a general method such as 'eviction'"
                ) from None
            chain = merge_stages(graph, stages, math.ceil(len(stages) / min(fit, L - 1)))
            continue
        row = prog.cost[0, L - 1, 0, 1:]
        break
    return chain, prog, row, unit, top


def _graded_levels(graph: ComputeGraph, budget: int, prog, row, top: int, deadline: Deadline | None):
    """Phase 2 of :func:`chain_dp`: the program's plans at a few slot counts, simulated;
    returns ``(best, tried, best_peak, timed_out)``, ``best`` the cheapest ``(sequence,
    result, slots)`` within ``budget`` or None."""
    # try the top level at the budget, then cheaper settings above it (the model is
    # conservative), then lower limits until the simulated peak fits
    tried: dict[tuple, tuple] = {}
    best = None
    best_peak = None

    def attempt(m: int):
        nonlocal best, best_peak
        seq = _drop_forced_repeats(graph, prog.emit(m))
        key = tuple(seq)
        if key in tried:
            return tried[key]
        r = simulate(graph, seq, deadline=deadline)
        tried[key] = (r.valid and r.peak_bytes <= budget, r)
        if r.valid:
            best_peak = r.peak_bytes if best_peak is None else min(best_peak, r.peak_bytes)
            if r.peak_bytes <= budget and (best is None or r.cost < best[1].cost):
                best = (seq, r, m)
        return tried[key]

    levels = [m for m in range(len(row)) if np.isfinite(row[m]) and (m == 0 or row[m] < row[m - 1])]
    above = [m for m in levels if m > top][:4]
    below = [m for m in reversed(levels) if m <= top]
    if top < len(row) and np.isfinite(row[top]):
        below = [top] + [m for m in below if m != top]
    timed_out = False
    try:
        for m in above:
            attempt(m)
        for m in below[:64]:
            if best is not None and row[m] >= best[1].cost - 1e-12:
                break
            ok, _ = attempt(m)
            if ok:
                break
    except OutOfTime:
        timed_out = True
    return best, tried, best_peak, timed_out
