"""The README's examples run and check themselves: the "Use" snippet (its own lines, on small shapes), the CPU EPBuffer
example, and examples/torchrun_moe.py (its ``main(group)`` in a 2-rank CPU world); docs/integrations.md quotes the
torchrun script as it is."""

import os
import re
import subprocess
import sys

import pytest
import torch

from tests import ROOT, load_script

README = (ROOT / "README.md").read_text()
EXAMPLE = ROOT / "examples" / "torchrun_moe.py"


def _python_blocks():
    return re.findall(r"```python\n(.*?)```", README, flags=re.S)


def _load_example():
    return load_script(str(EXAMPLE.relative_to(ROOT)))


_SMALL_BUFFER = "tep.EPBuffer(group, num_experts=8, hidden=64, max_tokens_per_rank=16, topk=2)"


def _use_block_small() -> str:
    """The README "Use" block as it is, on small shapes (its ``EPBuffer(...)`` arguments replaced) and without its
    ``buf.close()`` (the test reads the buffer's rows, then closes it)."""
    block = next(b for b in _python_blocks() if "buf.expert_out_buffer(" in b and "run_cpu_world" not in b)
    assert not any(line.strip() == "..." for line in block.splitlines()), "the Use snippet elides a step"
    assert block.count("torch._grouped_mm(") == 2, "the Use snippet's expert FFN is two grouped GEMMs"
    block, n = re.subn(r"tep\.EPBuffer\(group, [^)]*\)", _SMALL_BUFFER, block)
    assert n == 1, "the Use snippet builds one EPBuffer(group, ...)"
    return block.replace("buf.close()", "")


def _use_rank(group, block):
    """Run the README "Use" block on one rank (E = 8 experts over 2 ranks, H = 64, F = 32, local expert 1 of each rank
    routed to by nobody: an empty segment), then check its grouped GEMMs against a per-expert loop over the segments
    of ``out.expert_offsets``, its ``y`` against a dense per-token oracle, and that gradients reach x, w1, w2."""
    import torch.nn.functional as F

    num_local, hidden, ffn = 4, 64, 32
    gen = torch.Generator().manual_seed(0)  # every rank draws every expert's weights alike, then keeps its own
    w1_all = (torch.randn(8, hidden, ffn, generator=gen) / 8).bfloat16()
    w2_all = (torch.randn(8, ffn, hidden, generator=gen) / 8).bfloat16()
    torch.manual_seed(1 + group.rank())
    x = torch.randn(16, hidden).bfloat16().requires_grad_()
    topk_idx = torch.tensor([0, 2, 3, 4, 6, 7])[torch.randint(0, 6, (16, 2))]  # experts 1 and 5: no routes
    topk_idx[3, 1] = -1
    topk_weights = torch.rand(16, 2)
    mine = slice(group.rank() * num_local, (group.rank() + 1) * num_local)
    w1 = w1_all[mine].clone().requires_grad_()
    w2 = w2_all[mine].clone().requires_grad_()
    ns = dict(group=group, x=x, topk_idx=topk_idx, topk_weights=topk_weights, w1=w1, w2=w2)
    exec(compile(block, "README.md (Use)", "exec"), ns)
    out, buf = ns["out"], ns["buf"]
    try:
        ends = out.expert_offsets.tolist()
        rows = out.x.shape[0]
        assert rows == ends[-1] and ends[1] == ends[0], (rows, ends)  # local expert 1: an empty segment
        loop, s = [], 0
        for j, e in enumerate(ends):  # per-expert loop over the segments [ends[j-1] (or 0), ends[j])
            loop.append(F.silu(out.x[s:e] @ w1[j]) @ w2[j])
            s = e
        torch.testing.assert_close(ns["y_rows"].detach(), torch.cat(loop).detach())
        y = ns["y"]
        y.float().sum().backward()
    finally:
        buf.close()
    return y.detach(), x.grad, w1.grad, w2.grad, topk_idx, topk_weights, x.detach()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU world path (GPU: torchrun on the device machine)")
