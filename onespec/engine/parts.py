"""What every tensor-parallel rank runs, built alike on each: the target (its shard), the
drafter, the KV cache tensors and the SpecWorker that steps them. The engine (rank 0) adds
the host side around them (tokenizer, scheduler, block pool, runner); the other ranks
(distributed/ranks.py) build only this.

Every check here fails alike on every rank, before the one collective (the KV block count),
so no rank waits on a peer that gave up.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from onespec.combinations import check_combinations, engine_features, target_window
from onespec.config import DFlashConfig, Eagle3Config, EngineConfig, MTPConfig, NGramConfig
from onespec.distributed import TensorParallel
from onespec.distributed.attention_dp import set_rank_slots
from onespec.distributed.layers import tensor_parallel_ops
from onespec.engine.kv_cache import (allocate_kv_cache, kv_bytes_per_block,
                                     target_attention_layers, window_blocks)
from onespec.quant.kv_fp8 import configure_kv_cache
from onespec.engine.state_pool import StatePool, state_bytes
from onespec.engine.memory import available_bytes, require_bytes
from onespec.kernels.settings import KernelSettings
from onespec.layers.ops import make_ops
from onespec.models.eagle3 import (Eagle3HeadConfig, capture_from_aux_ids,
                                   default_capture_layers)
from onespec.models.dflash import load_dflash_head
from onespec.models.eagle3_io import load_eagle3_head
from onespec.models.loader import read_config
from onespec.models.mtp import load_mtp_head
from onespec.models.registry import load_target, resolve_device, resolve_dtype, target_class
from onespec.speculative.acceptors import make_acceptor
from onespec.speculative.dflash import DFlashDrafter
from onespec.speculative.eagle3 import Eagle3Drafter
from onespec.speculative.mtp import MTPDrafter
from onespec.speculative.parallel import ParallelDrafter
from onespec.speculative.shape import ChainShape, TreeShape
from onespec.speculative.worker import SpecWorker

def _tree_shape(sc) -> TreeShape | None:
    """The dynamic tree an EAGLE-3 config asks for, or None (chains)."""
    if not isinstance(sc, Eagle3Config) or not sc.use_dynamic_tree:
        return None
    return TreeShape(sc.max_draft_len, sc.dynamic_tree_max_topK, sc.max_total_draft_tokens)


@dataclass
class RankParts:
    config: EngineConfig
    parallel: TensorParallel | None
    device: torch.device
    dtype: torch.dtype
    tree: TreeShape | None
    shape: ChainShape | TreeShape
    kernel_settings: KernelSettings
    ops: object                 # the backend every layer computes with (layers/ops.py)
    model: torch.nn.Module
    drafter: Eagle3Drafter | MTPDrafter | DFlashDrafter | None
    max_model_len: int
    max_draft_len: int
    max_positions: int          # rotary tables cover positions [0, max_positions)
    num_kv_blocks: int          # the pool's blocks (each layer holds one more: scratch)
    worker: SpecWorker
    states: StatePool | None    # recurrent-state slots (hybrid targets)

    @classmethod
    def build(cls, config: EngineConfig, sc, parallel: TensorParallel | None,
              features: frozenset) -> "RankParts":
        """features: the configuration's (combinations.py), checked again once the
        target's window is known."""
        b = _Builder(config, sc, parallel)
        model = b.load_target()
        mcfg = model.config
        recurrent = getattr(model, "recurrent", False)
        latent = any(hasattr(a, "allocate_cache") for a in target_attention_layers(model))
        check_combinations(features | engine_features(config, sliding_window=target_window(mcfg),
                                                      recurrent=recurrent,
                                                      latent_cache=latent))
        if (config.max_model_len or 0) > mcfg.max_position_embeddings:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's "
                             f"max_position_embeddings={mcfg.max_position_embeddings}")
        max_model_len = config.max_model_len or mcfg.max_position_embeddings
        drafter = b.load_drafter(model) if sc and not isinstance(sc, NGramConfig) else None
        k = sc.max_draft_len if sc else 0
        shape = b.tree or ChainShape(drafter is not None,
                                     block=getattr(drafter, "block_size", 0))
        rows = shape.verify_rows(k)
        if config.max_num_tokens < rows:
            raise ValueError(f"max_num_tokens must be >= the rows of one verify = {rows} "
                             f"(max_draft_len + 1, or max_total_draft_tokens + 1 for a tree), "
                             f"got {config.max_num_tokens}")
        if b.tree is not None and b.tree.top_k > drafter.draft_vocab_size:
            raise ValueError(f"dynamic_tree_max_topK must be <= the head's draft vocabulary "
                             f"({drafter.draft_vocab_size}), got {b.tree.top_k}")
        max_positions = max_model_len + 2 * k + 2 + getattr(shape, "block", 0)
        model.setup_rotary(max_positions, b.device)
        target_layers = target_attention_layers(model)
        draft_layers = drafter.attention_layers if drafter else []
        if drafter:
            drafter.head.setup_rotary(max_positions, b.device)
        # every layer's cache dtype and FP8 scales, before the pool is sized (1 byte a value
        # under kv_cache_dtype="fp8"; draft layers too)
        configure_kv_cache(target_layers + draft_layers, config.kv_cache_dtype)
        blocks_per_seq = -(-(max_model_len + shape.gen_slots(k)) // config.block_size)
        if mcfg.sliding_window is not None:    # blocks behind the window go back
            blocks_per_seq = min(blocks_per_seq, window_blocks(
                mcfg.sliding_window, config.block_size, config.max_num_tokens, shape, k))
        num_blocks = b.num_kv_blocks(target_layers + draft_layers, blocks_per_seq, max_model_len,
                                     reserved=b.state_pool_bytes(model, shape.verify_rows(k))
                                     if recurrent else 0)
        # (after the count: the budget above leaves the state pool's bytes out)
        states = b.state_pool(model, shape.verify_rows(k)) if recurrent else None
        # one block past the pool is scratch space for the padding rows of CUDA graphs;
        # the target's layers apart from the drafter's (tree steps move the target's
        # entries of every layer at once: their own tensor)
        for layers in (target_layers, draft_layers):
            allocate_kv_cache(layers, num_blocks + 1, config.block_size, b.device)
            set_rank_slots(layers, num_blocks, config.block_size)   # (attention DP)
        generator = torch.Generator(b.device).manual_seed(config.seed)
        worker = SpecWorker(model, drafter, make_acceptor(sc), generator, b.backend, b.tree,
                            states)
        return cls(config, parallel, b.device, b.dtype, b.tree, shape, b.kernel_settings,
                   b.ops, model, drafter, max_model_len, k, max_positions, num_blocks, worker,
                   states)


def _check_parallel_head(head_cfg: Eagle3HeadConfig, sc: Eagle3Config):
    """parallel_drafting needs a head trained for it, and K within its trained depth."""
    if not head_cfg.parallel:
        raise ValueError(f"parallel_drafting=True needs a parallel (P-EAGLE) head with a mask "
                         f"token and mask_hidden; {sc.draft_model!r} is a chain EAGLE-3 head "
                         "(set parallel_drafting=False)")
    if head_cfg.parallel_depth is not None and sc.max_draft_len > head_cfg.parallel_depth:
        raise ValueError(f"max_draft_len must be <= the head's trained parallel depth "
                         f"({head_cfg.parallel_depth}) with parallel_drafting, got "
                         f"{sc.max_draft_len}")


class _Builder:
    """The settings the parts are built with, and the loaders that use them."""

    def __init__(self, config: EngineConfig, sc, parallel: TensorParallel | None):
        self.config, self.sc, self.parallel = config, sc, parallel
        self.device = parallel.device if parallel else resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.tree = _tree_shape(sc)
        self.backend = self._attention_backend()
        # the kernels' settings, fixed for the engine's life: the backend every layer is
        # built with
        self.kernel_settings = KernelSettings(triton=self.backend == "triton",
                                              pdl=config.programmatic_launch)
        self.ops = make_ops(self.kernel_settings)
        if parallel is not None:
            parallel.attention_dp = config.enable_attention_dp
            self.ops = tensor_parallel_ops(self.ops)

    def load_target(self):
        return load_target(self.config.model, self.device, self.dtype,
                           self.config.load_format == "dummy", self.ops, self.parallel,
                           quantization=self.config.quantization)

    def load_drafter(self, model) -> Eagle3Drafter | MTPDrafter | DFlashDrafter:
        sc, dummy = self.sc, self.config.load_format == "dummy"
        if isinstance(sc, DFlashConfig):
            return self.load_dflash(model)
        if isinstance(sc, MTPConfig):
            head = load_mtp_head(self.config.model, model, sc.num_mtp_layers, self.device,
                                 self.dtype, dummy=dummy, parallel=self.parallel,
                                 quantize=sc.draft_dtype == "fp8")
            return MTPDrafter(head, model, vanilla=sc.use_mtp_vanilla,
                              index_share=sc.use_index_share)
        head_cfg = Eagle3HeadConfig.from_hf(read_config(sc.draft_model))
        num_layers = model.config.num_hidden_layers
        if sc.layers_to_capture is not None:
            capture = sc.layers_to_capture
        elif head_cfg.aux_layer_ids:
            capture = capture_from_aux_ids(head_cfg.aux_layer_ids)
        else:
            capture = default_capture_layers(num_layers)
        bad = [i for i in capture if not 0 <= i < num_layers]
        if bad:
            raise ValueError(f"capture layers {capture} fall outside the target's {num_layers} "
                             "layers (ids are outputs-of; checkpoint aux ids are inputs-to)")
        draft_dtype = self.dtype if sc.draft_dtype in ("auto", "fp8") \
            else getattr(torch, sc.draft_dtype)
        if sc.parallel_drafting:
            _check_parallel_head(head_cfg, sc)
        head = load_eagle3_head(sc.draft_model, model.config, len(capture), self.device,
                                draft_dtype, dummy=dummy, ops=self.ops,
                                quantize=sc.draft_dtype == "fp8")
        if sc.parallel_drafting:
            return ParallelDrafter(head.eval(), model, tuple(capture))
        return Eagle3Drafter(head.eval(), model, tuple(capture))

    def load_dflash(self, model) -> DFlashDrafter:
        """A DFlash drafter over the target's layers its config names; K within its
        block."""
        sc = self.sc
        dtype = self.dtype if sc.draft_dtype == "auto" else getattr(torch, sc.draft_dtype)
        head = load_dflash_head(sc.draft_model, model.config, self.device, dtype,
                                dummy=self.config.load_format == "dummy", ops=self.ops)
        drafter = DFlashDrafter(head.eval(), model, head.config.target_layer_ids)
        if sc.max_draft_len > drafter.max_depth:
            raise ValueError(f"max_draft_len must be <= the DFlash drafter's block_size - 1 "
                             f"({drafter.max_depth}), got {sc.max_draft_len}")
        return drafter

    def state_pool_bytes(self, model, verify_rows: int) -> int:
        """Bytes of a hybrid target's state pool: a slot per request of the batch and a
        snapshot row per verify row (state_pool.py)."""
        per = state_bytes(model.recurrent_layers(), self.dtype)
        return per * (self.config.max_batch_size * (1 + verify_rows) + 1)   # + scratch slot

    def state_pool(self, model, verify_rows: int) -> StatePool:
        """The recurrent-state pool: max_batch_size slots, and snapshot rows for a step
        of max_batch_size requests of verify_rows rows each."""
        need = self.state_pool_bytes(model, verify_rows)
        require_bytes(need, self.device, f"the recurrent-state pool of max_batch_size="
                      f"{self.config.max_batch_size} requests")
        b = self.config.max_batch_size
        return StatePool(model.recurrent_layers(), b, b * verify_rows, self.dtype, self.device)

    def num_kv_blocks(self, attn_layers, blocks_per_seq: int, max_model_len: int,
                      reserved: int = 0) -> int:
        """The pool's block count: num_kv_blocks, or a fraction of free memory (less
        `reserved` bytes, the state pool's) but never more than the batch can use (the
        smallest over the ranks: all hold the same)."""
        cfg = self.config
        per_block = kv_bytes_per_block(attn_layers, cfg.block_size)
        if cfg.num_kv_blocks is not None:
            num = cfg.num_kv_blocks
            require_bytes(num * per_block, self.device, f"num_kv_blocks={num} (KV cache)")
        else:      # what the batch can use, capped by a fraction of free memory (a CPU
            #        pool takes pages only as blocks are written: zeros_on_write)
            budget = int(available_bytes(self.device) * cfg.kv_cache_memory_fraction) - reserved
            num = min(budget // per_block, blocks_per_seq * cfg.max_batch_size)
            if self.parallel:
                num = self.parallel.min_int(num)
        if num < blocks_per_seq:
            raise ValueError(f"num_kv_blocks={num} cannot hold one request of max_model_len="
                             f"{max_model_len} (+ draft slots; on a sliding-window target, "
                             f"its window and one step's tokens): needs >= {blocks_per_seq} "
                             f"blocks of {cfg.block_size}; raise num_kv_blocks or lower "
                             "max_model_len")
        return num

    def _attention_backend(self) -> str:
        backend = self.config.attention_backend
        target_cls = target_class(read_config(self.config.model))
        portable_only = not target_cls.supports_triton
        several_ranks = self.parallel is not None and self.parallel.world_size > 1
        if self.tree is not None and backend == "auto" and \
                not getattr(target_cls, "triton_tree_masks", False):
            return "torch"                       # (MLA's kernel has no tree masks)
        if backend == "auto":       # (several ranks: the portable path unless asked)
            backend = "triton" if self.device.type == "cuda" and not portable_only \
                and not several_ranks else "torch"
        if backend == "triton" and portable_only:
            raise ValueError(f"attention_backend='triton' is not available for "
                             f"{target_cls.__name__}; use 'torch'")
        if backend == "triton" and self.device.type != "cuda":
            raise ValueError("attention_backend='triton' needs a CUDA device")
        return backend
