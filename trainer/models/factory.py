"""Models from a Python factory as a model family (``[model] source = "python"``).

    [model]
    source = "python"
    factory = "my_pkg.models:build"     # build(model_table) -> nn.Module; [model.args] holds its own knobs

The factory receives the whole ``[model]`` table and returns an ``nn.Module`` mapping token ids
``[batch, seq]`` to logits ``[batch, seq, vocab]`` (or an output with ``.logits``). Everything else
(blocks, TP plan, pipeline cuts, the preflight) is :mod:`.brought`'s; such a model has no
transformers config, so it exports as safetensors or torch files only.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from checkpointing.errors import ConfigError

from .brought import UserModelSpec
from .refs import resolve_ref


class FactorySpec(UserModelSpec):
    family = "python"
    runs_code = True  # model.factory, model.loss, model.tp_plan: imported and called

    def construct(self) -> nn.Module:
        mcfg = self.mcfg
        factory = resolve_ref(mcfg.factory, "model.factory")
        try:
            model = factory(dataclasses.asdict(mcfg))
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - the user's factory failed
            raise ConfigError(f"model.factory={mcfg.factory!r} raised {type(e).__name__}: {e}") from None
        if not isinstance(model, nn.Module):
            raise ConfigError(f"model.factory={mcfg.factory!r} returned {type(model).__name__}, not a torch.nn.Module")
        return model

    def what_model(self, model: nn.Module) -> str:
        return "a python factory's model"

    def inference_model(self, state: dict[str, torch.Tensor]) -> tuple[nn.Module, int]:
        model = resolve_ref(self.mcfg.factory, "model.factory")(dataclasses.asdict(self.mcfg))
        model.load_state_dict(state)
        return model, self.mcfg.max_seq_len

    def hf_config_json(self, tokenizer: str) -> dict:
        raise ConfigError("--format hf needs a built-in or a transformers model (model.source=\"python\" has no "
                          "transformers config); use --format safetensors or torch")
