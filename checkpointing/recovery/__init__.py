"""The memory recovery tier: every rank's training state in host memory, its own and copies in its peers',
restored by recoveries and resizes before the durable checkpoint is (docs/operations.md#recovery-tiers).

One module per concept:

- ``snapshot``: one rank's snapshot of a step (the standard-DCP files of that step), its wire format
  and which peers hold copies of it;
- ``tier``: :class:`~checkpointing.recovery.tier.MemoryTier`, taking, agreeing and holding snapshots;
  ``results``: what became of a snapshot and of its copies;
- ``replay``: a snapshot's files laid out again by the last layout, without DCP (the per-step path), and
  the host copy's buffers placed where those files put each tensor (snapshots in place);
- ``local_copy``: the memory files a rank's snapshots are written into, mapped by peers on the same host;
- ``transport``: how a held snapshot moves (:class:`~checkpointing.recovery.transport.SnapshotTransport`):
  pushed to peers while training (``PeerCopyTransport``), fetched from holders on restore
  (``orchestrator.workers.tier_fetch.RayFetchTransport``);
- ``peer_copy``: the copies to peers, over a gloo group of the tier's own;
- ``held``: what a worker keeps of the tier across its process groups, and what it answers a restore;
- ``restore``: the plan of a restore (which holder gives each file of which snapshot) and the load;
- ``budget``: how many host bytes one rank's tier may hold.

The host copy of the state and the DCP layout planned for it are shared with the durable checkpoint
(:mod:`checkpointing.host_copy`); a restore reads through the durable reader and load planner
(:mod:`checkpointing.dcp.reader`), so it reshards exactly as a restore from storage does.
"""
