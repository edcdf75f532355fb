"""What a training process measures and reports: collectives and memory (``telemetry``, ``gpu_timing``,
``device_memory``), the Prometheus exporter and its endpoint (``metrics``, ``endpoint``, ``launcher``) and
experiment trackers (``trackers``)."""
