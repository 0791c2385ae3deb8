"""In-process adapters: the code that moves a workload's device state when the agent says so.

``base.WorkloadAdapter`` is the contract; ``callbacks``, ``vllm`` and ``sglang`` hold the
adapters for user callbacks, vLLM and SGLang engines. ``TorchAdapter`` (PyTorch modules
and optimizers) lives in ``tslice.workload.adapters.torch`` and is imported only on
demand, so torch stays optional.
"""
