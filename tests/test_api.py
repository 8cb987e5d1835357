"""The public Python API: lazy top-level names, and a user-written transformer audited end to end."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import attnaudit

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "transformer_api.py"


# the declared mapping: public name -> the attnaudit submodule it comes from (attnaudit/__init__.py)
PUBLIC = dict(attnaudit._PUBLIC)
# what `import attnaudit` must not pull in: the tensor stack, the CLI and its toolkit, optional extras
HEAVY = ("torch", "numpy", "scipy", "sklearn", "safetensors", "transformers", "typer", "click", "rich", "yaml")


def _is_submodule(name: str) -> bool:
    return importlib.util.find_spec(f"attnaudit.{name}") is not None


def _fresh_python(code: str) -> dict:
    """Run ``code`` in a new interpreter (nothing of attnaudit imported yet); its JSON output."""
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_all_dir_star_import_and_version_are_the_declared_public_api():
    assert len(attnaudit.__all__) == len(set(attnaudit.__all__))
    assert set(attnaudit.__all__) == set(PUBLIC) | {"__version__"}
    assert sorted(dir(attnaudit)) == sorted(attnaudit.__all__)  # dir() lists the lazy names before they are loaded
    assert not [n for n in attnaudit.__all__ if n.startswith("_") and n != "__version__"]
    # every name the module docstring's example uses is public (the documentation, not the mapping)
    documented = set(re.findall(r"\baa\.(\w+)", attnaudit.__doc__))
    assert {
        "Task",
        "Inputs",
        "compute_influence",
        "InfluenceConfig",
        "empirical_ntk",
        "run",
        "KappaRequest",
        "MalleabilityRequest",
    } <= documented
    assert documented <= set(attnaudit.__all__)
    # `from attnaudit import *` resolves every listed name (a listed name that fails raises here)
    namespace: dict = {}
    exec("from attnaudit import *", namespace)  # noqa: S102 - the star import is the thing tested
    assert set(attnaudit.__all__) <= set(namespace)
    # the version the package reports is the one the project declares
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    declared = re.search(r'^version\s*=\s*"([^"]+)"', pyproject, re.M).group(1)
    assert attnaudit.__version__ == declared


@pytest.mark.parametrize("name", sorted(n for n in PUBLIC if not _is_submodule(n)))
def test_each_public_name_is_the_object_of_its_declared_module(name):
    """Identity with a direct import of the declared submodule's attribute; defined there (or in
    a module of that package, per ``__module__``); classes are classes, functions functions,
    configs dataclasses; and the value is cached on the package after the first use."""
    module_name = f"attnaudit.{PUBLIC[name]}"
    value = getattr(attnaudit, name)
    direct = getattr(importlib.import_module(module_name), name)
    assert value is direct
    assert value.__module__ == module_name or value.__module__.startswith(module_name + "."), value.__module__
    if name[0].isupper():
        assert isinstance(value, type), type(value)
        if name.endswith("Config") or name.endswith("Spec"):
            assert dataclasses.is_dataclass(value)
    else:
        assert inspect.isfunction(value), type(value)
    assert vars(attnaudit)[name] is value  # cached: the next access does not go through __getattr__
    if name == "AuditError":
        assert issubclass(value, Exception)


def test_no_public_name_is_also_a_submodule_and_fit_stays_the_function():
    """The import system binds a submodule to its parent's attribute, which would shadow a
    public name of the same spelling; no public name may be a submodule's (or a moved
    module's deprecated alias), and ``attnaudit.fit`` stays the training function after the
    module that defines it (attnaudit.core.fit) and every other module are imported."""
    assert sorted(n for n in PUBLIC if _is_submodule(n)) == []
    code = textwrap.dedent(
        """
        import importlib, json, pkgutil, warnings, attnaudit
        attnaudit.Recipe  # imports attnaudit.core.fit
        for info in pkgutil.walk_packages(attnaudit.__path__, "attnaudit."):
            if info.name.startswith(("attnaudit.cli", "attnaudit.models.hf", "attnaudit.__main__")):
                continue
            importlib.import_module(info.name)
        module = importlib.import_module("attnaudit.core.fit")
        print(json.dumps({"fit_is_function": attnaudit.fit is module.fit}))
        """
    )
    assert _fresh_python(code) == {"fit_is_function": True}


@pytest.mark.parametrize("name", ["no_such_thing", "compute_influences", "auditerror", "__wrapped__"])
def test_unknown_names_raise_attribute_error_naming_them(name):
    with pytest.raises(AttributeError, match=rf"module 'attnaudit' has no attribute '{re.escape(name)}'"):
        getattr(attnaudit, name)
    assert not hasattr(attnaudit, name)
    assert name not in vars(attnaudit)  # a failed lookup caches nothing
    with pytest.raises(ImportError):
        exec(f"from attnaudit import {name}", {})  # noqa: S102


def test_import_is_light_and_names_load_one_module_on_first_use():
    """``import attnaudit`` imports no submodule, no torch, no CLI; the first use of a name
    imports its own submodule (AuditError: only attnaudit.errors, still no torch)."""
    code = textwrap.dedent(
        f"""
        import json, sys
        import attnaudit
        def loaded():
            return sorted(m for m in sys.modules if m.startswith("attnaudit") or m.split(".")[0] in {HEAVY!r})
        out = {{"after_import": loaded(), "bound": sorted(n for n in attnaudit._PUBLIC if n in vars(attnaudit))}}
        attnaudit.AuditError
        out["after_error"] = loaded()
        attnaudit.compute_influence
        out["influence_loaded"] = "attnaudit.analyses.influence.influence" in sys.modules
        out["cli_loaded"] = "attnaudit.cli" in sys.modules
        out["cached"] = sorted(n for n in ("AuditError", "compute_influence") if n in vars(attnaudit))
        print(json.dumps(out))
        """
    )
    out = _fresh_python(code)
    assert out["after_import"] == ["attnaudit"]
    assert out["bound"] == []
    assert out["after_error"] == ["attnaudit", "attnaudit.errors"]
    assert out["influence_loaded"] and not out["cli_loaded"]
    assert out["cached"] == ["AuditError", "compute_influence"]


def test_user_transformer_runs_influence_landscape_and_entk_without_special_cases(capsys):
    spec = importlib.util.spec_from_file_location("transformer_api", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main()
    out = capsys.readouterr().out
    assert "tracked by 'head': ['head.weight', 'head.bias']" in out  # the logits layer, found structurally
    assert (
        "influence (fast: nn.Linear head, cached features)" in out
        and "empirical NTK (generic: engine): shape (16, 16, 10, 10)" in out
    )
    assert "model untouched: True torch.float32" in out  # train mode and dtype as the user left them
