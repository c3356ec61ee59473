"""ftengine inside vLLM-Ascend: the NPU backend where vLLM-Ascend's worker builds its sentinel.

vLLM-Ascend's ``NPUWorker`` subclasses vLLM's ``WorkerBase`` (not the GPU ``Worker``) and
builds its own ``WorkerSentinel(worker=self, device=device)`` in ``_init_device``. This
package takes that place (``plugin``), applies the environment fault tolerance needs before
the NPU is set up, and serves the recovery through what vLLM-Ascend's kernels read: the
all2all manager's ``elastic_info`` (``update_mask`` / ``get_elastic_info``), the
``expert_replica_routing_table`` of every MoE layer and the per-expert weight lists
(``hooks``).

Targets: vLLM-Ascend's fault-tolerance branch, PR #16145 (retry + MC2 scale-down) on
PR #14113 (retry), neither merged (vLLM-Ascend main has no fault-tolerance code); vLLM with
its fault-tolerance framework (#44428, in 0.33.0) and without upstream #46370 (ftengine
brings its own ``scale_down``; ``engine_core`` refuses a vLLM carrying #46370). Every
vLLM-Ascend name used is in ``names``; what is still unconfirmed on hardware is listed in
docs/ascend.md.
"""

TARGET_VLLM_ASCEND = "vllm-ascend PR #16145 (on PR #14113, head f4cfea2c)"
TARGET_VLLM = "vllm >= 0.33.0 (fault tolerance #44428), without vllm PR #46370"
