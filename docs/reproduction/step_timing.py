"""Training-step time of the CPU-scale family, measured interleaved so that every preset sees the
same machine load: python docs/reproduction/step_timing.py [--rounds 5] [--steps 4]

One thread; per round, each preset (in a rotating order) runs ``--steps`` timed AdamW steps
(forward with XL memory, backward, optimizer) on random byte ids at the reproduction's shapes
(batch 16 x 128 tokens) after one untimed step. Prints, per preset, the median over rounds of
the wall and process-CPU seconds per step and both relative to repro-dense, as JSON and a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from moeify.models.repro_presets import REPRO_PRESETS
from moeify.models.presets import get_preset


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=16)
    args = p.parse_args()
    torch.set_num_threads(1)
    names = list(REPRO_PRESETS)
    state = {}
    for i, name in enumerate(names):
        torch.manual_seed(i)
        cfg = get_preset(name)
        model = cfg.build()
        state[name] = (cfg, model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    wall = {n: [] for n in names}
    cpu = {n: [] for n in names}

    def step(name, memory):
        cfg, model, opt = state[name]
        ids = torch.randint(0, cfg.vocab_size, (args.batch, cfg.context_length + 1))
        out = model(ids[:, :-1], ids[:, 1:], memory=memory)
        out.total_loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.memory

    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            memory = step(name, None)
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(args.steps):
                memory = step(name, memory)
            wall[name].append((time.perf_counter() - t0) / args.steps)
            cpu[name].append((time.process_time() - c0) / args.steps)
    base_w = statistics.median(wall["repro-dense"])
    base_c = statistics.median(cpu["repro-dense"])
    rows = {n: {"wall_s_per_step": statistics.median(wall[n]),
                "cpu_s_per_step": statistics.median(cpu[n]),
                "wall_vs_dense": statistics.median(wall[n]) / base_w,
                "cpu_vs_dense": statistics.median(cpu[n]) / base_c} for n in names}
    print(json.dumps(rows, indent=2))
    print(f"{'preset':<18} {'wall s/step':>12} {'x dense':>8} {'CPU s/step':>11} {'x dense':>8}")
    for n, r in rows.items():
        print(f"{n:<18} {r['wall_s_per_step']:>12.3f} {r['wall_vs_dense']:>8.2f} "
              f"{r['cpu_s_per_step']:>11.3f} {r['cpu_vs_dense']:>8.2f}")


if __name__ == "__main__":
    main()
