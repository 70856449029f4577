"""remat.solver: schedules of a training step under a memory budget.

The algorithms see only a :class:`graphs.ComputeGraph` (pure graph math);
:func:`solver.optimize` is the one place that joins them with torch.
"""

from solver.errors import InfeasibleBudget, NoScheduleFound, RematError, SolverError
from solver.feasibility import peak_lower_bound
from solver.registry import MethodInfo, get_method, methods, register, solve
from solver.schedule import Action, Offload, Schedule, TensorDecision
from solver.simulate import SimulationResult, simulate

__all__ = [
    "Action",
    "InfeasibleBudget",
    "MethodInfo",
    "NoScheduleFound",
    "Offload",
    "RematError",
    "Schedule",
    "SimulationResult",
    "SolverError",
    "TensorDecision",
    "get_method",
    "methods",
    "peak_lower_bound",
    "register",
    "simulate",
    "solve",
]
