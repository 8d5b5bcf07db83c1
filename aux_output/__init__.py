"""r3capture.aux_output: the vLLM auxiliary-output connector on r3capture's data path.

* ``worker.TritonAuxOutputWorker``: the worker connector (vLLM 0.33.0's worker protocol).
* ``scheduler.SchedulerConnector``: the scheduler side (used by the simulator; in vLLM the
  engine keeps its own).
* ``plugin.register``: the ``vllm.general_plugins`` entry point (``--aux-output-backend``).
* ``factory.build_worker``: sizes the worker from a ``VllmConfig`` the way vLLM does.

Nothing here imports vLLM at module level except ``types`` (vLLM's own message classes when
vLLM is importable) and the plugin's deferred hooks.
"""
