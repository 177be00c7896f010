"""The docs as reference: every result file they keep is cited, every file or script they cite
exists, and they speak of the project, not of how it was made (no numbered sessions or runs)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "docs" / "benchmarks"
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# Plots a command writes beside its JSON: cited with the JSON.
PLOT_SUFFIXES = ("", "_anatomy", "_trees")
CITED_PATH = re.compile(r"\b((?:docs/benchmarks|scripts|deploy|tests)/[\w./-]+\.\w+)")
# "session 23", "run 11", "runs 11 and 12", "_s23" file names; not "runs 2,000 samples".
HISTORY = re.compile(r"\b[Ss]essions? \d+\b|\b[Rr]un \d+\b|\bruns \d+ (and|to) \d+\b|_s\d+\b")


def _text() -> str:
    return "\n".join(page.read_text() for page in PAGES)


def test_every_result_file_is_cited():
    text = _text()
    cited_stems = {Path(name).stem for name in re.findall(r"[\w-]+\.json", text)}

    def cited(path: Path) -> bool:
        if path.name in text:
            return True
        return path.suffix == ".png" and any(path.stem == stem + suffix for stem in cited_stems for suffix in PLOT_SUFFIXES)

    orphans = sorted(p.name for p in RESULTS.iterdir() if p.is_file() and not cited(p))
    assert not orphans, f"docs/benchmarks files no page cites (cite them or delete them): {orphans}"


def test_every_plot_is_shown():
    """A plot kept in docs/benchmarks is on a page, next to what it measured."""
    shown = set(re.findall(r"!\[[^\]]*\]\((?:docs/)?benchmarks/([\w.-]+\.png)\)", _text()))
    hidden = sorted(p.name for p in RESULTS.glob("*.png") if p.name not in shown)
    assert not hidden, f"plots no page shows (show them where their JSON is cited, or delete them): {hidden}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_cited_file_exists(page):
    missing = sorted({path for path in CITED_PATH.findall(page.read_text()) if not (REPO / path.rstrip(".")).exists()})
    assert not missing, f"{page.name} cites files the repository lacks: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_pages_speak_of_the_project_not_its_history(page):
    found = sorted({m.group(0) for m in HISTORY.finditer(page.read_text())})
    assert not found, f"{page.name} names work sessions or numbered runs (history lives in git): {found}"


def test_the_readme_stays_short():
    """What it is, the two commands, the architecture, the APIs, configuration, results; the rest in docs/."""
    assert len((REPO / "README.md").read_text().splitlines()) <= 250


YAML_BLOCK = re.compile(r"```yaml\n(.*?)```", re.S)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_the_config_examples_load(page, tmp_path):
    """Every YAML example a page shows is a config the code accepts (what a reader copies must
    work); the files it names (`*_file` keys) are made in a scratch directory first."""
    from specdec.serving.config import config_from_dict

    def with_files(node):
        if isinstance(node, dict):
            return {key: _scratch_file(tmp_path, value) if key.endswith("_file") else with_files(value) for key, value in node.items()}
        return node

    for block in YAML_BLOCK.findall(page.read_text()):
        config_from_dict(with_files(yaml.safe_load(block)))


def _scratch_file(directory: Path, name: str) -> str:
    path = directory / Path(name).name
    path.write_text("example-token\n")
    return str(path)


# deploy/*.yaml with a verifier section (serve.yaml is Ray Serve's config: tests/test_deploy_manifests.py)
SERVE_CONFIGS = [p for p in sorted((REPO / "deploy").glob("*.yaml")) if "verifier" in yaml.safe_load(p.read_text())]


@pytest.mark.parametrize("config", SERVE_CONFIGS, ids=lambda p: p.name)
def test_the_deploy_configs_load(config):
    """The configs `specdec serve --config` is pointed at (Serve's and KubeRay's manifests have their own tests)."""
    from specdec.serving.config import load_config

    load_config(str(config))


def test_the_serve_configs_are_found():
    assert {p.name for p in SERVE_CONFIGS} == {
        "qwen2.5-coder.yaml", "qwen2.5-coder-smollm2.yaml", "qwen2.5-coder-0.5b.yaml", "smollm2.yaml"
    }


def test_the_embedded_pair_config_is_the_built_in_default():
    """deploy/smollm2.yaml names what a server with no config serves (the tests' pair)."""
    from specdec.serving.config import config_from_dict, load_config

    named, default = load_config(str(REPO / "deploy" / "smollm2.yaml")), config_from_dict({})
    assert (named.verifier.model, named.drafter.model) == (default.verifier.model, default.drafter.model)
