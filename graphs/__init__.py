"""remat.graphs: capture a training step as a cost-annotated DAG, and rewrite it.

Everything torch-specific lives here: capture (torch.fx, ATen level), costs, the memory
tracker and the rewriter. The solver package sees only :class:`ComputeGraph`.
"""

from graphs.compute_graph import SCHEMA_VERSION, ComputeGraph
from graphs.errors import CaptureError, GraphFormatError, RematError

__all__ = ["ComputeGraph", "SCHEMA_VERSION", "CaptureError", "GraphFormatError", "RematError"]
