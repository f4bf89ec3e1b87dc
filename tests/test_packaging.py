"""Packaging: the wheel built from this repository installs one top-level package,
``tengrad_fx`` (the repository's ``zoo/`` as ``tengrad_fx.zoo``, the programs as
``tengrad_fx.cli``), every module of them, console scripts that point into it, and only
torch and numpy as core requirements; the core imports and steps without the optional
dependencies; installed code and tests never import the repository-only ``tools``; the
import graph of ``tengrad_fx``, ``tengrad_fx.zoo`` and ``tools`` has no cycle.
"""
from __future__ import annotations

import ast
import configparser
import email.message
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile

import pytest

from testing.import_graph import cycles, import_graph, imported_names, module_files
from testing.repo_tools import REPO

INSTALLED = {"tengrad_fx": "tengrad_fx", "tengrad_fx.zoo": "zoo"}
"""Dotted package -> its folder in the repository: what the wheel installs."""
REPO_ONLY = ("tools", "testing", "zoo")
"""Top-level names that exist only in a checkout (``zoo`` is installed as ``tengrad_fx.zoo``)."""
OPTIONAL = ("timm", "torchvision", "tqdm", "matplotlib")
KNOWN_CYCLES: list[set[str]] = []


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    """The wheel of a copy of the repository's build inputs and top-level packages
    (``pip wheel --no-deps --no-build-isolation``: setuptools from this environment, no
    network, no ``build/`` left in the checkout)."""
    if importlib.util.find_spec("pip") is None:
        pytest.skip("pip is not installed")
    if importlib.util.find_spec("setuptools") is None:
        pytest.skip("setuptools (the build backend; in the test extra) is not installed")
    src = tmp_path_factory.mktemp("src")
    for entry in sorted(os.listdir(REPO)):
        path = os.path.join(REPO, entry)
        if entry in ("pyproject.toml", "README.md", "setup.py", "setup.cfg", "MANIFEST.in", "LICENSE"):
            shutil.copy(path, src / entry)
        elif os.path.isfile(os.path.join(path, "__init__.py")):
            shutil.copytree(path, src / entry, symlinks=True, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                           "--no-index", "-q", "-w", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (whl,) = out.glob("tengrad_fx-*.whl")
    return zipfile.ZipFile(whl)


def _dist_info(whl: zipfile.ZipFile, name: str) -> str:
    (path,) = [n for n in whl.namelist() if n.split("/")[0].endswith(".dist-info") and n.endswith("/" + name)]
    return whl.read(path).decode()


def test_wheel_installs_only_tengrad_fx(wheel: zipfile.ZipFile) -> None:
    tops = {n.split("/")[0] for n in wheel.namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"tengrad_fx"}, sorted(tops)
    assert _dist_info(wheel, "top_level.txt").split() == ["tengrad_fx"]


def test_wheel_holds_every_module(wheel: zipfile.ZipFile) -> None:
    """Each module under ``tengrad_fx/`` and ``zoo/`` is in the wheel at its import path
    (``zoo/`` through the link ``tengrad_fx/zoo``), and nothing else."""
    expected = {m.replace(".", "/") + ("/__init__.py" if f.endswith("__init__.py") else ".py")
                for m, f in module_files(REPO, INSTALLED).items()}
    shipped = {n for n in wheel.namelist() if n.endswith(".py")}
    missing = sorted(expected - shipped)
    assert not missing, f"not in the wheel: {missing}"
    assert shipped == expected, sorted(shipped - expected)
    assert "tengrad_fx/py.typed" in wheel.namelist()


def test_console_scripts_point_into_tengrad_fx(wheel: zipfile.ZipFile) -> None:
    entry_points = configparser.ConfigParser()
    entry_points.read_string(_dist_info(wheel, "entry_points.txt"))
    scripts = dict(entry_points["console_scripts"])
    assert set(scripts) == {"tengrad-train", "tengrad-reproduce"}
    for script, target in scripts.items():
        module, _, func = target.partition(":")
        assert module.startswith("tengrad_fx."), (script, target)
        tree = ast.parse(wheel.read(module.replace(".", "/") + ".py"))
        assert func in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}, (script, target)


