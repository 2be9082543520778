"""Attestation: a rollout or eval stage proves that its engine serves the policy it was handed.

    attest(engine, cfg, policy, stage, iteration) -> Attestation     the stage's postcondition on its engine
    expected_record(cfg, policy) -> dict                             what the engine must hold, recorded at commit

Why: a warm engine whose reload silently failed, a policy folder replaced after its commit, or an engine loaded
in another dtype than the trainer's would sample on, and the run would train on samples of a policy it never
named. Every stage that takes an engine (rollout, each rollout part, eval) calls `attest` right after
`rollout_engine_for`, whatever path brought the weights there: a first build, an in-place reload (vLLM), a
copy (HF), the warm trainer's tensors in memory, a fork or a resume. It compares the digest of the weights
the engine holds, read where they live (engines/weights_digest.py), with the one recorded for that policy:

- a checkpoint: "policy_digest" in its trainer/trainer.json, written by the trainer as it saved policy/, and
  read here with its sha256 checked against the commit marker (a swapped policy/ cannot bring its own record);
  a checkpoint written before attestation existed has none, and one written by another digest algorithm holds a
  record in another format (engines/weights_digest.py, DIGEST_FORMAT): its verified policy/ files are digested
  instead (logged as such), so an upgrade of the algorithm never reads as other weights; when they cannot be read,
  a RuntimeError says "digest format vN, this ppoflow computes vM" and why the files could not stand in;
- the initial model (version 0): its folder's files, digested once per process;
- weights this process handed to its engine itself (the in-memory loop, stages/loop.py): the record it took from
  the trainer's tensors or from the folder it had just saved, before the engine read it (`remember_record`).

A mismatch raises AttestationError naming the stage, the iteration, the expected policy and what the engine
holds, with the policy version those weights belong to when this process attested them before (a skipped reload
shows the previous version); the registry then forgets what the engine serves, so a retried stage loads the
policy again instead of trusting it. Cost: the digest (vLLM: a collective_rpc to its worker) once per stage.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import threading
import time
from typing import Optional

from engines.rollout.registry import mark_served
from engines.weights_digest import DIGEST_FORMAT, WeightsDigest, policy_record, record_format
from stages.manifests import Attestation, PolicyRef
from stages.policy import local_policy_dir
from storage import fs as fsutil
from storage.checkpoints import checkpoint_owner, read_commit_marker
from storage.layout import layout_for

log = logging.getLogger("ppoflow.rollout")

_TRAINER_JSON = "trainer/trainer.json"
_seen_lock = threading.Lock()
_seen: dict[str, int] = {}  # digest value -> the policy version this process attested with it
_records: dict[tuple, dict] = {}  # (weights_id, autocast dtype) -> the committed record read for it


class AttestationError(RuntimeError):
    """The engine does not serve the policy the stage was handed; the message names stage, iteration, both sides."""


@functools.lru_cache(maxsize=4)
def _initial_record(path: str, weights_id: str, autocast_dtype) -> dict:
    return policy_record(path, autocast_dtype)  # weights_id in the key: an edited folder is digested again


def _committed_record(cfg, policy: PolicyRef) -> dict | None:
    """The "policy_digest" of the checkpoint's trainer/trainer.json (None when it has none), its bytes checked
    against the commit marker's sha256. RuntimeError when the checkpoint is not committed or the file differs."""
    layout, iteration = layout_for(cfg), policy.checkpoint_iteration
    marker = read_commit_marker(layout, iteration)
    if marker is None or _TRAINER_JSON not in marker["files"]:
        raise RuntimeError(f"checkpoint {policy.uri} has no commit marker listing {_TRAINER_JSON}: nothing to attest")
    owner = checkpoint_owner(layout, iteration)  # a fork reads its parent's checkpoint
    path = fsutil.join(owner.checkpoint_dir(iteration), _TRAINER_JSON)
    data = owner.fs.cat_file(path)
    if hashlib.sha256(data).hexdigest() != marker["files"][_TRAINER_JSON]["sha256"]:
        raise RuntimeError(f"{owner.url(path)} differs from its commit marker: the policy's record cannot be trusted")
    return json.loads(data).get("policy_digest")


def remember_record(policy: PolicyRef, autocast_dtype, record: dict) -> None:
    """Keep `record` (policy_record's JSON) as what an engine serving `policy` holds: for weights that this process
    wrote or handed over itself and that no checkpoint records (the in-memory loop), taken as they were written."""
    with _seen_lock:
        _records[(policy.weights_id, autocast_dtype)] = record


