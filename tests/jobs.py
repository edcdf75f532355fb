"""Functions that tests run inside real multi-process groups (see tests.harness)."""

from __future__ import annotations

import contextlib
import gc

import torch

from trainer.config.load import load_config
from trainer.data.corpus import load_corpus
from trainer.loop import Trainer
from trainer.world import World, forget_meshes, init_distributed, shutdown_distributed

CPU = torch.device("cpu")


def trainers(world: World, base: list[str], layouts: list):
    """For each ``(name, overrides, *rest)`` of ``layouts``, one after another on one corpus: (name,
    rest, a Trainer of ``base + overrides``)."""
    corpus = load_corpus(load_config(None, base).data)
    for name, overrides, *rest in layouts:
        # DTensor's caches would hand the previous layout's meshes (equal by shape and names) to
        # this one: right ranks, but collectives on old groups, which the meter cannot name.
        forget_meshes()
        yield name, rest, Trainer(load_config(None, base + overrides), world, corpus=corpus, device=CPU)
        gc.collect()


@contextlib.contextmanager
def metered_world():
    """This process's group formed (CPU, gloo) with the comm meter on; (world, meter) inside, the group shut
    down after."""
    from trainer.observe.telemetry import comm_meter

    meter = comm_meter()
    meter.enabled = True  # a python -m trainer run earlier in this pooled process may have turned it off
    world = World.from_env()
    init_distributed(world, CPU)
    try:
        yield world, meter
    finally:
        shutdown_distributed()


def train_layouts(payload: dict) -> dict:
    """Train each layout for a few steps in this world: per layout its losses, memory (measured and
    predicted) and the collectives of an average step after the first, by "kind/axis".

    A layout is ``(name, overrides)`` (``payload["steps"]`` steps) or ``(name, overrides, steps)``.
    With ``payload["params"]`` the trained parameters come back too (whole tensors: world 1 only)."""
    with metered_world() as (world, meter):
        out = {}
        for name, rest, trainer in trainers(world, payload["base"], payload["layouts"]):
            steps = rest[0] if rest else payload["steps"]
            meter.name_axes(trainer.mesh)
            losses = [trainer.train_step().loss]
            before = meter.snapshot()
            losses += [trainer.train_step().loss for _ in range(steps - 1)]
            out[name] = {"losses": losses, "memory": trainer.memory_measured,
                         "predicted": trainer.memory_predicted(), "comm": comm_per_step(meter, before, steps - 1)}
            if payload.get("params"):
                out[name]["params"] = {n: p.detach().clone() for n, p in trainer.parts.named_parameters()}
            del trainer
        return out


def comm_per_step(meter, before: list[dict], steps: int) -> dict[str, dict]:
    """The meter's figures since the snapshot ``before``, per step, keyed "kind/axis"."""
    if steps < 1:
        return {}
    prior = {(c["kind"], c["axis"]): c for c in before}
    out = {}
    for c in meter.snapshot():
        b = prior.get((c["kind"], c["axis"]), {"bytes": 0, "calls": 0, "seconds": 0.0, "bus_bytes": 0.0})
        if c["calls"] > b["calls"]:
            out[f"{c['kind']}/{c['axis']}"] = {k: (c[k] - b[k]) / steps for k in ("bytes", "calls", "seconds",
                                                                                  "bus_bytes")}
    return out


def comm_volume(payload: dict) -> dict:
    """Per-step collective bytes by (kind, axis) measured by the comm meter over a few steps, with
    the model's full parameter bytes and per-block bytes for the analytic FSDP volume."""
    from trainer.observe.telemetry import comm_meter

    meter = comm_meter()
    meter.reset()
    meter.enabled = True  # a python -m trainer run earlier in this pooled process may have turned it off
    world = World.from_env()
    init_distributed(world, CPU)
    try:
        cfg = load_config(None, payload["overrides"])
        trainer = Trainer(cfg, world, device=CPU)
        meter.name_axes(trainer.mesh)
        trainer.train_step()  # warm-up (lazy init)
        before = meter.snapshot()
        steps = payload["steps"]
        for _ in range(steps):
            trainer.train_step()
        out = comm_per_step(meter, before, steps)
        model = trainer.parts.modules[0]
        blocks = list(model.layers.values())
        full = lambda ps: sum(p.numel() * p.element_size() for p in ps)  # noqa: E731 (DTensor numel is global)
        return {"per_step": out, "param_bytes": full(model.parameters()),
                "block_bytes": [full(b.parameters()) for b in blocks]}
    finally:
        shutdown_distributed()


