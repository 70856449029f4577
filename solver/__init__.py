"""remat.solver: schedules of a training step under a memory budget.

The algorithms see only a :class:`graphs.ComputeGraph` (pure graph math);
:func:`solver.optimize` is the one place that joins them with torch.
"""

# the method package first: importing it later would rebind ``solver.methods`` (the
# function below) to the package
import solver.methods as _method_package  # noqa: F401  (registers every method)
from solver.errors import BudgetNotReached, InfeasibleBudget, NoScheduleFound, OptionError, RematError, SolverError
from solver.feasibility import peak_lower_bound
from solver.registry import MethodInfo, register
from solver.solving import get_method, methods, solve
from solver.schedule import Action, Offload, Schedule, TensorDecision
from solver.simulate import SimulationResult, simulate
from solver.analytic import TransformerConfig
from solver.estimate import Estimate, estimate
from solver.policy import LayerAction, LayerPolicy, policy


def __getattr__(name):
    # optimize/verify join the solvers with torch (the package solver.join): imported on
    # first use, so that ``import solver`` stays free of torch
    if name in ("optimize", "verify", "Report", "optimizer_state_bytes"):
        import importlib

        return getattr(importlib.import_module("solver.join.optimize_model"), name)
    raise AttributeError(f"module 'solver' has no attribute {name!r}")

__all__ = [
    "Action",
    "BudgetNotReached",
    "Estimate",
    "LayerAction",
    "LayerPolicy",
    "Report",
    "TransformerConfig",
    "estimate",
    "optimize",
    "policy",
    "verify",
    "InfeasibleBudget",
    "MethodInfo",
    "NoScheduleFound",
    "Offload",
    "OptionError",
    "RematError",
    "Schedule",
    "SimulationResult",
    "SolverError",
    "TensorDecision",
    "get_method",
    "methods",
    "optimizer_state_bytes",
    "peak_lower_bound",
    "register",
    "simulate",
    "solve",
]
