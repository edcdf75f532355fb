"""``etrain plan``: memory, communication and step time of every layout and every size a run can take.

    from trainer.plan.search import plan_size
    result = plan_size(cfg, 64, DEVICES["h100"])     # the fastest layout that fits, its runner-up, the losers

Modules, bottom up: :mod:`.shape` (the model as the planner sees it, counted on the meta device),
:mod:`.accounting` (per-rank bytes: the ZeRO paper's model states from :mod:`trainer.observe.device_memory`,
Korthikanti et al.'s activations, buffers, checkpoint staging, the recovery tier), :mod:`.comm`
(bytes per step by collective kind and mesh axis, the pipeline bubble), :mod:`.cost` (device
profiles and the step-time model), :mod:`.search` (enumeration, simulator-guided random search,
elastic sizes and resize cost), :mod:`.explain`, :mod:`.calibrate` and :mod:`.cli`. The command-line
module imports torch only after its arguments are parsed. docs/planning.md has the sources.
"""
