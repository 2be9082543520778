"""Prefect tasks of ppoflow: thin, typed wrappers, one per stage; they move manifests, not tensors.

Importing this package changes nothing in Prefect: the adaptations a process needs (adaptations/) are installed
by its entry point (`adaptations.install_process_adaptations`)."""
