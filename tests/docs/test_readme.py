"""The README a newcomer reads: short, opening with what tritonep is, for whom and on which hardware; its two
commands as written; no commit hash or run date in it (history lives in git, figures come generated from the results
files: tests/bench/test_results_index.py); every local file it links exists; the validated-on table says what has
not run on several GPUs; the jargon of the code's internals is absent or explained."""

import re

from tests import ROOT

README = (ROOT / "README.md").read_text()


def test_readme_is_short_and_opens_with_what_whom_and_hardware():
    lines = README.splitlines()
    assert len(lines) <= 260, len(lines)
    head = " ".join(lines[:10]).lower()
    for word in ("mixture-of-experts", "dispatch", "for people who", "nvidia", "gpu", "cpu"):
        assert word in head, word


def test_readme_gives_the_two_commands_with_plain_times():
    for cmd in ("bash scripts/setup.sh && .venv/bin/tritonep run", "bash scripts/setup.sh && bash scripts/test.sh"):
        line = next(ln for ln in README.splitlines() if ln.startswith(cmd))
        assert re.search(r"\d+(\.\d+)?(-\d+(\.\d+)?)? min", line), line  # an expected time in minutes
        assert len(line) <= 120, line


def test_readme_has_no_commit_hash_or_date():
    hashes = [w for w in re.findall(r"\b[0-9a-f]{7,40}\b", README) if re.search(r"\d", w) and re.search(r"[a-f]", w)]
    assert not hashes, hashes
    assert not re.findall(r"\b20\d\d-\d\d-\d\d\b", README)


def test_readme_links_exist():
    links = re.findall(r"\]\(([^)#]+)\)", README)
    paths = [p for p in links if "://" not in p]
    assert paths, links
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, missing
    for name in re.findall(r"\b(docs/[a-z_-]+\.md)\b", README):
        assert name == "docs/deep_ep.md" or (ROOT / name).is_file(), name


def test_readme_says_what_has_not_run_on_several_gpus():
    sect = README[README.index("## Requirements and validated on"):README.index("## Install on a GPU machine")]
    assert "| configuration | what ran there | result |" in sect
    for row in ("CPU, 2 cores", "1 x H200, world 1", "2 ranks sharing it under MPS", "4 ranks", "2 x H200"):
        assert row in sect, row
    assert "Not run on 2 or more physical GPUs" in sect and ">= 1024 tokens per rank" in sect


def test_readme_avoids_internal_jargon():
    low = README.lower()
    for word in ("host protocol rule", "front door", "one-hop", "moonep", "twins"):
        assert word not in low, word
    if "num_worst_tokens" in README:
        assert "max_recv_tokens" in README[README.index("num_worst_tokens") - 300:][:600]
