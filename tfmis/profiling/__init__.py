"""Where training time goes: resource monitoring (GPU via NVML, else the process tree's CPU and RSS).

Imports only the standard library (pynvml and matplotlib when used), so it works without TensorFlow.
"""

from tfmis.profiling.monitor import (
    COLUMNS,
    ResourceMonitor,
    format_summary,
    monitor_command,
    plot_resources,
    read_resources,
)

__all__ = ["COLUMNS", "ResourceMonitor", "format_summary", "monitor_command", "plot_resources", "read_resources"]
