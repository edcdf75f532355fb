"""The training process: config, model, data, parallel layouts and the step loop.

It never imports Ray or the orchestrator: the same code runs under ``torchrun``
(``python -m trainer``), inside an orchestrator actor, or in a test harness.

    config/     the run's dataclasses; load: TOML + --set -> RunConfig
    models/     a spec per model family (decoder/, hf/, names/: a folder per family)
    data/       the corpus and global sample order, data formats, tokenizers, the token cache
    parallel/   the layout (dims), valid sizes; parallelize: pipeline, TP, CP, EP, AC, FSDP
    zero/       ZeRO 0-2 and the FSDP-backed stage 3, offload
    plan/       ``etrain plan``: memory and communication accounting, the search
    observe/    telemetry, device memory, the Prometheus exporter, trackers
    export/     ``etrain ckpt export`` and ``[checkpoint] export_every``
    world       this process, its group      loop        Trainer (one step), run_steps, save_due
    generate    ``etrain generate``          heap        the garbage collector in a long run
    compat      the torch versions           cli         ``python -m trainer``
"""
