"""A stand-in of vLLM-Ascend's fault-tolerance branch (PR #14113 / #16145), on the fake torch_npu.

Only what ftengine touches and what the tests drive, built from the real classes' shapes
(module paths, class, attribute and method names as on those branches) and run on CPU
tensors: ``NPUWorker`` (a ``WorkerBase``, not vLLM's GPU ``Worker``) whose ``_init_device``
builds ``WorkerSentinel(worker=self, device=device)``; vLLM-Ascend's own sentinel (a
subclass of vLLM's GPU sentinel); the MC2 all2all manager with ``update_mask`` /
``get_elastic_info``; MoE layers whose weights are processed as vLLM-Ascend's loader does
(per-expert lists under the v2 runner with EPLB, NZ where it casts) and whose forward calls
the fake MC2 ops with the manager's ``elastic_info`` and the layer's routing table.
Imported as top-level ``vllm_ascend`` (``tests.fakes.npu_install.fake_torch_npu``).
"""
