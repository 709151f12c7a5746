import dataclasses

import pytest

from layercheck.orchestrator.cli.config import SECTIONS, field_docs
from layercheck.orchestrator.cli.main import main


@pytest.mark.parametrize("table,cls", SECTIONS, ids=[cls.__name__ for _, cls in SECTIONS])
def test_every_run_config_field_is_documented(table, cls):
    documented = {name: doc for name, _, doc in field_docs(cls)}
    assert set(documented) == {f.name for f in dataclasses.fields(cls)}
    assert all(documented.values()), [name for name, doc in documented.items() if not doc]


def test_config_command_prints_the_reference(capsys):
    assert main(["config"]) == 0
    out = capsys.readouterr().out
    assert "[engine]\n  zero_stage = 0" in out and "smax = 1000" in out and "kill_at_step = 0" in out
