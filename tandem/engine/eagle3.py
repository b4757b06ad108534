"""Starting the EAGLE-3 proposer: the head is read and checked against the target before the target's runner (whose
KV pool is then sized around the head's weights, KV and the copied hidden states), and bound to it afterwards."""

from __future__ import annotations

import torch

from tandem.config import MAX_SPEC_TOKENS, EngineConfig
from tandem.models.llama import LlamaForCausalLM
from tandem.models.loader import load_model_config, model_max_len
from tandem.models.registry import MODEL_REGISTRY
from tandem.runner.model_runner import ModelRunner, SideOutputs
from tandem.speculative.eagle3 import Eagle3Proposer
from tandem.speculative.eagle3_rows import scratch_blocks_per_row
from tandem.speculative.eagle3_head import Eagle3Config, Eagle3Head, random_head_tensors, read_head_tensors


def load_eagle3_head(config: EngineConfig) -> tuple[Eagle3Head, SideOutputs]:
    """The head on the engine's device and what the target's steps must copy for it; ValueError naming the field
    where the head does not fit the target."""
    spec = config.speculative
    assert spec is not None and spec.model is not None
    head_config = Eagle3Config.from_folder(spec.model)
    target = load_model_config(config)
    if not issubclass(MODEL_REGISTRY.get(target.architecture, object), LlamaForCausalLM):
        raise ValueError(f"speculative_config method 'eagle3' needs a Llama-family target model, not "
                         f"{target.architecture!r}")
    aux_layers = head_config.check_target(target)
    tensors = read_head_tensors(spec.model)
    if not tensors:
        if config.load_format != "dummy":
            raise ValueError(f"speculative_config.model {spec.model!r} has no safetensors weights")
        tensors = random_head_tensors(head_config, config.seed)  # a benchmark's head of the right shape
    dtype = config.resolved_dtype()
    max_len = config.max_model_len or min(model_max_len(target), 8192)
    head = Eagle3Head(head_config, tensors, config.resolved_device(), dtype, max_len + MAX_SPEC_TOKENS + 1)
    per_block = head_config.kv_bytes_per_block(config.block_size, dtype)
    scratch = chain_rows(config) * scratch_blocks_per_row(config.block_size, spec.num_speculative_tokens)
    return head, SideOutputs(aux_layers, per_block, scratch * per_block)


def chain_rows(config: EngineConfig) -> int:
    """Requests the head's chains take at once: disable_by_batch_size (no drafts are proposed above), at most
    max_num_seqs."""
    spec = config.speculative
    assert spec is not None
    return min(spec.disable_by_batch_size, config.max_num_seqs)


def eagle3_proposer(head: Eagle3Head, runner: ModelRunner) -> Eagle3Proposer:
    """The proposer over the target's block ids, reading the target's embeddings where the head has none; it runs
    on the target's compute stream, behind the steps whose hidden states it reads. Its chains take up to
    disable_by_batch_size requests at once (no drafts are proposed above), their feeds k + 1 rows each; both in
    CUDA graphs where the target's decode steps are."""
    full = runner.full_embeddings  # tensor parallelism: the table gathered from every rank's rows
    head.use_target_embeddings(full if full is not None else runner.model.model.embed_tokens.weight)
    config = runner.config
    spec = config.speculative
    assert spec is not None
    cuda = runner.device.type == "cuda"
    proposer = Eagle3Proposer(head, runner.num_blocks, runner.block_size, runner.streams.compute if cuda else None,
                              max_blocks=runner.max_blocks_per_seq,
                              chain_rows=chain_rows(config), max_drafts=spec.num_speculative_tokens)
    if cuda and config.cuda_graph:
        proposer.capture()
    return proposer


def aux_states(runner: ModelRunner, slot: int) -> torch.Tensor:
    """The hidden states a slot's last step copied: [max_num_tokens, 3 x hidden]."""
    assert runner.executor.aux is not None
    return runner.executor.aux[slot].out
