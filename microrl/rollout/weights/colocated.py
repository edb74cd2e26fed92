"""How the weights reach a colocated ``vllm.LLM``: a new ``LoRARequest`` or ``reload_weights``."""

from __future__ import annotations

import shutil
from typing import Any

import torch

from microrl.engine.checkpoint.export import export_peft_adapter, locate_base_model
from microrl.engine.parallel import distributed
from microrl.rollout.samplers import vllm_options
from microrl.rollout.weights.full_weights import FullWeights
from microrl.rollout.weights.weight_sync import WeightSync

__all__ = ["LoRARequestSync", "ReloadWeightsSync"]


class LoRARequestSync(WeightSync):
    """Path 2: the adapter exported to a new directory, served as a new ``LoRARequest`` (ids
    never repeat: no cached, stale adapter; vLLM 0.32 takes a path only)."""

    def __init__(self, rollout: Any) -> None:
        self.rollout = rollout
        #: The ``LoRARequest`` of the adapter vLLM serves now.
        self.request = None

    def push(self, engine, version: int) -> None:
        from vllm.lora.request import LoRARequest

        rollout = self.rollout
        if rollout.weights_lost:  # sleep level 2 discarded the base: it is read back from disk
            rollout.reload_base()
        path = rollout.workdir / f"adapter-{version}"
        dtype = vllm_options.adapter_dtype(rollout.dtype, rollout.config.engine_kwargs)
        export_peft_adapter(engine.module, path, peft_model=engine.peft_model, dtype=dtype)
        previous = self.request
        self.request = LoRARequest(f"microrl-{version}", version, str(path))
        rollout.llm.llm_engine.add_lora(self.request)
        if previous is not None:
            rollout.llm.llm_engine.remove_lora(previous.lora_int_id)
        rollout.reset_encoder_cache()
        distributed.barrier()  # every rank has loaded the new adapter before the old one is deleted
        if previous is not None and distributed.rank() == 0:
            shutil.rmtree(previous.lora_path, ignore_errors=True)


class ReloadWeightsSync(WeightSync):
    """Path 3: the full weights streamed in place (``reload_weights``), one tensor at a time."""

    def __init__(self, rollout: Any) -> None:
        self.rollout = rollout

    def push(self, engine, version: int) -> None:
        rollout = self.rollout
        prefix, _ = locate_base_model(engine.module)
        weights = FullWeights(engine.module, prefix, dtype=getattr(torch, rollout.dtype))
        rollout.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        rollout.weights_lost = False
        rollout.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        rollout.reset_encoder_cache()
