"""remat.graphs: capture a training step as a cost-annotated DAG, and rewrite it.

Everything torch-specific lives here: capture (torch.fx, ATen level), costs, the memory
judge and tracker, and the rewriter. The solver package sees only :class:`ComputeGraph`; the
torch-dependent names below are imported on first use, so ``import graphs`` stays free
of torch.
"""

from graphs.compute_graph import BACKWARD_START, SCHEMA_VERSION, ComputeGraph
from graphs.errors import CaptureError, GraphFormatError, RematError
from graphs.hardware import Hardware, get_hardware

__all__ = [
    "ComputeGraph", "SCHEMA_VERSION", "BACKWARD_START", "CaptureError", "GraphFormatError", "RematError",
    "Hardware", "get_hardware", "capture", "AllocatorPeak", "MemoryTracker", "SavedTensorCounter", "measure_peak",
]

_LAZY = {
    "capture": "graphs.capture",
    "AllocatorPeak": "graphs.memory",
    "MemoryTracker": "graphs.memory",
    "SavedTensorCounter": "graphs.memory",
    "measure_peak": "graphs.memory",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'graphs' has no attribute {name!r}")
