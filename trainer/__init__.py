"""The training process: config, model, data, parallel layouts and the step loop.

It never imports Ray or the orchestrator: the same code runs under ``torchrun``
(``python -m trainer``), inside an orchestrator actor, or in a test harness.

    config          the run's dataclasses        config_load     TOML + --set -> RunConfig
    models          a spec per model family      data            corpus and global sample order
    parallel/       the layout (dims), valid sizes; parallelize: pipeline, TP, AC, FSDP
    zero           ZeRO 0-2 and FSDP optimizer  memory          predicted bytes per rank
    world           this process, its group      loop            Trainer (one step), save_due
    telemetry       comm and step measurements   metrics         the Prometheus exporter
    metrics_endpoint  its HTTP endpoint          launcher_metrics  rank 0's metrics under torchrun
    cli             ``python -m trainer``
"""
