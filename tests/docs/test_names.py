"""The README and docs/ name what the code has: recipe / geometry fields and benchmark profiles."""

import dataclasses
import re

from tests import ROOT

README = (ROOT / "README.md").read_text()


def _bullet(text: str, head: str) -> str:
    m = re.search(rf"^- \*{head}\*.*?(?=^- |^$)", text, flags=re.M | re.S)
    assert m, f"no '- *{head}*' bullet"
    return m.group(0)


def test_moe_doc_lists_exactly_the_recipe_and_geometry_fields():
    from tritonep.moe import MoEGeometry, MoERecipe

    doc = (ROOT / "docs" / "moe.md").read_text()
    for head, cls in (("Recipe", MoERecipe), ("Geometry", MoEGeometry)):
        named = set(re.findall(r"`([a-z_]+)`", _bullet(doc, head)))
        fields = {f.name for f in dataclasses.fields(cls)}
        assert fields <= named, f"{cls.__name__} fields missing from docs/moe.md: {fields - named}"
        other = {f.name for f in dataclasses.fields(MoEGeometry if cls is MoERecipe else MoERecipe)}
        assert not (named & other - fields), f"docs/moe.md puts {named & other - fields} under {head}"


def test_readme_lists_every_bench_profile():
    from tritonep.bench.profiles import PROFILES

    row = next(line for line in README.splitlines() if line.startswith("| `tritonep bench"))
    listed = set(re.findall(r"`([a-z0-9-]+)`", row))
    assert set(PROFILES) <= listed, f"profiles missing from the README's bench row: {set(PROFILES) - listed}"
