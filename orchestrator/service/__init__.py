"""The cluster's service above the runs: the allocator and its policy, demand and resize costs, the queue,
quotas, Ray's drains, authorization and the allocator's metrics."""
