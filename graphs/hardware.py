"""Hardware specs: what a roofline time estimate and an offload bandwidth model need."""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["Hardware", "PRESETS", "get_hardware"]


@dataclass(frozen=True)
class Hardware:
    """A device and its host link.

    Attributes
    ----------
    name : str
    peak_flops : float
        Dense FLOP/s that a matmul reaches (not the datasheet's sparse figure).
    mem_bandwidth : float
        Device memory bytes/s.
    host_bandwidth : float
        Host link bytes/s in each direction (offload and prefetch run concurrently).
    memory_bytes : int
        Device memory.

    Examples
    --------
    >>> get_hardware("h100-pcie5").host_bandwidth > get_hardware("a100-pcie4").host_bandwidth
    True
    """

    name: str
    peak_flops: float
    mem_bandwidth: float
    host_bandwidth: float
    memory_bytes: int

    def with_(self, **changes) -> "Hardware":
        return replace(self, **changes)

    def roofline_seconds(self, flops: float, bytes_moved: float) -> float:
        """Time of an op that does ``flops`` and moves ``bytes_moved`` bytes."""
        return max(flops / self.peak_flops, bytes_moved / self.mem_bandwidth)


GB = 1e9
# Effective figures (what kernels and copies reach), not datasheet peaks.
PRESETS: dict[str, Hardware] = {
    "a100-pcie4": Hardware("a100-pcie4", 250e12, 1.6e12, 25 * GB, 80 * 1024**3),
    "h100-pcie5": Hardware("h100-pcie5", 600e12, 2.8e12, 50 * GB, 80 * 1024**3),
    "h100-sxm-pcie5": Hardware("h100-sxm-pcie5", 750e12, 3.0e12, 50 * GB, 80 * 1024**3),
    "gh200-nvlink-c2c": Hardware("gh200-nvlink-c2c", 750e12, 3.6e12, 400 * GB, 96 * 1024**3),
    "h200-pcie5": Hardware("h200-pcie5", 750e12, 4.2e12, 50 * GB, 141 * 1024**3),
    "cpu": Hardware("cpu", 50e9, 20 * GB, 20 * GB, 16 * 1024**3),
}
PRESETS["pcie4"] = PRESETS["a100-pcie4"]
PRESETS["pcie5"] = PRESETS["h100-pcie5"]
PRESETS["nvlink-c2c"] = PRESETS["gh200-nvlink-c2c"]


def get_hardware(spec: "str | Hardware") -> Hardware:
    """A preset by name (``pcie4``, ``pcie5``, ``nvlink-c2c``, ``cpu``, ...) or the spec itself."""
    if isinstance(spec, Hardware):
        return spec
    try:
        return PRESETS[spec]
    except KeyError:
        raise ValueError(f"unknown hardware {spec!r}; choose one of {', '.join(sorted(PRESETS))} "
                         "or pass a graphs.Hardware") from None
