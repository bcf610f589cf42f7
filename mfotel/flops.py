"""Model FLOPs per token of a decoder-only transformer, and model FLOPs utilisation (MFU).

The standard estimate (Kaplan et al. 2020; PaLM, Chowdhery et al. 2022, appendix B; nanoGPT's
`estimate_mfu`) of the matrix-multiply FLOPs of one training token, forward and backward:

    flops_per_token = 6 N + 12 L h s

- `N`: parameters of the matrix multiplies: per layer the attention projections
  (`2 h^2 + 2 h kv`, with `kv = h * kv_heads / heads` under grouped-query attention) and the MLP
  (`3 h f` gated, as Llama's SwiGLU, or `2 h f`), plus the output projection `V h`; the input
  embedding is a lookup, not a multiply. 2 FLOPs per multiply-add forward, twice that backward:
  6 per parameter and token.
- `12 L h s`: attention scores and their weighted sum (`2 s h` multiply-adds per token and
  layer each way), counted over the full sequence `s` (no discount for the causal mask, as PaLM).

Norms, softmax, activations and the optimizer are left out, and so is recomputation: this is
MFU, the model's FLOPs, not the hardware's (HFU).

    shape = TransformerShape(hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=32,
                             ffn_hidden_size=11008, vocab_size=32000, seq_length=4096)
    shape.flops_per_token          # 4.61e10 (Llama-2 7B at 4k tokens)
    mfu(tokens_per_second=2000, flops_per_token=shape.flops_per_token, peak_flops=2.0e14)  # 0.46
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TransformerShape:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    vocab_size: int
    seq_length: int
    gated_mlp: bool = True

    @property
    def matmul_params(self) -> int:
        """N: parameters of the matrix multiplies (attention, MLP, output projection)."""
        h = self.hidden_size
        kv = h * self.num_kv_heads // self.num_heads
        mlp = (3 if self.gated_mlp else 2) * h * self.ffn_hidden_size
        return self.num_layers * (2 * h * h + 2 * h * kv + mlp) + self.vocab_size * h

    @property
    def flops_per_token(self) -> float:
        """6 N + 12 L h s: model FLOPs of one training token, forward and backward."""
        attention = 12 * self.num_layers * self.hidden_size * self.seq_length
        return float(6 * self.matmul_params + attention)


def llama_ffn_hidden_size(hidden_size: int, multiple_of: int = 256,
                          ffn_dim_multiplier: float | None = None) -> int:
    """Llama's MLP width when `intermediate_size` is not given: 2/3 of 4h, rounded up to a
    multiple of `multiple_of` (as mindformers' LlamaFeedForward computes it)."""
    width = 4 * hidden_size
    if ffn_dim_multiplier is not None:
        width = int((ffn_dim_multiplier + 0.01) * width)
    width = int(2 * width / 3)
    return multiple_of * ((width + multiple_of - 1) // multiple_of)


def mfu(tokens_per_second: float, flops_per_token: float, peak_flops: float) -> float:
    """Model FLOPs utilisation, 0..1: achieved model FLOP/s over the device's peak FLOP/s."""
    return tokens_per_second * flops_per_token / peak_flops
