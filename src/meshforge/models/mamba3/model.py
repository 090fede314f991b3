"""The built-in Mamba-3 causal LM: embedding, pre-norm Mamba-3 blocks, final norm, LM head.

The tree is meshforge's decoder layout (``model.embed_tokens``, ``model.layers.<i>`` with
``norm`` then ``mixer``, ``model.norm``, ``lm_head``), which FSDP, TP, PP and recompute address
the same way as the other families; the safetensors keys are the reference's
(``backbone.embeddings``, ``backbone.layers.<i>.mixer...``, ``backbone.norm_f``; ``hf.py``).
Each block is ``x + mixer(rmsnorm(x))`` as in ``mamba_ssm``'s and flash-linear-attention's
Mamba-3 models (no MLP); the head is tied to the embedding by default, as there.

Packed rows: ``segment_ids`` (a change of id) and ``position_ids`` (a restart at 0) mark
document starts; every mixer restarts its state, look-back and rotary angle there.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from meshforge.models.common.causal_lm import CausalLM, InnerModel, build_causal_lm
from meshforge.models.common.norms import RMSNorm
from meshforge.models.mamba3.args import Mamba3Args
from meshforge.models.mamba3.mixer import Mamba3Mixer, init_dt_bias_
from meshforge.models.mamba3.scan import document_index

# Per-head parameters with a fixed start (the reference's values).
_ONES = (".B_bias", ".C_bias", ".D", ".mimo_z")
_ONE_OVER_RANK = (".mimo_x", ".mimo_o")


class Mamba3Block(nn.Module):
    """``x + mixer(norm(x))``."""

    def __init__(self, args: Mamba3Args, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.norm = RMSNorm(args.hidden_size, args.norm_eps)
        self.mixer = Mamba3Mixer(args)

    def forward(self, x: torch.Tensor, doc: torch.Tensor | None = None) -> torch.Tensor:
        return x + self.mixer(self.norm(x), doc)


class Mamba3Model(InnerModel):
    """The inner model: embedding, blocks, final norm (no positional table: the angles are learned)."""

    # Set by meshforge.infer.kv_cache during cached generation (the hook every cached decoder
    # carries); not called: the mixers keep their own state and the positions mark the padding.
    decode_mask: Callable[[torch.Tensor], torch.Tensor | None] | None = None

    def __init__(self, args: Mamba3Args) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size, padding_idx=args.pad_token_id)
        self.layers = nn.ModuleList(Mamba3Block(args, i) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        doc = document_index(segment_ids, position_ids, input_ids.shape)
        for layer in self.layers:
            h = layer(h, doc)
        return self.norm(h)


class Mamba3ForCausalLM(CausalLM[Mamba3Args]):
    """Mamba-3 language model (``model`` then ``lm_head``)."""

    family = "mamba3"
    display_name = "Mamba-3"

    def __init__(self, args: Mamba3Args) -> None:
        super().__init__(args, Mamba3Model(args))

    def set_scan(self, scan: str) -> None:
        """Run every mixer's ``chunked`` scan or the token-by-token ``recurrent`` one."""
        for module in self.modules():
            if isinstance(module, Mamba3Mixer):
                module.scan = scan

    def init_full_parameter_(self, fqn: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        """The reference's initialisation: projections and embedding ~ normal(0,
        ``initializer_range``), norms 1, ``dt_bias`` the inverse softplus of a log-uniform
        ``dt``, ``B_bias``/``C_bias``/``D``/``mimo_z`` 1, ``mimo_x``/``mimo_o`` ``1 / mimo_rank``."""
        if fqn.endswith(".dt_bias"):
            init_dt_bias_(tensor, self.args, generator)
            return
        if fqn.endswith(_ONES) or fqn.endswith(_ONE_OVER_RANK):
            with torch.no_grad():
                tensor.fill_(1.0 if fqn.endswith(_ONES) else 1.0 / self.args.rank)
            return
        super().init_full_parameter_(fqn, tensor, generator)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: ``6 *`` the projection and head weights, plus the scan.

        The chunked scan of one head costs per token, forward, ``2 * R * N`` for the in-chunk
        scores and ``2 * R * P`` for their values over a chunk of ``C`` tokens (``C * R``
        columns), plus ``2 * R * P * N`` each for the chunk state, the carried-state read and
        the state update; the backward twice that.

        Args:
            seq_len: Sequence length of the batch (the scan's cost does not depend on it).
        """
        a = self.args
        matmul = sum(p.numel() for n, p in self.named_parameters() if n.endswith("_proj.weight"))
        matmul += a.vocab_size * a.hidden_size  # the LM head, tied or not
        r, n, p, c = a.rank, a.state_size, a.head_dim, min(a.chunk_size, seq_len)
        per_head = 2 * c * r * r * (n + p) + 3 * 2 * r * p * n
        return 6.0 * matmul + 3.0 * a.num_hidden_layers * a.num_heads * per_head


def build_mamba3(args: Mamba3Args, *, device: str | torch.device = "meta") -> Mamba3ForCausalLM:
    """Construct the model on ``device``; on a real device initialised as the reference does."""
    return build_causal_lm(Mamba3ForCausalLM, args, device)


__all__ = ["Mamba3Block", "Mamba3ForCausalLM", "Mamba3Model", "build_mamba3"]
