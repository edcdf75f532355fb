"""Which device a Ray worker actor trains on."""

from __future__ import annotations

import os

import ray

from trainer.world import visible_device_index


def ray_device_index() -> int:
    """This actor's GPU as a local device index: 0 where Ray narrowed ``CUDA_VISIBLE_DEVICES`` to the GPU it
    assigned (its default), else that GPU's place among the visible ones (Ray leaves them as they are when
    ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES`` is "1" or "true", as Ray reads it); 0 without a GPU."""
    ids = ray.get_gpu_ids() if ray.is_initialized() else []
    if not ids or os.environ.get("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES", "").lower() not in ("1", "true"):
        return 0
    return visible_device_index(str(ids[0]), os.environ.get("CUDA_VISIBLE_DEVICES"))