def _requirements(meta: email.message.Message) -> dict[str, set[str]]:
    """``{extra ("" for the core): names of the distributions it brings}``, an extra that
    names ``tengrad-fx[other]`` expanded to the other extra's."""
    direct: dict[str, set[str]] = {}
    for req in meta.get_all("Requires-Dist") or []:
        name, extras = re.match(r"([A-Za-z0-9._-]+)(?:\[([^]]*)\])?", req).groups()  # type: ignore[union-attr]
        name = name.lower().replace("_", "-")
        marker = re.search(r'extra\s*==\s*"([^"]+)"', req)
        entries = {f"[{e.strip()}]" for e in extras.split(",")} if name == "tengrad-fx" else {name}
        direct.setdefault(marker.group(1) if marker else "", set()).update(entries)

    def expand(extra: str) -> set[str]:
        out = set()
        for entry in direct.get(extra, set()):
            out |= expand(entry[1:-1]) if entry.startswith("[") else {entry}
        return out

    return {extra: expand(extra) for extra in direct}


def test_core_requirements_are_torch_and_numpy(wheel: zipfile.ZipFile) -> None:
    """The core needs torch and numpy only; ``plot`` (the README's install for
    ``tengrad-reproduce``) brings what the programs use; ``test`` what the tests use."""
    reqs = _requirements(email.message_from_string(_dist_info(wheel, "METADATA")))
    assert reqs[""] == {"torch", "numpy"}, reqs
    assert reqs["zoo"] >= {"timm", "torchvision"} and reqs["cli"] >= {"tqdm", "torchvision"}, reqs
    assert reqs["plot"] >= reqs["cli"] | {"matplotlib"}, reqs
    assert reqs["test"] >= reqs["zoo"] | reqs["plot"] | {"pytest", "hypothesis", "setuptools"}, reqs


def test_installed_code_and_tests_do_not_import_repository_only_packages() -> None:
    """``tengrad_fx`` and ``tengrad_fx.zoo`` import none of ``tools``, ``testing`` or the
    top-level ``zoo``; ``tests/`` and ``testing/`` import neither ``tools`` (tests of the
    tools go through ``testing.repo_tools``) nor ``zoo`` by its folder name."""
    bad = []
    for mod, path in module_files(REPO, INSTALLED).items():
        names = imported_names(mod, path)
        bad += [f"{os.path.relpath(path, REPO)}: {n}" for n in sorted(names) if n.split(".")[0] in REPO_ONLY]
    for folder in ("tests", "testing"):
        for mod, path in module_files(REPO, {folder: folder}).items():
            names = imported_names(mod, path)
            bad += [f"{os.path.relpath(path, REPO)}: {n}" for n in sorted(names) if n.split(".")[0] in ("tools", "zoo")]
    assert not bad, "\n".join(bad)


def test_import_graph_has_no_cycles() -> None:
    graph = import_graph(module_files(REPO, {**INSTALLED, "tools": "tools"}))
    assert len(graph) > 100 and "tengrad_fx.zoo.registry" in graph and "tools.bench" in graph
    found = [c for c in cycles(graph) if set(c) not in KNOWN_CYCLES]
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_core_imports_and_steps_without_optional_dependencies() -> None:
    """With timm, torchvision, tqdm and matplotlib made unimportable: ``tengrad_fx``, its
    zoo, CLI modules and counters import, a TENGraD step runs, and asking for what needs
    an extra raises an ImportError that names the extra."""
    script = textwrap.dedent(f"""
        import sys

        sys.modules.update(dict.fromkeys({OPTIONAL!r}))  # None: 'import x' raises ImportError
        import torch
        import torch.nn.functional as F
        import tengrad_fx, tengrad_fx.zoo, tengrad_fx.cli.train, tengrad_fx.cli.reproduce, tengrad_fx.utils

        torch.manual_seed(0)
        net = tengrad_fx.prepare(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2)))
        opt = tengrad_fx.TENGraD(net, lr=0.1, damping=0.1)
        x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
        before = [p.detach().clone() for p in net.parameters()]
        F.cross_entropy(net(x), y).backward()
        opt.step()
        assert all(not torch.equal(a, p) for a, p in zip(before, net.parameters()))
        tengrad_fx.zoo.get_model("3c1f")
        for call, extra in ((lambda: tengrad_fx.zoo.get_model("timm:resnet18"), "zoo"),
                            (lambda: tengrad_fx.cli._loop._progress(1, "x", True), "cli"),
                            (lambda: __import__("tengrad_fx.cli.plot"), "plot")):
            try:
                call()
            except ImportError as exc:
                assert f"pip install 'tengrad-fx[{{extra}}]'" in str(exc), exc
            else:
                raise AssertionError(extra)
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr
