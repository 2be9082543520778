"""deploy/kubernetes/*.json, the base job templates of ppoflow's Kubernetes work pools, rendered by prefect-kubernetes'
own code as its worker renders them for a flow run (tests/fixtures/k8s_render.py, in a subprocess with
prefect-kubernetes on its path), and each rendered Job validated against the Kubernetes API's models
(kubernetes_asyncio's V1Job, the client prefect-kubernetes itself uses).

Validation: the manifest is deserialized into a V1Job and serialized back; a field the API does not have (a typo, a
field at the wrong level) is dropped by that round trip, so the two must be equal. Upstream's own default template
fails it (it puts the Job's completions and parallelism in the pod spec): the test shows that too, so it can fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TEMPLATES = {
    path.stem: json.loads(path.read_text()) for path in sorted((REPO / "deploy" / "kubernetes").glob("*.json"))
}
SITE = REPO / ".venv" / "k8s-site"  # scripts/setup.sh
VALUES = {
    "defaults": {},
    "job-variables": {
        "image": "registry.example.com/ppoflow:0.2.0",
        "gpus": "2",
        "env": {"EXTRA": "1"},
        "cpu_limit": "8",
    },
}


@pytest.fixture(scope="module")
def rendered(prefect_server) -> dict:
    """{(template, values name): {"manifest", "round_trip"}}, and ("upstream", "defaults") for prefect-kubernetes'
    own default template."""
    cases = [(t, v) for t in TEMPLATES for v in VALUES] + [("upstream", "defaults")]
    payload = [
        {"template": TEMPLATES.get(t), "values": VALUES[v] if t in TEMPLATES else {"image": "x"}} for t, v in cases
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SITE), str(REPO)]), "PREFECT_API_URL": prefect_server}
    out = subprocess.run(
        [sys.executable, "-m", "tests.fixtures.k8s_render"],
        input=json.dumps(payload), capture_output=True, text=True, env=env, cwd=REPO, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return dict(zip(cases, json.loads(out.stdout.strip().splitlines()[-1])))


def test_there_are_templates():
    assert set(TEMPLATES) == {"flow-pool", "gpu-pool"}


@pytest.mark.parametrize("template", sorted(TEMPLATES))
@pytest.mark.parametrize("values", sorted(VALUES))
def test_each_rendered_job_is_a_valid_v1_job(rendered, template, values):
    manifest = rendered[(template, values)]["manifest"]
    assert rendered[(template, values)]["round_trip"] == manifest
    given = VALUES[values]
    container = manifest["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == given.get("image", "ppoflow:0.1.0")
    gpus = given.get("gpus", TEMPLATES[template]["variables"]["properties"]["gpus"]["default"])
    assert container["resources"]["limits"]["nvidia.com/gpu"] == gpus
    env = {e["name"]: e.get("value") for e in container["env"]}
    # the flow that submits a stage and the warm worker that runs it share result storage
    assert env["PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK"] == env["PREFECT_TASKS_SCHEDULING_DEFAULT_STORAGE_BLOCK"]
    assert env["PREFECT__FLOW_RUN_ID"]  # set by the worker's rendering for the flow run
    if "env" in given:
        assert env["EXTRA"] == "1"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]


def test_the_gpu_pool_asks_for_a_gpu_and_the_flow_pool_for_none():
    gpus = {name: t["variables"]["properties"]["gpus"]["default"] for name, t in TEMPLATES.items()}
    assert gpus == {"gpu-pool": "1", "flow-pool": "0"}


def test_upstreams_default_template_fails_the_round_trip(rendered):
    """The check can fail: prefect-kubernetes' default puts completions/parallelism in the pod spec."""
    manifest = rendered[("upstream", "defaults")]["manifest"]
    assert "completions" in manifest["spec"]["template"]["spec"]
    assert rendered[("upstream", "defaults")]["round_trip"] != manifest
