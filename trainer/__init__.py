"""The training process: config, model, data, parallel layouts and the step loop.

It never imports Ray: the same code runs under ``torchrun`` (``python -m
trainer``), inside an orchestrator actor, or in a test harness.
"""
