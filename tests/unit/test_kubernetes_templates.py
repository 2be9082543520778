"""deploy/kubernetes/*.json, the base job templates of ppoflow's Kubernetes work pools, rendered by prefect-kubernetes'
own code as its worker renders them for a flow run, and each rendered Job validated against the Kubernetes API's
models (kubernetes_asyncio's V1Job, the client prefect-kubernetes itself uses).

Validation: the manifest is deserialized into a V1Job and serialized back; a field the API does not have (a typo, a
field at the wrong level) is dropped by that round trip, so the two must be equal. Upstream's own default template
fails it (it puts the Job's completions and parallelism in the pod spec): the test shows that too, so it can fail.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from uuid import uuid4

import pytest

REPO = Path(__file__).resolve().parents[2]
TEMPLATES = sorted((REPO / "deploy" / "kubernetes").glob("*.json"))


def _render(template: dict, values: dict) -> dict:
    """The Job manifest prefect-kubernetes' worker would submit for a flow run of a deployment on this pool."""
    from prefect.client.schemas.objects import FlowRun
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    config = asyncio.run(KubernetesWorkerJobConfiguration.from_template_and_values(template, values))
    config.prepare_for_flow_run(FlowRun(flow_id=uuid4(), name="calm-otter"))
    return config.job_manifest


def _api_round_trip(manifest: dict) -> dict:
    from kubernetes_asyncio.client import ApiClient

    async def round_trip() -> dict:
        async with ApiClient() as api:  # its HTTP session needs a running loop; nothing is sent
            job = api._ApiClient__deserialize(manifest, "V1Job")  # the client's own path from JSON to its models
            return api.sanitize_for_serialization(job)

    return asyncio.run(round_trip())


def test_there_are_templates():
    assert {t.stem for t in TEMPLATES} == {"flow-pool", "gpu-pool"}


@pytest.mark.parametrize("path", TEMPLATES, ids=lambda p: p.stem)
@pytest.mark.parametrize(
    "values",
    [{}, {"image": "registry.example.com/ppoflow:0.2.0", "gpus": "2", "env": {"EXTRA": "1"}, "cpu_limit": "8"}],
    ids=["defaults", "job-variables"],
)
def test_each_rendered_job_is_a_valid_v1_job(prefect_api, path, values):
    template = json.loads(path.read_text())
    manifest = _render(template, values)
    assert _api_round_trip(manifest) == manifest
    pod = manifest["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["image"] == values.get("image", "ppoflow:0.1.0")
    gpus = values.get("gpus", template["variables"]["properties"]["gpus"]["default"])
    assert container["resources"]["limits"]["nvidia.com/gpu"] == gpus
    env = {e["name"]: e.get("value") for e in container["env"]}
    # the flow that submits a stage and the warm worker that runs it share result storage
    assert env["PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK"] == env["PREFECT_TASKS_SCHEDULING_DEFAULT_STORAGE_BLOCK"]
    assert env["PREFECT__FLOW_RUN_ID"]  # set by the worker's rendering for the flow run
    if "env" in values:
        assert env["EXTRA"] == "1"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]


def test_the_gpu_pool_asks_for_a_gpu_and_the_flow_pool_for_none():
    gpus = {t.stem: json.loads(t.read_text())["variables"]["properties"]["gpus"]["default"] for t in TEMPLATES}
    assert gpus == {"gpu-pool": "1", "flow-pool": "0"}


def test_upstreams_default_template_fails_the_round_trip(prefect_api):
    """The check can fail: prefect-kubernetes' default puts completions/parallelism in the pod spec."""
    from prefect_kubernetes.worker import KubernetesWorker

    manifest = _render(KubernetesWorker.get_default_base_job_template(), {"image": "x"})
    assert "completions" in manifest["spec"]["template"]["spec"]
    assert _api_round_trip(manifest) != manifest
