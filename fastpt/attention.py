"""Document attention: a token attends only to earlier tokens of its own document.

A training window cut from the token stream holds the end of one document and the start of the
next; with the causal mask alone the second attends into the first (Llama 3 and modded-nanogpt mask
it). The document token (the data's meta.json eot_id, put before every document by fastpt.prepare)
starts a document; the tokens before a row's first document token form a document of their own.

The mask is built once per batch from the token ids and shared by every layer:
- on CUDA, a FlexAttention BlockMask (torch.nn.attention.flex_attention), which skips the blocks
  that cross documents. It is always built by compiled code: inside a compiled model's graph, else
  by create_block_mask compiled on its own (torchtitan's way). create_block_mask run eagerly would
  materialize the dense (B, T, T) mask first.
- elsewhere a dense (B, 1, T, T) boolean mask for scaled_dot_product_attention: PyTorch's
  FlexAttention has no backward on CPU (torch 2.13 refuses requires_grad inputs there).

Every batch's mask_mod is a closure of one function over that batch's document ids: torch.compile
guards a closure by its code object, so a new layout is new tensor values for the same graph, in a
compiled model, in blocks compiled one by one (FSDP) and under CUDA graphs alike.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention


@functools.cache
def _standalone_flex():
    """FlexAttention compiled on its own, for an eager model: eager FlexAttention materializes the
    scores. Made on first use (torch.compile imports inductor, seconds that no other run should pay)."""
    return torch.compile(flex_attention, dynamic=False)


@functools.cache
def _standalone_block_mask():
    """create_block_mask compiled on its own, for a mask built outside a compiled graph (an eager
    model, or blocks compiled one by one)."""
    return torch.compile(create_block_mask, dynamic=False)


def document_ids(idx: torch.Tensor, doc_token: int) -> torch.Tensor:
    """(B, T) token ids -> (B, T) index of each token's document within its row."""
    return (idx == doc_token).cumsum(dim=-1)


def same_document_causal(doc: torch.Tensor):
    """The run's mask_mod over the document ids doc (B, T): query q of row b may attend key kv when
    kv is not after q and both are in one document."""

    def mask_mod(b, h, q, kv):
        return (q >= kv) & (doc[b, q] == doc[b, kv])

    return mask_mod


def block_mask(doc: torch.Tensor) -> BlockMask:
    """The FlexAttention BlockMask of the document ids doc (B, T), built by compiled code."""
    B, T = doc.shape
    build = create_block_mask if torch.compiler.is_compiling() else _standalone_block_mask()
    return build(same_document_causal(doc), B, None, T, T, device=doc.device)


def document_mask(idx: torch.Tensor, doc_token: int, flex: bool | None = None) -> BlockMask | torch.Tensor:
    """What `attend` needs for the batch idx (B, T): a BlockMask when flex (default: on CUDA), else
    a dense (B, 1, T, T) bool mask, True where query t may attend key s."""
    doc = document_ids(idx, doc_token)  # (B, T)
    if idx.device.type == "cuda" if flex is None else flex:
        return block_mask(doc)
    T = idx.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=idx.device).tril()  # (T, T)
    return (causal & (doc[:, :, None] == doc[:, None, :]))[:, None]  # (B, 1, T, T)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask | torch.Tensor, enable_gqa: bool
) -> torch.Tensor:
    """Masked attention of q (B, H, T, hd) over k, v (B, Hkv, T, hd) -> (B, H, T, hd)."""
    if isinstance(mask, BlockMask):
        if q.device.type == "cuda":  # a compiled model fuses flex_attention into its own graph
            flex = flex_attention if torch.compiler.is_compiling() else _standalone_flex()
            return flex(q, k, v, block_mask=mask, enable_gqa=enable_gqa)
        # Inductor's CPU FlexAttention template fails to lower transposed views (torch 2.13)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        return flex_attention(q, k, v, block_mask=mask, enable_gqa=enable_gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=enable_gqa)
