"""One rank of a tests.harness run: call module:function(payload), pickle the result."""

import importlib
import pickle
import sys

import torch


def main() -> None:
    target, payload_path, out_path = sys.argv[1:4]
    torch.set_num_threads(1)
    module, _, name = target.partition(":")
    fn = getattr(importlib.import_module(module), name)
    with open(payload_path, "rb") as f:
        payload = pickle.load(f)
    result = fn(payload)
    with open(out_path, "wb") as f:
        pickle.dump(result, f)


if __name__ == "__main__":
    main()
