"""Steps per second and peak resident memory with AdamW's state on NVMe (``parallel.offload="nvme"``) against
keeping it in memory, and how much of the swapper's I/O the step hides.

    python bench/offload.py [--quick] [--dir /local/nvme/tmp] [--buffer-mb 16] [--steps 5]

One process (world 1, the case ZeRO-Offload was made for), fp32 on the CPU, the small preset (25.6M
parameters, 205 MB of AdamW state; ``--quick``: two of its blocks, 6.6M parameters, 53 MB). Each
setting trains in a fresh process (``tests.offload_jobs:peak_rss``), so its peak resident set
(``VmHWM``) is its own: one warm-up step, then ``--steps`` timed ones. For offload="nvme": the
bytes the swapper moved per step, the seconds the step waited on them (``wait_s``: reads not
ready when their unit came up, and the last write-backs) against the seconds the reader and writer
threads spent (``io_s``), and ``overlap`` = 1 - wait_s / io_s (the share of the I/O hidden behind
the update). offload="cpu" is FSDP2's (ZeRO-3 with a data-parallel size > 1) and has no world-1
form: it is reported as not applicable. The offload files go to ``--dir`` (default: a temporary
directory under /tmp; on a machine with spare memory, much of it stays in the page cache). The
last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.harness import run_ranks  # noqa: E402

MB = 2**20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="two blocks of the small preset, 3 steps (about 30 s)")
    ap.add_argument("--dir", default="", help="parallel.offload_dir (default: a temporary directory)")
    ap.add_argument("--buffer-mb", type=float, default=16.0, help="parallel.offload_buffer_mb")
    ap.add_argument("--steps", type=int, default=0, help="timed steps (default 5; --quick 3)")
    args = ap.parse_args()
    steps = args.steps or (3 if args.quick else 5)
    base = ['model.preset="small"', "data.max_bytes=300000", "data.seq_len=64", "train.global_batch=4",
            "train.micro_batch=2", "train.warmup_steps=0", *(["model.n_layers=2"] if args.quick else [])]
    with tempfile.TemporaryDirectory(prefix="etrain-offload-", dir=args.dir or None) as where:
        settings = {"none": [], "nvme": ['parallel.offload="nvme"', f'parallel.offload_dir="{where}"',
                                         f"parallel.offload_buffer_mb={args.buffer_mb}"]}
        out = {}
        for name, layout in settings.items():
            r = run_ranks("tests.offload_jobs:peak_rss", 1, {"base": base, "layout": layout, "steps": steps},
                          fresh=True, timeout=900)[0]
            out[name] = {"steps_per_s": round(r["steps_per_s"], 3), "peak_rss_bytes": r["peak_rss"],
                         "state_bytes": r["state_bytes"], "losses": r["losses"]}
            if r["swap"]:
                s, n = r["swap"], steps + 1  # the warm-up step swapped too
                out[name].update(buffer_bytes=s["buffer_bytes"], units=s["units"],
                                 bytes_per_step=(s["read_bytes"] + s["written_bytes"]) // n,
                                 wait_s_per_step=round(s["wait_s"] / n, 4), io_s_per_step=round(s["io_s"] / n, 4),
                                 swap_s_per_step=round(s["swap_s"] / n, 4),
                                 overlap=round(1 - s["wait_s"] / s["io_s"], 3) if s["io_s"] else None)
    none, nvme = out["none"], out["nvme"]
    saved = none["peak_rss_bytes"] - nvme["peak_rss_bytes"]
    print(f"{'setting':8} {'steps/s':>8} {'peak RSS MiB':>13} {'state MiB':>10}")
    for name, r in out.items():
        print(f"{name:8} {r['steps_per_s']:8.3f} {r['peak_rss_bytes'] / MB:13.1f} {r['state_bytes'] / MB:10.1f}")
    print("cpu      not applicable at world 1 (FSDP2's offload: ZeRO-3, data-parallel size > 1)")
    print(f"nvme: peak RSS {saved / MB:.1f} MiB lower ({saved / none['state_bytes']:.2f}x the state), "
          f"{nvme['steps_per_s'] / none['steps_per_s']:.2f}x the steps/s; per step {nvme['bytes_per_step'] / MB:.1f} "
          f"MiB moved, waited {nvme['wait_s_per_step'] * 1e3:.1f} ms of {nvme['io_s_per_step'] * 1e3:.1f} ms I/O "
          f"(overlap {nvme['overlap']}); losses equal: {none['losses'] == nvme['losses']}")
    print(json.dumps({"bench": "offload", "quick": args.quick, "world": 1, "steps": steps,
                      "buffer_mb": args.buffer_mb, **out, "cpu": "not applicable at world 1",
                      "rss_saved_bytes": saved, "rss_saved_over_state": round(saved / none["state_bytes"], 3),
                      "speed_ratio": round(nvme["steps_per_s"] / none["steps_per_s"], 3),
                      "losses_equal": none["losses"] == nvme["losses"]}))


if __name__ == "__main__":
    main()
