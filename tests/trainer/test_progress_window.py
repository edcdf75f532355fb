"""`etrain train`'s progress line: its tokens/s and steps/s are rates over one window, the steps since the
line before, measured with a clock the test moves."""

from __future__ import annotations

from trainer.cli import Throughput, format_step
from trainer.loop import StepStats


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def stats(step: int, tokens_per_s: float = 38.0, step_seconds: float = 0.5) -> StepStats:
    return StepStats(step=step, loss=3.0, lr=1e-3, grad_norm=1.0, tokens_per_s=tokens_per_s,
                     step_seconds=step_seconds, data_seconds=0.0, world_size=2, samples_consumed=0)


def test_steps_and_tokens_per_second_are_of_the_same_window():
    clock = FakeClock()
    window = Throughput(tokens_per_step=1000, clock=clock)
    window.start(1)
    clock.now += 9.0  # steps 2..10 at 1 step/s
    assert window.rates(10) == (1.0, 1000.0)
    clock.now += 2.5  # then 10 steps in 2.5 s: the window is these steps only, not the mean since the start
    steps, tokens = window.rates(20)
    assert steps == 4.0 and tokens == 4000.0
    line = format_step(stats(20, tokens_per_s=99_000.0), 200, steps, tokens)
    assert "| 4.00k tok/s | 4.00 steps/s |" in line, line  # not the last step's 99k tok/s
    assert line.endswith("ETA 45.0 s")


def test_no_time_in_the_window_gives_no_rate():
    clock = FakeClock()
    window = Throughput(tokens_per_step=10, clock=clock)
    window.start(5)
    assert window.rates(5) == (None, None)
    # Without a window (the first line) both rates are the step's own: 1 / 0.5 s and its tokens/s.
    assert "| 38 tok/s | 2.00 steps/s |" in format_step(stats(1), 20, None, None)
