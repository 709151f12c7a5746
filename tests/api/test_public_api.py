"""The public API as a user meets it: ``import layercheck`` is cheap, ``dir`` and ``help`` show the
public names only, every policy config is importable from ``layercheck.policies``, and the API's
default schedule is the CLI's."""

import importlib.resources
import pydoc
import subprocess
import sys
import typing

import tomllib

import layercheck
from layercheck import policies
from layercheck.orchestrator.core.run_config import parse_run_config
from layercheck.policies.configs import POLICY_CONFIGS


def test_dir_lists_the_public_api_and_nothing_else():
    assert dir(layercheck) == sorted(layercheck.__all__)
    assert {"attach", "CheckpointConfig", "LayerCheckTrainer", "LayerCheckCallback", "policies"} <= set(dir(layercheck))
    assert not {"Any", "TYPE_CHECKING", "annotations", "importlib", "typing"} & set(dir(layercheck))


def test_every_public_name_resolves():
    for name in layercheck.__all__:
        assert getattr(layercheck, name) is not None, name


def test_help_documents_the_public_classes_and_functions():
    text = pydoc.render_doc(layercheck, renderer=pydoc.plaintext)
    for name in ("attach", "CheckpointConfig", "LayerCheckTrainer", "LayerCheckCallback"):
        assert name in text, name
    assert "TYPE_CHECKING" not in text and "_EXPORTS" not in text


def test_every_policy_config_is_exported_from_layercheck_policies():
    for cls in POLICY_CONFIGS.values():
        assert getattr(policies, cls.__name__) is cls
    assert set(typing.get_args(policies.PolicyConfig)) == set(POLICY_CONFIGS.values())


def test_the_api_and_the_cli_default_to_the_same_schedule():
    api = layercheck.CheckpointConfig(storage="/tmp/x").policy
    demo = tomllib.loads((importlib.resources.files("layercheck.examples") / "demo.toml").read_text())
    demo.pop("policy", None)  # a run config that names no policy: what `layercheck train` then uses
    cli = parse_run_config(demo).policy
    assert isinstance(api, policies.StaggeredConfig) and api == cli


def test_importing_layercheck_starts_nothing_heavy():
    code = "import sys, layercheck; print(sorted(m for m in ('torch', 'ray', 'deepspeed') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