class LiveBytes:
    """A dispatch mode that counts the bytes of tensor storages created inside it while they live,
    and their peak: what a step allocates (activations, gradients, temporaries), on any device."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils.weak import WeakIdKeyDictionary

        self.live = self.peak = 0
        self._seen = WeakIdKeyDictionary()
        outer = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                outer._count(out)
                return out

        self._mode = _Mode()

    def _count(self, out) -> None:
        import weakref

        from torch.utils._pytree import tree_leaves

        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            if storage in self._seen:
                continue
            n = self._seen[storage] = storage.nbytes()
            self.live += n
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, n)

    def _free(self, n: int) -> None:
        self.live -= n

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)


def micro_batch_bytes(trainer) -> tuple[int, int]:
    """(bytes the forward of the first micro-batch of sample 0 leaves for backward, the peak over its forward
    and backward), counted by :class:`LiveBytes`."""
    inputs, targets = trainer.batcher.tokens(trainer.batcher.local_positions(0))
    mb = trainer.cfg.train.micro_batch
    with LiveBytes() as live:
        loss = trainer.parts.loss(trainer.parts.forward(inputs[:mb]), targets[:mb])
        held = live.live
        loss.backward()
    return held, live.peak


def ac_probe(payload: dict) -> dict:
    """Activation checkpointing per mode (world 1): the losses of a few steps, then one micro-batch's
    forward and backward with each block's attention counting its forward calls (a recomputed block
    runs twice), the bytes forward leaves held for backward, and the peak over both."""
    world = World.from_env()
    init_distributed(world, CPU)
    try:
        out = {}
        for name, _, trainer in trainers(world, payload["base"], payload["modes"]):
            losses = [trainer.train_step().loss for _ in range(payload["steps"])]
            layers = trainer.parts.modules[0].layers
            calls = dict.fromkeys(layers, 0)

            def count(name):
                return lambda *_: calls.__setitem__(name, calls[name] + 1)

            hooks = [block.attention.register_forward_hook(count(n)) for n, block in layers.items()]
            held, peak = micro_batch_bytes(trainer)
            for h in hooks:
                h.remove()
            out[name] = {"losses": losses, "calls": calls, "held": held, "peak": peak}
            del trainer
        return out
    finally:
        shutdown_distributed()


def deferred_draw(payload: dict) -> dict:
    """Per layout, a Trainer that drew its weights at build against one that left them undrawn
    (``draw_weights=False``) and drew them at its first step: whether the undrawn one's weights were zero
    until then, the largest difference of this rank's weights after ``initial_weights`` (optimizer view and
    module parameters), and both trainers' losses over ``payload["steps"]`` steps."""
    from trainer.zero.common import local_tensor

    def local(t):
        return local_tensor(t).detach().float().clone()

    def weights(tr):
        return ({k: local(t) for k, t in tr.optimizer.checkpoint_state()["model"].items()},
                {k: local(p) for m in tr.parts.modules for k, p in m.named_parameters()})

    def diff(a, b):
        assert a.keys() == b.keys()
        return max(float((a[k] - b[k]).abs().max()) if a[k].numel() else 0.0 for k in a)

    with metered_world() as (world, _):
        corpus = load_corpus(load_config(None, payload["base"]).data)
        out = {}
        for name, overrides in payload["layouts"]:
            cfg = load_config(None, payload["base"] + overrides)
            got = {}
            for draw in (True, False):
                forget_meshes()
                tr = Trainer(cfg, world, corpus=corpus, device=CPU, draw_weights=draw)
                if not draw:
                    state, params = weights(tr)
                    got["zero_before"] = all(not t.any() for t in (*state.values(), *params.values()))
                    tr.initial_weights()
                got[draw] = weights(tr)
                got[f"losses_{draw}"] = [tr.train_step().loss for _ in range(payload["steps"])]
                del tr
                gc.collect()
            out[name] = {"zero_before": got["zero_before"], "state_diff": diff(got[True][0], got[False][0]),
                         "param_diff": diff(got[True][1], got[False][1]),
                         "losses": (got["losses_True"], got["losses_False"])}
        return out


def reform_in_background(payload: dict) -> dict:
    """Two groups in a row on one rendezvous store, as a re-formed TrainWorker has them: the first (a world
    group and a subgroup, as the memory tier makes) left with ``shutdown_distributed(background=True)``, the
    second formed at once with the ranks swapped. Per epoch the all-reduced sums; whether the first
    epoch's group objects were freed in the end (weak references), and by the thread."""
    import datetime
    import weakref

    import torch.distributed as dist

    from trainer.world import join_freeing, listening_store

    world = World.from_env()
    timeout = datetime.timedelta(seconds=60)
    store = (listening_store(world.master_addr, world.master_port, timeout, world_size=world.size)
             if world.is_main else dist.TCPStore(world.master_addr, world.master_port, world.size, is_master=False,
                                                  timeout=timeout))
    sums, refs = [], []
    for epoch in (1, 2):
        rank = world.rank if epoch == 1 else world.size - 1 - world.rank
        init_distributed(World(rank=rank, size=world.size, master_addr=world.master_addr,
                               master_port=world.master_port), CPU,
                         store=dist.PrefixStore(f"epoch_{epoch}", store), timeout_s=60)
        sub = dist.new_group(list(range(world.size)), backend="gloo")
        t = torch.tensor([float(rank + 1), float(epoch)])
        dist.all_reduce(t)
        s = torch.tensor([float(rank)])
        dist.all_reduce(s, group=sub)
        sums.append([*t.tolist(), *s.tolist()])
        if epoch == 1:
            refs = [weakref.ref(dist.group.WORLD), weakref.ref(sub)]
        del sub
        shutdown_distributed(background=True)
        gc.collect()
    join_freeing(timeout=30)
    return {"sums": sums, "freed": [r() is None for r in refs]}
