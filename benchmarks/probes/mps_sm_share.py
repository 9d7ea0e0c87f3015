"""Does a rank's random draw depend on the SM share it sees? Ranks sharing one GPU under MPS vs the parent process.

Each rank of a W-rank world on one GPU (time-sliced or under MPS) and the parent report the SM count torch sees
(``multi_processor_count``; MPS lowers it to the rank's share) and two checksums of a 2048 x 2048 draw of seed 7:
``torch.randn`` on a CUDA generator (ATen sizes its grid from the SM count) and
:func:`tritonep.moe.counter_rng.counter_normal` (a function of seed and index only), plus the expert weights of a
`tritonep run` layer (``MoELayer.init_expert_weights``), compared bit for bit with the parent's.

    python benchmarks/probes/mps_sm_share.py --world-size 2 --mps on --json out.json
"""

from __future__ import annotations

import argparse
import json

import torch


def _draws(device):
    from tritonep.moe import MoEGeometry, MoELayer
    from tritonep.moe.counter_rng import counter_normal

    g = torch.Generator(device=device).manual_seed(7)
    a = torch.randn(2048, 2048, generator=g, device=device)
    b = counter_normal(7, (2048, 2048), device=device)
    geo = MoEGeometry(hidden=2048, intermediate=1024, num_experts=64, topk=6, max_tokens_per_rank=1024)
    w1, w2 = MoELayer._expert_weights(geo, 1002, torch.bfloat16, [0, 1], device)
    return dict(sms=torch.cuda.get_device_properties(device).multi_processor_count,
                randn=a.cpu(), counter=b.cpu(), w1=w1.cpu(), w2=w2.cpu())


def rank_fn(group):
    return _draws(torch.device("cuda", torch.cuda.current_device()))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--mps", choices=["on", "off"], default="on")
    p.add_argument("--json", default="")
    a = p.parse_args()
    from tritonep.testing import run_gpu_world

    import mps_sm_share  # the ranks unpickle the rank function by module name (this folder is on their path)

    res = run_gpu_world(a.world_size, mps_sm_share.rank_fn, mps=a.mps == "on", timeout_s=240)
    ref = _draws(torch.device("cuda", 0))
    rows = []
    for r, d in enumerate(res):
        rows.append(dict(rank=r, sms=d["sms"], parent_sms=ref["sms"],
                         randn_equal=bool(torch.equal(d["randn"], ref["randn"])),
                         counter_equal=bool(torch.equal(d["counter"], ref["counter"])),
                         expert_weights_equal=bool(torch.equal(d["w1"], ref["w1"]) and torch.equal(d["w2"], ref["w2"]))))
        print(rows[-1], flush=True)
    out = dict(world=res.info.as_dict(), rows=rows)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    ok = all(r["counter_equal"] and r["expert_weights_equal"] for r in rows)
    print("verdict:", "counter draws and expert weights equal the parent's on every rank" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
