"""An iteration's subflow run is found again by its iteration, not by the order of the calls.

Prefect 3.7.7 links a subflow call to a "tracking" task run of the parent flow run whose dynamic key is a
per-flow-run call counter (prefect/_internal/engine.py `dynamic_key_for_task_run`), and a retried parent
reattaches each call to the subflow run of the previous attempt's task run with the same key
(`FlowRunEngine.load_subflow_run`). The training flow's retry starts at the first uncommitted iteration, so
its first call (iteration 3, say) got key 0, the first attempt's iteration 1: that old subflow run was renamed,
ran again or was skipped as done, and the UI listed iterations under each other's names. Prefect gives
subflows called from a task UUID keys for this very reason ("sibling call order is not a reliable identity
across retries"); it does not for subflows called from the flow itself.

`keyed_by(flow_obj, key)` sets that counter so the next call of `flow_obj` in the current flow run gets
dynamic key `key` (the iteration): the same iteration maps to the same tracking task run in every attempt,
and a different one never does. It touches Prefect's per-run counter (private): tests/integration/
test_retry_history.py fails if Prefect changes how subflow calls are keyed.
"""

from __future__ import annotations

from prefect import Flow
from prefect.context import FlowRunContext
from prefect.tasks import _generate_task_key


def keyed_by(flow_obj: Flow, key: int) -> None:
    """Make the next call of subflow `flow_obj` from the current flow run use dynamic key `key` (>= 0).

    No-op outside a flow run (a subflow called bare is its own flow run and has no tracking task), and for an
    object that is not a Flow."""
    context = FlowRunContext.get()
    if context is None or context.flow_run is None or not isinstance(flow_obj, Flow):
        return  # not a flow (a plain function standing in for one): no tracking task to key
    # the tracking task is Task(name=flow.name, fn=flow.fn): its key is the flow function's (flow_engine.py)
    task_key = _generate_task_key(flow_obj.fn)
    if key == 0:
        context.task_run_dynamic_keys.pop(task_key, None)  # absent -> the next call gets 0
    else:
        context.task_run_dynamic_keys[task_key] = key - 1  # present -> the next call gets it + 1
