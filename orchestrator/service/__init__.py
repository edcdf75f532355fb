"""The cluster's service above the runs: the allocator and its policy, demand and resize costs, the queue,
quotas, the cluster's capacity, Ray's drains, quarantined nodes (``quarantine``: the document, its bounds
and the set placement avoids; ``nodes``: the same on the live cluster, and ``etrain nodes``' rows),
authorization and the allocator's metrics."""
