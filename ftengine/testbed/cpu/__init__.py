"""The CPU reference cluster's device backend: gloo collectives, CPU experts and MoE layers
(only the cluster's workers and its reference run use them; the vLLM plugin's CPU backend
is ``ftengine.integrations.vllm.worker.cpu_backend``)."""