def expected_record(cfg, policy: PolicyRef) -> dict:
    """What an engine serving `policy` holds: {"format", "value", "dtypes", "rounded": {dtype: value}}
    (policy_record). Kept per weights_id once read: that id hashes the commit marker's file list, trainer.json's
    sha256 among them (or the folder's files, for the initial model)."""
    key = (policy.weights_id, cfg.model.autocast_dtype)
    with _seen_lock:
        record = _records.get(key)
    if record is None and policy.checkpoint_iteration is None:
        return _initial_record(policy.uri, policy.weights_id, cfg.model.autocast_dtype)
    if record is None:
        record = _committed_record(cfg, policy)
        if record is None or record_format(record) != DIGEST_FORMAT:
            record = _digest_files_instead(cfg, policy, record)
        with _seen_lock:
            _records[key] = record
    return record


def _digest_files_instead(cfg, policy: PolicyRef, record: dict | None) -> dict:
    """The record of a checkpoint whose own is absent (written before attestation) or in another digest format,
    made here from its policy/ files, fetched and checked against the commit marker. RuntimeError "digest format
    vN, this ppoflow computes vM" (with the reason) when those files cannot be read: never a false "weights differ"."""
    if record is None:
        log.warning("checkpoint %s records no policy digest (older ppoflow): digesting its policy/", policy.uri)
    else:
        log.warning("checkpoint %s records its policy digest in format v%d, this ppoflow computes v%d: digesting its "
                    "policy/", policy.uri, record_format(record), DIGEST_FORMAT)  # fmt: skip
    try:
        return policy_record(local_policy_dir(cfg, policy), cfg.model.autocast_dtype)
    except Exception as exc:  # noqa: BLE001 - any failure to read the files is reported with the format gap
        found = "no policy digest" if record is None else f"digest format v{record_format(record)}"
        raise RuntimeError(
            f"checkpoint {policy.uri} records {found}, this ppoflow computes v{DIGEST_FORMAT}, and its policy/ "
            f"could not be digested instead: {type(exc).__name__}: {exc}"
        ) from exc


def _expected_digest(record: dict, precision) -> WeightsDigest:
    """The digest an engine comparing at `precision` (None, or the autocast dtype it keeps copies in) must show."""
    if precision is None:
        return WeightsDigest.from_json(record)
    value = record.get("rounded", {}).get(precision)
    if value is None:
        raise RuntimeError(f"the policy's record holds no digest at {precision} (model.autocast_dtype changed?)")
    return WeightsDigest(value=value, dtypes=tuple(sorted({*record["dtypes"], precision})))


def attest(engine, cfg, policy: PolicyRef, stage: str, iteration: int) -> Optional[Attestation]:
    """Prove that `engine` serves `policy` (module docstring); the Attestation for the stage's manifest, None (with
    a warning) for an engine that cannot digest what it holds (vLLM with tensor parallelism).
    AttestationError naming `stage`, `iteration`, the expected and the found weights otherwise."""
    started = time.perf_counter()
    found = engine.weights_digest()
    if found is None:
        log.warning("%s iteration %d: the %s engine cannot digest its weights here: not attested", stage, iteration,
                    engine.name)  # fmt: skip
        return None
    expected = _expected_digest(expected_record(cfg, policy), engine.digest_precision)
    if found != expected:
        # forget what the engine was said to serve: a retry of the stage loads the policy into it again
        mark_served(engine, "unattested", -1)
        raise AttestationError(_mismatch(engine, policy, stage, iteration, expected, found))
    with _seen_lock:
        _seen[found.value] = policy.version
    seconds = time.perf_counter() - started
    log.info("%s iteration %d: %s engine attested policy version %d (%s) in %.3f s", stage, iteration, engine.name,
             policy.version, found, seconds)  # fmt: skip
    fields = {"version": policy.version, "weights_id": policy.weights_id, "digest": found.value}
    return Attestation(**fields, dtypes=list(found.dtypes), seconds=seconds)


def _mismatch(engine, policy: PolicyRef, stage: str, iteration: int, expected, found) -> str:
    with _seen_lock:
        before = _seen.get(found.value)
    if before is not None:
        whose = f"policy version {before}'s weights (it served them before: the new weights never reached it)"
    else:
        whose = "weights of no policy this process attested"
    held, wanted = "+".join(found.dtypes), "+".join(expected.dtypes)
    dtype = "" if held == wanted else f"; held in {held}, not the trainer's {wanted}"
    return (
        f"{stage} stage of iteration {iteration}: the {engine.name} engine does not serve the policy it was handed: "
        f"expected policy version {policy.version} ({policy.weights_id}, weights {expected}), found {found}: {whose}"
        f"{dtype}"
    )