def test_readme_use_snippet_grouped_gemm_runs_and_matches_a_loop():
    """The README "Use" lines themselves (dispatch, the two ``torch._grouped_mm`` over ``out.expert_offsets``, the copy
    into the combine region, combine) on 2 CPU ranks: each rank's expert rows equal a per-expert loop, ``y`` equals
    ``sum_k w[t, k] * silu(x[t] @ W1[e]) @ W2[e]`` (bf16 GEMMs: 3e-2 of the largest magnitude), and the backward reaches
    x, w1 and w2."""
    import torch.nn.functional as F

    from tritonep.testing import run_cpu_world

    res = run_cpu_world(2, _use_rank, _use_block_small())
    gen = torch.Generator().manual_seed(0)
    w1_all = (torch.randn(8, 64, 32, generator=gen) / 8).bfloat16().float()
    w2_all = (torch.randn(8, 32, 64, generator=gen) / 8).bfloat16().float()
    for y, gx, gw1, gw2, idx, wts, x in res:
        ref = torch.zeros(y.shape)
        for t in range(idx.shape[0]):
            for k in range(idx.shape[1]):
                e = int(idx[t, k])
                if e >= 0:
                    ref[t] += wts[t, k] * (F.silu(x[t].float() @ w1_all[e]) @ w2_all[e])
        tol = 3e-2 * ref.abs().max().item()
        torch.testing.assert_close(y.float(), ref, rtol=0, atol=tol)
        for g in (gx, gw1, gw2):
            assert g is not None and torch.isfinite(g.float()).all() and g.float().abs().sum() > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU world path (GPU: torchrun on the device machine)")
def test_torchrun_example_main_in_a_cpu_world():
    from tritonep.testing import run_cpu_world

    res = run_cpu_world(2, _load_example().main)  # main asserts its own checks; a failing rank raises RankError
    assert len(res) == 2
    for r in res:
        assert r["dispatch_err"] < 2e-2 and r["moe_err"] < 3e-2 and r["grad_x_norm"] > 0


def test_integrations_doc_quotes_the_torchrun_example_as_it_is():
    doc = (ROOT / "docs" / "integrations.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", doc, flags=re.S) if "def main(group" in b)
    src = EXAMPLE.read_text().splitlines()
    pos = 0
    for line in block.splitlines():
        if line.strip() in ("", "..."):
            continue  # elisions
        try:
            pos = src.index(line, pos) + 1  # every quoted line is in the script, in order
        except ValueError:
            pytest.fail(f"docs/integrations.md line not in {EXAMPLE.name} (in this order): {line!r}")
    assert "torchrun --nproc-per-node 2 examples/torchrun_moe.py" in doc
    assert "torchrun --nproc-per-node 2 examples/torchrun_moe.py" in README


def test_readme_cpu_example_runs_and_checks_its_result(tmp_path):
    block = next(b for b in _python_blocks() if "run_cpu_world(2, rank_fn)" in b)
    assert "assert_close" in block  # the example checks, not only prints
    script = tmp_path / "readme_example.py"
    script.write_text(block)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "checked: [(16, 64), (16, 64)]" in p.stdout


def test_torchtitan_example_trains_in_a_cpu_world():
    """examples/torchtitan_moe.py: torchtitan's MoE layers with tritonep's dispatcher, 4 AdamW steps on 2 CPU ranks;
    main() asserts the loss falls; every rank sees the same all-reduced loss."""
    if os.environ.get("CI"):
        import torchtitan  # noqa: F401  (installed by scripts/setup.sh: never skipped in CI)
    else:
        pytest.importorskip("torchtitan")
    from tritonep.testing import run_cpu_world

    mod = load_script("examples/torchtitan_moe.py")
    losses = run_cpu_world(2, mod.main, timeout_s=400)
    assert losses[0] == losses[1] and losses[0][-1] < losses[0][0]


def test_deep_ep_doc_cpu_example_runs_and_checks_its_result(tmp_path):
    """docs/deep_ep.md's CPU example: DeepEP's normal-mode calls through ``tritonep.compat.deep_ep.install()`` on 2
    CPU ranks; the block checks its combine itself (each token back once per rank it went to) and prints per rank
    the received rows and the rows per local expert."""
    doc = (ROOT / "docs" / "deep_ep.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", doc, flags=re.S) if "run_cpu_world(2, rank_fn)" in b)
    assert "assert_close" in block and "install()" in block
    script = tmp_path / "deep_ep_example.py"
    script.write_text(block)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    got = eval(p.stdout.strip().splitlines()[-1])  # [((rows, H), [rows per local expert]), ...] of both ranks
    assert len(got) == 2
    for (rows, hidden), per_expert in got:
        assert hidden == 64 and len(per_expert) == 4 and 0 < rows <= 2 * 16 and rows <= sum(per_expert)
