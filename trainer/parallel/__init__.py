"""Parallelism: the layout as a value and one ordered way to apply it, a module per parallelism.

    dims        ParallelDims, Axis, Mesh: degrees, derived quantities, valid sizes (no model code)
    parallelize build_model_parts: pipeline cut, TP, CP, EP, AC, FSDP, in that order; ModelParts
    pipeline    the cut into stages and the schedule     tensor   TP from the model's spec; the LM loss
    ac          activation checkpointing                 fsdp     ZeRO-3 / HSDP (FSDP2)

This package imports nothing itself, so that ``import trainer.parallel.dims`` loads no model code.
"""
