"""History lives in git, not in the tree: no numbered work periods, issue numbers, per-call notes of GPU runs or
review labels in the library, tests, docs, scripts, benchmarks, examples or the README (the pattern below is the one
the project's acceptance criteria grep for; its character classes keep this file from matching itself)."""

import re
import subprocess

from tests import ROOT

PATTERN = r"se[s]sion ?[0-9]|issue ?#?[0-9]|dev[i]ce call|he[l]per-?[0-9]|break-i[t]"
PLACES = ("tritonep", "tests", "docs", "scripts", "benchmarks", "README.md", "examples")


def _tracked_files():
    try:
        out = subprocess.run(["git", "ls-files", "--", *PLACES], cwd=ROOT, capture_output=True, text=True,
                             timeout=60, check=True).stdout.split()
        return [ROOT / p for p in out]
    except (OSError, subprocess.SubprocessError):  # no git (an unpacked archive): every file under the places
        files = []
        for p in PLACES:
            path = ROOT / p
            files += [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
        return files


def test_no_history_words_in_the_tree():
    rx = re.compile(PATTERN, re.I)
    hits = []
    for path in _tracked_files():
        if not path.is_file() or path.suffix in (".png", ".whl"):
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        hits += [f"{path.relative_to(ROOT)}:{i}: {ln.strip()[:100]}" for i, ln in enumerate(text.splitlines(), 1)
                 if rx.search(ln)]
    assert not hits, f"{len(hits)} lines name the work's history (git keeps it):\n" + "\n".join(hits[:40])


def test_the_pattern_finds_what_it_must():
    rx = re.compile(PATTERN, re.I)
    s, i, d, h, b = "ses" + "sion", "iss" + "ue", "dev" + "ice", "hel" + "per", "break" + "-it"
    for text in (f"{s} 14", f"{s.title()}12", f"{i} 24", f"{i} #7", f"{d} call 3", f"{h}-3", f"{b} review"):
        assert rx.search(text), text
    assert not rx.search("the sessions of users; issues of torch; a helper function")
