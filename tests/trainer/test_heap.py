"""trainer.heap: what boot made is exempt from garbage collection; what comes later is still collected;
thawed, everything is collectable again."""

import subprocess
import sys

from tests.harness import ROOT

PROBE = """
import gc, weakref
import torch, torch.distributed.checkpoint  # what a worker imports at boot
from trainer.heap import freeze_boot_heap, thaw_heap

before = gc.get_freeze_count()
freeze_boot_heap()
frozen = gc.get_freeze_count()

class Node:
    pass

a, b = Node(), Node()
a.other, b.other = b, a  # a cycle made after the freeze: only the collector frees it
gone = weakref.ref(a)
del a, b
gc.collect()
thaw_heap()
print(before, frozen, gone() is None, gc.get_freeze_count())
"""


def test_boot_objects_are_frozen_and_later_cycles_still_collected():
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    before, frozen, collected, thawed = out.stdout.split()
    assert int(before) == 0 and int(frozen) > 50_000, out.stdout  # torch alone: well over 100,000 objects
    assert collected == "True" and int(thawed) == 0
