"""The demo, every benchmark and their measurement tools (live views, traffic, page cache,
peak RSS, plots), the vLLM ones included (``vllm``, ``vllm_overhead``, ``vllm_scale_down``,
``inflight_vllm``). The test bed's commands import it inside their ``run``; its third-party
needs come with the ``testbed`` extra (``pip install 'ftengine[testbed]'``)."""
