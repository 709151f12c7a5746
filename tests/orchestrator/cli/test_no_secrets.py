"""No secret in the store or the logs: a storage URI's credentials (``KEY:SECRET@`` or a secret
query value) never reach ``run.json`` or the resume command a stopped run prints."""

import argparse
import json

from layercheck.orchestrator.cli.train import resume_command
from layercheck.orchestrator.core.run_config import load_run_config
from layercheck.orchestrator.core.run_start import StartOptions, open_run_store
from layercheck.orchestrator.store.layer_store import RUN_CONFIG_FILE, LayerStore
from tests.support.s3_server import FAST_FAIL

SECRET = "s3cr3t-value"


def test_run_json_keeps_the_storage_uri_without_its_credentials(s3):
    uri = s3.uri("runs/{name}", credentials=f"AKIDEXAMPLE:{SECRET}", **FAST_FAIL)
    config = load_run_config("examples/demo.toml", {"storage": uri, "metrics.port": 0}).with_absolute_storage()
    lease = open_run_store(config, StartOptions())
    try:
        text = LayerStore.open(config.storage_uri).fs.read_bytes(RUN_CONFIG_FILE).decode()
    finally:
        lease.release()
    assert SECRET not in text and "AKIDEXAMPLE" not in text
    assert json.loads(text)["storage"] == s3.uri("runs/{name}", **FAST_FAIL)  # the rest of it whole


def test_the_resume_command_carries_no_credentials():
    args = argparse.Namespace(
        config="run.toml",
        set=[f"storage=s3://AKIDEXAMPLE:{SECRET}@bucket/run?session_token={SECRET}&region=us-east-1", "steps=40"],
        restart_into=None,
    )
    command = resume_command(args)
    assert SECRET not in command and "AKIDEXAMPLE" not in command
    assert "storage=s3://bucket/run?session_token=***&region=us-east-1" in command and "--resume" in command
    restarted = resume_command(argparse.Namespace(config="run.toml", set=[], restart_into=f"s3://K:{SECRET}@b/new"))
    assert SECRET not in restarted and "storage=s3://b/new" in restarted
