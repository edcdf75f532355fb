"""What ``parallel.offload="nvme"`` (trainer.zero.offload) moves off the device and the host, for the planner.

    mem = nvme_memory(cfg, dims, count)       # None without it; else the bytes on disk, in buffers, per step
    doc = nvme_doc(layout_doc, nvme_bw)       # for `etrain plan`: the bandwidth the step needs (--nvme-bw)

AdamW's exp_avg and exp_avg_sq (8 bytes per parameter of this rank's share; 12 with bf16's fp32 masters
under ``parallel.offload_params``) leave memory for a file;
the host keeps a pool of ``offload_buffer_mb`` (pinned on a GPU), and the update runs a unit at a time,
so the foreach AdamW's temporary is a unit's, not the whole share's. Every step reads and writes the
state once: ``16`` (``24``) bytes per parameter of the share. The swap runs during the optimizer step, so
what the update does not hide adds to the step: at most ``bytes / nvme_bw``.
"""

from __future__ import annotations

from ..config import RunConfig
from ..parallel.dims import ParallelDims

OVERHEAD = 0.10  # the share of the step the swap may add, for the bandwidth the plan reports as needed


def nvme_memory(cfg: RunConfig, dims: ParallelDims, count: int, mixed: bool) -> dict[str, int] | None:
    """``nvme_state`` (bytes in this rank's file), ``host_offload_buffers``, ``nvme_bytes_per_step`` (read +
    written) and ``offload_unit_params`` (parameters a unit updates at once); None unless offloading."""
    if cfg.parallel.offload != "nvme":
        return None
    from ..zero.offload import BUFFERS, unit_numel

    local = -(-count // dims.zero_shards)
    numel = unit_numel(cfg.parallel.offload_buffer_mb)
    regions = 3 if cfg.parallel.offload_params and mixed else 2  # exp_avg, exp_avg_sq[, the fp32 master]
    return {"nvme_state": 4 * regions * local, "host_offload_buffers": BUFFERS * numel * 4,
            "nvme_bytes_per_step": 8 * regions * local, "offload_unit_params": min(local, numel // regions)}


def nvme_doc(layout: dict | None, nvme_bw: float | None) -> dict | None:
    """For a costed layout (``Candidate.to_dict()``): its offload figures, the bandwidth that keeps the
    swap under :data:`OVERHEAD` of the step, and with ``nvme_bw`` the seconds it adds at most."""
    if not layout or "memory_bytes" not in layout or not layout["memory_bytes"].get("nvme_state"):
        return None
    mem, step_s = layout["memory_bytes"], layout["time"]["step_s"]
    moved = mem["nvme_bytes_per_step"]
    out = {"state_bytes": mem["nvme_state"], "buffer_bytes": mem["host_offload_buffers"], "bytes_per_step": moved,
           "needed_bw": moved / (OVERHEAD * step_s) if step_s > 0 else None}
    if nvme_bw:
        out.update(nvme_bw=nvme_bw, io_s=moved / nvme_bw, added_share=moved / nvme_bw / step_s if step_s > 0 else None)
    return out


def nvme_line(doc: dict) -> str:
    gib = 2**30
    line = (f"offload nvme: {doc['state_bytes'] / gib:.2f} GiB of AdamW state per rank on disk, "
            f"{doc['buffer_bytes'] / 2**20:.0f} MiB of host buffers; {doc['bytes_per_step'] / gib:.2f} GiB read + "
            f"written per step")
    if doc["needed_bw"]:
        line += f"; {doc['needed_bw'] / 1e9:.2f} GB/s keeps it under {OVERHEAD:.0%} of the step"
    if doc.get("nvme_bw"):
        line += (f"; at --nvme-bw {doc['nvme_bw'] / 1e9:.2f} GB/s it adds at most {doc['io_s'] * 1e3:.1f} ms "
                 f"({doc['added_share']:.0%})")
    return line
